"""The client's core: one I/O thread, one DEALER, and a future for every task.

Everything the user-facing API does (sync calls, ``.map``, executors, asyncio) is a thin skin over
``Engine.submit`` and ``Engine.query``. The engine keeps every submission until its result has
arrived: unaccepted ones are re-sent (the coordinator de-duplicates by client id and sequence
number), accepted ones are FETCHed again after a reconnect, so a coordinator restart or a lost
message costs time, never a result.
"""

from __future__ import annotations

import _thread
import atexit
import concurrent.futures
import getpass
import itertools
import json
import logging
import os
import queue
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import _base  # the states a Future moves through
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import msgpack
import zmq

from .. import clock
from ..config import Endpoint, Settings, sizes_over_room
from ..errors import (
    ConfigError,
    MeshError,
    RemoteError,
    RunnerCrashed,
    SubmitRejected,
    TaskCancelled,
    TaskError,
    TaskTimeout,
    Unschedulable,
)
from ..protocol import (
    Command,
    ErrorCode,
    Message,
    ResultEncoding,
    ResultStatus,
    Role,
    encode,
    serialize,
)
from ..protocol.fields import for_terminal
from ..protocol.headers import (
    ID_CHARS,
    MAX_DIAGNOSIS,
    MAX_ERROR_MESSAGE,
    MAX_ERROR_TYPE,
    MAX_TRACEBACK,
)
from ..protocol.refs import Ref, parse_refs, ref_names, shared_bytes
from ..security import derive_keys
from ..session import Session
from ..sharedmem import SharedFolder, SharedFrameBusy, big_enough_to_share, materialize
from ..transport import DealerLink, LinkEvent
from .remotetb import localize_error

log = logging.getLogger("gpumesh.client")

# The engines' I/O threads. A future's done-callbacks run there (as an executor's run in the
# thread that finished the call): one that waits there for another result, or asks the
# coordinator something, waits for the very thread that would answer.
_IO_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def on_io_thread() -> bool:
    """Whether this code runs on a client engine's I/O thread (in a done-callback)."""
    return threading.current_thread() in _IO_THREADS


def refuse_wait_on_io_thread(what: str) -> None:
    """RuntimeError on an engine's I/O thread, where waiting for ``what`` never ends."""
    if on_io_thread():
        raise RuntimeError(
            f"{what} from a done-callback would wait forever: the callback runs on gpumesh's "
            "client I/O thread, which is what delivers the answer. Wait in a thread of your "
            "own, or chain another add_done_callback")

# Closing (close(), or the interpreter exiting): how long a task cancelled before its ACCEPTED
# waits for it (its CANCEL needs the task id), and how long the last messages get to leave.
CLOSE_GRACE = 2.0
GOODBYE_LINGER_MS = 1000
# Engines whose I/O thread still runs: closed at exit, so what the program asked reaches the
# coordinator before the interpreter kills the daemon thread (atexit runs while it still runs).
_OPEN_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


def _close_open_engines() -> None:
    """All at once (each may wait CLOSE_GRACE and the linger: one after another, N of them
    held the exit N times as long); a Ctrl+C here stops the waiting, not the interpreter."""
    engines = [e for e in list(_OPEN_ENGINES) if e._pid == os.getpid()]  # a forked child's
    try:                                                                 # copies have no thread
        for engine in engines:
            engine.close(wait=False)
        deadline = time.monotonic() + CLOSE_GRACE + GOODBYE_LINGER_MS / 1000 + 2.0
        for engine in engines:
            engine.io_thread.join(max(deadline - time.monotonic(), 0.0))
    except KeyboardInterrupt:
        pass


atexit.register(_close_open_engines)

# An unaccepted submission is sent again only when the coordinator has accepted nothing for
# this long: it answers SUBMITs in order, so while acceptances keep coming, later ones are
# queued behind them, not lost (a huge one-shot .map was once sent three times over).
RESEND_AFTER = 2.0
MAX_FUNCTIONS = 64  # entries of one SUBMIT's function table (the coordinator's limit)
# Task ids in one CANCEL, FETCH or RESULT_ACK: at the longest an id may be (ID_CHARS), 12,000
# take about 790 KB, inside the coordinator's 1 MiB header (20,000 would not be).
IDS_PER_MESSAGE = 12_000
# Results are acknowledged together, at most this long after the first came, instead of one
# RESULT_ACK per loop turn: a message costs both sides far more than the ids in it, and the
# coordinator merely keeps a result a few milliseconds longer.
ACK_DELAY = 0.005
OWNER_CHECK = 1.0  # seconds between looks whether the GPUMesh this connection serves is gone
CHUNK = 500  # tasks per SUBMIT
FIRST_CHUNK = 16  # tasks in a batch's first SUBMIT
ACK_BATCH = 1000  # task ids per CANCEL/FETCH/RESULT_ACK: about 300 KiB of header
BUSY_RETRY = 10.0  # seconds between retries of submissions refused by the queue quota
# A result this process could not read for want of descriptors or memory is read again from the
# message it came in after this long (its shared files stay until it is acknowledged). Asking
# the coordinator for it again found nothing once a result read back from disk was on its way.
REDECODE_AFTER = 2.0
# A query the coordinator refused as over its request rate (20 a second per client) is asked
# again after this long, doubling to QUERY_RETRY_MAX, until the caller's own timeout.
QUERY_RETRY = 0.1
QUERY_RETRY_MAX = 1.0
OutputHandler = Callable[[str, str, bytes, str], None]  # (worker short id, stream, data, task)


class _FutureLock(_thread.RLock):  # type: ignore[misc]  # a C type mypy cannot subclass
    """A TaskFuture's lock, where a concurrent.futures.Future has a Condition: its lock, waiter
    queue and bound methods were 8 of the 18 objects a queued task held in the client, each one
    more for the garbage collector to scan again and again while a .map runs (in a process
    holding numpy, Ray and Dask, its full collections cost 40-150 ms per 5,000-task map). Each
    future still has a lock of its own: ``concurrent.futures.wait`` takes the locks of the
    futures it is given in order, which only rules out deadlock when no two futures share one.
    Nobody waits on it (a thread that waits for a result waits on an event of its own:
    ``TaskFuture._wait``), so notifying is nothing and waiting returns at once."""

    __slots__ = ()

    def notify(self, n: int = 1) -> None:
        pass

    def notify_all(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> bool:
        return False


class _Waiters(list[Any]):
    """A future's waiters: ``concurrent.futures.wait`` and ``as_completed`` add theirs here
    before they block (``as_completed`` to finished futures too). Added in a done-callback, on
    the engine's I/O thread, for a future not finished, that wait would never end (the thread
    that would deliver the result is the one waiting): refused with what to do instead,
    rather than a client that hangs in silence."""

    __slots__ = ("_future",)

    def __init__(self, future: concurrent.futures.Future[Any]) -> None:
        super().__init__()
        self._future = weakref.ref(future)

    def append(self, waiter: Any) -> None:
        future = self._future()
        # Its state read without its lock: the standard library holds that lock here.
        if future is not None and future._state not in _SETTLED:
            refuse_wait_on_io_thread("concurrent.futures.wait or as_completed on mesh futures")
        super().append(waiter)


_SETTLED = (_base.FINISHED, _base.CANCELLED_AND_NOTIFIED)


class TaskFuture(concurrent.futures.Future[Any]):
    """A future for one task; ``task_id`` and ``worker`` are filled in as they become known."""

    def __init__(self, on_cancel: Callable[[TaskFuture], None] | None = None) -> None:
        # What Future.__init__ sets, with a plain lock for its Condition (_FutureLock;
        # tests/unit/test_task_future.py checks that these are all it sets).
        self._condition = _FutureLock()  # type: ignore[assignment]  # stands in for one
        self._state = _base.PENDING
        self._result = None
        self._exception: BaseException | None = None
        self._waiters: list[Any] = _Waiters(self)
        self._done_callbacks: list[Callable[[concurrent.futures.Future[Any]], object]] = []
        self.task_id = ""
        self.worker = ""
        self.attempts = 0
        self.seq = 0
        self.job = ""
        # Set once cancel() succeeded. The engine thread reads this plain attribute, not
        # cancelled(), which takes the future's lock: it asked several times a task.
        self.cancel_requested = False
        self._on_cancel = on_cancel

    _settled_traceback: TracebackType | None = None  # set with the exception (set_exception)

    def cancel(self) -> bool:
        """Cancel the task: at once here, and on the mesh as soon as the coordinator is told."""
        if self.cancel_requested:
            return True  # told once is enough (the state changes under the lock: once)
        with self._condition:
            if self._state in (_base.RUNNING, _base.FINISHED):
                return False
            if self._state in (_base.CANCELLED, _base.CANCELLED_AND_NOTIFIED):
                return True
            # Cancelled and its waiters told in one step, as an executor's
            # set_running_or_notify_cancel() would: those waiting in ``_wait`` (and
            # concurrent.futures.wait) wait on their own events, not on this lock.
            self._state = _base.CANCELLED_AND_NOTIFIED
            for waiter in self._waiters:
                waiter.add_cancelled(self)
        self.cancel_requested = True
        self._invoke_callbacks()  # type: ignore[attr-defined]  # Future's, not in its stubs
        if self._on_cancel is not None:
            self._on_cancel(self)
        return True

    def set_running_or_notify_cancel(self) -> bool:
        """As Future's: False for a cancelled future (cancel() told its waiters already)."""
        with self._condition:
            if self._state == _base.CANCELLED_AND_NOTIFIED:
                return False
        return super().set_running_or_notify_cancel()

    def result(self, timeout: float | None = None) -> Any:
        self._wait(timeout)
        error = self._exception  # settled: set once, never changed
        if error is None:
            return super().result(0)  # the outcome, CancelledError, or TimeoutError
        localize_error(error)
        try:
            # Raised afresh each time, with the traceback it was settled with: the caller's
            # frames and this line, then the task's own (a remote one: in its note; one run
            # here: its frames), not concurrent.futures' frames, nor those of an earlier
            # result() call that the same exception collected.
            raise error.with_traceback(self._settled_traceback)
        finally:
            del error  # no cycle through this frame (as Future.result)

    def set_exception(self, exception: BaseException | None) -> None:
        # What result() raises it with: a remote task's comes without one (the engine
        # settles it so), a call run here keeps the frames it raised in.
        self._settled_traceback = None if exception is None else exception.__traceback__
        super().set_exception(exception)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        # What an executor's future, asyncio's wrap_future and joblib read: each shows the
        # caller's own file and lines in the task's remote traceback, as a .map's error does.
        self._wait(timeout)
        error = super().exception(0)
        if error is not None:
            localize_error(error)
        return error

    def _wait(self, timeout: float | None) -> None:
        """Until done or ``timeout``, on an event of this wait's own (concurrent.futures.wait):
        the future's lock is a plain lock (_FutureLock), nothing to wait on."""
        if not self.done():
            refuse_wait_on_io_thread("waiting for a mesh task's result")
            concurrent.futures.wait([self], timeout)

    def __await__(self) -> Any:
        """``await future`` in a coroutine; cancelling the awaiting task cancels this task."""
        import asyncio

        return asyncio.wrap_future(self).__await__()


@dataclass
class _Submission:
    seq: int
    spec: dict[str, Any]
    frames: list[Any]
    future: TaskFuture
    job: str
    name: str = ""
    task_id: str = ""
    sent_at: float = 0.0
    sends: int = 0  # SUBMITs that carried it since its shared files were written
    busy: bool = False  # refused for now by the coordinator's per-client quota: sent again later
    leads: bool = True  # of its job's first batch (False: the rest of the same .map)
    # Its big frames as left in a shared-memory folder: (folder path, frames, references).
    shared: tuple[str, list[Any], Sequence[Ref]] | None = None

    @property
    def header_bytes(self) -> int:
        """Roughly what this task adds to a SUBMIT header: its spec, packed, plus the fields
        added on sending (seq, nf, split)."""
        return len(msgpack.packb(self.spec, use_bin_type=True)) + 64 + 4 * len(self.frames)


@dataclass
class _Query:
    header: dict[str, Any]
    future: concurrent.futures.Future[Any]
    sent: bool = False
    command: Command = Command.QUERY  # or CONTROL
    parts: list[Any] = field(default_factory=list)  # earlier pages of a paged answer
    retry_at: float = 0.0  # refused as busy: asked again then
    busy_tries: int = 0


@dataclass
class _Batch:
    job: str
    name: str = ""
    leads: bool = True  # its job's first batch: its first SUBMIT is small (FIRST_CHUNK)
    items: list[tuple[dict[str, Any], list[Any], TaskFuture]] = field(default_factory=list)


class Engine:
    """A client connection. Thread-safe: any thread may submit, query and close."""

    def __init__(
        self, settings: Settings, endpoint: Endpoint, token: str, *,
        on_output: OutputHandler | None = None, on_connect: Callable[[], None] | None = None,
        on_link: Callable[[float | None], None] | None = None,
        owner: weakref.ReferenceType[Any] | None = None,
    ) -> None:
        self.settings = settings
        # What this connection serves (a GPUMesh), held weakly: once it is collected and
        # nothing is outstanding, the connection closes itself (OWNER_CHECK).
        self._owner = owner
        self._owner_checked = time.monotonic()
        self.endpoint = endpoint
        self._keys = derive_keys(token)
        self.client_id = secrets.token_hex(8)
        self.on_output = on_output
        self.on_connect = on_connect
        # Told when an established session is lost (None) and when it is back (the seconds
        # it was away): a caller waiting on results would otherwise see nothing happen.
        self.on_link = on_link
        self._ctx = zmq.Context()
        self._link = DealerLink(self._ctx, endpoint, self._keys, settings.limits)
        self._shm: SharedFolder | None = None  # the coordinator's, when this machine shares it
        # The alive workers' Python versions, as the coordinator pushes them (WELCOME, then
        # HEARTBEAT when they change); None from a coordinator that does not.
        self.worker_pythons: set[str] | None = None
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._cancel_hook = self._on_cancel  # one bound method for all futures, not one each
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)  # a full pair means the loop is awake: never block on it
        self._wake_fd = self._wake_r.fileno()
        self._seq = itertools.count(1)
        self._qids = itertools.count(1)
        self._outstanding: dict[int, _Submission] = {}
        self._by_task: dict[str, _Submission] = {}
        # Results not readable for now: task id -> (when to read it again, its RESULT).
        self._redecode: dict[str, tuple[float, Message]] = {}
        self._queries: dict[int, _Query] = {}
        self._acks: list[str] = []  # results to acknowledge, sent together (ACK_DELAY)
        self._acks_since = 0.0  # when the oldest of them arrived
        self._parked: list[_Submission] = []  # refused as busy: sent again as tasks finish
        self._closing = threading.Event()
        self._connected = threading.Event()
        self.fatal: MeshError | None = None
        self.ever_connected = False
        self.disconnected_since: float | None = clock.now()
        self.welcome: dict[str, Any] = {}
        # HELLO/WELCOME, heartbeats, silence and reconnects: the session; tasks: this class.
        self._session = Session(Role.CLIENT, self.client_id, endpoint, settings.timing,
                                self._link, self)
        self._poll = zmq.Poller()
        self._polled: tuple[Any, ...] = ()  # the sockets self._poll watches
        self._stopped = False  # the I/O thread has ended: nobody else reads _commands
        self._thread = threading.Thread(target=self._run, name="gpumesh-client", daemon=True)
        _IO_THREADS.add(self._thread)
        self._pid = os.getpid()
        _OPEN_ENGINES.add(self)
        self._thread.start()

    # ----------------------------------------------------------------- public, any thread

    def wait_connected(self, timeout: float) -> bool:
        """True once a session is up; False if the coordinator did not answer (refused or silent)."""
        deadline = clock.now() + timeout
        while clock.now() < deadline:
            if self._connected.wait(0.05):
                return True
            if self.fatal is not None:
                raise self.fatal
            if not self.ever_connected and self._link.refusals >= 3:
                return False  # nothing listens there: no point waiting out the timeout
        return self._connected.is_set()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def refused(self) -> bool:
        """True when connecting keeps failing at once: nothing listens at the address."""
        return not self.ever_connected and self._link.refusals >= 3

    def submit(self, items: list[tuple[dict[str, Any], list[Any]]], job: str = "", name: str = "",
               *, continues: bool = False) -> list[TaskFuture]:
        """Queue tasks (spec, payload frames) as one job; returns their futures in order.
        ``continues``: more of a job whose first tasks were queued already (the rest of a big
        .map, after its first FIRST_CHUNK), whose SUBMITs are then all full-sized."""
        self._check_usable()
        if len(job) > ID_CHARS or not job.isprintable():
            # The coordinator would refuse the whole SUBMIT, again at every re-send.
            raise ConfigError(f"the job id {job[:80]!r} must be printable text of at most "
                              f"{ID_CHARS} characters")
        batch = _Batch(job, name, leads=not continues)
        futures = []
        for spec, frames in items:
            future = TaskFuture(self._cancel_hook)
            batch.items.append((spec, frames, future))
            futures.append(future)
        self._command(batch)
        return futures

    def awaiting_acceptance(self, futures: Sequence[Any]) -> int:
        """How many of ``futures`` went to the coordinator and are not accepted yet: a cancel
        of one goes out only once it is (from any thread: a snapshot of the engine's table)."""
        seqs = {getattr(future, "seq", 0) for future in futures} - {0}
        return sum(1 for sub in list(self._outstanding.values())
                   if sub.seq in seqs and sub.sent_at and not sub.task_id)

    def query(self, what: str, timeout: float = 10.0, **args: Any) -> Any:
        """Ask the coordinator (``workers``, ``status``, ``events``) and wait for the answer."""
        return self._ask(_Query({"what": what, **args}, concurrent.futures.Future()), what, timeout)

    def control(self, action: str, target: str, timeout: float = 10.0, *, force: bool = False
                ) -> dict[str, Any]:
        """``cancel``/``retry`` a job or ``kill`` a worker; the coordinator's account of it.

        Another owner's job is refused unless ``force`` (docs/protocol.md, CONTROL)."""
        header: dict[str, Any] = {"action": action, "target": target}
        if force:
            header["force"] = True
        query = _Query(header, concurrent.futures.Future(), command=Command.CONTROL)
        answer = self._ask(query, action, timeout)
        if not isinstance(answer, dict):
            raise MeshError(f"the coordinator gave an unexpected answer to {action}")
        if "error" in answer:
            raise MeshError(str(answer["error"]))
        return answer

    def _ask(self, query: _Query, what: str, timeout: float) -> Any:
        refuse_wait_on_io_thread(f"asking the coordinator ({what})")
        self._check_usable()
        began = time.monotonic()
        self._command(query)
        try:
            answer = query.future.result(timeout)
            log.debug("%s answered in %.1f ms", what, (time.monotonic() - began) * 1000)
            return answer
        except concurrent.futures.TimeoutError:
            # Cancelled, the engine asks no more (a busy retry, a reconnect); it settles a
            # future with _settle, so this cannot break it. Answered meanwhile: the answer.
            if not query.future.cancel():
                return query.future.result(0)
            raise MeshError(
                f"the coordinator at {self.endpoint} did not answer a {what} request within "
                f"{timeout:g}s: check that it is running ('gpumesh workers')"
            ) from None

    def cancel(self, futures: list[TaskFuture]) -> None:
        """Ask the coordinator to cancel these tasks. A task not yet accepted, or a cancel made
        while disconnected, is cancelled as soon as the coordinator is reachable."""
        self._command(("cancel", list(futures)))

    @property
    def io_thread(self) -> threading.Thread:
        return self._thread

    def close(self, wait: bool = True) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        self._wake()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def _check_usable(self) -> None:
        if self.fatal is not None:
            raise self.fatal
        if self._closing.is_set():
            raise MeshError("this mesh connection is closed: create a new GPUMesh")

    def _command(self, command: Any) -> None:
        self._commands.put(command)
        self._wake()
        if self._stopped:
            # close() ended the I/O thread between the caller's _check_usable() and the put:
            # what was queued would wait forever.
            self._fail_commands(self.fatal or MeshError(
                "this mesh connection is closed: create a new GPUMesh"))

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full, so the loop is awake anyway

    # ----------------------------------------------------------------- the I/O thread

    def _run(self) -> None:
        goodbye = False  # connected when the loop ended: the last messages get a linger
        try:
            self._link.open()
            self._last_resend_check = 0.0
            self._last_accepted = self._welcomed_at = 0.0
            self._last_unpark = 0.0
            self._session.start(clock.now())
            while not self._closing.is_set():
                self._turn()
            goodbye = self._connected.is_set()
            if goodbye:
                self._send_what_was_asked()
                self._flush_acks()
                self._link.flush()
                self._link.send(encode(Command.DISCONNECT, {"reason": "closed"}))
        except MeshError as exc:
            self.fatal = exc
            self._fail_all(exc)
        except Exception as exc:  # a bug must not leave callers waiting forever
            log.exception("client I/O thread failed")
            self.fatal = MeshError(f"the gpumesh client thread failed: {exc!r}")
            self._fail_all(self.fatal)
        finally:
            _OPEN_ENGINES.discard(self)
            if not goodbye:
                self._say_unheard_cancels()
            self._connected.clear()
            if self._shm is not None:
                self._shm.release()
            # A moment for the CANCELs and the goodbye just queued to leave: closed at once,
            # ZeroMQ drops what is still in its queue.
            self._link.close(linger_ms=GOODBYE_LINGER_MS if goodbye else 0)
            self._wake_r.close()
            self._wake_w.close()
            self._ctx.term()
            # Before the last drain: a command queued after it is failed by its sender.
            self._stopped = True
            self._fail_all(MeshError("the mesh connection was closed before this task finished"))

    def _say_unheard_cancels(self) -> None:
        """Closing while the coordinator is away: tasks it accepted that were cancelled here
        (a .map run locally after the coordinator had gone, or Ctrl+C) may still be queued in
        its journal (a CANCEL sent as the link went down may be lost, or may have been
        journaled: no answer says which), and it runs them once it is back, though nobody will
        read their results (and their side effects happen twice). Said, with the command that
        cancels them."""
        jobs: dict[str, int] = {}
        for sub in self._outstanding.values():
            if sub.task_id and sub.future.cancel_requested:
                jobs[sub.job] = jobs.get(sub.job, 0) + 1
        for job, count in jobs.items():
            log.warning("[gpumesh] the coordinator at %s may not have heard that %d task(s) "
                        "of job %s were cancelled here (or ran here while it was gone): it runs "
                        "them when it is back unless told, with: gpumesh cancel %s",
                        self.endpoint, count, job, job)

    def _send_what_was_asked(self) -> None:
        """Closing, or the program exiting: what it asked for still reaches the coordinator.
        Queued submissions and cancels go out (they were lost with the thread, so a script
        that exited right after a .map's error left the rest of it running), and a task
        cancelled before the coordinator confirmed it waits up to CLOSE_GRACE for its
        ACCEPTED, which sends its CANCEL (_on_accepted): the coordinator does not cancel a
        departing client's tasks (a detached job is a feature)."""
        deadline = clock.now() + CLOSE_GRACE
        self._take_commands(clock.now())
        while self._connected.is_set() and clock.now() < deadline and any(
                sub.future.cancel_requested and sub.sent_at and not sub.task_id and not sub.busy
                for sub in self._outstanding.values()):
            self._turn()

    def _fail_all(self, exc: BaseException) -> None:
        for sub in list(self._outstanding.values()):
            if not sub.task_id and not sub.sent_at:
                # Never sent: nobody else will remove its files. One sent and not yet accepted
                # may be in the journal (its ACCEPTED lost with a crash): its input stays, for
                # the task to run after the restart; the coordinator sweeps what nothing names.
                self._unshare(sub)
            if not sub.future.done():
                _settle(sub.future.set_exception, exc)
        self._outstanding.clear()
        self._by_task.clear()
        for q in list(self._queries.values()):
            if not q.future.done():
                _settle(q.future.set_exception, exc)
        self._queries.clear()
        self._fail_commands(exc)

    def _fail_commands(self, exc: BaseException) -> None:
        """The futures of what is queued for the I/O thread, failed with ``exc`` (any thread:
        each command is taken once)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            targets = [f for _, _, f in command.items] if isinstance(command, _Batch) else (
                [command.future] if isinstance(command, _Query) else [])
            for future in targets:
                if not future.done():
                    _settle(future.set_exception, exc)

    def _poller(self) -> zmq.Poller:
        """The loop's poller, built again only when the link replaced its sockets (a poller
        made and filled every turn cost more than the turn's own work for small tasks)."""
        sockets = (self._link.sock, self._link.monitor)
        if self._polled != sockets:
            self._polled = sockets
            self._poll = zmq.Poller()
            for sock in sockets:
                if sock is not None:
                    self._poll.register(sock, zmq.POLLIN)
            self._poll.register(self._wake_r, zmq.POLLIN)
        return self._poll

    def _turn(self) -> None:
        poller = self._poller()
        now = clock.now()
        wait = min(self._session.next_timer(now), self._session.heartbeat / 4)
        if self._acks and self._connected.is_set():
            wait = min(wait, max(self._acks_since + ACK_DELAY - now, 0.0))
        if self._queries:
            retry = self._next_query_retry()
            if retry is not None:
                wait = min(wait, max(retry - now, 0.0))
        ready = dict(poller.poll(0 if self._link.backlog else max(1, int(wait * 1000))))
        now = clock.now()
        # Only what poll named is read: each read that finds nothing costs an exception.
        if self._link.monitor in ready:
            for event in self._link.monitor_events():
                if event is LinkEvent.DROPPED:
                    log.debug("connection to %s dropped", self.endpoint)
        if self._wake_fd in ready:  # poll names a plain socket by its descriptor
            try:
                while self._wake_r.recv(4096):
                    pass
            except (BlockingIOError, OSError):
                pass
        if not self._commands.empty():
            self._take_commands(now)
        if self._link.backlog or self._link.sock in ready:
            for _ in range(10_000):
                msg = self._link.recv()
                if msg is None:
                    break
                self._session.on_message(msg, now)
        if self._acks and (now - self._acks_since >= ACK_DELAY or len(self._acks) >= ACK_BATCH):
            self._flush_acks()
        self._session.tick(now)
        if self._session.welcomed:
            self._timers(now)
        self._link.flush()
        if self._owner is not None and time.monotonic() - self._owner_checked >= OWNER_CHECK:
            self._owner_checked = time.monotonic()
            if self._owner() is None and not self._outstanding and not self._queries \
                    and self._commands.empty():
                # A GPUMesh dropped without close(): its thread, sockets and session with the
                # coordinator went on until the interpreter exited, one per GPUMesh made.
                self._closing.set()

    def _take_commands(self, now: float) -> None:
        batches: list[_Submission] = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Batch):
                for spec, frames, future in command.items:
                    seq = next(self._seq)
                    future.seq = seq
                    sub = _Submission(seq, spec, frames, future, command.job, command.name,
                                      leads=command.leads)
                    self._outstanding[seq] = sub
                    batches.append(sub)
            elif isinstance(command, _Query):
                qid = next(self._qids)
                command.header["qid"] = qid
                self._queries[qid] = command
                if self._connected.is_set():
                    if batches:  # in the order asked: a status query sees the job just sent
                        self._send_submissions(batches, now)
                        batches = []
                    command.sent = self._link.send(encode(command.command, command.header))
            elif isinstance(command, tuple) and command[0] == "cancel":
                tasks = [f.task_id for f in command[1] if f.task_id]
                if tasks and self._connected.is_set():
                    self._send_ids(Command.CANCEL, tasks)
        if batches and self._connected.is_set():
            self._send_submissions(batches, now)
            # Results held for acknowledgement go now, behind the SUBMIT: the coordinator hands
            # the new task out before it reads them, and this thread skips a turn of its own
            # (a loop of single calls acknowledged each result ACK_DELAY later, by itself).
            self._flush_acks()

    def _unpark(self, now: float, count: int) -> None:
        """Send again up to ``count`` submissions the coordinator refused as busy: one for each
        task of ours that finished, and all of them every BUSY_RETRY seconds."""
        if not self._parked or not self._connected.is_set():
            return
        self._last_unpark = now
        batch, self._parked = self._parked[:count], self._parked[count:]
        for sub in batch:
            sub.busy = False
        self._send_submissions([s for s in batch if s.seq in self._outstanding], now)

    def _on_cancel(self, future: TaskFuture) -> None:
        """A future was cancelled, in any thread: the engine tells the coordinator."""
        self._command(("cancel", [future]))

    def _send_submissions(self, subs: list[_Submission], now: float) -> None:
        """SUBMIT in batches of bounded size; one message carries many small tasks."""
        by_job: dict[tuple[str, str], list[_Submission]] = {}
        for sub in subs:
            if sub.future.cancel_requested and not sub.sent_at:
                self._outstanding.pop(sub.seq, None)  # cancelled before it was ever sent
                self._unshare(sub)  # its files, written for a send that failed, name nothing
            else:
                # A cancelled one that was sent may be durable already: sending it again gets
                # its task id back (seq dedupe), and ACCEPTED then cancels it.
                by_job.setdefault((sub.job, sub.name), []).append(sub)
        # A SUBMIT's header must stay well inside the coordinator's header limit (specs can
        # carry up to 32 KiB of env each), or the coordinator drops the whole message.
        header_budget = self.settings.limits.max_header_bytes // 2
        room_bytes, room_frames = self._message_room()
        chunk_bytes = self.settings.limits.chunk_bytes
        for job, group in by_job.items():
            chunk: list[_Submission] = []
            size = header = wire_bytes = wire_frames = 0
            # A small first chunk: the coordinator starts it on idle workers while it still
            # journals the rest (a 200-task .map's first task began after 40 ms, now ~8). The
            # rest of that .map, handed over once its first chunk went, goes in full SUBMITs.
            most = FIRST_CHUNK if group[0].leads else CHUNK
            for sub in group:
                if sub.future.cancel_requested and not sub.sent_at:
                    # Cancelled while the chunks before it went (big frames take a while to
                    # write: Ctrl+C of a map of big arrays must not wait for all of them).
                    self._outstanding.pop(sub.seq, None)
                    self._unshare(sub)
                    continue
                # What the task puts on the wire: its big frames in shared memory when they can
                # go there (written once, whatever the re-sends), the rest in slices.
                sent_frames, refs = self._shared_frames(sub)
                task_bytes, task_frames = serialize.wire_cost(sent_frames, chunk_bytes)
                if task_bytes > room_bytes or task_frames > room_frames:
                    self._refuse_oversize(sub, task_bytes, task_frames, room_bytes, room_frames)
                    continue
                if chunk and (wire_bytes + task_bytes > room_bytes
                              or wire_frames + task_frames > room_frames):
                    # The coordinator drops a message over its limits unanswered: this task
                    # opens the next SUBMIT instead.
                    self._send_chunk(job, chunk, now)
                    chunk, size, header, wire_bytes, wire_frames = [], 0, 0, 0, 0
                    most = CHUNK
                chunk.append(sub)
                size += task_bytes + shared_bytes(refs) if refs else task_bytes
                header += sub.header_bytes
                wire_bytes += task_bytes
                wire_frames += task_frames
                if len(chunk) >= most or size >= 8 * 1024 * 1024 or header >= header_budget:
                    self._send_chunk(job, chunk, now)
                    chunk, size, header, wire_bytes, wire_frames = [], 0, 0, 0, 0
                    most = CHUNK
            if chunk:
                self._send_chunk(job, chunk, now)

    def _message_room(self) -> tuple[int, int]:
        """The payload bytes and frames one SUBMIT may carry, by the coordinator's limits (from
        WELCOME, else this side's defaults)."""
        limits = self.settings.limits
        message_bytes = _positive(self.welcome.get("max_message_bytes"), limits.max_message_bytes)
        frames = _positive(self.welcome.get("max_frames"), limits.max_frames)
        if message_bytes <= limits.max_header_bytes or frames <= 3:
            return limits.message_room  # a message with no room for a task: not a real limit
        # Limits.message_room's arithmetic, without a new Limits for every submission.
        return message_bytes - limits.max_header_bytes, frames - 3

    def _refuse_oversize(self, sub: _Submission, nbytes: int, frames: int, room_bytes: int,
                         room_frames: int) -> None:
        """A task no SUBMIT can carry fails now: sent, it would be dropped by the coordinator
        and sent again every RESEND_AFTER, forever."""
        self._outstanding.pop(sub.seq, None)
        self._unshare(sub)
        if nbytes > room_bytes:
            shown, most = sizes_over_room(nbytes, room_bytes)
            why = (f"its pickled input is {shown}, and one message to the coordinator carries "
                   f"at most {most}")
        else:
            why = (f"its pickled input is {frames} frames, and one message to the coordinator "
                   f"carries at most {room_frames}: pass fewer, larger arrays (one stacked "
                   "array instead of many small ones)")
        hint = ("pass big data by path (a file every worker can read) or split it over "
                "several tasks")
        # Shared memory carries a function task's big frames, not a script's, nor small ones.
        if nbytes > room_bytes and sub.spec.get("kind") == "fn":
            if not self.settings.share_memory:
                hint += ("; or let shared memory carry it (GPUMESH_SHARED_MEMORY=0 turned it "
                         "off), which has no such limit on the coordinator's machine")
            elif self._shm is None:
                hint += ("; a client on the coordinator's machine hands big arrays over in "
                         "shared memory, which has no such limit")
            else:  # the folder is there, and did not take it: full (/dev/shm, --shm-size)
                hint += (f"; or make room in the shared-memory folder {self._shm.path}, which "
                         "had none for it (on Linux /dev/shm; in Docker, --shm-size) and "
                         "carries big arrays with no such limit")
        if not sub.future.done():
            _settle(sub.future.set_exception,
                    SubmitRejected(f"the task was not sent: {why}. To run it, {hint}."))

    def _send_chunk(self, job: tuple[str, str], chunk: list[_Submission], now: float) -> None:
        specs: list[dict[str, Any]] = []
        frames: list[Any] = []
        # The message's function table (digest -> pickled function): a .map sends its function
        # once per SUBMIT, not once per task, to a coordinator that reads tables (WELCOME).
        functions: dict[str, Any] = {}
        by_reference = self.welcome.get("fnref") is True
        limit = self.settings.limits.chunk_bytes
        for sub in chunk:
            task_frames, refs = self._shared_frames(sub)
            # Frames over the coordinator's frame limit travel as slices of themselves.
            wire, layout = serialize.split_frames(task_frames, limit)
            spec = {**sub.spec, "seq": sub.seq}
            digest = spec.get("fn")
            if (by_reference and spec.get("kind") == "fn" and isinstance(digest, str) and wire
                    and not refs and layout is None
                    and (digest in functions or len(functions) < MAX_FUNCTIONS)):
                functions.setdefault(digest, wire[0])
                wire = wire[1:]
                spec["fnref"] = True
            spec["nf"] = len(wire)
            if refs:
                spec["shm"] = [list(ref) for ref in refs]
            if layout is not None:
                spec["split"] = layout
            specs.append(spec)
            frames += wire
        header: dict[str, Any] = {"job": job[0], "name": job[1], "tasks": specs}
        if functions:
            header["fns"] = list(functions)
            frames = [*functions.values(), *frames]
        if self._link.send(encode(Command.SUBMIT, header, frames)):
            for sub in chunk:
                sub.sent_at = now
                sub.sends += 1

    def _shared_frames(self, sub: _Submission) -> tuple[list[Any], Sequence[Ref]]:
        """A function task's big frames go through the coordinator's shared-memory folder when
        this process can use it (same machine): written once, whatever the re-sends."""
        folder = self._shm
        if folder is None or sub.spec.get("kind") != "fn":
            return sub.frames, ()
        path = str(folder.path)
        if sub.shared is None or sub.shared[0] != path:
            by_table = function_goes_by_table(sub.spec, sub.frames,
                                              self.settings.limits.chunk_bytes)
            frames, refs = folder.share(sub.frames, start=1 if by_table else 0)
            # Nothing big (a tiny task): its own frames, and no new lists kept per task.
            sub.shared = (path, frames, refs) if refs else (path, sub.frames, ())
            sub.sends = 0
        return sub.shared[1], sub.shared[2]

    def _unshare(self, sub: _Submission) -> None:
        """The coordinator will never own this submission's shared files: remove them."""
        if sub.shared is not None and self._shm is not None:
            self._shm.remove(ref_names(sub.shared[2]))
        sub.shared = None

    # ----------------------------------------------------------------- the session's hooks

    def on_hello(self) -> dict[str, Any]:
        self._connected.clear()
        return {"info": {"pid": os.getpid(), "host": socket.gethostname(), "user": _user()}}

    def heartbeat_header(self) -> dict[str, Any]:
        return {}

    def on_lost(self, now: float, delay: float, was_welcomed: bool) -> None:
        if was_welcomed:
            log.info("lost the coordinator at %s; reconnecting", self.endpoint)
            if self.on_link is not None:
                self.on_link(None)
        self._connected.clear()
        if self.disconnected_since is None:
            self.disconnected_since = now

    def on_disconnect(self, header: dict[str, Any], now: float) -> bool:
        return False  # whatever the reason, a client starts a new session

    def on_message(self, msg: Message, now: float) -> None:
        handler = _HANDLERS.get(msg.command)
        if handler is not None:
            handler(self, msg, now)

    def on_welcome(self, header: dict[str, Any], now: float) -> None:
        self.welcome = header
        self._welcomed_at = now
        self._note_pythons(header)
        # The new folder first: the old one is let go only once nothing can fail in between.
        folder = SharedFolder.join(header.get("shm")) if self.settings.share_memory else None
        if self._shm is not None:
            self._shm.release()
        self._shm = folder
        if self._shm is not None:
            # Before any SUBMIT that names a shared file: the coordinator reads in order.
            self._link.send(encode(Command.HEARTBEAT, {"shm": self._shm.proof}))
        self._connected.set()
        log.debug("welcomed by the coordinator at %s (%s shared memory)", self.endpoint,
                  "with" if self._shm is not None else "without")
        if self.disconnected_since is not None and self.ever_connected \
                and self.on_link is not None:
            self.on_link(max(now - self.disconnected_since, 0.0))
        self.disconnected_since = None
        first = not self.ever_connected
        self.ever_connected = True
        if first and self.on_connect is not None:
            self.on_connect()
        # A new session: ask again for what was accepted, send again what was not, and repeat
        # cancels the old session may have lost.
        self._redecode.clear()  # what the old session sent is asked for again here
        accepted = [sub.task_id for sub in self._outstanding.values() if sub.task_id]
        if accepted:
            self._send_ids(Command.FETCH, accepted, qid=0)
        cancelled = [sub.task_id for sub in self._outstanding.values()
                     if sub.task_id and sub.future.cancel_requested]
        if cancelled:
            self._send_ids(Command.CANCEL, cancelled)
        self._send_submissions([s for s in self._outstanding.values() if not s.task_id], now)
        for qid, q in list(self._queries.items()):
            self._ask_again(qid, q)

    def _on_accepted(self, msg: Message, now: float) -> None:
        self._last_accepted = now
        job = str(msg.header.get("job", ""))
        cancelled = []
        for seq, task_id in _pairs(msg.header.get("accepted"), 2):
            if type(seq) is not int or type(task_id) is not str or not 0 < len(task_id) <= ID_CHARS:
                continue  # a pair this side cannot read: its task is asked for again later
            sub = self._outstanding.get(seq)
            if sub is not None and not sub.task_id:
                other = self._by_task.get(task_id)
                if other is not None and other is not sub:
                    # One id for two calls (a coordinator's bug, or a lie): a result under it
                    # must settle one call only, so this one stays unassigned and goes again.
                    log.warning("the coordinator named task %s for two calls; the second is "
                                "sent again", task_id)
                    continue
                sub.task_id = task_id
                sub.job = sub.job or job
                sub.future.task_id = task_id
                self._by_task[task_id] = sub
                if sub.future.cancel_requested:
                    cancelled.append(task_id)  # cancelled while the SUBMIT was in flight
        if cancelled:
            self._send_ids(Command.CANCEL, cancelled)
        for seq, code, text in _pairs(msg.header.get("rejected"), 3):
            sub = self._outstanding.get(seq) if type(seq) is int else None
            if sub is None or sub.task_id:
                continue
            text = for_terminal(str(text)[:500])
            if code == ErrorCode.BUSY.value and not sub.future.done():
                # Over this client's queue quota: it goes again as earlier tasks finish.
                if not self._parked:
                    log.warning("the coordinator's queue for this client is full: %s", text)
                if not sub.busy:
                    sub.busy = True
                    self._parked.append(sub)
                    # Not taken: its shared files would hold RAM in /dev/shm while it waits
                    # (a .map of a thousand 64 MiB arrays filled it). Written again when sent.
                    # Not when a second copy (a re-send on silence) may be on its way: the
                    # coordinator could take that one, naming the files.
                    if sub.sends <= 1:
                        self._unshare(sub)
                continue
            self._outstanding.pop(seq, None)
            self._unshare(sub)
            if not sub.future.done():
                _settle(sub.future.set_exception,
                        SubmitRejected(f"the coordinator refused the task: {text}"))

    def _on_result(self, msg: Message, now: float) -> None:
        header = msg.header
        task_id = header.get("task")
        if type(task_id) is not str or not 0 < len(task_id) <= ID_CHARS:
            log.debug("dropped a RESULT without a task id this side can read")
            return  # nothing to match, and an acknowledgement of it could not be sent
        seq = header.get("seq")
        sub = self._by_task.get(task_id)
        if sub is None and type(seq) is int:
            sub = self._outstanding.get(seq)
            if sub is not None and sub.task_id and sub.task_id != task_id:
                sub = None  # that call has another task: this is not its result
        if sub is not None and type(seq) is int and seq != sub.seq:
            # The task of one call and the seq of another: neither is settled with it, and
            # it is not acknowledged (the coordinator keeps whatever it holds under that id).
            log.warning("dropped a RESULT for task %s that names another call's seq", task_id)
            return
        if not self._acks:
            self._acks_since = now
        self._acks.append(task_id)
        if sub is None:
            return  # a duplicate delivery: acknowledged above, otherwise ignored
        self._by_task.pop(task_id, None)
        self._outstanding.pop(sub.seq, None)
        try:
            self._settle_result(sub, task_id, msg, now)
        finally:
            self._unpark(now, 1)  # after the future is settled: nothing here may leave it waiting

    def _settle_result(self, sub: _Submission, task_id: str, msg: Message, now: float) -> None:
        future = sub.future
        if future.done() and not future.cancelled():
            return  # settled already (only the engine thread settles, and only once)
        future.task_id = task_id
        future.worker = str(msg.header.get("worker", ""))[:ID_CHARS]
        attempts = msg.header.get("attempts")  # nothing read here may raise: the future waits
        future.attempts = attempts if type(attempts) is int and attempts >= 0 else 0
        if future.cancel_requested:
            return  # only the engine thread settles a task's future, and only once
        try:
            value = decode_result(msg.header, msg.payload,
                                  script=sub.spec.get("kind") == "script", shm=self._shm)
        except SharedFrameBusy as exc:
            # Its frames are there, but this process is short of descriptors or memory now:
            # not acknowledged (the coordinator keeps them), and read again shortly.
            log.warning("cannot read the result of task %s yet (%s): trying again in %gs",
                        task_id, exc, REDECODE_AFTER)
            if self._acks and self._acks[-1] == task_id:
                self._acks.pop()
            sub.task_id = task_id  # matched by its seq, or already this id: one key only
            self._outstanding[sub.seq] = sub
            self._by_task[task_id] = sub
            self._redecode[task_id] = (now + REDECODE_AFTER, msg)
        except BaseException as exc:  # the remote exception, rebuilt
            # Without the engine thread's frames (decode_result's raise): the caller's result()
            # and exception() show the caller's frames, then the task's remote traceback.
            _settle(future.set_exception, exc.with_traceback(None))
        else:
            _settle(future.set_result, value)

    def _on_heartbeat(self, msg: Message, now: float) -> None:
        self._note_pythons(msg.header)

    def _note_pythons(self, header: dict[str, Any]) -> None:
        pythons = header.get("pythons")
        if isinstance(pythons, list) and len(pythons) <= 64 \
                and all(isinstance(p, str) and len(p) <= 16 for p in pythons):
            self.worker_pythons = set(pythons)

    def _on_output(self, msg: Message, now: float) -> None:
        if self.on_output is None or not msg.payload:
            return
        header = msg.header
        worker, task = header.get("worker", ""), header.get("task", "")
        if type(worker) is not str or type(task) is not str or len(task) > ID_CHARS:
            return  # not what a coordinator sends: nothing of it is printed
        data = msg.payload[0]
        # The worker id prefixes each line: printable and short, whoever relayed it (the
        # coordinator refuses other ids at HELLO). The output itself is the task's own.
        self.on_output(for_terminal(worker[:ID_CHARS]),
                       "err" if header.get("stream") == "err" else "out",
                       data.bytes if hasattr(data, "bytes") else bytes(data), task)

    def _on_reply(self, msg: Message, now: float) -> None:
        qid = msg.header.get("qid", 0)
        data = msg.header.get("data")
        if qid == 0 and isinstance(data, dict):  # the answer to a FETCH
            listed = data.get("missing")
            missing = [self._by_task.pop(t) for t in (listed if type(listed) is list else [])
                       if type(t) is str and t in self._by_task]
            for sub in missing:
                sub.task_id = ""  # the coordinator lost it (new database?): submit it again
            if missing:
                self._send_submissions(missing, now)
            return
        query = self._queries.pop(qid, None)
        if query is None or query.future.done():
            return
        if msg.payload:
            data = _with_frames(data, msg.payload)
        more = msg.header.get("more")
        if isinstance(more, int) and not isinstance(more, bool) and more > 0:
            # A paged answer: keep this part, ask for the rest under the same qid.
            query.parts.append(data)
            query.header["page"] = more
            self._queries[qid] = query
            query.sent = self._link.send(encode(query.command, query.header))
            return
        _settle(query.future.set_result, _joined(query.parts, data))

    def _on_error(self, msg: Message, now: float) -> None:
        code = msg.header.get("code")
        text = for_terminal(str(msg.header.get("message", ""))[:500])
        qid = msg.header.get("qid")
        query = self._queries.pop(qid, None) if isinstance(qid, int) else None
        if query is not None:
            if code == ErrorCode.BUSY.value and not query.future.done():
                # Over the coordinator's request rate: "ask again later", so this side does,
                # shortly; the caller's timeout still bounds the wait.
                query.retry_at = now + min(QUERY_RETRY * 2 ** query.busy_tries, QUERY_RETRY_MAX)
                query.busy_tries += 1
                query.sent = False
                self._queries[int(query.header["qid"])] = query
                return
            if not query.future.done():
                _settle(query.future.set_exception,
                        MeshError(f"the coordinator refused the request: {text}"))
            return
        log.warning("coordinator error (%s): %s", for_terminal(str(code)[:32]), text)
        for q in list(self._queries.values()):
            if code == ErrorCode.UNSUPPORTED.value and not q.future.done():
                _settle(q.future.set_exception,
                        MeshError(f"the coordinator does not support this: {text}"))

    def _send_ids(self, command: Command, task_ids: list[str], **extra: Any) -> None:
        """CANCEL, FETCH or RESULT_ACK in messages of at most IDS_PER_MESSAGE task ids, so a
        client with a huge job in flight stays under the coordinator's header limit."""
        for start in range(0, len(task_ids), IDS_PER_MESSAGE):
            chunk = task_ids[start:start + IDS_PER_MESSAGE]
            self._link.send(encode(command, {"tasks": chunk, **extra}))

    def _flush_acks(self) -> None:
        if self._acks and self._connected.is_set():
            self._send_ids(Command.RESULT_ACK, self._acks)
            self._acks = []

    def _timers(self, now: float) -> None:
        """While a session is up: send again what was refused as busy, or never answered."""
        if self._parked and now - self._last_unpark >= BUSY_RETRY:
            self._unpark(now, len(self._parked))
        if self._redecode:
            due = [task_id for task_id, (when, _) in self._redecode.items() if when <= now]
            for task_id in due:
                self._on_result(self._redecode.pop(task_id)[1], now)
        if self._queries:
            self._retry_queries(now)
        if now - self._last_resend_check >= RESEND_AFTER / 4:
            # A scan of everything outstanding: a few times per RESEND_AFTER, not per turn.
            self._last_resend_check = now
            # Not while a SUBMIT still goes in pieces: the coordinator cannot answer one it
            # has not had whole, and sent again it would go whole again behind it.
            quiet = now - max(self._last_accepted, self._welcomed_at) > RESEND_AFTER \
                and not self._link.sending_pieces
            stale = [s for s in self._outstanding.values()
                     if quiet and not s.task_id and not s.busy
                     and now - s.sent_at > RESEND_AFTER]
            if stale:
                self._send_submissions(stale, now)

    def _retry_queries(self, now: float) -> None:
        """Ask again the queries refused as busy whose wait is over; forget those whose caller
        stopped waiting."""
        for qid, q in list(self._queries.items()):
            if q.retry_at and now >= q.retry_at:
                self._ask_again(qid, q)

    def _ask_again(self, qid: int, q: _Query) -> None:
        """Send a query again (a new session, or its busy wait is over), unless its caller
        stopped waiting: then it is forgotten."""
        if q.future.done():
            del self._queries[qid]
            return
        q.retry_at = 0.0
        q.sent = self._link.send(encode(q.command, q.header))

    def _next_query_retry(self) -> float | None:
        """When the first query refused as busy is to be asked again, if any is."""
        due = [q.retry_at for q in self._queries.values() if q.retry_at]
        return min(due) if due else None


_HANDLERS: dict[Command, Callable[[Engine, Message, float], None]] = {
    Command.ACCEPTED: Engine._on_accepted,
    Command.RESULT: Engine._on_result,
    Command.OUTPUT: Engine._on_output,
    Command.HEARTBEAT: Engine._on_heartbeat,
    Command.REPLY: Engine._on_reply,
    Command.ERROR: Engine._on_error,
}


def script_value(data: bytes, encoding: Any) -> Any:
    """A script's output as a value: its JSON (``encoding`` json), else its text. Raises
    ValueError for bytes that are not UTF-8, or not the JSON they are said to be."""
    text = data.decode("utf-8")
    return json.loads(text) if encoding == ResultEncoding.JSON.value else text


def decode_result(header: dict[str, Any], payload: list[Any], *, script: bool = False,
                  shm: SharedFolder | None = None) -> Any:
    """A task's value, or raise what the task ended with (the original type where possible).

    A script's result is JSON or text and is never unpickled, whatever the header says: only a
    function's submitter, who sent the function, unpickles what comes back for it."""
    status = header.get("status")
    split = header.get("split")
    payload = serialize.join_frames(payload, split if isinstance(split, list) else None)
    refs = parse_refs(header.get("shm"), len(payload)) if not script else ()
    if refs:
        # Mapped copy-on-write (read, under 1 MiB): either way the value stays writable.
        payload = materialize(payload, refs, shm)
    if status == ResultStatus.OK.value:
        encoding = header.get("encoding")
        if encoding in (ResultEncoding.JSON.value, ResultEncoding.TEXT.value):
            return script_value(_frame_bytes(payload[0]) if payload else b"", encoding)
        if script:
            task_id = _peer_text(header.get("task", ""), ID_CHARS)
            raise TaskError(f"task {task_id}: the worker sent a script result that is not JSON "
                            "or text; it was not read", task_id=task_id)
        return serialize.loads(serialize.writable(payload))
    # From here on the worker's text is printed (an exception, its traceback): any escape code
    # in it is written out, not acted on by the user's terminal. (Not on the path above: a
    # result that succeeded prints none of it, and that path runs for every task.)
    task_id = _peer_text(header.get("task", ""), ID_CHARS)
    worker = _peer_text(header.get("worker", ""), ID_CHARS)
    diagnosis = _peer_text(header.get("diagnosis", ""), MAX_DIAGNOSIS)
    error = header.get("error")
    if not isinstance(error, dict):
        error = {}
    if status == ResultStatus.ERROR.value:
        remote_tb = _peer_text(error.get("traceback", ""), MAX_TRACEBACK)
        message = _peer_text(error.get("message", "the task raised an exception"),
                             MAX_ERROR_MESSAGE)
        if payload and not script:
            try:
                original = serialize.loads(payload)
            except Exception:
                original = None
            if isinstance(original, BaseException):
                _add_note(original, f"Remote traceback (worker {worker[:8]}):\n{remote_tb}")
                # An attribute of our own on the user's exception type.
                original.remote_traceback = remote_tb  # type: ignore[attr-defined]
                raise original
        raise RemoteError(message,
                          remote_type=_peer_text(error.get("type", "Exception"), MAX_ERROR_TYPE),
                          remote_traceback=remote_tb, task_id=task_id, worker=worker)
    if status == ResultStatus.TIMEOUT.value:
        raise TaskTimeout(_peer_text(error.get("message", "the task timed out"),
                                     MAX_ERROR_MESSAGE), task_id=task_id, worker=worker)
    if status == ResultStatus.CRASHED.value:
        raise RunnerCrashed(f"task {task_id} failed: {diagnosis}", task_id=task_id, worker=worker)
    if status == ResultStatus.UNSCHEDULABLE.value:
        raise Unschedulable(diagnosis, task_id=task_id)
    if status == ResultStatus.CANCELLED.value:
        raise TaskCancelled(f"task {task_id} was cancelled on the mesh", task_id=task_id,
                            worker=worker)
    raise TaskError(f"task {task_id} ended with status {for_terminal(repr(status)[:64])}: "
                    f"{diagnosis}", task_id=task_id)


def _peer_text(value: Any, limit: int) -> str:
    """A free-text field of a RESULT as it may be printed: at most ``limit`` characters (what
    the coordinator keeps of it) after control characters are written out. A line a progress
    bar rewrote with carriage returns keeps what a terminal would have shown: its last part."""
    lines = str(value)[:limit].split("\n")
    text = "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in lines)
    return for_terminal(text)[:limit]


def _pairs(value: Any, size: int) -> list[list[Any]]:
    """The items of an ACCEPTED list that are lists of ``size`` (seq, task id, ...); others
    are left out, each alone, before any is acted on."""
    if type(value) is not list:
        return []
    return [item for item in value if type(item) is list and len(item) == size]


def _positive(value: Any, default: int) -> int:
    """A limit from the coordinator's WELCOME, or ``default`` when it sent none that is usable."""
    return value if type(value) is int and value > 0 else default


def _settle(settle: Callable[[Any], None], outcome: Any) -> None:
    """Set a future's result or exception, unless its caller cancelled it a moment ago."""
    try:
        settle(outcome)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled between the check and now: the caller already has its answer


def _with_frames(data: Any, payload: list[Any]) -> Any:
    """An answer whose items name frames of its message (``results``: each task's output as
    ``frame``, the index of its first piece, and ``pieces``, how many): each such item gets
    those frames' bytes, joined, as ``raw``. A range that is not within the frames names
    nothing."""
    tasks = data.get("tasks") if isinstance(data, dict) else None
    if not isinstance(tasks, list):
        return data
    for item in tasks:
        if isinstance(item, dict):
            index, count = item.pop("frame", None), item.pop("pieces", 1)
            if type(index) is int and type(count) is int and index >= 0 \
                    and 1 <= count <= len(payload) - index:
                item["raw"] = b"".join(_frame_bytes(f) for f in payload[index:index + count])
    return data


def _joined(parts: list[Any], last: Any) -> Any:
    """A paged answer put back together: lists end to end, or a status's ``tasks`` lists."""
    if not parts:
        return last
    if isinstance(last, list):  # a part of another shape is left out: the rest still answers
        return [item for part in parts if isinstance(part, list) for item in part] + last
    if isinstance(last, dict) and isinstance(last.get("tasks"), list):
        tasks = [t for part in parts if isinstance(part, dict) and isinstance(part.get("tasks"), list)
                 for t in part["tasks"]]
        return {**last, "tasks": tasks + last["tasks"]}
    return last


def _user() -> str:
    """This account's name, for the owner label of jobs (``user@host``)."""
    try:
        return getpass.getuser()
    except Exception:  # no name for this uid (containers): the owner is then ?@host
        return ""


def _frame_bytes(frame: Any) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]


def function_goes_by_table(spec: dict[str, Any], frames: Sequence[Any], chunk_bytes: int) -> bool:
    """Whether a function task's pickled function (frame 0) stays out of the shared-memory
    folder to go once per SUBMIT in the function table (``_send_chunk``): only when none of its
    arguments goes there (a task that names shared frames carries its function: protocol.md,
    "SUBMIT") and it fits one frame. Otherwise each task's copy is better in the folder than
    on the socket."""
    return bool(spec.get("fn")) and len(frames) > 0 \
        and serialize.frame_nbytes(frames[0]) <= chunk_bytes \
        and not any(big_enough_to_share(frame) for frame in frames[1:])
