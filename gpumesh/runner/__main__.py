"""Entry point of a runner process: ``python -m gpumesh.runner FD SCRATCH [NAME ...]``.

The worker agent starts one runner per slot and hands it one end of a socket pair. The runner
reads a task, runs it, writes the result, and waits for the next one, so there is no process
start per task. It never talks to the network: a task that hangs, hogs the GIL or crashes the
interpreter cannot stop the agent's heartbeats.

SCRATCH is a folder the agent made for this runner alone: scripts run in folders made in it,
and a running script's process group is named there, so that the agent ends both when it kills
the runner. The NAMEs are the variables the worker's owner passes to every task (``join
--pass-env``). Before the first task the runner cuts its own environment down to what tasks
may see (environment.py); each task then runs with that plus its own ``env``.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal.getsignal without its enum lookups
import contextlib
import functools
import io
import os
import select
import shutil
import signal
import socket
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgpack

from ..protocol.refs import Ref, parse_refs, ref_names
from ..protocol.vocabulary import ResultStatus
from ..sharedmem import SharedFolder, big_enough_to_share
from ..shmowners import ANONYMOUS, is_name_start
from .environment import base_environment, set_environ
from .execute import fit_to_send, infrastructure_failure, run_task, script_groups
from .pipe import MARKER, PipeClosed, recv_message, send_message

MAX_TASK_BYTES = 1 << 40
MARKER_WAIT = 30.0  # seconds a start marker waits for room in a full output pipe


_scratch: str | None = None  # this runner's folder (main), for the parent watch


def _exit_with_parent() -> None:
    """Die with the agent: a runner orphaned by ``kill -9`` of its agent must not run on."""
    parent = os.getppid()
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            for group in list(script_groups):  # a script runs in a group of its own
                with contextlib.suppress(OSError):
                    os.killpg(group, signal.SIGKILL)
            if _scratch:  # its agent, killed, removes nothing (a later one sweeps, late)
                shutil.rmtree(_scratch, ignore_errors=True)
            try:
                os.killpg(os.getpid(), signal.SIGKILL)  # also what a function task started
            finally:
                os._exit(1)


class _Start:
    """What a task may change in the runner's own process and the next task must not inherit:
    the working directory (README: a function task runs in the worker's start directory), the
    import path, ``sys.stdout``/``sys.stderr`` and the descriptors 1 and 2 under them (the
    pipes the agent reads each task's output from), kept as copies to put back; and the
    signal handlers, blocked signals, interval timers (``alarm``), umask, and the pipes'
    blocking mode. An ``alarm(30)`` left set raised a TimeoutError in the next task, another
    client's maybe; SIGCHLD ignored made every later failed script read as exit code 0; a pipe
    left non-blocking lost later tasks' output. (About 4 µs a task, checked each time.)"""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.streams = {"stdout": sys.stdout, "stderr": sys.stderr}
        # Copies above 2, not inherited by what a task starts (os.dup's default).
        self.fds = {fd: (os.dup(fd), _identity(fd)) for fd in (1, 2)}
        # Handlers installed by C code (None here) cannot be put back, nor SIGKILL's/SIGSTOP's.
        self.handlers = [(number, handler) for number, handler in
                         ((n, _signal.getsignal(n)) for n in _SIGNALS) if handler is not None]
        # No signal masks, interval timers or blocking flags on pipes on Windows (before 3.12).
        self.blocked = _blocked_signals()
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        self.limits = _ResourceLimits()

    def restore(self) -> None:
        if os.getpid() != self.pid:
            # A task's fork() that returned into this loop: two processes would answer the
            # agent on one socket. The child goes, as a forked worker process would.
            os._exit(0)
        for fd, (copy, identity) in self.fds.items():
            if _identity(fd) != identity:  # closed, or a file the task opened took its number
                os.dup2(copy, fd)
        try:
            moved = os.getcwd() != self.cwd
        except OSError:  # it went into a folder it then deleted
            moved = True
        if moved:
            try:
                os.chdir(self.cwd)
            except OSError:
                pass  # the start folder itself is gone: nothing better to go back to
        if sys.path != self.path:
            sys.path[:] = self.path
        self._restore_process_state()

    def _restore_process_state(self) -> None:
        for timer in _TIMERS:
            if signal.getitimer(timer) != (0.0, 0.0):
                signal.setitimer(timer, 0)  # first: a pending alarm must not fire meanwhile
        if self.blocked is not None and _blocked_signals() != self.blocked:
            # A signal that came while the task blocked it is delivered as the mask lifts:
            # ignored, not taken by the default action (SIGUSR1 ends the process, SIGINT
            # raises here) after the task ended and before its result is sent.
            for number in signal.sigpending():
                _set_handler(number, signal.SIG_IGN)
            signal.pthread_sigmask(signal.SIG_SETMASK, self.blocked)
        for number, handler in self.handlers:
            if _signal.getsignal(number) != handler:
                _set_handler(number, handler)
        os.umask(self.umask)
        self.limits.restore()
        for fd in (1, 2):
            try:
                if not os.get_blocking(fd):
                    os.set_blocking(fd, True)
            except (OSError, AttributeError):
                pass


class _ResourceLimits:
    """The process's resource limits as the runner started, put back after a task lowered
    them (one it raised stays raised): a task that lowered its memory (``RLIMIT_AS``, as
    code-evaluation guards do) or its open files left every later task of the runner, any
    client's, failing. Reading them all
    after each task costs more than the rest of the task's hygiene, so ``resource.setrlimit``
    and ``resource.prlimit`` are wrapped to say that a task called them (one through ctypes
    goes unseen). A hard limit a task lowered cannot be raised again without privilege: the
    runner is restarted then (``restore`` raises)."""

    def __init__(self) -> None:
        self.changed = False
        self.names: dict[int, str] = {}
        self.start: dict[int, tuple[int, int]] = {}
        try:
            import resource
        except ImportError:  # Windows: no limits to put back
            self._resource: Any = None
            return
        self._resource = resource
        for name in sorted(dir(resource)):  # RLIMIT_NOFILE, not its alias RLIMIT_OFILE
            if name.startswith("RLIMIT_"):
                self.names.setdefault(getattr(resource, name), name)
        self.start = {which: resource.getrlimit(which) for which in self.names}
        self._set = resource.setrlimit

    def watch(self) -> None:
        """From here on, a task's call of ``resource.setrlimit``/``prlimit`` is noticed."""
        for name in ("setrlimit", "prlimit"):
            real = getattr(self._resource, name, None)
            if real is not None:
                setattr(self._resource, name, self._watched(real))

    def _watched(self, real: Any) -> Any:
        @functools.wraps(real)
        def watched(*args: Any) -> Any:
            self.changed = True
            return real(*args)
        return watched

    def restore(self) -> None:
        if not self.changed:
            return
        self.changed = False
        for which, limits in self.start.items():
            if not self._below(self._resource.getrlimit(which), limits):
                continue  # unchanged, or raised (a module that lifts its open files at import
            try:          # stays cached here, and counts on it for every later task)
                self._set(which, limits)
            except (ValueError, OSError) as exc:
                raise RuntimeError(f"the task lowered {self.names[which]}, which a process cannot "
                                   f"raise again ({exc})") from None

    def _below(self, now: tuple[int, int], start: tuple[int, int]) -> bool:
        """Whether either limit is lower than it started (RLIM_INFINITY counts as the most)."""
        most = self._resource.RLIM_INFINITY

        def size(value: int) -> float:
            return float("inf") if value == most else value

        return size(now[0]) < size(start[0]) or size(now[1]) < size(start[1])


def _set_handler(number: int, handler: Any) -> None:
    try:
        signal.signal(number, handler)
    except (OSError, ValueError, TypeError):
        pass


def _blocked_signals() -> set[int | signal.Signals] | None:
    if not hasattr(signal, "pthread_sigmask"):
        return None
    return signal.pthread_sigmask(signal.SIG_BLOCK, [])


_SIGNALS = [int(n) for n in signal.valid_signals()
            if n not in (getattr(signal, "SIGKILL", None), getattr(signal, "SIGSTOP", None))]
_TIMERS = ((signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)
           if hasattr(signal, "setitimer") else ())


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        info = os.fstat(fd)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def main(argv: list[str]) -> int:
    threading.Thread(target=_exit_with_parent, name="gpumesh-parent-watch", daemon=True).start()
    sock = socket.socket(fileno=int(argv[0]))
    # Passed to this process inheritable: what a task starts (os.system, a Popen with
    # close_fds=False) must not hold it, and write to it or read the next task from it.
    sock.set_inheritable(False)
    start = _Start()
    start.limits.watch()
    # The agent's folder for this runner (scripts' folders): it removes it. Empty: it has none.
    global _scratch
    scratch = _scratch = argv[1] or None
    base_env = base_environment(os.environ, argv[2:])
    set_environ(base_env)  # the interpreter has read its PYTHON* variables; tasks do not see them
    send_message(sock, [msgpack.packb({"ready": True})])
    inbox = _Inbox(sock)
    while True:
        try:
            frames = inbox.next()
        except PipeClosed:
            return 0
        folder: SharedFolder | None = None
        result_refs: list[Ref] = []
        restart = ""
        try:
            header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
            if "drop" in header:
                inbox.dropped.add(header["drop"])
                continue
            nonce = header.get("pre")
            if nonce is not None and inbox.was_dropped(nonce):
                continue  # the agent took it back while the task before ran: never start it
            # Only now, so that a marker always means the task started: a drop read after
            # the marker was written left the agent sure a task ran that never did.
            _mark_start(nonce)
            folder = _shared_folder(header)
            task_frames: list[Any] = frames[1:]
            refs = parse_refs(header.get("shm"), len(task_frames))
            if refs and folder is not None:
                task_frames = folder.resolve(task_frames, refs)
            began = time.perf_counter()
            result_header, result_frames = run_task(header, task_frames, base_env, scratch)
            restart = str(result_header.pop("restart", ""))
            if os.getpid() != start.pid:
                os._exit(0)  # a task's fork() whose child returned here: it writes nothing
            # Its own run time: the agent may read this result well after it was written.
            result_header["ran"] = round(time.perf_counter() - began, 6)
            del task_frames
            if folder is not None and result_header.get("status") == ResultStatus.OK.value \
                    and "encoding" not in result_header:
                # A big return value goes straight into the shared folder: written once.
                result_frames, result_refs = folder.share(result_frames)
                if result_refs:
                    result_header["shm"] = [list(ref) for ref in result_refs]
            # After the shared folder took what it could: what is left travels in messages.
            sent_header, result_frames = _fit(result_header, result_frames, folder)
            if sent_header is not result_header and folder is not None and result_refs:
                folder.remove(ref_names(result_refs))  # nobody will ever name these files
            sent_header["ran"] = result_header["ran"]
            result_header = sent_header
        except BaseException as exc:
            # A fault in the runner's own handling of one task (or a task's SystemExit that
            # reached it some other way): answer for it and stay up.
            result_header, result_frames = infrastructure_failure("the runner failed", exc)
            if folder is not None and result_refs:
                folder.remove(ref_names(result_refs))  # written, and now named by nothing
        del frames
        try:
            start.restore()  # first: a forked child leaves here, and fds 1 and 2 are the pipes
            _settle_output(start)
        except Exception as exc:
            # The task left the process so that it cannot be put back (it replaced os.chdir
            # or os.getcwd, as code-evaluation guards do): its result goes, then this runner.
            restart = f"the runner could not undo what the task changed in its process: {exc!r}"
        if restart:
            # The agent restarts this runner after the result; what was handed ahead goes
            # back to its queue, never started here.
            result_header = {**result_header, "restart": restart[:500]}
        send_message(sock, [msgpack.packb(result_header, use_bin_type=True), *result_frames])
        if restart:
            return 0


def _settle_output(start: _Start) -> None:
    """Flush what the task printed, and leave the next task the runner's own ``sys.stdout``
    and ``sys.stderr``, working: a task that replaced them (a StringIO it never put back)
    would take every later task's output; one that closed them (or set them to None) made the
    flush raise, the runner exit, and its result be lost, on every worker it was retried on."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        try:
            stream.flush()
        except Exception:  # closed, None, or a replacement of the task's that fails
            pass
        if stream is not start.streams[name]:
            setattr(sys, name, start.streams[name])  # the task's own goes with the task
            stream = start.streams[name]
        try:
            stream.flush()
            usable = not getattr(stream, "closed", False)
        except Exception:
            usable = False
        if not usable:
            # The descriptors are the pipes again (_Start.restore): a new text layer over
            # each, written through as -u made the first, and kept as the runner's own.
            original = getattr(sys, f"__{name}__", None)
            fresh = io.TextIOWrapper(
                io.FileIO(fd, "w", closefd=False), write_through=True,
                encoding=getattr(original, "encoding", None) or "utf-8",
                errors=getattr(original, "errors", None) or "backslashreplace")
            setattr(sys, name, fresh)
            start.streams[name] = fresh


def _fit(header: dict[str, Any], frames: list[Any], folder: SharedFolder | None
         ) -> tuple[dict[str, Any], list[Any]]:
    """fit_to_send, telling a full shared folder from a result too big: a frame the folder
    would have taken but did not (full: /dev/shm is small in containers, and may empty) makes
    the task crashed, so it runs again, with the cause, instead of failing for good as told
    to "return less"."""
    sent, fitted = fit_to_send(header, frames)
    if sent is header or folder is None or header.get("status") != ResultStatus.OK.value \
            or "encoding" in header or not any(big_enough_to_share(f) for f in frames):
        # It fits; or no folder was offered it (another machine; an error's pickled
        # exception, a script's text, go by message only): too large, as before.
        return sent, fitted
    return {"status": ResultStatus.CRASHED.value, "diagnosis": (
        f"{sent['error']['message']}; the shared-memory folder {folder.path} that carries big "
        f"results on this machine had no room for it ({_free_space(folder.path)} free): free "
        "space there (on Linux /dev/shm; in Docker, --shm-size)")}, []


def _free_space(path: Path) -> str:
    try:
        info = os.statvfs(path)
    except OSError:
        return "?"
    return f"{info.f_bavail * info.f_frsize / 2**20:,.0f} MiB"


class _Inbox:
    """The agent's messages, in order, and the tasks handed ahead that it took back since
    (``{drop: nonce}``: it sends one when it cancels or moves such a task while the task
    before still runs here)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.waiting: deque[list[Any]] = deque()
        self.dropped: set[Any] = set()
        self.closed = False

    def next(self) -> list[Any]:
        if self.waiting:
            return self.waiting.popleft()
        if self.closed:
            raise PipeClosed("the agent closed the runner pipe")
        return recv_message(self.sock, MAX_TASK_BYTES)

    def was_dropped(self, nonce: Any) -> bool:
        """Whether the task handed ahead with ``nonce`` was taken back: reads, without waiting,
        what the agent wrote after it (a drop it sent meanwhile sits behind the task)."""
        while not self.closed and select.select([self.sock], [], [], 0)[0]:
            try:
                frames = recv_message(self.sock, MAX_TASK_BYTES)
            except PipeClosed:
                self.closed = True  # the agent is gone: start nothing more
                return True
            header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
            if isinstance(header, dict) and "drop" in header:
                self.dropped.add(header["drop"])
            else:
                self.waiting.append(frames)
        if nonce in self.dropped:
            self.dropped.discard(nonce)
            return True
        return False


def _mark_start(nonce: Any) -> None:
    """A task handed ahead (gpumesh/worker/runners.py) starts by marking both output pipes,
    so the agent tells its output from the previous task's."""
    if isinstance(nonce, str) and 0 < len(nonce) <= 64 and nonce.isalnum():
        marker = MARKER + nonce.encode() + b"\x00"
        deadline = time.monotonic() + MARKER_WAIT  # for both: the task's timeout has begun
        for fd in (1, 2):
            _write_marker(fd, marker, deadline)


def _write_marker(fd: int, marker: bytes, deadline: float) -> None:
    """Write a marker whole, waiting for room where an earlier task (or a child of it) made the
    pipe non-blocking and filled it. A marker left out made the agent take all that followed,
    later tasks' output too, for the task before it. (Under PIPE_BUF bytes, a pipe writes it
    whole or not at all.)"""
    while True:
        try:
            os.write(fd, marker)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                return  # the agent has not read for that long: it is not reading at all
            select.select([], [fd], [], left)
        except OSError:
            return  # the agent closed its end: it has stopped listening anyway


_FOLDERS: dict[str, SharedFolder] = {}


def _shared_folder(header: dict[str, Any]) -> SharedFolder | None:
    """The coordinator's shared-memory folder, as the agent (which proved it can read it)
    names it for a function task; None otherwise. One object per folder for the runner's life,
    so the spare file it makes after a big result is there for the next one."""
    where = header.get("shm_dir")
    if header.get("kind", "fn") != "fn" or not isinstance(where, str) or not where:
        return None
    folder = _FOLDERS.get(where)
    if folder is None:
        for old in _FOLDERS.values():  # the coordinator moved: its old folder's spare goes
            old.release()
        _FOLDERS.clear()
        folder = _FOLDERS[where] = SharedFolder(Path(where), "")
    # Its results are named as the agent's own frames: the agent keeps each until the
    # coordinator has it, and outlives this process (gpumesh/shmowners.py). Without the
    # agent's prefix, at random: never as this process's, whose end would let them go while
    # the agent still holds them.
    owner = header.get("shm_owner")
    folder.owner = owner if isinstance(owner, str) and is_name_start(owner) else ANONYMOUS
    return folder


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
