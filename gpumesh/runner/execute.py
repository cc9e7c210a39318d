"""Running one task inside a runner process: a pickled function, or a script with a JSON payload.

Returns ``(header, frames)`` for the agent. A user exception is a result like any other: its
type, message and traceback travel in the header, and the exception itself, pickled, when it can
be, so the caller can raise the original type. A task the worker refuses (a bad ``env`` or
script name) is an error too, reported once and never retried; a failure of the worker itself
(it cannot start a process or write a file) is reported as ``crashed``, so the task is retried
elsewhere, while the runner stays up.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import msgpack

from ..config import Limits, sizes_over_room
from ..processes import how_it_ended
from ..protocol import ResultEncoding, ResultStatus, serialize
from ..protocol.headers import MAX_ERROR_MESSAGE, MAX_TRACEBACK
from ..protocol.taskenv import check_script_name, check_task_env
from .environment import script_environment, task_environ

STDERR_TAIL = 4000  # characters of a failed script's stderr kept for its error report
OUTPUT_GRACE = 1.0  # seconds a script's pipes are read after it exited (a child may hold them)
GROUP_GRACE = 2.0  # seconds what a script left running has after SIGTERM, before SIGKILL
GROUP_FILE = "group-"  # in a runner's scratch folder: a script's process group, while it lives
SCRIPT_FOLDER = "gpumesh-script-"  # the start of each script's folder's name
# What one result may carry: it travels to the coordinator in one message, which also holds its
# header (the client keeps the same room for a task's input). The agent reads at most one
# message's bytes from its runner, and the pipe takes 4,095 frames, more than this leaves.
_LIMITS = Limits()
RESULT_ROOM_BYTES, RESULT_ROOM_FRAMES = _LIMITS.message_room

_functions: OrderedDict[str, Any] = OrderedDict()
_FUNCTION_CACHE = 64
# The process groups of the scripts running now: the runner's parent watch ends them too.
script_groups: set[int] = set()


def run_task(header: dict[str, Any], frames: Sequence[Any], base_env: dict[str, str],
             scratch: str | None = None) -> tuple[dict[str, Any], list[Any]]:
    """Run one task of either kind with ``base_env`` plus the task's own ``env``; a script's
    folder goes in ``scratch`` (the runner's own, which its agent removes with it)."""
    script = header.get("kind") == "script"
    try:
        task_env = check_task_env(header["env"]) if "env" in header else {}
    except ValueError as exc:
        return _refused(f"this worker refused the task's env: {exc}")
    if script:
        return run_script(header, frames, {**script_environment(base_env), **task_env}, scratch)
    with task_environ(base_env, task_env) as seen:
        result = run_function(header, frames)
    if seen.moved_pinning:
        # Set for this task (in ``env``) or by it: a GPU library it started read it.
        result[0]["restart"] = (f"the task set {seen.moved_pinning} in the runner's process, "
                                "which pins every later task of it")
    return result


def infrastructure_failure(what: str, exc: BaseException) -> tuple[dict[str, Any], list[Any]]:
    """The worker, not the task, failed: ``crashed`` makes the coordinator retry it elsewhere."""
    return {"status": ResultStatus.CRASHED.value,
            "diagnosis": f"{what}: {type(exc).__name__}: {_text(lambda: str(exc))}"}, []


def _text(make: Callable[[], str]) -> str:
    """Text about a task's exception that the result header can carry: the user's ``__str__``
    may raise, and its text may hold lone surrogates, which msgpack refuses (the runner could
    then send no result at all). The exception itself travels pickled, as it is."""
    try:
        text = make()
    except BaseException as exc:  # a __str__ that calls sys.exit() is the task's, not ours
        return f"(its text could not be made: {type(exc).__name__})"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def run_function(header: dict[str, Any], frames: Sequence[Any]) -> tuple[dict[str, Any], list[Any]]:
    if header.get("src"):
        # The last two frames are the source form (client/portable.py); the rest the pickle.
        if header.get("form") == "source":
            return run_source(str(header["src"]), frames[-2:])
        frames = frames[:-2]
    try:
        # Keyed by the digest of the bytes at hand, never by the one the task claims: a task
        # of one client must not be able to name another client's function and get its own.
        digest = serialize.function_digest(frames[0])
        fn = _functions.get(digest)
        if fn is None:
            fn = serialize.loads([frames[0]])
            _functions[digest] = fn
            if len(_functions) > _FUNCTION_CACHE:
                _functions.popitem(last=False)
        else:
            _functions.move_to_end(digest)
        args, kwargs = serialize.loads(frames[1:])
    except BaseException as exc:  # a module whose import calls sys.exit() (argparse) too
        return _error(exc, "the task could not be unpickled on this worker (a module your function "
                           "uses may be missing here, or Python versions differ): ")
    try:
        value = fn(*args, **kwargs)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt from user code are results too
        return _error(exc)
    return _returned(value)


def run_source(name: str, frames: Sequence[Any]) -> tuple[dict[str, Any], list[Any]]:
    """Define the function from its source and call it with its plain-data arguments.

    Used on a worker whose Python differs from the submitter's, where the pickle cannot load.
    """
    try:
        source = bytes(frames[0]).decode("utf-8")
        args, kwargs = msgpack.unpackb(bytes(frames[1]), raw=False)
        namespace: dict[str, Any] = {"__name__": "__gpumesh_source__"}
        exec(compile(source, f"<gpumesh source of {name}>", "exec"), namespace)  # noqa: S102
        fn = namespace[name]
    except BaseException as exc:
        return _error(exc, f"the source form of {name} could not be loaded on this worker (Python "
                           f"{sys.version_info.major}.{sys.version_info.minor}): ")
    try:
        value = fn(*args, **kwargs)
    except BaseException as exc:
        return _error(exc)
    return _returned(value)


# The runner's frames that call a task's function: left out of the task's traceback.
_CALLERS = (run_function.__code__, run_source.__code__)


def _returned(value: Any) -> tuple[dict[str, Any], list[Any]]:
    """The result of a call; a value that cannot travel is an error that says it was the
    return value, and for a generator what to return instead."""
    lazy = ("generator" if inspect.isgenerator(value) else
            "async generator" if inspect.isasyncgen(value) else
            "coroutine" if inspect.iscoroutine(value) else None)
    if lazy is not None:
        if inspect.iscoroutine(value):
            value.close()  # never awaited: say so here, not in a RuntimeWarning
        # The message is the exception's own: the caller raises it as a TypeError.
        return _error(TypeError(
            f"cannot pickle {lazy!r} object: the function's return value is a {lazy}, which "
            "cannot leave the worker; return a list (e.g. return list(...)) or the awaited "
            "value instead"))
    try:
        return {"status": ResultStatus.OK.value}, serialize.dumps(value)
    except BaseException as exc:  # a __reduce__ may raise anything, SystemExit included
        return _error(exc, "the function's return value could not be pickled: ")


def fit_to_send(header: dict[str, Any], frames: Sequence[Any], room_bytes: int = RESULT_ROOM_BYTES,
                room_frames: int = RESULT_ROOM_FRAMES) -> tuple[dict[str, Any], list[Any]]:
    """The result as it is when one message can carry it, else an error that says so: sent,
    the agent would take it for a dead runner (over its read limit) or the coordinator would
    drop it (over its own), and the task would be retried, each time to the same end."""
    nbytes, count = serialize.wire_cost(frames, _LIMITS.chunk_bytes)
    if nbytes <= room_bytes and count <= room_frames:
        return header, frames if isinstance(frames, list) else list(frames)
    if nbytes > room_bytes:
        shown, most = sizes_over_room(nbytes, room_bytes)
        what = f"{shown} pickled, and one result carries at most {most}"
    else:
        what = (f"{count} frames pickled, and one result carries at most {room_frames}: return "
                "fewer, larger arrays (one stacked array instead of many small ones)")
    return _refused(f"the task's result was not sent: it is {what}. Return less, or write it "
                    "to a file every machine can read and return the path",
                    kind="gpumesh.ResultTooLarge")


def _error(exc: BaseException, prefix: str = "") -> tuple[dict[str, Any], list[Any]]:
    """An exception as a result: its text cut to what the agent passes on (a message of
    hundreds of MB, ``ValueError(huge_list)``, made a header over the agent's read limit and
    the runner taken for broken), and itself pickled when it can be and fits a message (one
    holding a big array went as ResultTooLarge, its type and message lost)."""
    message = prefix + _text(lambda: str(exc)[:MAX_ERROR_MESSAGE])
    error = {"type": f"{type(exc).__module__}.{type(exc).__qualname__}",
             "message": message[:MAX_ERROR_MESSAGE],
             "traceback": _text(lambda: "".join(
                 traceback.format_exception(type(exc), exc, _from_the_task(exc.__traceback__))
             )[-MAX_TRACEBACK:])}
    try:
        frames = serialize.dumps(exc.with_traceback(None))
    except BaseException:
        frames = []
    header = {"status": ResultStatus.ERROR.value, "error": error}
    if frames and fit_to_send(header, frames)[0] is not header:
        error["message"] = ("(the exception itself was too large to send: raised as "
                            "RemoteError) " + error["message"])
        frames = []
    return header, frames


def _from_the_task(tb: TracebackType | None) -> TracebackType | None:
    """A task's traceback from its own first frame: the runner's frame that called it
    (``run_function``) tells the user nothing. Kept whole when the error is the runner's
    own (nothing of the task's below it: an argument that does not match, say)."""
    if tb is not None and tb.tb_frame.f_code in _CALLERS and tb.tb_next is not None:
        return tb.tb_next
    return tb


def run_script(header: dict[str, Any], frames: Sequence[Any], env: dict[str, str],
               scratch: str | None = None) -> tuple[dict[str, Any], list[Any]]:
    """Run the script with the payload as JSON on stdin; stdout is the result.

    The script runs with ``env`` as its whole environment, in a temporary directory of its own
    (its working directory, removed afterwards; made in ``scratch`` when given). stderr streams
    to the caller as it is written (through this runner's stderr), and its last lines are kept
    for the error report when the script fails. It runs in a process group of its own, and
    what it leaves running in it ends with it (``_end_group``): a server or a training process
    it started in the background held a GPU and its memory until the runner restarted.
    """
    try:
        name = check_script_name(header.get("name", ""))
    except ValueError as exc:
        return _refused(f"this worker refused the script: {exc}", "gpumesh.ScriptError")
    script, payload = bytes(frames[0]), bytes(frames[1]) if len(frames) > 1 else b"{}"
    try:
        tmp = tempfile.TemporaryDirectory(prefix=SCRIPT_FOLDER, dir=scratch,
                                          ignore_cleanup_errors=True)
    except OSError as exc:
        return infrastructure_failure("could not make a temporary directory for the script", exc)
    with tmp:
        path = os.path.join(tmp.name, name if name.endswith(".py") else f"{name}.py")
        try:
            with open(path, "wb") as handle:
                handle.write(script)
            proc = subprocess.Popen(
                [sys.executable, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, env=env, cwd=tmp.name, start_new_session=True,
            )
        except OSError as exc:
            return infrastructure_failure("could not start the script", exc)
        group = _ScriptGroup(proc.pid, scratch)
        tail: deque[bytes] = deque()
        try:
            out, written = _exchange(proc, payload, tail, group.end)
        finally:
            group.end()
    if proc.returncode != 0:
        stderr = b"".join(tail).decode("utf-8", "replace")[-STDERR_TAIL:]
        last = stderr.strip().splitlines()[-1:] or [""]
        detail = f": {last[0]}" if last[0] else ""
        error = {"type": "gpumesh.ScriptError",
                 "message": f"script {name} {how_it_ended(proc.returncode)}{detail}",
                 "traceback": stderr or out.decode("utf-8", "replace")[-STDERR_TAIL:]}
        return {"status": ResultStatus.ERROR.value, "error": error}, []
    if written > len(out):
        shown, most = sizes_over_room(written, RESULT_ROOM_BYTES)
        return _refused(f"script {name} printed {shown} on stdout, and one result carries at "
                        f"most {most}: stdout is the script's result. Print less (logs go to "
                        "stderr), or write big outputs to a file every machine can read and "
                        "print its path", kind="gpumesh.ResultTooLarge")
    text = out.decode("utf-8", "replace").strip()
    try:
        json.loads(text)
        encoding = ResultEncoding.JSON.value
    except ValueError:
        encoding = ResultEncoding.TEXT.value
    return {"status": ResultStatus.OK.value, "encoding": encoding}, [text.encode("utf-8")]


def _refused(message: str, kind: str = "gpumesh.TaskRefused") -> tuple[dict[str, Any], list[Any]]:
    """A task this worker will not run as sent: an error without frames (nothing to unpickle),
    so it fails once, here, instead of being retried on every other worker."""
    return {"status": ResultStatus.ERROR.value, "error": {"type": kind, "message": message, "traceback": ""}}, []


class _ScriptGroup:
    """A running script's process group, named where the runner's end can find it: in
    ``script_groups`` for the runner's parent watch, and as a file in the runner's scratch
    folder for its agent, which ends the group when it kills the runner (a cancel, a
    timeout): in a group of its own, the script is no longer killed with the runner's."""

    def __init__(self, pid: int, scratch: str | None) -> None:
        self.pid = pid
        self.file = os.path.join(scratch, f"{GROUP_FILE}{pid}") if scratch else None
        self.ended = False
        script_groups.add(pid)
        if self.file is not None:
            try:
                with open(self.file, "x"):
                    pass
            except OSError:
                self.file = None  # the agent cannot end it then: the runner still does

    def end(self) -> None:
        """Once the script has exited: SIGTERM to what it left in its group, SIGKILL to what
        is still there GROUP_GRACE later. A process that left the group (``setsid``, as a
        daemon does) is not found: that is its choice."""
        if self.ended:
            return
        self.ended = True
        try:
            _end_group(self.pid)
        finally:
            script_groups.discard(self.pid)
            if self.file is not None:
                with contextlib.suppress(OSError):
                    os.remove(self.file)


def _end_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return  # nothing left in it (the usual case), or nothing this user may end
    deadline = time.monotonic() + GROUP_GRACE
    looked = 0
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        looked += 1
        if looked % 10 == 0 and _only_zombies_in(pgid):  # every 0.2 s: it reads all of /proc
            return  # ended, waiting for an init to reap them (some containers' never does)
        time.sleep(0.02)  # rare (the script left something running): no cheaper wait for a group
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _only_zombies_in(pgid: int) -> bool:
    """Whether every process left in group ``pgid`` has exited and awaits its reaping (Linux,
    from /proc; elsewhere the group's end is waited for)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return False
    group, zombies = str(pgid).encode(), 0
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if len(fields) > 2 and fields[2] == group:
            if fields[0] != b"Z":
                return False
            zombies += 1
    # None seen at all is not "all ended": /proc may not show them (another pid namespace,
    # hidepid), and the group answered signal 0 a moment ago.
    return zombies > 0


def _exchange(proc: subprocess.Popen[bytes], payload: bytes, tail: deque[bytes],
              exited: Callable[[], None]) -> tuple[bytes, int]:
    """Give the script its payload and read what it writes until it exits: ``(stdout, bytes
    it wrote there)``, stdout kept up to one result's room; stderr relayed live with its end
    kept in ``tail``. Once it has exited, ``exited`` ends what it left in its group, and its
    pipes are read for OUTPUT_GRACE more and then left: a child that left the group (a
    daemon) may hold them open, and waiting for their end hung the slot for good. What such a
    child writes after that is read and dropped: kept, it grew the runner's memory for as long
    as the child ran."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    pipes = (proc.stdin, proc.stdout, proc.stderr)
    proc.stdin = proc.stdout = proc.stderr = None  # the threads' alone from here
    out = _Stdout()
    left = threading.Event()  # set: what still comes is no longer this task's
    relaying = threading.Event()  # set while the relay waits for the agent to read fd 2
    threads = [threading.Thread(target=_feed, args=(pipes[0], payload), daemon=True),
               threading.Thread(target=_collect, args=(pipes[1], out, left), daemon=True),
               threading.Thread(target=_relay_stderr, args=(pipes[2], tail, left, relaying),
                                daemon=True)]
    for thread in threads:
        thread.start()
    # Reaped first: its exited leader would keep the group answering signal 0, and each
    # script would wait out a look at /proc (or, without /proc, the whole grace). A group with
    # members left keeps its number from any new process meanwhile.
    proc.wait()
    exited()
    deadline = time.monotonic() + OUTPUT_GRACE
    for thread in threads[1:]:
        thread.join(max(deadline - time.monotonic(), 0.0))
        # A relay held up by the agent's reading is not a child holding the pipe: the end of
        # stderr (a failed script's traceback, for its error) is still to come.
        while thread.is_alive() and relaying.is_set():
            thread.join(0.1)
    with out.lock:
        left.set()
        return b"".join(out.chunks), out.written


class _Stdout:
    """A script's stdout as read: at most one result's room of it (plus a byte, to tell an
    output over the room), and how much it wrote in all."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.kept = 0
        self.written = 0
        self.lock = threading.Lock()


def _feed(pipe: Any, payload: bytes) -> None:
    try:
        pipe.write(payload)
        pipe.close()
    except OSError:
        pass  # it exited without reading all of it: its exit code says how it went


def _collect(pipe: Any, out: _Stdout, left: threading.Event) -> None:
    for chunk in iter(lambda: pipe.read1(65536), b""):
        with out.lock:
            if left.is_set():
                continue  # a child the script left running: read, so it never blocks; dropped
            out.written += len(chunk)
            room = RESULT_ROOM_BYTES + 1 - out.kept
            if room > 0:
                out.chunks.append(chunk[:room])
                out.kept += min(len(chunk), room)
    pipe.close()


def _relay_stderr(pipe: Any, tail: deque[bytes], left: threading.Event,
                  relaying: threading.Event) -> None:
    """Copy the script's stderr to ours as it comes (the caller sees it live); keep the end."""
    kept = 0
    for chunk in iter(lambda: pipe.read1(65536), b""):
        if left.is_set():
            continue  # a child the script left printing: not the next task's output
        relaying.set()
        try:  # fd 2 itself: whatever a task left in sys.stderr (one without .buffer)
            _write_all(2, chunk)
        except OSError:
            pass
        finally:
            relaying.clear()
        tail.append(chunk)
        kept += len(chunk)
        while kept - len(tail[0]) > STDERR_TAIL and len(tail) > 1:
            kept -= len(tail.popleft())
    pipe.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
