"""Processes the benchmark starts: each in its own process group, all killed on the way out
(normal exit, an exception, Ctrl+C or SIGTERM), and their CPU time read from the kernel."""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

REPO_ROOT = Path(__file__).resolve().parent.parent
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_started: list[subprocess.Popen[bytes]] = []


def spawn(args: Sequence[str], *, env: Mapping[str, str] | None = None,
          log: IO[Any] | None = None, cwd: Path = REPO_ROOT,
          pass_fds: Sequence[int] = (), stdout_pipe: bool = False) -> subprocess.Popen[bytes]:
    """Start ``args`` in a new session (its own process group), remembered for ``kill_all``.
    Output goes to ``log`` (or nowhere); ``stdout_pipe`` keeps stdout readable instead."""
    stdout: Any = subprocess.PIPE if stdout_pipe else (log or subprocess.DEVNULL)
    proc = subprocess.Popen(list(args), env=dict(env) if env is not None else None, cwd=cwd,
                            stdin=subprocess.DEVNULL, stdout=stdout,
                            stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
                            start_new_session=True, pass_fds=tuple(pass_fds))
    _started.append(proc)
    return proc


def python_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment, with the repository importable (children run ``bench.tasks``)."""
    env = dict(os.environ)
    paths = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra or {})
    return env


def stop_group(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """SIGINT the process group (a clean shutdown), then SIGKILL what is left of it."""
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    # The leader may be gone while children it started linger in the group.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_all() -> None:
    while _started:
        stop_group(_started.pop(), grace=0.5)


def install_teardown() -> None:
    """Kill every started process group at exit; SIGTERM and SIGHUP exit like Ctrl+C does."""
    atexit.register(kill_all)

    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_for(condition: Any, timeout: float, what: str, every: float = 0.02) -> None:
    """Poll ``condition()`` until it is true; TimeoutError naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:g}s")
        time.sleep(every)


# ----------------------------------------------------------------- CPU and memory of processes

def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (its threads included), None once it is gone.

    On Linux from the process's CPU clock, to the nanosecond: the kernel's tick counts (psutil,
    /proc/PID/stat) come in 10 ms steps, 33 µs a call over the bench's 300 single calls."""
    if sys.platform.startswith("linux"):
        try:
            return time.clock_gettime(_process_cpu_clock(pid))
        except OSError:
            pass  # gone (EINVAL), or not ours to read: psutil and /proc tell which
    try:
        import psutil
    except ImportError:
        return _proc_stat_cpu(pid)
    try:
        times = psutil.Process(pid).cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return float(times.user + times.system)


def _process_cpu_clock(pid: int) -> int:
    """clock_getcpuclockid(3) of another process: the kernel's MAKE_PROCESS_CPUCLOCK(pid,
    CPUCLOCK_SCHED), which Python's time module has no call for."""
    return ((~pid) << 3) | 2


def _proc_stat_cpu(pid: int) -> float | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime (fields 14, 15)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc (works without psutil)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def python_exe() -> str:
    return sys.executable
