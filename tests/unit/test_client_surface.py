"""The decorators, executor, notebook magic and tracebacks as a user meets them, without a mesh:
options kept in every form, mesh functions inside tasks, a late configuration, and the
standard-library contracts the skins promise."""

from __future__ import annotations

import concurrent.futures
import gc
import pickle
import threading
import types

import cloudpickle
import pytest
from conftest import require

from gpumesh.client import remotetb
from gpumesh.client.decorators import (
    DefaultMesh,
    InPlaceFunction,
    MeshFunction,
    MeshSource,
    accelerate,
    mesh,
)
from gpumesh.client.engine import TaskFuture, _Waiters
from gpumesh.client.executor import MeshExecutor, _CallFuture
from gpumesh.scheduler import Requirements


def scale(x, by=2):
    return x * by


class Model:
    factor = 3

    @mesh
    def apply(self, x):
        return x * self.factor


def test_options_given_with_the_function_are_kept_not_dropped():
    """``mesh(fn, gpu=...)`` and ``accelerate(fn, gpu=...)`` accept both forms; the function
    given with its options lost them all (a hardware filter, a timeout, mesh_only)."""
    for decorate in (mesh, accelerate):
        fn = decorate(scale, gpu="A100", timeout=5, mesh_only=True)
        assert fn.options.requirements == Requirements(gpu="A100") and fn.options.timeout == 5
        assert fn.mesh_only
        with pytest.raises(TypeError, match="unknown option"):
            decorate(scale, bogus=1)


@pytest.mark.parametrize("target", ["A100", 7])
def test_a_decorator_given_something_other_than_a_function_says_how_options_go(target):
    with pytest.raises(TypeError, match=r"options go by name: @mesh\(gpu='A100'\)"):
        mesh(target)


def test_coroutine_and_generator_functions_are_refused_with_what_to_do():
    async def fetch(x):
        return x

    def numbers(n):
        yield from range(n)

    with pytest.raises(TypeError, match=r"coroutine function.*fn\.aio"):
        mesh(fetch)
    with pytest.raises(TypeError, match="generator function.*a list instead"):
        accelerate(gpu=True)(numbers)


def test_a_decorated_method_keeps_map_and_submit(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUMESH_HOME", str(tmp_path))  # no mesh configured: it runs here
    for name in ("GPUMESH_URL", "GPUMESH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    model = Model()
    bound = model.apply
    assert isinstance(bound, MeshFunction) and bound(2) == 6
    assert bound.map([1, 2]) == [3, 6]  # bound to model, with .map of its own


def test_a_mesh_function_inside_a_task_runs_in_place_map_and_submit_included():
    """Pickled into a task it arrived as the plain function: ``inner.map`` inside a task was an
    AttributeError on the worker, while the same code ran locally."""
    inner = mesh(scale)
    shipped = cloudpickle.loads(cloudpickle.dumps(inner))
    assert isinstance(shipped, InPlaceFunction)
    assert shipped(3) == 6 and shipped.map([1, {"x": 2, "by": 5}]) == [2, 10]
    assert shipped.submit(4).result() == 8 and shipped.to("cuda") is shipped
    assert isinstance(shipped.submit(4), TaskFuture)  # awaitable, as a mesh task's future
    failed = shipped.submit("a", by=None)
    assert isinstance(failed.exception(), TypeError)
    assert cloudpickle.loads(cloudpickle.dumps(shipped))(1) == 2
    import copy
    assert copy.copy(inner) is inner and copy.deepcopy(inner) is inner


def test_gpumesh_local_keeps_submit_and_joblib_here_too(monkeypatch, capsys):
    """Inside a task (GPUMESH_LOCAL=1) a call and .map ran in place, but .submit resolved the
    worker's saved connection and sent the call back to the mesh, as the joblib backend did."""
    monkeypatch.setenv("GPUMESH_LOCAL", "1")
    fn = MeshFunction(scale, MeshSource(), mesh(scale).options)
    future = fn.submit(3)
    assert isinstance(future, TaskFuture) and future.result(timeout=0) == 6
    failed = fn.submit("x", by=None)
    assert isinstance(failed.exception(timeout=0), TypeError)
    joblib = require("joblib")
    from joblib.parallel import FallbackToBackend

    from gpumesh.client.joblib_backend import MeshBackend

    with pytest.raises(FallbackToBackend):
        MeshBackend().configure(n_jobs=2)
    assert "GPUMESH_LOCAL=1: running with loky" in capsys.readouterr().err
    assert joblib is not None


def test_gpumesh_local_runs_here_when_another_variable_does_not_parse(monkeypatch):
    # The escape hatch failed with the rest: every call raised GPUMESH_CONNECT_TIMEOUT's
    # ConfigError though GPUMESH_LOCAL=1 said not to reach for the mesh at all.
    from gpumesh.errors import ConfigError

    monkeypatch.setenv("GPUMESH_CONNECT_TIMEOUT", "abc")
    monkeypatch.setenv("GPUMESH_LOCAL", "1")
    fn = MeshFunction(scale, MeshSource(), mesh(scale).options)
    assert fn(3) == 6 and fn.map([1, 2]) == [2, 4] and fn.submit(4).result(timeout=0) == 8
    monkeypatch.delenv("GPUMESH_LOCAL")
    with pytest.raises(ConfigError, match="GPUMESH_CONNECT_TIMEOUT"):  # said, not run here
        MeshFunction(scale, MeshSource(), mesh(scale).options)(3)


def test_the_default_mesh_answers_private_names_with_attribute_error(tmp_path, monkeypatch):
    """hasattr, doctest, mock and inspect.unwrap ask for dunder names: a ConfigError there broke
    ``pytest --doctest-modules`` on any machine without a saved connection."""
    monkeypatch.setenv("GPUMESH_HOME", str(tmp_path))
    for name in ("GPUMESH_URL", "GPUMESH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    default = DefaultMesh()
    assert not hasattr(default, "__wrapped__")
    import inspect
    assert inspect.unwrap(default) is default
    from gpumesh.errors import ConfigError
    with pytest.raises(ConfigError, match="no coordinator configured"):
        default.workers()


def test_a_connection_saved_after_a_failed_lookup_is_found(tmp_path, monkeypatch):
    """The first lookup found nothing (no serve yet); one set afterwards (a notebook's next
    cell, or `gpumesh serve`) is used, where the miss used to be remembered for good."""
    monkeypatch.setenv("GPUMESH_HOME", str(tmp_path))
    for name in ("GPUMESH_URL", "GPUMESH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    source = MeshSource()
    assert source.mesh() is None and source.mesh() is None
    monkeypatch.setenv("GPUMESH_URL", "tcp://127.0.0.1:9")
    monkeypatch.setenv("GPUMESH_TOKEN", "rand-" + "a" * 40)
    found = source.mesh()
    try:
        assert found is not None and found.url == "tcp://127.0.0.1:9"
    finally:
        found.close()


def test_a_task_error_is_not_traded_for_what_a_namespace_object_raises():
    """``localize`` looks through ``__main__``; an object whose ``__getattr__`` raises (the
    default ``mesh`` without a saved connection raises ConfigError) replaced the task's error."""

    class Raises:
        def __getattr__(self, name):
            raise RuntimeError(f"no {name} here")

    def task():
        raise ValueError("bad")

    namespace = {"mesh": Raises(), "task": task}
    line = task.__code__.co_firstlineno + 1
    text = f'Traceback:\n  File "<dynamic-code>", line {line}, in task\nValueError: bad\n'
    better = remotetb.localize(text, remotetb._roots(namespace))
    assert __file__ in better and 'raise ValueError("bad")' in better

    error = ValueError("bad")
    error.remote_traceback = text
    main = types.ModuleType("__main__")
    main.mesh = Raises()
    import sys
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = main
    try:
        remotetb.localize_error(error)  # raised RuntimeError before
    finally:
        sys.modules["__main__"] = saved


def test_an_executor_future_refuses_wait_and_as_completed_on_the_io_thread(monkeypatch):
    """``result`` refused already; ``concurrent.futures.wait`` in a done-callback blocked the
    client's only I/O thread instead of raising as the README promises."""
    from gpumesh.client import engine

    future = _CallFuture()
    assert isinstance(future._waiters, _Waiters)
    monkeypatch.setattr(engine, "on_io_thread", lambda: True)
    with pytest.raises(RuntimeError):
        concurrent.futures.wait([future], timeout=5)
    with pytest.raises(RuntimeError):
        next(concurrent.futures.as_completed([future], timeout=5))
    future.set_result(1)
    assert concurrent.futures.wait([future], timeout=0).done == {future}


class StandInMesh:
    """What the executor uses of a GPUMesh: tasks the test settles, or cancels."""

    def __init__(self):
        self.tasks: list[TaskFuture] = []
        self.cancelled: list[TaskFuture] = []

    def submit_calls(self, fn, calls, options, job="", name=""):
        made = [TaskFuture(self.cancelled.append) for _ in calls]
        self.tasks += made
        return made

    def close(self):
        pass


def _wait_for(check, what):
    for _ in range(500):
        if check():
            return
        threading.Event().wait(0.01)
    raise AssertionError(what)


def test_ctrl_c_in_an_executor_block_cancels_its_calls_on_the_mesh(capsys):
    """README: Ctrl+C means stop. Without max_workers every call is on the mesh ("running"),
    so leaving ``with`` on KeyboardInterrupt waited for every one of them to run."""
    stand_in = StandInMesh()
    with pytest.raises(KeyboardInterrupt), MeshExecutor(mesh=stand_in) as pool:
        calls = [pool.submit(scale, x) for x in range(50)]
        _wait_for(lambda: len(pool._running) == 50 and not pool._sending,
                  "the calls to reach the mesh")
        stand_in.tasks[0].set_result(0)
        raise KeyboardInterrupt
    assert len(stand_in.cancelled) == 49  # all but the one already finished
    assert calls[0].result(timeout=5) == 0
    assert all(isinstance(c.exception(timeout=5), concurrent.futures.CancelledError)
               for c in calls[1:])
    assert "cancelled 49 unfinished call(s)" in capsys.readouterr().err


def test_ctrl_c_while_leaving_the_executor_block_cancels_too():
    """The body returns at once and the wait happens in __exit__'s shutdown: a Ctrl+C there
    skipped the cancel."""
    stand_in = StandInMesh()
    pool = MeshExecutor(mesh=stand_in)
    real_shutdown = pool.shutdown

    def interrupted(wait=True, *, cancel_futures=False):
        real_shutdown(wait=False)
        raise KeyboardInterrupt

    pool.shutdown = interrupted
    with pytest.raises(KeyboardInterrupt), pool:
        calls = [pool.submit(scale, x) for x in range(5)]
        _wait_for(lambda: len(pool._running) == 5 and not pool._sending, "the calls")
    assert len(stand_in.cancelled) == 5
    assert all(isinstance(c.exception(timeout=5), concurrent.futures.CancelledError)
               for c in calls)


def test_an_executor_dropped_right_after_submit_still_sends_its_calls():
    """Held weakly by its dispatcher, an executor dropped at once (a temporary one, or one
    local to a function) was collected with its calls still queued in it: never sent, their
    futures never finished."""
    lone = StandInMesh()
    call = MeshExecutor(mesh=lone).submit(scale, 1)
    windowed = StandInMesh()
    window = MeshExecutor(mesh=windowed, max_workers=2)
    queued = [window.submit(scale, x) for x in range(6)]
    del window
    gc.collect()
    _wait_for(lambda: len(lone.tasks) == 1, "the lone call to reach the mesh")
    lone.tasks[0].set_result(0)
    assert call.result(timeout=5) == 0
    for finished in range(6):  # each call finished lets the next queued one go
        _wait_for(lambda n=finished: len(windowed.tasks) == min(n + 2, 6), "the next call")
        next(t for t in windowed.tasks if not t.done()).set_result(10 + finished)
        gc.collect()
    assert sorted(f.result(timeout=5) for f in queued) == list(range(10, 16))


def test_an_executor_dropped_without_shutdown_ends_its_thread():
    """The dispatcher held its executor for good: every executor a notebook made and dropped
    left a thread (and for one made from a URL, a connection) until the interpreter exited."""
    stand_in = StandInMesh()
    pool = MeshExecutor(mesh=stand_in)
    call = pool.submit(scale, 1)
    _wait_for(lambda: stand_in.tasks, "the call to reach the mesh")
    thread = pool._thread
    stand_in.tasks[0].set_result(2)
    assert call.result(timeout=5) == 2
    del pool, call
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_mesh_cell_options_apply_and_coroutines_stay_as_defined(tmp_path, monkeypatch):
    """``%%mesh gpu="A100"`` ignored its line; an ``async def`` or generator the cell defined
    became a mesh function that could only fail on a worker."""
    require("IPython")
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setenv("GPUMESH_HOME", str(tmp_path))
    for name in ("GPUMESH_URL", "GPUMESH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    shell = InteractiveShell.instance()
    try:
        shell.run_line_magic("load_ext", "gpumesh")
        cell = ("def square(x):\n    return x * x\n"
                "in_cell = square._mesh().options\n"
                "async def fetch(x):\n    return x\n"
                "def numbers(n):\n    yield from range(n)\n")
        shell.run_cell_magic("mesh", 'gpu="A100", timeout=60', cell)
        square = shell.user_ns["square"]
        assert isinstance(square, MeshFunction)
        assert square.options.requirements.gpu == "A100" and square.options.timeout == 60
        in_cell = shell.user_ns["in_cell"]  # .map and the rest within the cell: the same
        assert in_cell.requirements.gpu == "A100" and in_cell.timeout == 60
        assert not isinstance(shell.user_ns["fetch"], MeshFunction)
        assert not isinstance(shell.user_ns["numbers"], MeshFunction)
        from IPython.core.error import UsageError
        for line in ("bogus=1", "gpu=print('ran')", "--gpu A100"):
            with pytest.raises(UsageError, match="%%mesh"):
                shell.run_cell_magic("mesh", line, "ran = True")
            assert "ran" not in shell.user_ns
    finally:
        InteractiveShell.clear_instance()


def test_a_decorated_function_still_pickles_by_value_for_the_mesh():
    shipped = pickle.loads(cloudpickle.dumps(mesh(scale)))
    assert shipped(5) == 10


TOKEN = "Q2x7d9KfLmNpRsTuVwXyZ0123456789abcdefghijk"


@pytest.mark.parametrize("url, token", [
    (TOKEN, "http://127.0.0.1:8000"), (TOKEN, "127.0.0.1:8000"), (TOKEN, "tcp://[::1]:9")])
def test_a_url_and_token_passed_the_wrong_way_round_are_refused_without_quoting(url, token):
    """Accepted, the token became the host: in the repr, in "does not resolve" errors, in
    the connect lines and in a DNS query."""
    from gpumesh import GPUMesh
    from gpumesh.errors import ConfigError

    with pytest.raises(ConfigError, match="seem swapped") as caught:
        GPUMesh(url, token=token)
    assert TOKEN not in str(caught.value) and token not in str(caught.value)


def test_a_chosen_token_with_a_colon_is_no_swap():
    from gpumesh import GPUMesh

    GPUMesh("tcp://127.0.0.1:9", token="our-team-shared-gpu-mesh:2024", quiet=True).close()
    GPUMesh("gpubox", token="our-team-shared-gpu-mesh:2024", quiet=True).close()


@pytest.mark.parametrize("kwargs, words", [
    ({"url": 123}, "url must be a string"), ({"token": 12345}, "token must be a string"),
    ({"connect_timeout": "3"}, "connect_timeout"), ({"connect_timeout": -1}, "connect_timeout")])
def test_constructor_arguments_of_the_wrong_type_say_which(kwargs, words):
    from gpumesh import GPUMesh
    from gpumesh.errors import ConfigError

    with pytest.raises(ConfigError, match=words):
        GPUMesh(**{"url": "tcp://127.0.0.1:9", "token": TOKEN, **kwargs})


@pytest.mark.parametrize("timeout", ["abc", "300", True, float("nan"), float("inf")])
def test_a_timeout_that_is_not_a_number_of_seconds_is_refused_where_given(timeout):
    from gpumesh.client.tasks import TaskOptions
    from gpumesh.errors import ConfigError

    with pytest.raises(ConfigError, match="timeout must be a number of seconds"):
        TaskOptions(timeout=timeout)
    with pytest.raises(ConfigError, match="timeout"):
        mesh(timeout=timeout)


def test_timeouts_that_are_numbers_still_pass():
    import numpy as np

    from gpumesh.client.tasks import TaskOptions

    for timeout in (None, 0, -5, 2, 2.5, np.float64(3), np.int64(4)):
        TaskOptions(timeout=timeout)


@pytest.mark.parametrize("items", ["abc", b"ab", {"x": 1}])
def test_map_over_a_string_bytes_or_a_dict_says_to_put_it_in_a_list(items):
    from gpumesh.client.tasks import TaskOptions, plan_calls

    with pytest.raises(TypeError, match=r"put it in a list"):
        plan_calls(scale, items, TaskOptions())


def test_submitting_something_not_callable_points_to_scripts():
    from gpumesh import GPUMesh

    client = GPUMesh("tcp://127.0.0.1:9", TOKEN, quiet=True)
    try:
        with pytest.raises(TypeError, match=r"script='process.py'"):
            client.submit("process.py", payloads=[{}])
    finally:
        client.close()


def test_a_mesh_dropped_without_close_ends_its_connection_once_nothing_is_outstanding():
    """Each GPUMesh's engine held it through its callbacks, and its thread held the engine: a
    loop making GPUMesh(url, token).workers() left a thread, a ZeroMQ context and a session
    with the coordinator per iteration, for the life of the process."""
    import socket

    from gpumesh import GPUMesh

    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = GPUMesh(f"tcp://127.0.0.1:{port}", TOKEN, quiet=True)
    assert not client.connect(timeout=0.05)
    idle = client._engine._thread
    busy_client = GPUMesh(f"tcp://127.0.0.1:{port}", TOKEN, quiet=True)
    busy_client.connect(timeout=0.05)
    engine = busy_client._engine
    engine._outstanding[-1] = None  # a submission waiting for its coordinator, as it looks
    busy = engine._thread
    del client, busy_client
    gc.collect()
    idle.join(timeout=10)
    assert not idle.is_alive()
    busy.join(timeout=2.5)  # over OWNER_CHECK: it would have ended by now
    assert busy.is_alive()  # a future still waits on it
    del engine._outstanding[-1]
    busy.join(timeout=10)
    assert not busy.is_alive()


def test_a_task_cancelled_on_the_mesh_is_an_error_of_the_awaiting_coroutine():
    """Settled with concurrent.futures.CancelledError itself, ``await`` turned it into the
    awaiting coroutine's own cancellation: a TaskGroup swallowed it and went on."""
    import asyncio

    from gpumesh import TaskCancelled
    from gpumesh.client.engine import decode_result

    with pytest.raises(TaskCancelled, match="cancelled on the mesh") as caught:
        decode_result({"status": "cancelled", "task": "t1", "worker": "w1"}, [])
    assert isinstance(caught.value, concurrent.futures.CancelledError)  # except clauses hold
    assert caught.value.task_id == "t1"

    async def main():
        future = TaskFuture()
        future.set_exception(caught.value)
        waiting = asyncio.ensure_future(_await(future))
        outcome = await asyncio.gather(waiting, return_exceptions=True)
        return waiting.cancelled(), outcome[0]

    # The coroutine was not cancelled (a TaskGroup would have taken it for its own and gone
    # on): it failed with the task's error.
    cancelled, outcome = asyncio.run(main())
    assert not cancelled and isinstance(outcome, TaskCancelled)


async def _await(future):
    return await future  # TaskFuture.__await__


def test_a_client_keeps_the_futures_of_its_latest_script_jobs_only(tmp_path, monkeypatch):
    """Every script job's futures (and so its results) stayed for the GPUMesh's life."""
    from types import SimpleNamespace

    from gpumesh import GPUMesh
    from gpumesh.client import api

    script = tmp_path / "job.py"
    script.write_text("print(1)\n")

    def submit(items, job, name):
        futures = [TaskFuture() for _ in items]
        for future in futures:
            future.task_id = "t"
        return futures

    client = GPUMesh("tcp://127.0.0.1:9", TOKEN, quiet=True)
    monkeypatch.setattr(client, "_require", lambda: SimpleNamespace(submit=submit))
    jobs = [client.submit_script(script=script, payloads=[{}]) for _ in range(api.KEPT_JOBS + 5)]
    assert len(client._jobs) == api.KEPT_JOBS
    assert client.job_futures(jobs[0]) == [] and len(client.job_futures(jobs[-1])) == 1


def test_a_configured_coordinator_that_does_not_answer_is_said_once_not_only_when_verbose(
        tmp_path, monkeypatch, capsys):
    # A typo'd port ran every call locally without a word: the user took the results for
    # the mesh's. Said once (on stderr), and the calls still run here.
    import socket

    from gpumesh.client.api import GPUMesh
    from gpumesh.config import Settings

    monkeypatch.delenv("GPUMESH_VERBOSE", raising=False)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = Settings.from_env({"GPUMESH_HOME": str(tmp_path)})
    nobody = GPUMesh(f"tcp://127.0.0.1:{port}", "a-token-for-nobody-" + "x" * 30,
                     connect_timeout=0.2, settings=settings)
    try:
        fn = MeshFunction(scale, MeshSource(nobody), mesh(scale).options)
        assert fn(2) == 4 and fn.map([1, 2]) == [2, 4]
    finally:
        nobody.close()
    said = capsys.readouterr().err
    assert said.count(f"no coordinator answering at tcp://127.0.0.1:{port}: running locally") == 1


@pytest.mark.parametrize("status, said", [
    ({"workers": 0, "workers_paused": 0}, "no worker is connected"),
    ({"workers": 2, "workers_paused": 2}, "every worker of"),
    ({"workers": 2, "workers_paused": 1}, None)])
def test_tasks_waiting_on_paused_workers_are_said_as_on_none(tmp_path, capsys, status, said):
    # With every worker paused a .map waited without a word, past the pending timeout.
    from gpumesh.client.api import GPUMesh
    from gpumesh.config import Settings

    client = GPUMesh("tcp://127.0.0.1:9", "a-token-for-nobody-" + "x" * 30,
                     settings=Settings.from_env({"GPUMESH_HOME": str(tmp_path)}))
    client._engine = types.SimpleNamespace(connected=True,  # type: ignore[assignment]
                                           query=lambda what, timeout: status)
    client._say_if_no_worker(3)
    err = capsys.readouterr().err
    assert (said in err) if said else err == ""


def test_the_clients_lines_are_dropped_where_there_is_no_stderr(monkeypatch):
    # Under pythonw.exe sys.stderr is None: print() wrote nothing, a bare write raised, and a
    # decorated call (or the engine's thread telling a lost link) failed.
    import sys

    from gpumesh.client.console import say_line

    monkeypatch.setattr(sys, "stderr", None)
    say_line("[gpumesh] nobody reads this")


def test_a_map_cancelled_on_the_mesh_raises_task_cancelled_not_a_bare_cancelled_error():
    """`gpumesh cancel JOB` during a .map: the first RESULT that says so must be what the caller
    gets, not a CancelledError of a sibling the map cancelled itself a moment later."""
    from gpumesh.client.api import GPUMesh
    from gpumesh.errors import TaskCancelled

    mesh = GPUMesh("tcp://127.0.0.1:9", "a" * 40, quiet=True)
    try:
        waiting: concurrent.futures.Future[int] = concurrent.futures.Future()
        cancelled: concurrent.futures.Future[int] = concurrent.futures.Future()
        cancelled.set_exception(TaskCancelled("task t2 was cancelled on the mesh", task_id="t2"))
        with pytest.raises(TaskCancelled, match="t2 was cancelled on the mesh"):
            mesh._gather([waiting, cancelled], timeout=5, fallback=None)
        assert waiting.cancelled()  # the rest are still stopped
    finally:
        mesh.close()


def test_a_client_loop_that_fails_closes_its_connection_cleanly(monkeypatch, tmp_path):
    """A wrong token (AuthenticationError in the loop) ended the I/O thread with an
    UnboundLocalError in its cleanup: sockets and context left open, callers never failed."""
    from gpumesh.client.engine import Engine
    from gpumesh.config import Settings, parse_url
    from gpumesh.errors import AuthenticationError

    def refused(self):
        raise AuthenticationError("the coordinator refused this token")

    monkeypatch.setattr(Engine, "_turn", refused)
    engine = Engine(Settings(home=tmp_path), parse_url("tcp://127.0.0.1:9"), "t" * 43)
    engine.io_thread.join(10)
    assert not engine.io_thread.is_alive()
    assert isinstance(engine.fatal, AuthenticationError) and engine._stopped


def test_a_payload_json_cannot_hold_names_its_index_and_what_json_takes(tmp_path):
    # A bare TypeError ("Object of type object is not JSON serializable") named neither the
    # payload nor what to give instead; the other payload errors name both.
    from gpumesh import ConfigError, GPUMesh

    script = tmp_path / "job.py"
    script.write_text("print(1)\n")
    client = GPUMesh("tcp://127.0.0.1:9", TOKEN, quiet=True)
    with pytest.raises(ConfigError, match=r"payload 1 cannot be written as JSON .*object.*"
                                          r"dicts, lists, strings"):
        client.submit_script(script=script, payloads=[{"a": 1}, {"a": object()}])
    looped: dict = {}
    looped["me"] = looped
    with pytest.raises(ConfigError, match="payload 0 cannot be written as JSON"):
        client.submit_script(script=script, payloads=[looped])


def test_output_must_be_a_function():
    from gpumesh import ConfigError, GPUMesh

    with pytest.raises(ConfigError, match="output must be a function"):
        GPUMesh("tcp://127.0.0.1:9", TOKEN, output="stderr")
