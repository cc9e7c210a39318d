"""Other processes: whether one is alive, how one ended, and ending a helper with the process
that started it.

``serve --public`` starts ngrok (through pyngrok). A coordinator that exits normally stops it;
one killed with ``kill -9`` (or the OOM killer) left it running: a public tunnel pointing at a
port nobody may be serving any more, and, on a free ngrok account, the one agent session the
account gets, so the next ``serve --public`` failed until the user found and killed it.
``end_with_this_process(pid)`` starts a small watcher (``python -m gpumesh.processes``) in a
session of its own: when this process is gone, however it went, the watcher ends ``pid`` and
exits; it exits on its own as soon as ``pid`` has ended.

Nothing of gpumesh is imported here: any layer may use it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL = 0.5  # seconds between the watcher's checks
TERM_WAIT = 3.0  # seconds a helper has to exit after SIGTERM before it gets SIGKILL


def is_alive(pid: int) -> bool:
    if os.name == "nt":
        # Not os.kill(pid, 0): signal 0 is CTRL_C_EVENT there, which Python turns into a
        # GenerateConsoleCtrlEvent that interrupts every process on the console.
        return _alive_on_windows(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # on Linux, an exited child its parent has not reaped yet is a zombie: gone for us
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _alive_on_windows(pid: int) -> bool:
    import ctypes
    from ctypes import wintypes

    query_limited_information, still_active, access_denied = 0x1000, 259, 5
    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
    handle = kernel32.OpenProcess(query_limited_information, False, pid)
    if not handle:
        return bool(ctypes.get_last_error() == access_denied)  # type: ignore[attr-defined]
    try:
        code = wintypes.DWORD()
        if not kernel32.GetExitCodeProcess(handle, ctypes.byref(code)):
            return True
        return code.value == still_active
    finally:
        kernel32.CloseHandle(handle)


def how_it_ended(code: int) -> str:
    """A process's end as a user reads it: "exited with code 3", or, for a negative return
    code, the signal that killed it and its usual cause ("was killed by SIGKILL (out of
    memory, or killed by the system)"), not "exited with code -9"."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    what = f"was killed by {name}"
    if -code == getattr(signal, "SIGKILL", 9):
        what += " (out of memory, or killed by the system)"
    elif -code == signal.SIGSEGV:
        what += " (a segmentation fault in native code)"
    return what


def started_at(pid: int) -> str | None:
    """When ``pid`` started, as the kernel counts it (Linux), so that a number the system gave
    to a new process after ours ended is not taken for ours; None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def end_with_this_process(pid: int) -> subprocess.Popen[bytes] | None:
    """Start the watcher that ends ``pid`` once this process is gone. None where it cannot run
    (Windows, where a process's parent is not replaced when it dies, or no process could be
    made): the helper then ends only with a normal exit, as before."""
    if os.name == "nt":
        return None
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "gpumesh.processes", str(os.getpid()), str(pid),
             started_at(pid) or "-"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            # Its own session: a Ctrl+C or a signal to this process's group leaves it running
            # to do its job.
            start_new_session=True,
        )
    except OSError:
        return None


def stop_watching(watcher: subprocess.Popen[bytes] | None) -> None:
    """The helper was ended the usual way: its watcher goes too."""
    if watcher is None or watcher.poll() is not None:
        return
    watcher.terminate()
    try:
        watcher.wait(TERM_WAIT)
    except subprocess.TimeoutExpired:
        watcher.kill()
        watcher.wait()


def watch(parent: int, pid: int, start: str | None) -> int:
    """Until ``pid`` ends (0) or ``parent`` does, then end ``pid`` (1)."""
    while True:
        if not is_alive(pid) or (start is not None and started_at(pid) != start):
            return 0
        if os.getppid() != parent:  # it died, and this process went to another parent
            break
        time.sleep(POLL)
    if start is not None and started_at(pid) != start:
        return 0  # it ended meanwhile, and its number went to another process
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        return 0
    deadline = time.monotonic() + TERM_WAIT
    while is_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if is_alive(pid) and (start is None or started_at(pid) == start):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return 1


def main(argv: list[str]) -> int:
    """``python -m gpumesh.processes PARENT PID START``: what ``end_with_this_process``
    starts."""
    if len(argv) != 3 or not argv[0].isdigit() or not argv[1].isdigit():
        print("usage: python -m gpumesh.processes PARENT_PID PID START|-", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl+C is not for it
    return watch(int(argv[0]), int(argv[1]), None if argv[2] == "-" else argv[2])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
