"""Runner child processes as the agent sees them: start, feed, read, watch, kill, diagnose.

Each slot has one long-lived runner (``python -m gpumesh.runner``) connected by a socket pair.
Its stdout and stderr are pipes the agent reads, to stream what tasks print and to keep the last
lines for a diagnosis when the runner dies. A runner starts with the environment tasks may see
(gpumesh/runner/environment.py), not the agent's: the worker's credentials stay out of it.

While tasks are short, a busy runner is handed its next tasks ahead (``hand_ahead``, as many as
the agent's ``ahead_depth``): it starts each as soon as it has written the result before, without
waiting for the agent to wake up, read that result and answer (about 0.6 ms a task here). Pipes
and the socket are not ordered with each other, so such a task begins by writing a marker of its
own on stdout and stderr: what the pipes carry before it belongs to the task before, what
follows to the new one. A task handed ahead cannot be taken back from the socket: dropping the
tasks handed ahead (cancel, pause, or a move to a free slot when the task before turns out long)
writes a ``drop`` for each, which the runner reads before it would start it, and restarts the
runner once the task before has finished, in case a drop came too late.
"""

from __future__ import annotations

import functools
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from ..processes import how_it_ended
from ..protocol import ResultEncoding, ResultStatus, serialize
from ..protocol.headers import MAX_DIAGNOSIS, MAX_ERROR_MESSAGE, MAX_ERROR_TYPE, MAX_TRACEBACK
from ..protocol.ids import HexIds
from ..runner.environment import runner_process_environment
from ..runner.pipe import (
    MARKER,
    MAX_FRAMES,
    SHARED_THRESHOLD,
    PipeClosed,
    encode_small,
    memfd_works,
    recv_message,
    send_message,
)
from ..sharedmem import SharedFolder
from . import scratch

log = logging.getLogger("gpumesh.worker")
START_AGAIN = 1.0  # seconds before a runner that no process could be made for is tried again
HEADER_BYTES = 512  # a runner header's fixed fields, packed, at most (kind, fn, lease, shm_dir...)
REF_BYTES = 64  # one shm reference [index, 32-hex name, size], packed, at most

TAIL_LINES = 20
KILL_WAIT = 0.2  # seconds kill() waits for the killed runner to exit before it moves on
REAP_READS = 16  # reads of an exited runner's pipes at most (1 MiB)
PARTIAL_BYTES = 4096  # of a line still open, kept for the tail
# Bytes on the socket handed ahead to one runner, at most: well inside a socket pair's buffer
# (about 200 KiB), so a write never blocks the agent while the runner's current task runs (it
# reads only between tasks; if that task filled its stdout meanwhile, agent and runner would
# each wait for the other). The first task ahead may take FIRST_AHEAD_BYTES alone; a bigger
# one waits for the runner to be idle. Frames of SHARED_THRESHOLD bytes or more go through a
# memfd and count only as their descriptor, where memfd works.
AHEAD_BYTES = 64 * 1024
FIRST_AHEAD_BYTES = 128 * 1024
# What each end of a runner's socket pair asks for: macOS gives a socket pair 8 KiB by default,
# where the agent's writes ahead would block (and, with a runner writing a big result at the
# same time, agent and runner would wait on each other for good). What the system grants
# bounds what is handed ahead (``Runner.socket_room``).
SOCKET_BUFFER = 512 * 1024
# Once a runner's message has begun, each further part of it must come within this long: a
# runner stopped halfway must not hold the agent's loop past a few heartbeats (the coordinator
# loses a worker silent for 5 s).
READ_STALL = 2.0


def socket_room(ours: socket.socket, theirs: socket.socket, wanted: int = SOCKET_BUFFER) -> int:
    """Ask for ``wanted`` bytes of buffer on both ends of a socket pair (our sending side, the
    runner's receiving one), and say what was granted: the smaller of the two as the system
    reports it (Linux reports twice what it grants, its own bookkeeping included)."""
    for sock, option in ((ours, socket.SO_SNDBUF), (theirs, socket.SO_RCVBUF)):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, wanted)
        except OSError:
            pass  # over the system's maximum: what it has is what it reports below
    try:
        return min(ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
                   theirs.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
    except OSError:
        return 4 * AHEAD_BYTES  # unknown: the limits as they were


def why_no_runners() -> str | None:
    """Why this machine cannot run tasks, or None where it can. A runner is a child process
    on one end of a Unix socket pair handed over at its start (``pass_fds``), in a process
    group of its own, whose output pipes the agent polls: none of which Windows has."""
    if os.name == "nt":
        return ("this machine cannot be a worker: gpumesh runs tasks on Linux and macOS (its "
                "runner processes need Unix sockets and process groups). On Windows, run "
                "'gpumesh join' inside WSL (Windows Subsystem for Linux); this machine can "
                "still serve a mesh and submit work to it")
    return None


class BadRunnerMessage(ValueError):
    """The runner wrote what is not a message of its protocol, or stopped in the middle of one:
    the stream is out of step and the runner cannot be read any more. (It runs the task's
    code, which can write to the socket as well.)"""


@dataclass
class RunningTask:
    task_id: str
    lease_id: int
    started: float
    deadline: float | None
    header: dict[str, Any] = field(default_factory=dict)
    received: float = 0.0  # when the agent got it


@dataclass
class QueuedTask:
    """A task this worker holds but has not started: its runner header and frames."""

    task: RunningTask
    header: dict[str, Any]
    frames: list[Any]

    @functools.cached_property
    def socket_bytes(self) -> int:
        """About what handing it to a runner writes on the runner's socket, header included
        (a frame of SHARED_THRESHOLD or more goes as a shared file). Counted once: it was
        counted three times a task (room ahead, handed ahead, started), a tenth of an agent."""
        # The header's fixed fields fit HEADER_BYTES; what grows with the task goes on top:
        # its shm refs (up to 4,096) and folder, a script's or source form's name, and the
        # submitter's env (up to 32 KiB). Counted as a flat 512 bytes, 64 tasks with a 5 KiB
        # env each filled the socket and blocked the agent's loop on a write. (Estimated, not
        # packed: _write packs the header, and packing it here too cost 1.1 µs a task.)
        header = self.header
        refs = header.get("shm")
        total = HEADER_BYTES + REF_BYTES * (len(refs) if isinstance(refs, list) else 0) \
            + len(str(header.get("name", ""))) + len(str(header.get("src", ""))) \
            + len(str(header.get("shm_dir", "")))
        env = self.task.header.get("env")
        if isinstance(env, dict):
            total += sum(len(str(k)) + len(str(v)) + 8 for k, v in env.items())
        by_file = memfd_works()
        for frame in self.frames:
            size = serialize.frame_nbytes(frame)
            if size < SHARED_THRESHOLD or not by_file:
                total += size
        return total


# What a stream's bytes belong to: a task, or None (printed outside any task: dropped).
Owner = RunningTask | None


class Runner:
    """One runner child. Not thread-safe: the agent's loop thread owns it.

    ``env`` is the agent's environment for this slot (with its GPU pinning); the runner gets the
    allow-listed part of it plus the variables named in ``pass_env``, the owner's choice.
    """

    def __init__(self, slot: int, env: Mapping[str, str], max_bytes: int,
                 pass_env: Iterable[str] = ()) -> None:
        self.slot = slot
        self._pass_env = list(pass_env)
        self._env = runner_process_environment(env, self._pass_env)
        self._max_bytes = max_bytes
        self.proc: subprocess.Popen[bytes] | None = None
        self.control: socket.socket | None = None
        self.ready = False
        self.task: RunningTask | None = None
        # Handed ahead, in order, with the nonce each was sent with: they start as ``task`` ends.
        self.ahead: deque[tuple[QueuedTask, str]] = deque()
        self.ahead_depth = 1  # how many the agent hands ahead at most (it sets this)
        # Starts in a row that ended before the runner said it was ready (a module in the
        # worker's folder that shadows one it imports), and when the next start is due
        # (time.monotonic) while it waits out its back-off; None when it is not waiting.
        self.failed_starts = 0
        self.start_at: float | None = None
        self.dying: list[subprocess.Popen[bytes]] = []  # killed, not yet exited (kill())
        # The runner's own folder (its scripts' folders, and their process groups named):
        # made as it starts, ended with it (``end_scratch``).
        self.scratch: str | None = None
        self.ahead_bytes = 0  # what the tasks in ``ahead`` put on the socket
        self.socket_room = 4 * AHEAD_BYTES  # set again at start, from what the system granted
        self.read_at = 0.0  # when the agent last read this runner's socket
        # Small messages handed ahead and not yet written: ``flush`` writes them in one call
        # (a write that wakes the runner costs tens of µs here, and a TASK brings many tasks).
        self._unsent: list[bytes] = []
        self.restart_after_task = False  # a task handed ahead was dropped: it must not run on
        # (folder, name start) of the result files of tasks taken from it (shmowners.tagged)
        self.stale: list[tuple[str, str]] = []
        # The last lines it printed, each with the task that printed it: a crash's diagnosis
        # quotes its own task's only (another job's output reached a stranger's error).
        self.tail: deque[tuple[Owner, str]] = deque(maxlen=TAIL_LINES)
        self._partial = {"out": b"", "err": b""}
        self._partial_owner: dict[str, Owner] = {"out": None, "err": None}
        self._reset_streams()

    def _reset_streams(self) -> None:
        self.drained = {"out": False, "err": False}  # the last read left the pipe empty
        self._owner: dict[str, Owner] = {"out": None, "err": None}
        # Per stream, the markers still to come, in order, with the task each one starts.
        self._markers: dict[str, deque[tuple[bytes, Owner]]] = {"out": deque(), "err": deque()}
        self._held = {"out": b"", "err": b""}  # the start of a marker, cut by a read

    def start(self) -> None:
        self._remove_stale()  # the process before (if any) was reaped: it writes no more
        try:
            parent, child = socket.socketpair()
        except OSError as exc:
            self._start_failed(exc)
            return
        self.socket_room = socket_room(parent, child)
        self.end_scratch()  # the process before's, should nothing have ended it yet
        self.scratch = scratch.make(self.slot)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "gpumesh.runner", str(child.fileno()),
                 self.scratch or "", *self._pass_env],
                pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, env=self._env, start_new_session=True,
            )
        except OSError as exc:
            parent.close()
            child.close()
            self.end_scratch()
            self._start_failed(exc)
            return
        child.close()
        for stream in (self.proc.stdout, self.proc.stderr):
            assert stream is not None
            os.set_blocking(stream.fileno(), False)
        self.control = parent
        self._unsent = []
        self.ready = False
        self.task = None
        self.ahead.clear()
        self.ahead_bytes = 0
        self.restart_after_task = False
        self.tail.clear()
        self._partial = {"out": b"", "err": b""}
        self._partial_owner = {"out": None, "err": None}
        self._reset_streams()

    def _start_failed(self, exc: OSError) -> None:
        """No process could be made (out of descriptors, processes or memory, as right after
        the kernel killed the runner before for its memory): tried again a second later, by
        the agent's check of its runners, rather than the agent failing with all it held."""
        log.warning("runner %d could not be started (%s); trying again in %gs",
                    self.slot, exc, START_AGAIN)
        self.proc, self.control, self.ready, self.task = None, None, False, None
        self.start_at = time.monotonic() + START_AGAIN

    @property
    def idle(self) -> bool:
        return self.ready and self.task is None

    @property
    def next(self) -> QueuedTask | None:
        """The task handed ahead that starts next, if any."""
        return self.ahead[0][0] if self.ahead else None

    @property
    def takes_ahead(self) -> bool:
        """Busy, with room ahead: the next task could go now."""
        return (self.ready and self.task is not None and len(self.ahead) < self.ahead_depth
                and not self.restart_after_task)

    @property
    def socket_room(self) -> int:
        """Bytes its socket takes without a writer waiting: what is handed ahead stays within
        a third of it (AHEAD_BYTES at most), the first task ahead within a half
        (FIRST_AHEAD_BYTES at most). Both bounds are worked out here, once a runner."""
        return self._socket_room

    @socket_room.setter
    def socket_room(self, room: int) -> None:
        self._socket_room = room
        self._ahead_room = min(AHEAD_BYTES, room // 3)
        self._first_ahead_room = min(FIRST_AHEAD_BYTES, room // 2)

    def fits_ahead(self, queued: QueuedTask) -> bool:
        """Whether ``queued`` may be handed ahead without filling the socket (``socket_room``)."""
        room = self._ahead_room if self.ahead else self._first_ahead_room
        return self.ahead_bytes + queued.socket_bytes <= room

    def fds(self) -> list[tuple[int, str]]:
        """(file descriptor, what it is) pairs the agent polls."""
        if self.proc is None or self.control is None:
            return []
        pairs = [(self.control.fileno(), "control")]
        assert self.proc.stdout is not None and self.proc.stderr is not None
        if not self.proc.stdout.closed:
            pairs.append((self.proc.stdout.fileno(), "out"))
        if not self.proc.stderr.closed:
            pairs.append((self.proc.stderr.fileno(), "err"))
        return pairs

    def send(self, task: RunningTask, header: dict[str, Any], frames: list[Any]) -> None:
        """Start ``task`` in this idle runner."""
        self._write(task, header, frames)
        self.task = task
        for stream in ("out", "err"):
            if not self._markers[stream]:
                self._owner[stream] = task

    def hand_ahead(self, queued: QueuedTask) -> None:
        """Give this busy runner a task; it starts when those before it end. A small one is
        written with the next ``flush`` (the agent flushes before it waits), with the others
        handed ahead meanwhile: if that write fails, the runner is gone and ``take_back``
        returns the task, as for one it never started."""
        nonce = _nonce()
        self._write(queued.task, {**queued.header, "pre": nonce}, queued.frames, hold=True)
        self.ahead.append((queued, nonce))
        self.ahead_bytes += queued.socket_bytes
        marker = MARKER + nonce.encode() + b"\x00"
        for stream in ("out", "err"):
            self._markers[stream].append((marker, queued.task))

    def _write(self, task: RunningTask, header: dict[str, Any], frames: list[Any], *,
               hold: bool = False) -> None:
        assert self.control is not None
        if "env" in task.header:
            # The submitter's variables (the runner checks them before it runs anything).
            header = {**header, "env": task.header["env"]}
        message = [msgpack.packb(header, use_bin_type=True), *frames]
        if hold:
            small = encode_small(message)
            if small is not None:
                self._unsent.append(small)
                return
        self.flush()  # what was held goes first: the runner reads in order
        send_message(self.control, message)

    def flush(self) -> None:
        """Write the messages ``hand_ahead`` held, in one call. OSError when the runner is
        gone (its death is handled as any other; what was held is dropped with it)."""
        if not self._unsent or self.control is None:
            return
        unsent, self._unsent = self._unsent, []
        self.control.sendall(unsent[0] if len(unsent) == 1 else b"".join(unsent))

    def finished(self) -> QueuedTask | None:
        """The running task wrote its result: the first one handed ahead (now running), if
        any. None as well when those were dropped: then ``restart_after_task`` is set, and the
        agent restarts the runner."""
        following = self.ahead.popleft()[0] if self.ahead else None
        if following is not None:
            self.ahead_bytes = max(self.ahead_bytes - following.socket_bytes, 0)
        self.task = following.task if following is not None else None
        if following is None:
            for stream in ("out", "err"):
                if not self._markers[stream]:
                    self._owner[stream] = None  # printed after its task: nobody's
        return following

    def take_back(self) -> list[QueuedTask]:
        """Before a restart: the tasks handed ahead, which never started (none when they were
        dropped), in order."""
        following = [queued for queued, _ in self.ahead]
        self.ahead.clear()
        self.ahead_bytes = 0
        self._given_up(following)
        return following

    def _given_up(self, tasks: Iterable[QueuedTask]) -> None:
        """Remember how the result files of tasks taken from this runner are named: should it
        have started one after all, what it wrote goes when it starts again (``start``)."""
        for queued in tasks:
            where, start = queued.header.get("shm_dir"), queued.header.get("shm_owner")
            if isinstance(where, str) and isinstance(start, str):
                self.stale.append((where, start))

    def _remove_stale(self) -> None:
        """The files the process just ended wrote for tasks given up: nothing will name them."""
        starts: dict[str, list[str]] = {}
        for where, start in self.stale:
            starts.setdefault(where, []).append(start)
        self.stale = []
        for where, named in starts.items():
            SharedFolder(Path(where), "").remove_starting(named)

    def drop_ahead(self) -> list[QueuedTask]:
        """Give up the tasks handed ahead (one cancelled, handed back by the owner, or moved
        to a free slot), in order. They cannot be taken off the socket: the runner is told to
        skip each (``drop``, which it reads before starting it) and is restarted once the
        current task ends, in case it had started one already; nothing a dropped one prints
        is forwarded."""
        if not self.ahead:
            return []
        dropped = list(self.ahead)
        self.ahead.clear()
        self.ahead_bytes = 0
        self.restart_after_task = True
        self._given_up(queued for queued, _ in dropped)
        if self.control is not None:
            try:
                self.flush()  # a drop must follow the task it drops
                for _, nonce in dropped:
                    send_message(self.control, [msgpack.packb({"drop": nonce})])
            except OSError:
                pass  # the runner is gone: its death is handled as any other
        gone = {id(queued.task) for queued, _ in dropped}
        for stream in ("out", "err"):
            self._markers[stream] = deque(
                (marker, None if owner is not None and id(owner) in gone else owner)
                for marker, owner in self._markers[stream])
        return [queued for queued, _ in dropped]

    def has_message(self) -> bool:
        """Whether the runner has written something on its socket not yet read."""
        assert self.control is not None
        return bool(select.select([self.control], [], [], 0)[0])

    def receive(self) -> tuple[dict[str, Any], list[bytearray | memoryview]]:
        """Read one message from the runner; PipeClosed when it died, BadRunnerMessage when
        what it wrote cannot be read."""
        assert self.control is not None
        try:
            frames = recv_message(self.control, self._max_bytes, stall=READ_STALL)
        except OSError as exc:
            raise PipeClosed(str(exc)) from None
        except ValueError as exc:
            raise BadRunnerMessage(str(exc)) from None
        if not frames:
            raise BadRunnerMessage("a message without frames")
        try:
            header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types on garbage
            raise BadRunnerMessage(f"a header that is not msgpack ({type(exc).__name__})") from None
        if type(header) is not dict:
            raise BadRunnerMessage(f"a header that is a {type(header).__name__}, not a map")
        return header, frames[1:]

    def read_stream(self, stream: str) -> list[tuple[Owner, bytes]] | None:
        """What the runner printed on ``stream`` since the last read, each piece with the task
        that printed it; None when there was nothing to read (or the pipe closed)."""
        assert self.proc is not None
        pipe = self.proc.stdout if stream == "out" else self.proc.stderr
        assert pipe is not None
        if pipe.closed:
            return None  # read to its end already
        try:
            data = os.read(pipe.fileno(), _READ_SIZE)
        except BlockingIOError:
            self.drained[stream] = True
            return None
        except OSError:
            data = b""
        # A short read emptied the pipe: whoever reads to the end need not read again (an
        # empty read costs a system call per stream per task, for nothing).
        self.drained[stream] = len(data) < _READ_SIZE
        if not data:
            pipe.close()
            held, self._held[stream] = self._held[stream], b""
            return [(self._owner[stream], held)] if held else None
        pieces = self._split_at_markers(stream, self._held[stream] + data)
        for owner, chunk in pieces:
            self._add_to_tail(stream, owner, chunk)
        return [(owner, chunk) for owner, chunk in pieces if chunk]

    def _add_to_tail(self, stream: str, owner: Owner, chunk: bytes) -> None:
        if not chunk:
            return
        if owner is not self._partial_owner[stream]:
            if self._partial[stream]:  # another task's unfinished line ends with its task
                self.tail.append((self._partial_owner[stream],
                                  self._partial[stream].decode("utf-8", "replace")))
            self._partial[stream], self._partial_owner[stream] = b"", owner
        lines = (self._partial[stream] + chunk).split(b"\n")
        # Only the tail (a crash's last words) reads it: a task that never ends a line must
        # not make every read copy and split all it printed so far.
        self._partial[stream] = lines.pop()[-PARTIAL_BYTES:]
        self.tail.extend((owner, line.decode("utf-8", "replace")) for line in lines)

    def _split_at_markers(self, stream: str, data: bytes) -> list[tuple[Owner, bytes]]:
        pieces: list[tuple[Owner, bytes]] = []
        self._held[stream] = b""
        markers = self._markers[stream]
        while markers:
            marker, starts = markers[0]
            at = data.find(marker)
            if at < 0:
                # Hold back an end that may be the start of the marker, cut by this read.
                keep = next((n for n in range(min(len(marker) - 1, len(data)), 0, -1)
                             if data.endswith(marker[:n])), 0)
                if keep:
                    self._held[stream], data = data[-keep:], data[:-keep]
                break
            pieces.append((self._owner[stream], data[:at]))
            markers.popleft()
            self._owner[stream] = starts
            data = data[at + len(marker):]
        pieces.append((self._owner[stream], data))
        return pieces

    def kill(self) -> None:
        """Stop the runner and everything it started (its process group). It waits KILL_WAIT
        at most: a killed process that takes longer to go (a CUDA process releasing its GPU can
        take seconds) is let go here, its pipes closed, and reaped later (``reap_dying``), so
        that the agent's loop never stalls past a heartbeat for runners killed together."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        self.end_scratch()
        if self.reap(timeout=KILL_WAIT) is None and self.proc is not None:
            self._close(keep_tail=False)
            if self.proc not in self.dying:
                self.dying.append(self.proc)

    def reap_dying(self, timeout: float = 0.0) -> bool:
        """Collect the killed runners that have exited since (waiting up to ``timeout`` for
        them all); whether none is left."""
        deadline = time.monotonic() + timeout
        for proc in list(self.dying):
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                continue
            self.dying.remove(proc)
        return not self.dying

    def kill_group(self) -> None:
        """SIGKILL to what is left of the runner's process group as soon as the runner itself
        is found dead: its task's children would otherwise live on, holding memory and GPUs
        (and writing into the runner's output pipes). Its number stays taken while any of them
        lives, so it names no other group; called later, once they are all gone, it could."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.end_scratch()

    def end_scratch(self) -> None:
        """Once the runner is killed or gone: its scripts' groups killed and its folder removed
        (worker/scratch.py). A killed script's folder was left behind, one for each timeout or
        cancel, and the script itself, in a group of its own, ran on."""
        if self.scratch is not None:
            scratch.end(self.scratch)
            self.scratch = None

    def reap(self, timeout: float = 5.0) -> int | None:
        """Wait up to ``timeout`` for the runner to exit, then close its pipes and socket: its
        exit status, or None if it is still running (nothing is closed then)."""
        if self.proc is None:
            return None
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self._close(keep_tail=True)
        return code

    def _close(self, keep_tail: bool) -> None:
        """Close the runner's pipes and socket; with ``keep_tail``, what is left in the pipes
        goes to ``tail`` first, up to a bound: a process that escaped its group may still write
        into them, faster than they are read."""
        assert self.proc is not None
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is None or pipe.closed:
                continue
            rest = bytearray()
            for _ in range(REAP_READS if keep_tail else 0):
                try:
                    chunk = os.read(pipe.fileno(), _READ_SIZE)
                except OSError:  # BlockingIOError: nothing more now
                    break
                if not chunk:
                    break
                rest += chunk
            stream = "out" if pipe is self.proc.stdout else "err"
            if rest:
                # Split at start markers as any read is: a task handed ahead that started, and
                # broke its runner before the pipes were read, printed these, not the one before.
                held = self._held[stream] + bytes(rest[-_READ_SIZE:])
                for owner, chunk in self._split_at_markers(stream, held):
                    self._add_to_tail(stream, owner, chunk)
            if self._partial[stream]:  # its last words, though they never ended a line
                self.tail.append((self._partial_owner[stream],
                                  self._partial[stream].decode("utf-8", "replace")))
                self._partial[stream] = b""
            pipe.close()
        if self.control is not None:
            self.control.close()
            self.control = None
        self._unsent = []

    def diagnosis(self, code: int | None, what: str = "", task: Owner = None) -> str:
        """What killed the runner (``what``, or read from its exit ``code``), in words, with
        the last lines ``task`` printed (None: what it printed outside any task, as it
        started)."""
        what = what or _exit_reason(code)
        said = [line for owner, line in self.tail if owner is task]
        said += [part.decode("utf-8", "replace") for stream, part in self._partial.items()
                 if part and self._partial_owner[stream] is task]
        lines = [line for line in said if line.strip()][-5:]
        if lines:
            what += "; last output:\n    " + "\n    ".join(lines)
        return what


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "the runner process stopped responding"
    return f"the runner process {how_it_ended(code)}"


def checked_result(header: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a runner's result that a RESULT carries, checked, and its free text cut
    to the protocol's limits. The runner runs the task's code, so nothing it wrote is taken as
    it is: an exception with a 600 KB message once made a RESULT header the coordinator had to
    refuse (over 1 MiB), and the task ran again and again (also with 300,000 emoji: the limits
    count bytes). Anything unreadable makes the task crashed, with the reason."""
    status = header.get("status")
    if not (type(status) is str and status in _WORKER_STATUSES):
        return _unreadable(f"its status is {_shown(status)}")
    result: dict[str, Any] = {"status": status}
    error = header.get("error")
    if isinstance(error, Mapping):
        result["error"] = {"type": _text(error.get("type"), MAX_ERROR_TYPE) or "Exception",
                           "message": _text(error.get("message"), MAX_ERROR_MESSAGE),
                           "traceback": _text(error.get("traceback"), MAX_TRACEBACK)}
    elif error is not None:
        return _unreadable(f"its error is {_shown(error)}")
    if "diagnosis" in header:
        result["diagnosis"] = _text(header["diagnosis"], MAX_DIAGNOSIS)
    if "encoding" in header:
        encoding = header["encoding"]
        if not (type(encoding) is str and encoding in _ENCODINGS):
            return _unreadable(f"its encoding is {_shown(encoding)}")
        result["encoding"] = encoding
    if "shm" in header:  # checked against the frames where they are read (parse_refs)
        refs = header["shm"]
        if not (type(refs) is list and len(refs) <= MAX_FRAMES):
            return _unreadable(f"its shared frames are {_shown(refs)}")
        result["shm"] = refs
    ran = header.get("ran")
    if type(ran) is float and 0.0 <= ran < float("inf"):  # NaN fails too
        result["ran"] = ran
    return result


_WORKER_STATUSES = frozenset(s.value for s in ResultStatus if s.from_worker)
_ENCODINGS = frozenset(e.value for e in ResultEncoding)


def _text(value: Any, limit: int) -> str:
    """``value`` cut to ``limit`` bytes of UTF-8: the header's limit is in bytes, and a
    character may take four."""
    if type(value) is not str:
        return ""
    if len(value) <= limit // 4:
        return value
    return value.encode("utf-8", "replace")[:limit].decode("utf-8", "ignore")


def _shown(value: Any) -> str:
    return repr(value)[:100]


def _unreadable(why: str) -> dict[str, Any]:
    return {"status": ResultStatus.CRASHED.value,
            "diagnosis": f"the runner reported a result the worker cannot read: {why}"}


_READ_SIZE = 65536
# An unguessable nonce for each task handed ahead: its marker must not be forgeable by the
# task before it.
_nonce = HexIds(16, per_draw=64)

