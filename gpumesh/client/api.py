"""``GPUMesh``: the Python API over a client engine (sync calls, batches, queries, jobs)."""

from __future__ import annotations

import concurrent.futures
import ipaddress
import logging
import numbers
import os
import re
import socket
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .. import clock
from ..config import Endpoint, Settings, parse_url
from ..discovery import browse_interfaces, find_coordinator
from ..errors import ConfigError, ConnectionFailed, MeshError, MeshTimeout
from ..protocol.fields import for_terminal
from ..protocol.ids import HexIds
from .console import say_line
from .engine import (
    FIRST_CHUNK,
    Engine,
    TaskFuture,
    on_io_thread,
    refuse_wait_on_io_thread,
    script_value,
)
from .launch import CoordinatorHandle, WorkerHandle, start_coordinator, start_worker
from .portable import SourceForm, source_form
from .remotetb import localize_error
from .tasks import (
    DEFAULT_OPTIONS,
    PYTHON,
    PickledFunction,
    TaskOptions,
    plan_calls,
    scheduler_options,
    script_task,
)

if TYPE_CHECKING:
    from .executor import MeshExecutor

R = TypeVar("R")
UNREACHABLE_MEMORY = 5.0  # seconds a failed connect is remembered before trying again
ACCEPT_TIMEOUT = 30.0  # seconds submit(script=...) waits for the coordinator to make a job durable
JOB_POLL = 0.25  # seconds between status queries while waiting for a job
# Seconds a Ctrl+C waits for the cancels of what was sent to reach the coordinator (a query
# answered behind them): milliseconds usually, seconds while big frames are still written.
INTERRUPT_FLUSH = 10.0
NO_WORKER_NOTICE = 3.0  # seconds a gather waits before checking whether any worker is there
KEPT_JOBS = 256  # script jobs whose futures a GPUMesh keeps for job_futures()
PYTHONS_CACHE = 5.0  # seconds the workers' Python versions are trusted before asking again
log = logging.getLogger("gpumesh.client")


class GPUMesh:
    """A connection to one coordinator.

    ``GPUMesh()`` with no arguments uses ``GPUMESH_URL``/``GPUMESH_TOKEN``, then the connection
    saved by ``gpumesh serve``/``join``. It connects on first use and reconnects by itself.
    What tasks print streams back: to this process's stdout and stderr, each line prefixed
    with its worker (none with ``quiet``), or to ``output(worker, stream, data, task_id)``,
    called on the connection's thread (keep it short).
    """

    def __init__(
        self, url: str | None = None, token: str | None = None, *, quiet: bool = False,
        connect_timeout: float | None = None, settings: Settings | None = None,
        output: Callable[[str, str, bytes, str], None] | None = None,
    ) -> None:
        _check_arguments(url, token, connect_timeout)
        if output is not None and not callable(output):
            raise ConfigError(f"output must be a function (worker, stream, data, task id), not "
                              f"a {type(output).__name__}")
        self.settings = settings or Settings.from_env()
        self.endpoint, self._token = _resolve(self.settings, url, token)
        self.quiet = quiet
        # Where what tasks print goes: called on the connection's thread with the worker's id,
        # "out" or "err", the bytes and the task's id; by default this process's stdout and
        # stderr, each line prefixed with its worker, unless quiet.
        self._output = output if output is not None else None if quiet else _print_output
        self.connect_timeout = (self.settings.timing.connect_timeout if connect_timeout is None
                                else connect_timeout)
        self._engine: Engine | None = None
        self._engine_pid = os.getpid()
        self._lock = threading.Lock()
        self._closed_thread: threading.Thread | None = None  # the I/O thread close() ended
        self._unreachable_at = 0.0
        # The futures of the script jobs this GPUMesh submitted, the latest KEPT_JOBS of them:
        # each holds its results, and a long-lived client submitting job after job kept all.
        self._jobs: OrderedDict[str, list[TaskFuture]] = OrderedDict()
        self._pythons: set[str] = set()  # Python versions of alive workers, refreshed now and then
        self._pythons_at = 0.0

    def __repr__(self) -> str:
        return f"GPUMesh({str(self.endpoint)!r})"

    @property
    def url(self) -> str:
        return self.endpoint.zmq

    # ----------------------------------------------------------------- connection

    def _get_engine(self) -> Engine:
        with self._lock:
            if self._engine is not None and self._engine_pid != os.getpid():
                # Inherited through fork (a multiprocessing pool): its I/O thread did not come
                # along, so this process gets a connection of its own.
                self._engine = None
            if self._engine is None or self._engine.fatal is not None:
                if threading.current_thread() is self._closed_thread:
                    # A done-callback of the connection close() is ending: a new one made
                    # there would outlive the close, on a mesh its user just closed.
                    raise MeshError("this mesh connection was closed while this callback ran: "
                                    "nothing more is sent from it")
                self._engine_pid = os.getpid()
                # Its callbacks hold this object weakly: a GPUMesh dropped without close()
                # is collected, and its connection then closes itself.
                self._engine = Engine(self.settings, self.endpoint, self._token,
                                      on_output=self._output,
                                      on_connect=_weakly(self._announce),
                                      on_link=_weakly(self._link_changed),
                                      owner=weakref.ref(self))
            return self._engine

    def _announce(self) -> None:
        if self.quiet:
            return
        say_line(f"[gpumesh] connected to coordinator at {self.endpoint}")
        pythons = self._engine.worker_pythons if self._engine is not None else None
        if pythons and PYTHON not in pythons:
            # Said at connect time, not after a pending timeout: what differs, what to do.
            theirs = for_terminal(", ".join(sorted(pythons)))  # as the coordinator said
            say_line(f"[gpumesh] no worker runs Python {PYTHON} like this client (they run "
                     f"{theirs}): pickled functions wait for one, plain "
                     "top-level functions travel as source. Join a worker with Python "
                     f"{PYTHON} to run everything.")

    def _link_changed(self, away: float | None) -> None:
        """Said on the engine's thread: the coordinator went silent, or is back."""
        if self.quiet:
            return
        if away is None:
            say_line(f"[gpumesh] lost the coordinator at {self.endpoint}; reconnecting. Tasks it "
                     "accepted are kept in its journal, and this client sends again what it had "
                     "not handed over.")
        else:
            say_line(f"[gpumesh] back: reconnected to the coordinator at {self.endpoint} after "
                     f"{away:.0f}s away.")

    def connect(self, timeout: float | None = None) -> bool:
        """Wait until a session with the coordinator is up. False if it could not be reached.

        Raises AuthenticationError when the token is wrong.
        """
        engine = self._get_engine()
        if engine.connected:
            return True
        if clock.now() - self._unreachable_at < UNREACHABLE_MEMORY and not engine.ever_connected:
            return False
        ok = engine.wait_connected(self.connect_timeout if timeout is None else timeout)
        if not ok:
            self._unreachable_at = clock.now()
        return ok

    def _require(self) -> Engine:
        if not self.connect():
            engine = self._engine
            unresolved = _unresolved(self.endpoint.host)
            if unresolved:
                what = unresolved
            elif engine is not None and engine.refused:
                what = "nothing is listening there (connection refused)"
            else:
                what = f"no coordinator answered within {self.connect_timeout:g}s"
            raise ConnectionFailed(
                f"cannot reach a coordinator at {self.endpoint}: {what}. Start one with "
                "'gpumesh serve', or check the URL and that its port is reachable"
            )
        assert self._engine is not None
        return self._engine

    @property
    def connected(self) -> bool:
        return self._engine is not None and self._engine.connected

    def close(self) -> None:
        # Closed outside the lock: closing joins the I/O thread, where a done-callback that
        # submits more (joblib's next batch, a chained call) waits for this lock.
        # It stays this mesh's engine while it closes: what runs on its thread meanwhile (the
        # connect notice, a callback's submit, refused as closed) still finds it.
        with self._lock:
            engine = self._engine
            if engine is not None:
                self._closed_thread = engine.io_thread
        if engine is not None:
            engine.close()
            with self._lock:
                if self._engine is engine:
                    self._engine = None

    def __enter__(self) -> GPUMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- running functions

    def submit(self, fn: Callable[..., Any] | None = None, /, *args: Any, **kwargs: Any) -> Any:
        """``submit(fn, *args, **kwargs)`` runs one call and returns a future.

        ``submit(name=..., script=..., payloads=[...])`` (no function) submits a script job and
        returns its job id, as the spec's job API does.
        """
        if fn is None:
            return self.submit_script(**kwargs)
        return self.submit_calls(fn, [(args, kwargs)])[0]

    def submit_calls(
        self, fn: Callable[..., Any], calls: Iterable[tuple[Any, ...]],
        options: TaskOptions | None = None, job: str = "", name: str = "",
    ) -> list[TaskFuture]:
        """One task per call: ``(args, kwargs)`` or ``(args, kwargs, options)``, as one job.
        If a call cannot be pickled, the error is raised and those already sent are cancelled."""
        if not callable(fn):
            raise TypeError(
                f"the task's function must be callable, not {type(fn).__name__} ({fn!r}); a "
                "script goes by name: mesh.submit(script='process.py', payloads=[...])")
        engine = self._require()
        options = options or DEFAULT_OPTIONS
        pickled = PickledFunction.of(fn)
        portable = self._portable_form(fn)
        calls = list(calls)
        job = job or new_job_id()
        label = name or getattr(fn, "__qualname__", "function")

        # One spec for the calls under the same options: made once, not once per call, and
        # held once by the engine while they are out.
        specs: dict[int, tuple[TaskOptions, dict[str, Any]]] = {}

        def spec_of(call_options: TaskOptions) -> dict[str, Any]:
            made = specs.get(id(call_options))
            if made is None or made[0] is not call_options:
                made = specs[id(call_options)] = (call_options, pickled.spec(call_options))
            return made[1]

        def pickle_calls(part: list[tuple[Any, ...]]) -> list[tuple[dict[str, Any], list[Any]]]:
            return [pickled.task(call[0], call[1],
                                 spec_of(call[2] if len(call) > 2 else options), portable)
                    for call in part]

        # A big batch's first FIRST_CHUNK calls go before the rest is pickled: the mesh starts
        # on them meanwhile (a 5,000-task .map's first result came after 100 ms, now 15). The
        # rest goes in one hand-over, in full SUBMITs. (Handed over a SUBMIT's worth at a time
        # as it was pickled, a map of 256 KiB arrays ran at 0.63x: the caller's pickling and
        # the engine's writes into shared memory took the GIL from each other.)
        early = calls[:FIRST_CHUNK] if len(calls) > 4 * FIRST_CHUNK else []
        futures = engine.submit(pickle_calls(early), job, label) if early else []
        try:
            rest = pickle_calls(calls[len(early):])
            if rest or not early:
                futures += engine.submit(rest, job, label, continues=bool(early))
        except KeyboardInterrupt:  # Ctrl+C while the rest was pickled: stop what was sent
            self.interrupted(futures)
            raise
        except BaseException:
            for future in futures:
                future.cancel()  # the mesh cancels them too: those that started are stopped
            raise
        for future in futures:
            future.job = job
        return futures

    def _portable_form(self, fn: Callable[..., Any]) -> SourceForm | None:
        """The source form of ``fn`` when some alive worker runs another Python, else None."""
        others = self._other_pythons()
        if not others:
            return None
        form = source_form(fn)
        name = getattr(fn, "__qualname__", "the function")
        versions = ", ".join(sorted(others))
        if isinstance(form, str):
            self._verbose(f"{name} runs only on Python {PYTHON} workers, not on the ones with "
                          f"Python {versions}: {form}")
            return None
        self._verbose(f"{name} also travels as source, for the workers on Python {versions} "
                      f"(this is {PYTHON})")
        return form

    def _verbose(self, text: str) -> None:
        """GPUMESH_VERBOSE=1 says it on stderr, like the decorator's routing lines; -v logs it."""
        if self.settings.verbose:
            sys.stderr.write(f"[gpumesh] {text}\n")  # one write: threads' lines stay whole
        else:
            log.debug("%s", text)

    def _other_pythons(self) -> set[str]:
        engine = self._engine
        if engine is not None and engine.worker_pythons is not None:
            # Pushed by the coordinator: no round trip on the way of every call.
            return {p for p in engine.worker_pythons if p and p != PYTHON}
        now = clock.now()
        # A call made in a done-callback (joblib sends its next batch from one) runs on the
        # I/O thread, which cannot wait for an answer it would read itself: the last listing.
        if now - self._pythons_at > PYTHONS_CACHE and not on_io_thread():
            try:
                listing = self._require().query("workers")
            except MeshError:
                return set()
            self._pythons = {str(w.get("python", "")) for w in listing if w.get("alive")}
            self._pythons_at = now
        return {p for p in self._pythons if p and p != PYTHON}

    def map(self, fn: Callable[..., R], items: Iterable[Any], *, timeout: float | None = None,
            options: TaskOptions | None = None) -> list[R]:
        """Run ``fn`` once per item across the mesh; results in input order.

        A dict item is keyword arguments, a tuple positional ones, anything else one argument.
        A dict's scheduler keys (``gpu``, ``cores``, ``memory``, ``vram``, ``cost``) place the
        task instead of reaching ``fn``, unless ``fn`` declares a parameter of that name.
        """
        futures = self.submit_calls(fn, plan_calls(fn, items, options or DEFAULT_OPTIONS), options)
        return self.gather(futures, timeout=timeout)

    def distribute(self, function: Callable[..., R], params: Sequence[dict[str, Any]],
                   timeout: float | None = None) -> list[R]:
        """The spec's batch call: one task per kwargs dict, results in order."""
        return self.map(function, params, timeout=timeout)

    def gather(
        self, futures: Sequence[concurrent.futures.Future[Any]], *, timeout: float | None = None,
        fallback: Callable[[int], Any] | None = None,
    ) -> list[Any]:
        """Wait for every future; raise the first task error in input order.

        With ``fallback``, tasks still unfinished after the coordinator has been gone for the
        reconnect grace period are run locally by ``fallback(index)``.
        """
        try:
            return self._gather(futures, timeout, fallback)
        except KeyboardInterrupt:
            self.interrupted(futures)
            raise

    def interrupted(self, futures: Sequence[concurrent.futures.Future[Any]]) -> int:
        """Ctrl+C means stop: cancel the unfinished ``futures`` on the mesh (pending ones never
        start, running ones are stopped), say so in one line, and return how many."""
        waiting = [f for f in futures if not f.done()]
        self._cancel(waiting)
        engine = self._engine
        heard = False
        if waiting and engine is not None and engine.connected:
            deadline = time.monotonic() + INTERRUPT_FLUSH
            # Answered once the engine is past what it was sending (big frames take seconds to
            # write) and the coordinator past the CANCELs ahead of it. Asked again each second
            # until then, and given up on once the link is found dead: a coordinator killed a
            # moment before held the Ctrl+C for the whole INTERRUPT_FLUSH.
            heard = self._answered_before(engine, deadline)
            # A submission sent but not yet accepted is cancelled once its ACCEPTED comes
            # (which the coordinator sends after its commit, maybe after that answer).
            if heard and engine.awaiting_acceptance(waiting):
                while engine.awaiting_acceptance(waiting) and time.monotonic() < deadline \
                        and engine.connected:
                    time.sleep(0.01)
                heard = self._answered_before(engine, max(deadline, time.monotonic() + 0.5))
        if waiting and heard:
            say_line(f"[gpumesh] interrupted: cancelled {len(waiting)} unfinished task(s) on the "
                     "mesh")
        elif waiting:
            say_line(f"[gpumesh] interrupted: {len(waiting)} unfinished task(s) cancelled here; "
                     f"the coordinator at {self.endpoint} did not confirm it (unreachable): it "
                     "hears of it if this program reconnects")
        return len(waiting)

    @staticmethod
    def _answered_before(engine: Engine, deadline: float) -> bool:
        """Whether the coordinator answers a query before ``deadline`` while the link lives."""
        while time.monotonic() < deadline and engine.connected:
            try:
                engine.query("status", timeout=min(1.0, max(deadline - time.monotonic(), 0.05)),
                             tasks=False)
                return True
            except MeshError:
                if engine.fatal is not None:
                    return False
                time.sleep(0.05)  # an answer that came at once (busy): not asked in a spin
        return False

    def _gather(self, futures: Sequence[concurrent.futures.Future[Any]], timeout: float | None,
                fallback: Callable[[int], Any] | None) -> list[Any]:
        started = clock.now()
        deadline = None if timeout is None else started + timeout
        if on_io_thread() and not all(f.done() for f in futures):
            self._cancel([f for f in futures if not f.done()])  # nobody would collect them
            refuse_wait_on_io_thread("waiting for a .map's results")
        watch = _Countdown(futures)
        noticed = self.quiet
        while True:
            # One callback per future, not concurrent.futures.wait over the whole set every
            # quarter second: that took every future's lock each time, and a 10,000-task map
            # spent more of the client's time there than in the mesh.
            watch.changed.wait(0.25)
            if watch.failed:
                # Chosen before the rest are cancelled here: one cancelled by that, earlier in
                # the list, raised a bare CancelledError in place of the task's own error (a
                # `gpumesh cancel JOB` read as CancelledError, not TaskCancelled).
                ended = [f for f in futures if f.done() and (
                    f.cancelled() or f.exception() is not None)]
                first = next((f for f in ended if not f.cancelled()), ended[0])
                self._cancel([f for f in futures if not f.done()])
                error = None if first.cancelled() else first.exception()
                if error is not None:
                    localize_error(error)  # the caller's source lines for its own frames
                first.result()  # raises the task's error (or CancelledError)
            if watch.finished:
                return [f.result() for f in futures]
            now = clock.now()
            if deadline is not None and now >= deadline:
                waiting = [f for f in futures if not f.done()]
                if waiting:
                    self._cancel(waiting)
                    raise MeshTimeout(f"{len(waiting)} of {len(futures)} tasks did not finish "
                                      f"within {timeout:g}s")
            engine = self._engine
            if not noticed and now - started > NO_WORKER_NOTICE:
                noticed = True
                self._say_if_no_worker(sum(1 for f in futures if not f.done()))
            if fallback is not None and engine is not None:
                gone = engine.disconnected_since
                if gone is not None and now - gone > self.settings.timing.reconnect_grace:
                    waiting = [f for f in futures if not f.done()]
                    say_line(f"[gpumesh] coordinator at {self.endpoint} gone for "
                             f"{now - gone:.0f}s: running {len(waiting)} unfinished task(s) "
                             "locally")
                    self._cancel(waiting)
                    return [f.result() if f.done() and not f.cancelled() else fallback(i)
                            for i, f in enumerate(futures)]

    def _say_if_no_worker(self, count: int) -> None:
        """One stderr line when tasks wait because no worker is connected at all, or every one
        is paused or draining (a .map then waited without a word, past the pending timeout:
        a paused worker is expected back)."""
        engine = self._engine
        if engine is None or not engine.connected:
            return
        try:
            status = engine.query("status", timeout=2.0)
        except MeshError:
            return
        alive, paused = status.get("workers", 1), status.get("workers_paused", 0)
        if not alive:
            say_line(f"[gpumesh] {count} task(s) waiting: no worker is connected to {self.endpoint}; "
                     "start one with 'gpumesh join URL --token-file FILE'")
        elif type(alive) is int and type(paused) is int and paused >= alive:
            say_line(f"[gpumesh] {count} task(s) waiting: every worker of {self.endpoint} is paused "
                     "or draining ('gpumesh resume' on its machine, 'gpumesh workers' to see them)")

    def _cancel(self, futures: Iterable[concurrent.futures.Future[Any]]) -> None:
        for future in futures:
            future.cancel()

    def executor(self, max_workers: int | None = None, *, options: TaskOptions | None = None
                 ) -> MeshExecutor:
        """A ``concurrent.futures.Executor`` on this mesh (``gpumesh.MeshExecutor``); its
        ``shutdown`` leaves this connection open."""
        from .executor import MeshExecutor

        return MeshExecutor(max_workers=max_workers, mesh=self, options=options)

    # ----------------------------------------------------------------- scripts and jobs

    def submit_script(self, *, script: str | Path, payloads: Sequence[Any], name: str | None = None,
                      options: TaskOptions | None = None, accept_timeout: float = ACCEPT_TIMEOUT,
                      job_id: str | None = None) -> str:
        """Submit a script job: one task per payload (JSON on the script's stdin).

        Returns the job id once the coordinator has made the job durable, so ``status(job)``
        and ``wait_job(job)`` work at once, from here or from any other client. ``job_id``
        (from ``new_job_id()``) names the job before the call returns, for a caller that may
        be interrupted while it waits; by default a new one is made.
        """
        if isinstance(payloads, (str, bytes, Mapping)) or not isinstance(payloads, Sequence):
            raise ConfigError(f"payloads must be a list of payloads, one per task, not a "
                              f"{type(payloads).__name__}: wrap a single payload as [payload]")
        if not payloads:
            raise ConfigError("payloads is empty: a script job needs at least one payload")
        for index, payload in enumerate(payloads):
            if not isinstance(payload, Mapping):
                raise ConfigError(f"payload {index} is a {type(payload).__name__}, not an object: "
                                  "each payload is a dict the script reads as JSON, e.g. "
                                  "{\"lr\": 0.1}")
        path = Path(script)
        try:
            source = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read the script {path}: {exc.strerror}") from None
        options = options or DEFAULT_OPTIONS
        items = []
        for index, payload in enumerate(payloads):
            payload, task_options = scheduler_options(payload, options, where=f"payload {index}")
            items.append(script_task(path.name, source, payload, task_options,
                                     where=f"payload {index}"))
        job = job_id or new_job_id()
        futures = self._require().submit(items, job, name or str(script))
        for future in futures:
            future.job = job
        self._jobs[job] = futures
        self._jobs.move_to_end(job)
        while len(self._jobs) > KEPT_JOBS:
            self._jobs.popitem(last=False)
        self._wait_accepted(job, futures, accept_timeout)
        return job

    def _wait_accepted(self, job: str, futures: Sequence[TaskFuture], timeout: float) -> None:
        deadline = clock.now() + timeout
        while not all(f.task_id or f.done() for f in futures):
            if clock.now() > deadline:
                raise MeshTimeout(
                    f"the coordinator at {self.endpoint} did not accept job {job} within "
                    f"{timeout:g}s; it may still run: check with 'gpumesh status {job}'")
            time.sleep(0.005)
        for future in futures:
            if future.task_id or not future.done() or future.cancelled():
                continue
            error = future.exception()  # done without a task id: the coordinator refused it
            if error is not None:
                raise error

    def job_futures(self, job_id: str) -> list[TaskFuture]:
        """Futures of a job this GPUMesh submitted (results arrive here, not to other clients):
        of its latest KEPT_JOBS (256) script jobs; ``status(job)`` reads any job the
        coordinator still holds."""
        return list(self._jobs.get(job_id, []))

    def status(self, job_id: str | None = None, *, tasks: bool = True) -> dict[str, Any]:
        """A job's state (``job_id``: its id, a unique prefix, or its name), or the mesh's.

        ``{'job', 'name', 'status': 'queued'|'running'|'finished', 'counts', 'tasks': [...]}``;
        ``tasks=False`` leaves out the task list (cheap enough to poll).
        """
        answer = self._require().query("status", job=job_id, tasks=tasks)
        if isinstance(answer, dict) and "error" in answer:
            raise MeshError(str(answer["error"]))
        return answer

    def wait_job(self, job_id: str, *, timeout: float | None = None,
                 progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Wait until every task of the job has finished; ``progress`` sees each status."""
        deadline = None if timeout is None else clock.now() + timeout
        while True:
            status = self.status(job_id, tasks=False)
            if progress is not None:
                progress(status)
            if status["status"] == "finished":
                return self.status(job_id)  # once more, with every task
            if deadline is not None and clock.now() >= deadline:
                raise MeshTimeout(f"job {job_id} did not finish within {timeout:g}s")
            time.sleep(JOB_POLL)

    def job_results(self, job_id: str, *, timeout: float = 300.0) -> dict[str, Any]:
        """A script job's outputs, whole, as the coordinator holds them (``status`` shows
        each only up to 4 KiB): ``{'job', 'name', 'collected', 'tasks': [{'id', 'state',
        'result', 'bytes', ...}]}``. ``result`` is the script's JSON, or its text where that
        is not JSON; a task without one says why in ``note`` or ``error``. The results of a
        detached ``submit`` stay readable for GPUMESH_RESULT_TTL; those its submitter
        collected are gone from the coordinator (``collected`` counts them), but for those
        this GPUMesh collected itself (a job it submitted): they are listed from its futures."""
        answer = self._require().query("results", timeout=timeout, job=job_id)
        if isinstance(answer, dict) and "error" in answer:
            raise MeshError(str(answer["error"]))
        tasks = answer.get("tasks") if isinstance(answer, dict) else None
        if not isinstance(tasks, list):
            raise MeshError("the coordinator gave an unexpected answer to results")
        kept = []
        for item in tasks:  # the coordinator's words: only what has the expected shape
            if not (isinstance(item, dict) and type(item.get("id")) is str):
                continue
            raw = item.pop("raw", None)
            if isinstance(raw, bytes):
                try:
                    item["result"] = script_value(raw, item.pop("encoding", None))
                except (ValueError, RecursionError):  # as the worker read it: text
                    item["result"] = raw.decode("utf-8", "replace")
            kept.append(item)
        collected = answer.get("collected")
        collected = collected if type(collected) is int and collected >= 0 else 0
        job = str(answer.get("job", job_id))
        # This client's own collected results, which the coordinator gave up as they came: a
        # job submitted from Python read as empty here though its outputs were in this process.
        listed = {item["id"] for item in kept}
        for future in self._jobs.get(job, ()):
            if collected and future.task_id and future.task_id not in listed and future.done() \
                    and not future.cancelled():
                error = future.exception()
                kept.append({"id": future.task_id, "state": "failed", "error": str(error)}
                            if error is not None else
                            {"id": future.task_id, "state": "done", "result": future.result()})
                collected -= 1
        return {"job": job, "name": str(answer.get("name", "")), "collected": collected,
                "tasks": kept}

    def cancel_job(self, job_id: str, *, force: bool = False) -> int:
        """Cancel a job: pending tasks never start, running ones are stopped. Returns how many.

        A job submitted from another account or machine (another ``user@host``) is refused
        unless ``force``: the mesh is shared, and a mistyped id must not stop a friend's work."""
        return int(self.control_job("cancel", job_id, force=force)["cancelled"])

    def retry_job(self, job_id: str, *, force: bool = False) -> int:
        """Run a job's failed and cancelled tasks again. Returns how many were re-queued.
        Another owner's job needs ``force``, as for ``cancel_job``."""
        return int(self.control_job("retry", job_id, force=force)["retried"])

    def control_job(self, action: str, job_id: str, *, force: bool = False) -> dict[str, Any]:
        """``cancel_job``/``retry_job`` with the coordinator's whole answer: ``{'job', 'owner',
        'cancelled' or 'retried', 'stopping'}``, ``stopping`` counting the job's tasks
        cancelled while running whose worker has not confirmed the stop yet (one stopped or
        cut off: they end as cancelled when it answers or its lease expires, and are not
        retried before)."""
        if action not in ("cancel", "retry"):
            raise ConfigError(f"control_job does cancel or retry, not {action!r}")
        answer = self._require().control(action, job_id, force=force)
        stopping = answer.get("stopping")
        answer["stopping"] = stopping if type(stopping) is int and stopping >= 0 else 0
        return answer

    def kill_worker(self, worker: str) -> dict[str, Any]:
        """Remove a worker (id, unique prefix or hostname): its tasks go back to the queue.
        Any client may; the worker's owner is told who did it."""
        return self._require().control("kill", worker)

    def steer_worker(self, worker: str, action: str) -> dict[str, Any]:
        """Ask a worker to ``drain``, ``pause`` or ``resume`` as its owner's ``gpumesh ACTION``
        would; it never undoes what its owner chose on its machine. The worker, the
        coordinator's log and the event stream are told who asked."""
        if action not in ("drain", "pause", "resume"):
            raise ValueError(f"action must be drain, pause or resume, not {action!r}")
        return self._require().control(action, worker)

    def health(self) -> dict[str, Any]:
        """The coordinator's own state: ``{uptime, queue, journal_bytes, clients, workers,
        finished_total, ...}`` (docs/protocol.md, QUERY ``health``)."""
        return self._require().query("health")

    def task_detail(self, task_id: str) -> dict[str, Any]:
        """One task as the coordinator holds it: state, worker, attempts, times and its whole
        ``error`` (type, message, remote traceback). Raises MeshError once it is forgotten."""
        answer = self._require().query("task", task=task_id)
        if isinstance(answer, dict) and "error" in answer and "id" not in answer:
            raise MeshError(str(answer["error"]))
        return answer

    def events(self, since: int = 0) -> list[list[Any]]:
        """State changes after event number ``since``: ``[[seq, time, kind, data], ...]``."""
        return self._require().query("events", since=since)

    @staticmethod
    def results_to_dataframe(results: Iterable[Any]) -> Any:
        """A pandas DataFrame: a row per result; dict results become columns."""
        from .frames import results_to_dataframe

        return results_to_dataframe(results)

    # ----------------------------------------------------------------- the pool

    def lan_urls(self, timeout: float = 3.0) -> list[str]:
        """The URLs this mesh's coordinator advertises on the LAN (what another machine
        dials), nearest subnet first; empty when it is not advertised (bound to loopback, or
        discovery off). Browses the LAN for up to ``timeout`` seconds; raises ConfigError when
        this machine cannot listen for advertisements on any of its LAN addresses."""
        from ..discovery import adapters, browse
        from ..security import derive_keys

        interfaces = browse_interfaces(self.settings.discovery_interfaces)
        if not self.settings.discovery or not interfaces:
            return []
        fingerprint = derive_keys(self._token).fingerprint
        local = adapters()
        return [url for found in browse(timeout, interfaces, want=fingerprint)
                if found.mesh == fingerprint for url in found.urls(local)]

    def workers(self) -> list[dict[str, Any]]:
        """``[{'id', 'device', 'device_name', 'hostname', 'score', 'alive', ...}]``"""
        return self._require().query("workers")

    def devices(self) -> list[dict[str, Any]]:
        """The unified pool: one entry per GPU of every alive worker, one per CPU-only worker."""
        pool = []
        for worker in self.workers():
            if not worker["alive"]:
                continue
            gpus = worker.get("gpus") or []
            for gpu in gpus:
                pool.append({"worker": worker["id"], "hostname": worker["hostname"], "type": "GPU",
                             "name": gpu.get("name", ""), "vram": gpu.get("vram", 0),
                             "score": worker["score"] / max(len(gpus), 1)})
            if not gpus:
                pool.append({"worker": worker["id"], "hostname": worker["hostname"], "type": "CPU",
                             "name": worker["device_name"], "cores": worker.get("cores", 0),
                             "score": worker["score"]})
        return pool

    def device_count(self) -> int:
        return sum(1 for w in self.workers() if w["alive"])

    def gpu_count(self) -> int:
        return sum(len(w.get("gpus") or []) for w in self.workers() if w["alive"])

    def total_score(self) -> float:
        return round(sum(float(w["score"]) for w in self.workers() if w["alive"]), 3)

    def auto_device(self) -> dict[str, Any] | None:
        """The most powerful alive device, or None on an empty pool."""
        pool = self.devices()
        return max(pool, key=lambda d: d["score"]) if pool else None

    # ----------------------------------------------------------------- starting processes

    @staticmethod
    def start_coordinator(port: int = 8000, token: str | None = None, host: str = "127.0.0.1",
                          **options: Any) -> CoordinatorHandle:
        """Start ``gpumesh serve`` in the background; returns once it listens. Non-blocking."""
        return start_coordinator(port=port, token=token, host=host, **options)

    @staticmethod
    def add_worker(url: str, token: str | None = None, **options: Any) -> WorkerHandle:
        """Start ``gpumesh join URL`` in the background; returns once it joined. Non-blocking.
        As ``join`` does, it benchmarks the machine (kept for 30 days per machine) so that the
        scheduler ranks it by its score; ``benchmark=False`` skips that (score 0)."""
        options.setdefault("benchmark", True)
        return start_worker(url, token=token, **options)


def new_job_id() -> str:
    """A fresh job id: 12 hex digits, drawn from the kernel in bulk (a getrandom call per
    single call cost 40 µs on the test machine, a fifth of its time in the caller's thread)."""
    return _job_ids()


_job_ids = HexIds(12)


_OPEN_LINES: set[tuple[str, str, str]] = set()  # (worker, stream, task) whose last chunk ended mid-line
# Lines left open at once, at most: past it the set starts afresh (a line continued after that
# gets its worker's prefix again), so tasks that end mid-line cannot make it grow for good.
MAX_OPEN_LINES = 1024


def _print_output(worker: str, stream: str, data: bytes, task: str = "") -> None:
    """A task's output, each line prefixed with its worker. ``print`` flushes the text and the
    newline as separate chunks at times: a chunk that continues a line of the same task gets no
    prefix (two tasks of one worker print side by side, each its own lines)."""
    target = sys.stderr if stream == "err" else sys.stdout
    text = data.decode("utf-8", "replace")
    if not text:
        return
    key = (worker, stream, task)
    out = []
    for piece in text.splitlines(keepends=True):
        if key in _OPEN_LINES:
            _OPEN_LINES.discard(key)
            out.append(piece)
        else:
            out.append(f"[{worker}] {piece}")
    if not text.endswith(("\n", "\r")):
        if len(_OPEN_LINES) >= MAX_OPEN_LINES:
            _OPEN_LINES.clear()
        _OPEN_LINES.add(key)
    try:
        target.write("".join(out))
        target.flush()
    except (OSError, ValueError):
        pass  # the caller closed its stdout; printing is best effort


class _Countdown:
    """Done-callbacks on a list of futures: ``changed`` is set when the last one finishes or
    one fails (an error, or cancelled)."""

    def __init__(self, futures: Sequence[concurrent.futures.Future[Any]]) -> None:
        self.changed = threading.Event()
        self.failed = False
        self._left = len(futures)
        self._lock = threading.Lock()
        if not futures:
            self.changed.set()
        for future in futures:
            future.add_done_callback(self._done)

    @property
    def finished(self) -> bool:
        return self._left == 0

    def _done(self, future: concurrent.futures.Future[Any]) -> None:
        try:  # one look under the future's lock, not two: this runs once a task (Future's
            # own: a TaskFuture's rewrites a remote traceback, which _gather does for the one
            # error it raises)
            bad = concurrent.futures.Future.exception(future, 0) is not None
        except concurrent.futures.CancelledError:
            bad = True
        with self._lock:
            self._left -= 1
            self.failed = self.failed or bad
            if bad or self._left == 0:
                self.changed.set()


def _weakly(method: Callable[..., None]) -> Callable[..., None]:
    """``method``, bound to its object without keeping it alive: a no-op once it is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


def _check_arguments(url: Any, token: Any, connect_timeout: Any) -> None:
    """The constructor's arguments, by type, before anything reads them. The values are never
    quoted: one may be the token (a URL and a token passed the wrong way round)."""
    for name, value in (("url", url), ("token", token)):
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"GPUMesh: {name} must be a string, not {type(value).__name__}")
    if isinstance(token, str) and ("://" in token or _HOST_AND_PORT.match(token.strip())) \
            and isinstance(url, str) and _TOKEN_SHAPED.match(url.strip()):
        # Both: a chosen token may hold a colon ("team-mesh:2024"), and a url may be a bare
        # host name; a url shaped like a token and a token shaped like an address are a swap.
        raise ConfigError("GPUMesh: the token looks like an address: the url and the token seem "
                          "swapped; call GPUMesh(url, token=token)")
    if connect_timeout is not None and (
            isinstance(connect_timeout, bool) or not isinstance(connect_timeout, numbers.Real)
            or not 0 <= float(connect_timeout) < float("inf")):
        raise ConfigError(f"GPUMesh: connect_timeout must be a number of seconds >= 0, not "
                          f"{connect_timeout!r}")


# host:port, the shape of an address: a token (letters, digits, - and _) never has a colon.
_HOST_AND_PORT = re.compile(r"^\[?[\w.:-]+\]?:\d{1,5}$")
# A generated token's shape (secrets.token_urlsafe, 22+ characters; rand-...): no dots, no
# colons, no slashes, as no IP address or usual host name of that length is.
_TOKEN_SHAPED = re.compile(r"^[A-Za-z0-9_-]{22,}$")


def _resolve(settings: Settings, url: str | None, token: str | None) -> tuple[Endpoint, str]:
    """The coordinator and token: given, from the environment or saved (Settings), else this
    token's mesh found on the LAN when discovery is on."""
    try:
        return settings.resolve_connection(url, token)
    except ConfigError as missing:
        saved = settings.saved_connection()
        chosen = token or settings.token or (saved.token if saved else None)
        if url or settings.url or (saved and saved.url) or not chosen or not settings.discovery:
            raise
        try:
            found, _ = find_coordinator(chosen, browse_interfaces(settings.discovery_interfaces),
                                        settings.discovery_timeout)
        except MeshError as exc:
            raise ConfigError(f"{missing}; nor was one found on the LAN: {exc}") from None
        log.info("found this mesh's coordinator on the LAN: %s", found)
        return parse_url(found), chosen


def _unresolved(host: str) -> str:
    """Why ``host`` does not resolve, when it is a name that does not; "" otherwise (ZeroMQ
    reports a name it cannot look up as a refused connection)."""
    try:
        ipaddress.ip_address(host)
        return ""
    except ValueError:
        pass
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return (f"the name {host} does not resolve ({exc.strerror}): check its spelling, or "
                "use the machine's IP address")
    except OSError:
        return ""
    return ""

