"""Remote output in a notebook: what a task prints shows in the cell that called it."""

from __future__ import annotations

from conftest import require

CELL = """
import os
from gpumesh import GPUMesh

mesh = GPUMesh(os.environ["NB_MESH_URL"], os.environ["NB_MESH_TOKEN"])

def shout(x):
    print(f"hello from task {x}")
    return x * 10

print(mesh.map(shout, [1, 2]))
"""


def test_task_output_reaches_the_calling_notebook_cell(mesh_env, monkeypatch):
    nbformat = require("nbformat")
    nbclient = require("nbclient")
    require("ipykernel")
    mesh_env.start_coordinator()
    worker = mesh_env.add_worker(slots=2)
    for key, value in mesh_env.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("NB_MESH_URL", mesh_env.coordinator.url)
    monkeypatch.setenv("NB_MESH_TOKEN", mesh_env.token)
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CELL)])
    nbclient.NotebookClient(notebook, timeout=60, kernel_name="python3").execute()
    text = "".join(o.get("text", "") for o in notebook.cells[0].outputs if o["output_type"] == "stream")
    assert "[10, 20]" in text
    for x in (1, 2):
        assert f"[{worker.worker_id[:8]}] hello from task {x}" in text
    assert mesh_env.token not in text


MAGIC_CELLS = [
    "%load_ext gpumesh",
    "%%mesh\nimport os\ndef where(x):\n    print(f'task {x} here')\n    return (x, os.getpid())\nprint('cell output shows')",
    "results = where.map([1, 2, 3, 4])\nprint(sorted(r[0] for r in results), len({r[1] for r in results}))",
]


def test_load_ext_and_mesh_cell_magic_run_on_two_workers(mesh_env, monkeypatch):
    nbformat = require("nbformat")
    nbclient = require("nbclient")
    require("ipykernel")
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=1)
    mesh_env.add_worker(slots=1)
    client = mesh_env.client()
    mesh_env.wait_workers(2, client)
    for key, value in mesh_env.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("GPUMESH_URL", mesh_env.coordinator.url)
    monkeypatch.setenv("GPUMESH_TOKEN", mesh_env.token)
    cells = [nbformat.v4.new_code_cell(c) for c in MAGIC_CELLS]
    notebook = nbformat.v4.new_notebook(cells=cells)
    nbclient.NotebookClient(notebook, timeout=60, kernel_name="python3").execute()

    def text(cell):
        return "".join(o.get("text", "") for o in cell.outputs if o["output_type"] == "stream")

    assert "cell output shows" in text(notebook.cells[1])
    out = text(notebook.cells[2])
    assert "[1, 2, 3, 4]" in out and "task 3 here" in out
    assert mesh_env.token not in out
