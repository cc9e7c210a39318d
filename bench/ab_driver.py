"""One side of ``python -m bench.ab``: a mesh of one gpumesh tree, driven over stdin/stdout.

Run as ``python -m bench.ab_driver TREE WORKERS`` from this repository: the ``bench`` package is
this checkout's, while ``gpumesh`` (here, in the coordinator, the workers and their runners)
is imported from TREE. It starts ``gpumesh serve`` and WORKERS ``gpumesh join`` processes as
the benchmark does (bench/systems/gpumesh_system.py), a client in this process, prints
``ready``, then answers one JSON line per command line:

    calls N [BYTES]  N sequential single calls: {"ms": [latency, ...]}
    map N [BYTES]    one map of N tasks: {"seconds": s}
    cpu         CPU seconds so far, by process role: {"cpu": {role: seconds}}
    quit        stop the mesh and exit (so does the end of stdin)
"""

from __future__ import annotations

import json
import os
import sys
import time
import types
from pathlib import Path
from typing import Any

from .procs import cpu_seconds, descendants, install_teardown
from .systems.gpumesh_system import Mesh, wait_for_workers
from .tasks import noop


def side_mesh(tree: Path) -> type[Mesh]:
    class SideMesh(Mesh):
        # Started in TREE: ``python -m gpumesh`` puts the folder it starts in ahead of
        # PYTHONPATH, so from this checkout every side's coordinator, agents and runners ran
        # this checkout's gpumesh, whatever the tree (only the client differed).
        cwd = tree

        def env(self) -> dict[str, str]:
            # TREE first: the processes import its gpumesh (and its bench.tasks, for noop).
            env = super().env()
            env["PYTHONPATH"] = os.pathsep.join([str(tree), env["PYTHONPATH"]])
            return env

    return SideMesh


def roles(mesh: Mesh) -> dict[int, str]:
    found = {os.getpid(): "client", mesh.coordinator.pid: "coordinator"}
    for worker in mesh.workers:
        found[worker.pid] = "worker agents"
        found.update({pid: "worker runners" for pid in descendants(worker.pid)})
    return found


def cpu_by_role(mesh: Mesh) -> dict[str, float]:
    spent: dict[str, float] = {}
    for pid, role in roles(mesh).items():
        seconds = cpu_seconds(pid)
        if seconds is not None:
            spent[role] = spent.get(role, 0.0) + seconds
    return spent


def first_byte(data: bytes) -> int:
    return data[0]


def task_and_items(count: int, payload: int) -> tuple[Any, list[Any], list[Any]]:
    """(the task, its arguments, the results it must give): no-ops, or with ``payload`` a task
    taking that many bytes (eight distinct buffers, each item pickled on its own)."""
    if not payload:
        items = list(range(count))
        return noop, items, items
    # By value (a copy of first_byte in __main__, which cloudpickle never imports): the base
    # tree's workers cannot import a task this checkout added. A module of None instead would
    # make cloudpickle search every loaded module for it, ~6 ms a call.
    task = types.FunctionType(first_byte.__code__, {"__name__": "__main__"})
    buffers = [bytes([n]) * payload for n in range(8)]
    return task, [buffers[i % 8] for i in range(count)], [i % 8 for i in range(count)]


def answer(command: str, mesh: Mesh, client: Any) -> dict[str, Any]:
    verb, *numbers = command.split()
    if verb == "cpu":
        return {"cpu": cpu_by_role(mesh)}
    count, payload = int(numbers[0]), int(numbers[1]) if len(numbers) > 1 else 0
    task, items, expected = task_and_items(count, payload)
    if verb == "calls":
        latencies = []
        for item in items:
            started = time.perf_counter()
            client.submit(task, item).result(120)
            latencies.append((time.perf_counter() - started) * 1000)
        return {"ms": latencies}
    if verb == "map":
        started = time.perf_counter()
        if client.map(task, items, timeout=120) != expected:
            raise RuntimeError("the map returned wrong results")
        return {"seconds": time.perf_counter() - started}
    raise ValueError(f"unknown command {command!r}")


def main(argv: list[str]) -> int:
    tree, workers = Path(argv[0]).resolve(), int(argv[1])
    sys.path.insert(0, str(tree))  # before anything imports gpumesh
    install_teardown()
    import gpumesh

    origin = getattr(gpumesh, "__file__", None)  # None: a folder without __init__.py
    if origin is None or Path(origin).resolve().parent.parent != tree:
        raise SystemExit(f"gpumesh came from {origin or list(gpumesh.__path__)}, not from {tree}")
    mesh = side_mesh(tree).fresh()
    client = None
    try:
        mesh.start_coordinator()
        for _ in range(workers):
            mesh.add_worker()
        mesh.wait_listening()
        client = mesh.client()
        wait_for_workers(client, workers)
        client.map(noop, list(range(500)))  # runners, imports and caches warm
        for index in range(100):
            client.submit(noop, index).result(120)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            command = line.strip()
            if command == "quit":
                break
            print(json.dumps(answer(command, mesh, client)), flush=True)
    finally:
        if client is not None:
            client.close()
        mesh.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
