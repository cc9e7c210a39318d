"""Runner child processes as the agent sees them: start, feed, read, watch, kill, diagnose.

Each slot has one long-lived runner (``python -m gpumesh.runner``) connected by a socket pair.
Its stdout and stderr are pipes the agent reads, to stream what tasks print and to keep the last
lines for a diagnosis when the runner dies. A runner starts with the environment tasks may see
(gpumesh/runner/environment.py), not the agent's: the worker's credentials stay out of it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ..runner.environment import runner_process_environment
from ..runner.pipe import PipeClosed, recv_message, send_message

TAIL_LINES = 20


@dataclass
class RunningTask:
    task_id: str
    lease_id: int
    started: float
    deadline: float | None
    header: dict[str, Any] = field(default_factory=dict)


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
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._partial = {"out": b"", "err": b""}

    def start(self) -> None:
        parent, child = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "gpumesh.runner", str(child.fileno()), *self._pass_env],
            pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=self._env, start_new_session=True,
        )
        child.close()
        for stream in (self.proc.stdout, self.proc.stderr):
            assert stream is not None
            os.set_blocking(stream.fileno(), False)
        self.control = parent
        self.ready = False
        self.task = None
        self.tail.clear()

    @property
    def idle(self) -> bool:
        return self.ready and self.task is None

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
        assert self.control is not None
        self.task = task
        if "env" in task.header:
            # The submitter's variables (the runner checks them before it runs anything).
            header = {**header, "env": task.header["env"]}
        send_message(self.control, [msgpack.packb(header, use_bin_type=True), *frames])

    def receive(self) -> tuple[dict[str, Any], list[bytearray | memoryview]]:
        """Read one message from the runner; PipeClosed when it died."""
        assert self.control is not None
        try:
            frames = recv_message(self.control, self._max_bytes)
        except (OSError, ValueError) as exc:
            raise PipeClosed(str(exc)) from None
        return msgpack.unpackb(frames[0], raw=False, strict_map_key=False), frames[1:]

    def read_stream(self, stream: str) -> list[bytes]:
        """Whatever the runner printed on ``stream`` since the last read, as whole chunks."""
        assert self.proc is not None
        pipe = self.proc.stdout if stream == "out" else self.proc.stderr
        assert pipe is not None
        try:
            data = os.read(pipe.fileno(), 65536)
        except BlockingIOError:
            return []
        except OSError:
            data = b""
        if not data:
            pipe.close()
            return []
        text = self._partial[stream] + data
        lines = text.split(b"\n")
        self._partial[stream] = lines.pop()
        self.tail.extend(line.decode("utf-8", "replace") for line in lines)
        return [data]

    def kill(self) -> None:
        """Stop the runner and everything it started (its process group)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        self.reap()

    def reap(self) -> int | None:
        if self.proc is None:
            return None
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None and not pipe.closed:
                try:
                    rest = pipe.read() or b""
                except (OSError, ValueError):
                    rest = b""
                self.tail.extend(rest.decode("utf-8", "replace").splitlines())
                pipe.close()
        if self.control is not None:
            self.control.close()
            self.control = None
        return code

    def diagnosis(self, code: int | None) -> str:
        """What killed the runner, in words, with the last lines it printed."""
        if code is None:
            what = "the runner process stopped responding"
        elif code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            what = f"the runner process was killed by {name}"
            if -code == signal.SIGKILL:
                what += " (out of memory, or killed by the system)"
            elif -code == signal.SIGSEGV:
                what += " (a segmentation fault in native code)"
        else:
            what = f"the runner process exited with code {code}"
        lines = [line for line in self.tail if line.strip()][-5:]
        if lines:
            what += "; last output:\n    " + "\n    ".join(lines)
        return what
