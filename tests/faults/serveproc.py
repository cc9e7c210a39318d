"""A coordinator as its own process for the fault suite: started, killed -9, started again on the
same port and journal, with its output kept in a log file the failure messages quote, and its
memory sampled while something hostile happens."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import psutil


class _Heartbeating(Protocol):
    def heartbeat(self) -> None: ...


class Coordinator:
    """``python -m gpumesh serve`` on 127.0.0.1 with its output in a log file: started, killed
    with SIGKILL, and started again on the same port and journal."""

    def __init__(self, home: Path, db: Path, env: dict[str, str]) -> None:
        self.home, self.db, self.env = home, db, env
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = home / "coordinator.log"
        self.starts = 0

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def rss(self) -> int:
        return psutil.Process(self.pid).memory_info().rss

    def start(self, wait: float = 30.0) -> None:
        self.starts += 1
        read_fd, write_fd = os.pipe()
        with open(self.log, "ab") as log:
            log.write(f"\n===== start {self.starts} =====\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "gpumesh", "serve", "--host", "127.0.0.1",
                     "--port", str(self.port), "--no-self-worker", "--no-save",
                     "--db", str(self.db), "--ready-fd", str(write_fd), "--exit-with-parent"],
                    env=self.env, pass_fds=[write_fd], stdin=subprocess.DEVNULL, stdout=log,
                    stderr=log, start_new_session=True)
            finally:
                os.close(write_fd)
        try:
            self.port = int(self._ready_line(read_fd, wait))
        except BaseException:
            self.kill()
            raise
        finally:
            os.close(read_fd)

    def _ready_line(self, read_fd: int, wait: float) -> bytes:
        """The port the child writes to its ready pipe, or an error quoting its log."""
        assert self.proc is not None
        line = b""
        deadline = time.time() + wait
        while not line.endswith(b"\n"):
            if time.time() > deadline:
                raise AssertionError(f"the coordinator did not start:\n{self.log_tail()}")
            ready, _, _ = select.select([read_fd], [], [], 0.2)
            if ready:
                chunk = os.read(read_fd, 64)
                if not chunk:
                    raise AssertionError(
                        f"the coordinator exited at start (code {self.proc.wait(5)}) on the "
                        f"journal of the last run:\n{self.log_tail()}")
                line += chunk
        return line

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)

    def log_tail(self, lines: int = 40, width: int = 300) -> str:
        """The log's last lines, each cut short: peers' values end up in exception messages."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(line if len(line) <= width else line[:width] + " [...]"
                         for line in text.splitlines()[-lines:])

    def dead_message(self, when: str) -> str:
        code = self.proc.poll() if self.proc is not None else None
        return f"the coordinator died {when} (exit code {code}); its log ends:\n{self.log_tail()}"


def survives(coordinator: Coordinator, seconds: float, peers: Sequence[_Heartbeating] = (),
             when: str = "") -> None:
    """Keep ``peers`` alive with heartbeats for ``seconds`` while the coordinator runs its timers
    (liveness, the unschedulable check, restore grace); fail as soon as it dies."""
    assert coordinator.proc is not None
    end = time.time() + seconds
    while (left := end - time.time()) > 0:
        for peer in peers:
            peer.heartbeat()
        try:
            coordinator.proc.wait(timeout=min(left, 0.1))
        except subprocess.TimeoutExpired:
            continue
        raise AssertionError(coordinator.dead_message(when))


class PeakRss:
    """Samples a process's resident memory in a thread until ``stop()``; keeps the peak."""

    def __init__(self, pid: int, every: float = 0.02) -> None:
        self._proc = psutil.Process(pid)
        self._every = every
        self._done = threading.Event()
        self.start_rss = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self._every):
            try:
                self.peak = max(self.peak, self._proc.memory_info().rss)
            except psutil.Error:
                return

    def stop(self) -> int:
        self._done.set()
        self._thread.join(5)
        return self.peak
