"""A pytest plugin that runs joblib's own ``test_parallel.py`` against the ``"gpumesh"`` backend.

``python -m pytest -p joblib_mesh_plugin --pyargs joblib.test.test_parallel -k gpumesh``: joblib
builds its backend lists when the module is imported, so the backend must be registered before
collection, and a live mesh must be there for the whole session (started here, on loopback, and
stopped at the end).

The tests must run on the mesh, not merely pass: here the backend never falls back to loky (a
call that finds no coordinator fails), and the summary ends with a line saying how many tests
had results of mesh tasks, and how many tasks the coordinator saw finish (``test_joblib.py``
reads it).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import joblib  # noqa: E402
from conftest import Mesh  # noqa: E402

import gpumesh  # noqa: E402,F401  (workers register "gpumesh" with joblib as users' processes do)
from gpumesh import GPUMesh  # noqa: E402
from gpumesh.client.joblib_backend import MeshBackend  # noqa: E402

SUMMARY = ("gpumesh joblib plugin: {ran} of {tests} tests got results of {results} mesh tasks; "
           "the coordinator finished {finished}")
_mesh: Mesh | None = None
_client: GPUMesh | None = None
_tests: list[str] = []
_current = ""  # the test running now: what its Parallel calls submit is counted for it
_results: Counter[str] = Counter()  # test id: its mesh tasks that came back with a result
_lock = threading.Lock()
# loky's children never import gpumesh, so a nested Parallel there cannot name the backend.
NOT_APPLICABLE = {"test_nested_loop[loky-gpumesh]", "test_nested_loop[back_compat_backend-gpumesh]"}


class MeshOnlyBackend(MeshBackend):
    """The gpumesh backend without its fallback to loky: no coordinator is an error here."""

    def configure(self, n_jobs: int = 1, parallel: Any = None, prefer: str | None = None,
                  require: str | None = None, **kwargs: Any) -> int:
        if require != "sharedmem" and self._connected_mesh() is None:
            raise RuntimeError("joblib_mesh_plugin: no coordinator answered; this run must use "
                               "the mesh, not fall back to loky")
        return super().configure(n_jobs, parallel, prefer, require, **kwargs)

    def submit(self, func: Any, callback: Any = None) -> concurrent.futures.Future[Any]:
        future = super().submit(func, callback)
        test = _current
        future.add_done_callback(lambda f: _count_result(test, f))
        return future


def _count_result(test: str, future: concurrent.futures.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is None:
        with _lock:
            _results[test] += 1


joblib.register_parallel_backend("gpumesh", MeshOnlyBackend)


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    keep = [item for item in items if item.name not in NOT_APPLICABLE]
    config.hook.pytest_deselected(items=[item for item in items if item.name in NOT_APPLICABLE])
    items[:] = keep


def pytest_configure(config):  # type: ignore[no-untyped-def]
    global _mesh, _client
    if _mesh is not None:
        return
    _mesh = Mesh(Path(tempfile.mkdtemp(prefix="gpumesh-joblib-")))
    _mesh.start_coordinator()
    _mesh.add_worker(slots=2)
    _mesh.add_worker(slots=2)
    _client = _mesh.client()
    _mesh.wait_workers(2, _client)
    os.environ.update(_mesh.env)
    os.environ["GPUMESH_URL"] = _mesh.coordinator.url
    os.environ["GPUMESH_TOKEN"] = _mesh.token


def pytest_runtest_call(item):  # type: ignore[no-untyped-def]
    global _current
    _current = item.nodeid
    _tests.append(item.nodeid)
    yield


pytest_runtest_call.hookwrapper = True  # type: ignore[attr-defined]


def pytest_terminal_summary(terminalreporter):  # type: ignore[no-untyped-def]
    assert _client is not None
    with _lock:
        ran, results = sum(1 for n in _results.values() if n), sum(_results.values())
    finished = _client.health()["finished_total"]
    terminalreporter.write_line(SUMMARY.format(ran=ran, tests=len(_tests), results=results,
                                               finished=finished))


def pytest_unconfigure(config):  # type: ignore[no-untyped-def]
    global _mesh, _client
    if _mesh is not None:
        _mesh.close()
        # Its home goes too: while its journal is there, the coordinator's shared-memory folder
        # and the frames it names are kept for a restart that never comes (a few MB of RAM in
        # /dev/shm for every run of this suite); once it is gone, the next coordinator to start
        # removes them.
        shutil.rmtree(_mesh.home, ignore_errors=True)
        _mesh = _client = None
