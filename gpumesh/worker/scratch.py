"""Each runner's own folder: where its scripts run, and where their process groups are named.

A script runs in a process group of its own (its leftovers end with it: runner/execute.py), so
killing the runner's group (a cancel, a timeout, a runner that broke) no longer reaches it. The
runner names each running script's group here (``group-PID``); the agent that kills the runner
ends those groups and removes the folder (``end``). A script killed in the instant before its
group was named is found by its working directory, which is in this folder (Linux). Folders of
agents that were killed themselves (``kill -9``) are swept when a later agent starts
(``sweep``).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

from ..processes import is_alive
from ..runner.execute import GROUP_FILE, SCRIPT_FOLDER

log = logging.getLogger("gpumesh.worker")
PREFIX = "gpumesh-runner-"
STALE_AFTER = 600.0  # seconds a dead agent's folder is left first (a namespace's pid may lie)


def make(slot: int) -> str | None:
    """A new folder for the runner of ``slot`` (named after this agent's pid, for ``sweep``);
    None where none can be made (a full or read-only temporary folder): function tasks need
    none, and a script then makes its own folder where it can."""
    try:
        return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-{slot}-")
    except OSError as exc:
        log.warning("runner %d has no folder of its own (%s): its scripts' folders and what "
                    "they leave running are not removed if it is killed", slot, exc)
        return None


def end(folder: str) -> None:
    """Once its runner is killed or gone: SIGKILL to each script group named in ``folder``,
    then, off the agent's loop (a script's folder may hold a clone or a dataset: seconds to
    delete), to what still runs there, and the folder removed."""
    try:
        names = os.listdir(folder)
    except OSError:
        names = []
    for name in names:
        number = name[len(GROUP_FILE):]
        if name.startswith(GROUP_FILE) and number.isdigit() and int(number) > 1:
            _kill_group(int(number))
    if not any(name.startswith(SCRIPT_FOLDER) for name in names):
        shutil.rmtree(folder, ignore_errors=True)  # no script's folder in it: nothing to wait on
        return
    thread = threading.Thread(target=_finish, args=(folder, True), name="gpumesh-scratch",
                              daemon=True)
    thread.start()
    _removing[:] = [*(t for t in _removing if t.is_alive()), thread]


_removing: list[threading.Thread] = []  # folders still being removed (end), for ``wait``


def wait(timeout: float) -> None:
    """Let the folders being removed go, up to ``timeout`` seconds, before the agent exits: a
    daemon thread dies with the process, its folder left half removed."""
    deadline = time.monotonic() + timeout
    for thread in list(_removing):
        thread.join(max(deadline - time.monotonic(), 0.0))
    _removing[:] = [thread for thread in _removing if thread.is_alive()]


def _finish(folder: str, scripts: bool) -> None:
    if scripts:
        _kill_working_in(folder)
    shutil.rmtree(folder, ignore_errors=True)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OverflowError):
        pass


def _kill_working_in(folder: str) -> None:
    """SIGKILL to the group of each process whose working directory is in ``folder`` (Linux):
    a script whose group the runner had not named yet when it was killed."""
    try:
        pids = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return  # no /proc (macOS): the groups named are all that is known
    inside = os.path.realpath(folder) + os.sep
    for pid in pids:
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            if (cwd + os.sep).startswith(inside):
                _kill_group(os.getpgid(int(pid)))
        except OSError:  # gone, or another user's
            continue


def sweep(now: float | None = None) -> None:
    """Remove, in the background, the folders of agents that are gone (killed: nothing ended
    their runners' folders), once they have been left STALE_AFTER seconds."""
    threading.Thread(target=_sweep, args=(time.time() if now is None else now,),
                     name="gpumesh-scratch-sweep", daemon=True).start()


def _sweep(now: float) -> None:
    base = Path(tempfile.gettempdir())
    try:
        entries = [entry for entry in base.iterdir() if entry.name.startswith(PREFIX)]
    except OSError:
        return
    for entry in entries:
        owner = entry.name[len(PREFIX):].split("-", 1)[0]
        try:
            stale = now - entry.stat().st_mtime > STALE_AFTER
        except OSError:
            continue
        # Its groups are not killed: its runners killed them as they saw their agent gone,
        # and a number named minutes ago may be another process's now.
        if owner.isdigit() and int(owner) != os.getpid() and not is_alive(int(owner)) and stale:
            shutil.rmtree(entry, ignore_errors=True)
