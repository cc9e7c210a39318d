"""Placement with real workers that advertise fake inventories: payload-dict scheduler keys in
`.map`, and the source form for a worker on another Python version."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import wait_for

from gpumesh import GPUMesh
from gpumesh.client.tasks import TaskOptions, plan_calls
from gpumesh.errors import Unschedulable


def where_am_i(x):
    # Under the source form the function lives in a fresh namespace, not in this module.
    return {"x": x * x, "module": __name__}


def fake(**inventory) -> dict[str, str]:
    return {"GPUMESH_TEST_INVENTORY": json.dumps(inventory)}


def test_map_payload_keys_pick_workers_and_never_reach_the_function(mesh_env):
    mesh_env.start_coordinator()
    gpu = mesh_env.add_worker(slots=2, env=fake(gpus=[{"name": "NVIDIA A100", "vram": 4e10}],
                                                 cores=64))
    cpu = mesh_env.add_worker(slots=2, env=fake(cores=2))
    client = mesh_env.client()
    mesh_env.wait_workers(2, client)
    items = [{"x": i, "gpu": "A100", "cost": 5} for i in range(4)] + \
            [{"x": 10 + i, "cores": 32} for i in range(2)]
    futures = client.submit_calls(where_am_i, plan_calls(where_am_i, items, TaskOptions()))
    results = client.gather(futures)
    assert [r["x"] for r in results] == [i * i for i in range(4)] + [100, 121]
    assert {f.worker for f in futures} == {gpu.worker_id}
    assert cpu.worker_id in {w["id"] for w in client.workers() if w["alive"]}  # there, unused
    # The same keys through .map; an impossible one fails naming it after the pending timeout.
    assert client.map(where_am_i, [{"x": 3, "vram": "10GB"}])[0]["x"] == 9
    with pytest.raises(Unschedulable, match="cores>=1000"):
        client.map(where_am_i, [{"x": 1, "cores": 1000}], timeout=30)


def test_a_worker_on_another_python_runs_plain_functions_from_source(mesh_env, capsys):
    mesh_env.start_coordinator()
    other = mesh_env.add_worker(slots=2, env=fake(python="3.99"))
    client = GPUMesh(mesh_env.coordinator.url, mesh_env.token, quiet=True,
                     settings=replace(mesh_env.settings, verbose=True))
    mesh_env.clients.append(client)
    mesh_env.wait_workers(1, client)
    results = client.map(where_am_i, list(range(5)))
    assert [r["x"] for r in results] == [i * i for i in range(5)]
    assert {r["module"] for r in results} == {"__gpumesh_source__"}
    assert "where_am_i also travels as source, for the workers on Python 3.99" in \
        capsys.readouterr().err
    offset = 1

    def closure(x):
        return x + offset

    with pytest.raises(Unschedulable, match="Python"):
        client.map(closure, [1], timeout=30)  # no source form, and no worker on this Python
    # Once a worker on the submitter's Python joins, it is preferred and runs the pickle.
    same = mesh_env.add_worker(slots=2)
    wait_for(lambda: len([w for w in client.workers() if w["alive"]]) == 2, what="2 workers")
    client._pythons_at = 0.0  # forget the cached worker Pythons, as 5 s would
    futures = client.submit_calls(where_am_i, [((i,), {}) for i in range(2)])  # its 2 free slots
    assert [r["module"] for r in client.gather(futures)] == [__name__] * 2
    assert {f.worker for f in futures} == {same.worker_id}
    assert other.worker_id not in {f.worker for f in futures}


def test_a_worker_and_a_client_on_other_pythons_are_told_so_when_they_join(mesh_env):
    import os
    import subprocess
    import sys

    mesh_env.start_coordinator()
    env = {**os.environ, **mesh_env.env, **fake(python="3.99"), "GPUMESH_TOKEN": mesh_env.token}
    worker = subprocess.Popen([sys.executable, "-m", "gpumesh", "join", mesh_env.coordinator.url,
                               "--no-benchmark", "--no-save", "--slots", "1"], env=env,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert worker.stdout is not None
        lines = []
        for line in worker.stdout:
            lines.append(line)
            if "this machine runs Python" in line:
                break
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        assert (f"[worker] this machine runs Python 3.99 and the coordinator Python {here}: "
                f"functions pickled on Python {here} cannot load here") in "".join(lines)
        assert f"join with Python {here}" in lines[-1]
        # A client on the coordinator's Python hears at connect time that no worker runs it.
        code = ("import sys\nfrom gpumesh import GPUMesh\n"
                f"m = GPUMesh({mesh_env.coordinator.url!r})\nm.connect()\nm.close()\n")
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=60)
        assert f"no worker runs Python {here} like this client (they run 3.99)" in done.stderr
    finally:
        worker.terminate()
        worker.communicate(timeout=15)


def test_tasks_queued_behind_long_ones_go_to_a_worker_that_joins_idle(mesh_env, tmp_path):
    from dashboard_tasks import pause

    mesh_env.start_coordinator()
    first = mesh_env.add_worker(slots=2)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    # A run of instant tasks: the worker grants a deep prefetch (64 a slot).
    assert client.map(abs, range(-40, 0)) == list(range(40, 0, -1))
    gate = tmp_path / "gate"
    futures = client.submit_calls(pause, [((60, str(gate)), {})] * 4)

    def running(worker_id: str) -> int:
        return next((int(w.get("running", 0)) for w in client.workers()
                     if w["id"] == worker_id), -1)

    # All four went to the only worker: two run, two wait there, then go back (0.2 s in).
    wait_for(lambda: client.status(tasks=False)["counts"].get("running", 0) >= 2,
             what="the long tasks started")
    wait_for(lambda: running(first.worker_id) == 2, what="the two waiting tasks handed back")
    second = mesh_env.add_worker(slots=2)
    wait_for(lambda: running(second.worker_id) == 2,
             what="the worker that joined idle running the two that waited")
    assert running(first.worker_id) == 2
    gate.touch()
    assert [f.result(timeout=60) for f in futures] == [60] * 4
