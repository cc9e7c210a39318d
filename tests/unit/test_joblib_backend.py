"""The joblib backend's own logic, over a stand-in mesh (a thread pool): a batch that cannot
be sent, a coordinator that does not answer a slot count, an old joblib, and the lazy
registration surviving a probe for joblib."""

from __future__ import annotations

import concurrent.futures
import pickle
import subprocess
import sys
import threading

import pytest
from conftest import require

from gpumesh.errors import ConfigError, MeshError


class StandInMesh:
    """What the backend uses of a GPUMesh: results come on a thread of their own, as they come
    on the engine's I/O thread, and a call is pickled before submit_calls returns."""

    def __init__(self) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(2)
        self.answers = True
        self.names: list[str] = []  # each submission's job name

    def connect(self, timeout: float | None = None) -> bool:
        return True

    def workers(self) -> list[dict]:
        if not self.answers:
            raise MeshError("the coordinator did not answer a workers request within 10s")
        return [{"alive": True, "slots": 3}]

    def submit_calls(self, func, calls, options, job="", name=""):
        pickle.dumps(func)
        self.names.append(name)

        def run():
            threading.Event().wait(0.01)  # a task's work: its result comes on this thread
            return func()
        return [self.pool.submit(run)]


def ident(x):
    return x


def test_a_later_batch_that_cannot_be_sent_fails_the_call_instead_of_hanging_it():
    joblib = require("joblib")
    from gpumesh.client.joblib_backend import MeshBackend

    items = [1, 2, 3, 4, 5, 6, threading.Lock()]  # the last goes from a done-callback
    outcome: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            with joblib.parallel_config(backend=MeshBackend(mesh=StandInMesh()), n_jobs=2):
                joblib.Parallel(batch_size=1, pre_dispatch="2")(
                    joblib.delayed(ident)(x) for x in items)
        except BaseException as exc:
            outcome.set_result(exc)
        else:
            outcome.set_result(None)

    threading.Thread(target=run, daemon=True).start()
    error = outcome.result(timeout=20)  # the code before: Parallel never returned
    assert isinstance(error, TypeError) and "pickle" in str(error)


def test_a_slot_count_the_coordinator_does_not_answer_falls_back_to_the_last_one():
    require("joblib")
    from gpumesh.client import joblib_backend
    from gpumesh.client.joblib_backend import MeshBackend

    mesh = StandInMesh()
    backend = MeshBackend(mesh=mesh)
    assert backend.effective_n_jobs(-1) == 3
    mesh.answers = False
    joblib_backend._SLOTS[mesh] = (0.0, 3)  # stale: asked again
    assert backend.effective_n_jobs(-1) == 3  # the last count, not MeshError
    joblib_backend._SLOTS.pop(mesh)
    assert backend.effective_n_jobs(-1) == 2  # never 1: joblib would run it all here


def test_n_jobs_minus_one_on_a_one_slot_mesh_still_sends_to_the_mesh():
    """joblib runs n_jobs=1 in the caller's process: a friend's single GPU (one slot), or a
    mesh no worker has joined yet, made n_jobs=-1 run every batch on the laptop, silently."""
    joblib = require("joblib")
    from gpumesh.client.joblib_backend import MeshBackend

    sent = []

    class OneSlot(StandInMesh):
        def workers(self):
            return [{"alive": True, "slots": 1}]

        def submit_calls(self, func, calls, options, job="", name=""):
            sent.append(name)
            return super().submit_calls(func, calls, options, job, name)

    backend = MeshBackend(mesh=OneSlot())
    assert backend.effective_n_jobs(-1) == 2 and backend.effective_n_jobs(None) == 2
    assert backend.effective_n_jobs(-2) == 2 and backend.effective_n_jobs(5) == 5
    with joblib.parallel_config(backend=backend):
        assert joblib.Parallel(n_jobs=-1)(joblib.delayed(ident)(x) for x in range(6)) == \
            list(range(6))
    assert sent, "every batch ran in this process"


def test_an_old_joblib_is_told_which_version_the_backend_needs(monkeypatch):
    joblib = require("joblib")
    from gpumesh.client.joblib_backend import MeshBackend

    monkeypatch.setattr(joblib, "__version__", "1.4.2")
    with pytest.raises(ConfigError, match=r"needs joblib 1\.5 or later.*1\.4\.2.*pip install -U"):
        MeshBackend(mesh=StandInMesh()).configure(n_jobs=2)


def test_a_probe_for_joblib_before_its_import_leaves_the_backend_registered():
    require("joblib")
    code = ("import importlib.util, gpumesh\n"
            "assert importlib.util.find_spec('joblib') is not None\n"
            "assert importlib.util.find_spec('joblib') is not None\n"
            "import joblib\n"
            "from joblib.parallel import BACKENDS\n"
            "print('gpumesh' in BACKENDS)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr


def test_a_batch_sent_as_joblib_aborts_is_cancelled_with_the_rest():
    require("joblib")
    from gpumesh.client.joblib_backend import MeshBackend

    mesh = StandInMesh()
    # Tasks queued on the mesh, not started: as a TaskFuture, cancel() takes them back.
    mesh.submit_calls = lambda func, calls, options, job="", name="": [  # type: ignore[method-assign]
        concurrent.futures.Future()]
    backend = MeshBackend(mesh=mesh)
    backend.configure(n_jobs=2)
    first = backend.submit(lambda: 1)
    backend.abort_everything()
    late = backend.submit(lambda: 2)  # from a callback racing the abort
    assert first.cancelled() and late.cancelled() and not backend._futures
    backend.start_call()  # the next call of a `with Parallel(...) as p` starts clean
    assert not backend.submit(lambda: 3).cancelled()
    backend.abort_everything()
    backend.configure(n_jobs=2)  # ... as does a new Parallel
    assert not backend.submit(lambda: 4).cancelled()


def test_the_job_is_named_after_the_function_joblib_runs():
    joblib = require("joblib")
    from gpumesh.client.joblib_backend import MeshBackend

    mesh = StandInMesh()
    with joblib.parallel_config(backend=MeshBackend(mesh=mesh), n_jobs=2):
        assert joblib.Parallel(batch_size=1)(joblib.delayed(ident)(x) for x in range(3)) == [0, 1, 2]
    assert set(mesh.names) == {"joblib ident"}
