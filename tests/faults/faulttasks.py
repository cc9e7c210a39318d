"""Task functions for the fault suite. Workers import this module to unpickle them.

Every task writes what it did to a per-task file in a log folder the test owns (``start`` when
it begins, ``end`` when it returns, each with the agent's pid), so a test can count executions
and see which worker ran what, independently of what the mesh reports.
"""

from __future__ import annotations

import os
import time


def _record(log_dir: str, i: int, what: str) -> None:
    # One small O_APPEND write per line: concurrent runners never interleave within a line.
    fd = os.open(os.path.join(log_dir, str(i)), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, f"{what} {os.getppid()} {os.getpid()} {time.time():.6f}\n".encode())
    finally:
        os.close(fd)


def record_square(i: int, log_dir: str, delay: float = 0.0) -> int:
    """Return ``i * i`` after ``delay`` seconds, logging the start and the end."""
    _record(log_dir, i, "start")
    time.sleep(delay)
    _record(log_dir, i, "end")
    return i * i


def record_square_long_first(i: int, log_dir: str, long: float, count: int, delay: float) -> int:
    """Like ``record_square``; the first ``count`` tasks of a job take ``long`` seconds."""
    return record_square(i, log_dir, long if i < count else delay)


def die(i: int, how: str) -> int:
    """A task that kills its runner (or itself) in one of the ways user code does."""
    if how == "exit":
        os._exit(1)
    if how == "segv":
        import ctypes

        ctypes.string_at(0)
    if how == "oom":
        import resource

        # Cap this runner's address space a little above what it uses now, then ask for more:
        # what a task that runs out of memory under a limit sees.
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/statm") as statm:
            used = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (used + 64 * 2**20, hard))
        try:
            hog = bytearray(1024 * 2**20)
            return len(hog)
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    if how == "oom-kill":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer does
    if how == "hang":
        time.sleep(3600)
    return i * i
