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


def _two_workers_for_the_kernel(mesh_env, monkeypatch):
    """A coordinator with two one-slot workers, and the environment a kernel started now
    inherits to reach it (``from gpumesh import mesh`` needs nothing more); a client of it."""
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=1)
    mesh_env.add_worker(slots=1)
    client = mesh_env.client()
    mesh_env.wait_workers(2, client)
    for key, value in {**mesh_env.env, "GPUMESH_URL": mesh_env.coordinator.url,
                       "GPUMESH_TOKEN": mesh_env.token}.items():
        monkeypatch.setenv(key, value)
    return client


def test_load_ext_and_mesh_cell_magic_run_on_two_workers(mesh_env, monkeypatch):
    nbformat = require("nbformat")
    nbclient = require("nbclient")
    require("ipykernel")
    _two_workers_for_the_kernel(mesh_env, monkeypatch)
    cells = [nbformat.v4.new_code_cell(c) for c in MAGIC_CELLS]
    notebook = nbformat.v4.new_notebook(cells=cells)
    nbclient.NotebookClient(notebook, timeout=60, kernel_name="python3").execute()

    def text(cell):
        return "".join(o.get("text", "") for o in cell.outputs if o["output_type"] == "stream")

    assert "cell output shows" in text(notebook.cells[1])
    out = text(notebook.cells[2])
    assert "[1, 2, 3, 4] 2" in out and "task 3 here" in out  # both workers' runners ran some
    assert mesh_env.token not in out


def test_the_stop_button_cancels_the_cells_tasks_on_the_mesh(mesh_env, monkeypatch):
    require("ipykernel")
    jupyter_client = require("jupyter_client")
    from conftest import wait_for

    client = _two_workers_for_the_kernel(mesh_env, monkeypatch)
    manager = jupyter_client.KernelManager(kernel_name="python3")
    manager.start_kernel()
    kernel = manager.client()
    kernel.start_channels()
    try:
        kernel.wait_for_ready(timeout=60)
        for code in ("%load_ext gpumesh",
                     "%%mesh\nimport time\ndef nap(x):\n    time.sleep(60)\n    return x"):
            kernel.execute_interactive(code, timeout=60)
        long_cell = kernel.execute("nap.map(range(8))")

        def counts():
            return client.status(tasks=False)["counts"]

        wait_for(lambda: counts().get("running", 0) == 2, timeout=30,
                 what="the cell's tasks running on both workers")
        manager.interrupt_kernel()  # the notebook's stop button
        while True:
            reply = kernel.get_shell_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == long_cell:
                break
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        wait_for(lambda: not counts().get("running") and not counts().get("pending"),
                 timeout=30, what="nothing of the interrupted cell left on the mesh")
    finally:
        kernel.stop_channels()
        manager.shutdown_kernel(now=True)


def _run_notebook(cells, nbformat, nbclient):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbclient.NotebookClient(notebook, timeout=60, kernel_name="python3").execute()
    return notebook


def test_mesh_cell_wraps_only_the_functions_it_defines(mesh_env, monkeypatch):
    nbformat = require("nbformat")
    nbclient = require("nbclient")
    require("ipykernel")
    _two_workers_for_the_kernel(mesh_env, monkeypatch)
    cells = [
        "%load_ext gpumesh",
        "def earlier(x):\n    return x",
        "%%mesh\nimport functools\nfrom os.path import join\nfrom textwrap import dedent as undent\n"
        "alias = earlier\n"
        "def tagged(fn):\n    @functools.wraps(fn)\n    def inner(*a):\n        return fn(*a)\n"
        "    return inner\n"
        "@tagged\ndef twice(x):\n    return 2 * x\n"
        "def square(x):\n    return x * x",
        "from gpumesh.client.decorators import MeshFunction\n"
        "print({n: isinstance(globals()[n], MeshFunction)\n"
        "       for n in ('join', 'undent', 'earlier', 'alias', 'tagged', 'twice', 'square')})\n"
        "print(join('a', 'b'), square.map([1, 2, 3]), twice.map([4]))",
    ]
    notebook = _run_notebook(cells, nbformat, nbclient)
    out = "".join(o.get("text", "") for o in notebook.cells[3].outputs
                  if o["output_type"] == "stream")
    assert ("{'join': False, 'undent': False, 'earlier': False, 'alias': False, 'tagged': True, "
            "'twice': True, 'square': True}") in out, out
    assert "a/b [1, 4, 9] [8]" in out, out


def test_the_spec_s_mesh_cell_maps_the_function_it_defines_in_that_same_cell(mesh_env,
                                                                            monkeypatch):
    nbformat = require("nbformat")
    nbclient = require("nbclient")
    require("ipykernel")
    _two_workers_for_the_kernel(mesh_env, monkeypatch)
    cells = [
        "%load_ext gpumesh",
        # The spec's example, with the process that ran each chunk.
        "%%mesh\nimport os\n"
        "def preprocess(chunk_id, rows):\n"
        "    return {'chunk': chunk_id, 'rows': rows * rows, 'pid': os.getpid()}\n\n"
        "def helper(fn):\n    fn.tag = 'kept'\n    return fn\n\n"
        "@helper\ndef tagged(x):\n    return x\n\n"
        "results = preprocess.map([{'chunk_id': i, 'rows': 100 + i} for i in range(6)])\n"
        "print([r['chunk'] for r in results], results[1]['rows'],\n"
        "      os.getpid() in {r['pid'] for r in results}, tagged.tag)",
        "from gpumesh.client.decorators import MeshFunction\n"
        "print([type(f).__name__ for f in (preprocess, helper, tagged)], tagged.map([7]))",
    ]
    notebook = _run_notebook(cells, nbformat, nbclient)

    def text(cell):
        return "".join(o.get("text", "") for o in cell.outputs if o["output_type"] == "stream")

    # On the mesh (not this kernel's process), and the cell's helper ran here as it was used.
    assert "[0, 1, 2, 3, 4, 5] 10201 False kept" in text(notebook.cells[1]), text(notebook.cells[1])
    assert "['MeshFunction', 'MeshFunction', 'MeshFunction'] [7]" in text(notebook.cells[2])


def test_a_failing_mesh_cell_fails_the_notebook_with_its_error(mesh_env, monkeypatch):
    nbformat = require("nbformat")
    nbclient = require("nbclient")
    require("ipykernel")
    import pytest

    _two_workers_for_the_kernel(mesh_env, monkeypatch)
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in (
        "%load_ext gpumesh",
        "%%mesh\ndef defined_first(x):\n    return x\nraise ValueError('the cell broke')",
        "print('after the failed cell')",
    )])
    with pytest.raises(nbclient.exceptions.CellExecutionError) as failed:
        nbclient.NotebookClient(notebook, timeout=60, kernel_name="python3").execute()
    assert "ValueError" in str(failed.value) and "the cell broke" in str(failed.value)
    errors = [o for o in notebook.cells[1].outputs if o["output_type"] == "error"]
    assert [(e["ename"], e["evalue"]) for e in errors] == [("ValueError", "the cell broke")]
    assert not notebook.cells[2].outputs  # nbclient stopped at the failed cell


class _Shell:
    """What the magic uses of an InteractiveShell: a namespace and a run_cell (which runs the
    cell with exec, and records it)."""

    def __init__(self):
        import types

        self.user_ns, self.user_module = {}, types.ModuleType("__main__")
        self.displayhook = types.SimpleNamespace(exec_result=None)
        self.magic = None
        self.ran: list[str] = []

    def push(self, names):
        self.user_ns.update(names)

    def register_magic_function(self, fn, magic_kind, magic_name):
        self.magic = fn

    def transform_cell(self, cell):
        return cell

    def run_cell(self, cell):
        import types

        self.ran.append(cell)
        try:
            exec(cell, self.user_ns)
        except Exception as e:
            return types.SimpleNamespace(error_before_exec=None, error_in_exec=e)
        return types.SimpleNamespace(error_before_exec=None, error_in_exec=None)


def test_a_mesh_cell_run_outside_a_cell_raises_its_error():
    """``run_cell_magic`` called by code, with no cell of its own whose result could fail: the
    cell's error is raised to that code."""
    import pytest

    from gpumesh.client.notebook import load_ipython_extension

    shell = _Shell()
    load_ipython_extension(shell)
    with pytest.raises(ValueError, match="the cell broke"):
        shell.magic("", "raise ValueError('the cell broke')")


def test_a_mesh_cell_that_awaits_inside_a_running_kernel_says_how_instead_of_failing_midway():
    """In Jupyter the kernel's loop runs the cell: the magic's nested run_cell ran a cell that
    awaits with run_until_complete on that same loop, and it failed after its first lines."""
    import asyncio

    import pytest

    from gpumesh.client.notebook import load_ipython_extension

    class Kernel(_Shell):
        def should_run_async(self, cell, *, transformed_cell=None):
            return "await" in cell

    shell = Kernel()
    load_ipython_extension(shell)

    async def in_the_kernel():
        shell.magic("", "x = await f.aio(1)")

    with pytest.raises(Exception, match="await their .aio"):
        asyncio.run(in_the_kernel())
    assert shell.ran == []  # nothing of the cell ran


def test_ipython_itself_is_asked_whether_a_cell_awaits():
    """IPython 9.16 and later refuse should_run_async(cell) without transformed_cell=: the
    refusal above never fired under a real shell."""
    import asyncio

    from conftest import require

    require("IPython")
    from IPython.core.interactiveshell import InteractiveShell

    from gpumesh.client.notebook import _awaits_in_a_running_loop

    shell = InteractiveShell.instance()

    async def in_the_kernel():
        return (_awaits_in_a_running_loop(shell, "x = await f.aio(1)"),
                _awaits_in_a_running_loop(shell, "x = f(1)"))

    assert asyncio.run(in_the_kernel()) == (True, False)
    assert not _awaits_in_a_running_loop(shell, "x = await f.aio(1)")  # no loop: IPython awaits
