"""``MeshExecutor``: a ``concurrent.futures.Executor`` over the futures engine.

It behaves as the standard library's executors do (``submit``, ``map`` with ``timeout`` and
``chunksize``, ``shutdown(wait, cancel_futures)``, the context manager, the interpreter-exit hook)
and passes CPython's own executor tests. ``max_workers`` is the executor's window: at most that
many of its calls are on the mesh at once, the rest wait here, where ``cancel()`` and
``shutdown(cancel_futures=True)`` take them back, like a ``ThreadPoolExecutor``'s queue. A call
handed to the mesh is *running*; ``cancel()`` then returns False, as for a started thread.
Without ``max_workers`` every call goes to the mesh at once and the coordinator queues them.
One difference, on purpose: the calls of a ``map`` whose results nobody will read (a timeout,
an error, leaving the loop) are stopped on the mesh too, running or not.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from ..errors import MeshError
from .api import GPUMesh, new_job_id
from .console import say_line
from .engine import FIRST_CHUNK, TaskFuture, _Waiters, refuse_wait_on_io_thread
from .tasks import TaskOptions

T = TypeVar("T")

_EXECUTORS: weakref.WeakSet[MeshExecutor] = weakref.WeakSet()
# Executors with calls not yet on the mesh, held here until the dispatcher sent them: those
# calls live in the executor alone (one on the mesh is held by its _Relay), and one dropped
# right after submit() (``MeshExecutor(...).submit(f, 1).result()``) must still send them.
_SENDING: set[MeshExecutor] = set()
GROUP = 4 * FIRST_CHUNK  # calls per submission, at most (GPUMesh.submit_calls sends none early)
_EXITING = False
COLLECTED_CHECK = 1.0  # seconds an idle dispatcher waits before it looks whether its executor is gone


def _at_exit() -> None:
    """Before the interpreter joins its threads: no new calls, and every executor finishes what
    it has, as ``ThreadPoolExecutor`` does."""
    global _EXITING
    _EXITING = True
    for executor in list(_EXECUTORS):
        executor._wake_for_exit()


try:
    threading._register_atexit(_at_exit)  # type: ignore[attr-defined]  # what concurrent.futures uses
except (AttributeError, RuntimeError):  # pragma: no cover - another Python, or already exiting
    import atexit

    atexit.register(_at_exit)


class _Call:
    __slots__ = ("future", "fn", "args", "kwargs")

    def __init__(self, future: concurrent.futures.Future[Any], fn: Callable[..., Any],
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.future, self.fn, self.args, self.kwargs = future, fn, args, kwargs


class MeshExecutor(concurrent.futures.Executor):
    """Run calls on the mesh through the standard ``Executor`` interface.

    ``MeshExecutor(url, token)`` opens its own connection (closed by ``shutdown``);
    ``mesh.executor()`` shares that ``GPUMesh``. ``options`` apply to every task (timeout,
    requirements, env). All calls of one executor form one job (``gpumesh status`` shows it).
    """

    def __init__(self, url: str | None = None, token: str | None = None, *,
                 max_workers: int | None = None, mesh: GPUMesh | None = None,
                 options: TaskOptions | None = None, name: str = "executor") -> None:
        if max_workers is not None and max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        self._mesh = mesh if mesh is not None else GPUMesh(url, token)
        self._owns_mesh = mesh is None
        self._window = max_workers
        self._options = options or TaskOptions()
        self._job = new_job_id()
        self._name = name
        self._waiting: deque[_Call] = deque()  # beyond the window: cancellable
        self._taken: list[_Call] = []  # running, on their way to the mesh
        self._sending = 0  # taken by the dispatcher, not yet in _running
        self._running: set[TaskFuture] = set()
        self._changed = threading.Condition()
        self._shutdown = False
        self._interrupted = False
        self._thread: threading.Thread | None = None
        _EXECUTORS.add(self)

    @property
    def job(self) -> str:
        """The job id every call of this executor is submitted under."""
        return self._job

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
               ) -> concurrent.futures.Future[T]:
        with self._changed:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if _EXITING:
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            future: concurrent.futures.Future[T] = _CallFuture()
            call = _Call(future, fn, args, kwargs)
            if self._room() > 0 and not self._waiting:
                # A free place takes the call at once, as an idle pool thread would: from now
                # on it is running, and shutdown(cancel_futures=True) leaves it to finish.
                future.set_running_or_notify_cancel()
                self._taken.append(call)
            else:
                self._waiting.append(call)
            _SENDING.add(self)
            if self._thread is None:
                # Not a daemon: like the standard executors, calls in flight finish before the
                # interpreter exits. It holds the executor weakly, as theirs do: one dropped
                # without shutdown() ends its thread and connection once nothing is in flight
                # (each call on the mesh holds it until its result is in).
                self._thread = threading.Thread(
                    target=_dispatch, args=(weakref.ref(self), self._changed,
                                            self._mesh if self._owns_mesh else None),
                    daemon=False, name=f"gpumesh-executor-{self._job}")
                self._thread.start()
            self._changed.notify_all()
            return future

    def map(self, fn: Callable[..., T], *iterables: Iterable[Any], timeout: float | None = None,
            chunksize: int = 1, buffersize: int | None = None) -> Iterator[T]:
        """As ``Executor.map`` (``buffersize``, as in Python 3.14: at most that many calls
        submitted ahead of the one being read); ``chunksize`` > 1 sends that many calls as
        one task, which suits many short calls (one round trip and one scheduling decision
        per chunk). Unlike a thread pool's, the calls the caller will never read (a timeout,
        an error, leaving the loop early) are stopped on the mesh too, running or not: a
        running thread cannot be stopped, a task on the mesh can, and it holds a friend's GPU."""
        if chunksize < 1:
            raise ValueError("chunksize must be >= 1.")
        if buffersize is not None and not isinstance(buffersize, int):
            raise TypeError("buffersize must be an integer or None")  # as Python 3.14's
        if buffersize is not None and buffersize < 1:
            raise ValueError("buffersize must be None or > 0")
        calls: Iterator[tuple[Any, ...]] = zip(*iterables, strict=False)
        if chunksize > 1:
            calls = zip(itertools.repeat(fn), _chunks(calls, chunksize), strict=False)
            results = self._map(_run_chunk, calls, timeout, buffersize)
            return _flatten(results)
        return self._map(fn, calls, timeout, buffersize)

    def _map(self, fn: Callable[..., Any], calls: Iterator[tuple[Any, ...]],
             timeout: float | None, buffersize: int | None) -> Iterator[Any]:
        end = None if timeout is None else time.monotonic() + timeout
        ahead = calls if buffersize is None else itertools.islice(calls, buffersize)
        futures = deque(self.submit(fn, *args) for args in ahead)
        # Weakly, as the stdlib's: the iterator must not keep the executor alive.
        executor = weakref.ref(self)

        def results() -> Iterator[Any]:
            try:
                while futures:
                    if buffersize is not None:
                        owner = executor()
                        if owner is not None:
                            for args in itertools.islice(calls, 1):
                                futures.append(owner.submit(fn, *args))
                        del owner
                    # No name for the future while its result is out: the caller's result
                    # must be freed when the caller drops it (the stdlib's own test).
                    yield _result_of(futures.popleft(),
                                     None if end is None else end - time.monotonic())
            finally:
                _abandon(futures)

        return results()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Any:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            self._interrupt()  # README: Ctrl+C means stop, not "wait for every call first"
        try:
            return super().__exit__(exc_type, exc, tb)
        except KeyboardInterrupt:  # while shutdown(wait=True) waited for the calls
            self._interrupt()
            raise

    def _interrupt(self) -> None:
        """Cancel every unfinished call: those waiting here and those on the mesh, pending or
        running, and those on their way there (cancelled as they arrive, in _send)."""
        with self._changed:
            self._shutdown = self._interrupted = True
            waiting = list(self._waiting)
            self._waiting.clear()
            running = list(self._running)
            on_the_way = self._sending + len(self._taken)
            self._changed.notify_all()
        for call in waiting:
            call.future.cancel()
            call.future.set_running_or_notify_cancel()  # wakes wait()/as_completed() on it
        cancelled = sum(1 for task in running if task.cancel())
        count = len(waiting) + cancelled + on_the_way
        if count:
            say_line(f"[gpumesh] interrupted: cancelled {count} unfinished call(s) of the executor "
                     "on the mesh")

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._changed:
            self._shutdown = True
            if cancel_futures:
                while self._waiting:
                    future = self._waiting.popleft().future
                    future.cancel()
                    future.set_running_or_notify_cancel()  # wakes wait()/as_completed() on it
            self._changed.notify_all()
            thread = self._thread
        if thread is None:
            if self._owns_mesh:
                self._mesh.close()
            return
        if wait:
            # A done-callback runs on the client's I/O thread, which delivers the results this
            # would wait for (as a pool thread cannot join itself: the same RuntimeError).
            refuse_wait_on_io_thread("shutdown(wait=True)")
            thread.join()

    # ----------------------------------------------------------------- the dispatcher thread

    def _wake_for_exit(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _done(self) -> bool:
        return ((self._shutdown or _EXITING) and not self._waiting and not self._taken
                and not self._running and not self._sending)

    def _room(self) -> int:
        if self._window is None:
            return len(self._waiting) + 1
        return self._window - len(self._running) - len(self._taken) - self._sending

    def _ready(self) -> bool:
        return bool(self._taken) or (bool(self._waiting) and self._room() > 0)

    def _take(self) -> list[_Call]:
        while self._waiting and self._room() > 0:
            call = self._waiting.popleft()
            if call.future.set_running_or_notify_cancel():
                self._taken.append(call)
        batch, self._taken = self._taken, []
        self._sending = len(batch)
        return batch

    def _send(self, batch: list[_Call]) -> None:
        # Consecutive calls of one function go as one submission (one pickled function), of
        # at most GROUP calls: submit_calls pickles a group that size whole before it sends any
        # of it, so a call that cannot be pickled has sent nothing, and the group can go again
        # a call at a time without running any call twice.
        groups: list[list[_Call]] = []
        for _, run in itertools.groupby(batch, key=lambda c: id(c.fn)):
            same = list(run)
            groups += [same[start:start + GROUP] for start in range(0, len(same), GROUP)]
        batch.clear()
        while groups:
            calls = groups.pop(0)
            try:
                tasks = self._mesh.submit_calls(calls[0].fn, [(c.args, c.kwargs) for c in calls],
                                                self._options, job=self._job, name=self._name)
            except BaseException as exc:
                if len(calls) > 1 and not isinstance(exc, MeshError):
                    # One call that cannot be sent (an argument that does not pickle) fails
                    # alone, as it would have had it been submitted a moment apart: the group
                    # goes again a call at a time (what went of it was cancelled).
                    groups[:0] = [[call] for call in calls]
                    continue
                # The mesh itself refused (unreachable: each try waited connect_timeout, and a
                # group of 64 tried one by one held the dispatcher for minutes): all fail at once.
                for call in calls:
                    call.future.set_exception(exc)
                with self._changed:
                    self._sending -= len(calls)
                continue
            with self._changed:
                self._running.update(tasks)
                self._sending -= len(calls)
                interrupted = self._interrupted
            for call, task in zip(calls, tasks, strict=True):
                future = call.future
                if isinstance(future, _CallFuture):
                    future._task = task  # for _abandon
                task.add_done_callback(_Relay(self, future).done)
                if interrupted or getattr(future, "_abandoned", False):
                    task.cancel()  # sent while Ctrl+C stopped the executor, or the map's
                    # reader gave up on it: stopped too
            del calls  # no reference to the arguments once they are on their way

    def _finished(self, task: TaskFuture) -> None:
        with self._changed:
            self._running.discard(task)
            self._changed.notify_all()


def _dispatch(ref: weakref.ReferenceType[MeshExecutor], changed: threading.Condition,
              owned: GPUMesh | None) -> None:
    """The dispatcher thread: hands waiting calls to the mesh as the window allows, in batches
    of one function. It holds the executor only while it works, never while it waits."""
    try:
        while True:
            with changed:
                while True:
                    executor = ref()
                    if executor is None or executor._done():
                        return
                    if executor._ready():
                        break
                    if not executor._waiting and not executor._taken and not executor._sending:
                        _SENDING.discard(executor)  # nothing of it left that only it holds
                    del executor
                    # Woken by submit, shutdown, a finished call, interpreter exit; and now
                    # and then to see whether the executor was collected, which sends no wake.
                    changed.wait(COLLECTED_CHECK)
                batch = executor._take()
            executor._send(batch)
            del executor, batch
    finally:
        gone = ref()
        if gone is not None:
            _SENDING.discard(gone)
        if owned is not None:
            owned.close()


class _CallFuture(concurrent.futures.Future[Any]):
    """An executor call's future. Its result is set on the client's I/O thread, where its
    done-callbacks run too: waiting there for one not done would wait forever (``result``,
    ``exception``, and ``concurrent.futures.wait``/``as_completed`` through ``_Waiters``)."""

    def __init__(self) -> None:
        super().__init__()
        self._waiters: list[Any] = _Waiters(self)
        self._task: TaskFuture | None = None  # its task on the mesh, once sent
        self._abandoned = False  # a map's reader gave up on it: stopped on the mesh too

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            refuse_wait_on_io_thread("waiting for an executor call's result")
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            refuse_wait_on_io_thread("waiting for an executor call's result")
        return super().exception(timeout)


class _Relay:
    """Copies a mesh task's outcome to the executor's future, then frees a window place."""

    __slots__ = ("executor", "future")

    def __init__(self, executor: MeshExecutor, future: concurrent.futures.Future[Any]) -> None:
        self.executor, self.future = executor, future

    def done(self, task: concurrent.futures.Future[Any]) -> None:
        future, executor = self.future, self.executor
        self.future = self.executor = None  # type: ignore[assignment]
        if isinstance(future, _CallFuture):
            future._task = None
        if task.cancelled():
            future.set_exception(concurrent.futures.CancelledError(
                "the task was cancelled on the mesh"))
        elif task.exception() is not None:
            future.set_exception(task.exception())
        else:
            future.set_result(task.result())
        executor._finished(task)  # type: ignore[arg-type]


def _result_of(future: concurrent.futures.Future[Any], timeout: float | None) -> Any:
    try:
        return future.result(timeout)
    finally:
        _abandon([future])
        del future


def _abandon(futures: Iterable[concurrent.futures.Future[Any]]) -> None:
    """Calls whose results nobody will read: cancelled here if they wait here, else on the mesh
    (on their way there: as they arrive, in _send)."""
    for future in futures:
        if future.done() or future.cancel():
            continue
        if isinstance(future, _CallFuture):
            future._abandoned = True
            task = future._task  # once: the I/O thread clears it as the call settles
            if task is not None:
                task.cancel()


def _run_chunk(fn: Callable[..., T], chunk: list[tuple[Any, ...]]) -> list[T]:
    return [fn(*args) for args in chunk]


def _chunks(items: Iterator[tuple[Any, ...]], size: int) -> Iterator[list[tuple[Any, ...]]]:
    while True:
        chunk = list(itertools.islice(items, size))
        if not chunk:
            return
        yield chunk


def _flatten(lists: Iterator[list[T]]) -> Iterator[T]:
    """Items of each list in order, popped so the iterator keeps no reference to a result."""
    for items in lists:
        items.reverse()
        while items:
            yield items.pop()
