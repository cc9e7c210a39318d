"""The worker id: stable for one machine and home folder, unique for every running agent.

A restarted ``gpumesh join`` comes back under the id it had, so the coordinator knows it is the
same worker (its old leases are released at once, not after their lease time, and the worker
list does not grow a ghost per restart). Two agents on one machine get two ids. A home folder
copied to another machine, or restored from a backup into another folder, must not give two
workers one id (exo#748: two nodes with one id split a cluster silently): the id is stored with
a fingerprint of the machine and of the folder itself, and a mismatch makes a new one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import socket
from pathlib import Path
from typing import IO, Any

from ..fileio import replace_private

log = logging.getLogger("gpumesh.worker")

FOLDER = "workers"
MAX_AGENTS = 64  # agents of one home folder running at once before ids stop being kept
_ID = re.compile(r"[0-9a-f]{12}")
_MACHINE_ID_FILES = ("/etc/machine-id", "/var/lib/dbus/machine-id")


def machine_fingerprint(home: Path) -> str:
    """This machine and this folder: the OS's machine id (or the MAC), the host name, and the
    folder's inode (a copy, even on the same machine, is another folder; the device number is
    left out: on NFS, overlay or btrfs it can change at every boot)."""
    machine = ""
    for path in _MACHINE_ID_FILES:
        try:
            machine = Path(path).read_text().strip()
        except OSError:
            continue
        if machine:
            break
    if not machine:
        import uuid

        machine = f"mac:{uuid.getnode():012x}"
    folder = os.stat(home)
    material = f"{machine}\n{socket.gethostname()}\n{folder.st_ino}"
    return hashlib.sha256(material.encode()).hexdigest()[:32]


class WorkerIdentity:
    """The id this agent runs under; ``release()`` (or process exit) frees it for a restart."""

    def __init__(self, worker_id: str, lock: IO[Any] | None, copied: bool = False) -> None:
        self.worker_id = worker_id
        self._lock = lock
        self.copied = copied  # the folder came from elsewhere: the id is new for that reason

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file drops its lock
            self._lock = None


def claim(home: Path) -> WorkerIdentity:
    """The first of this folder's worker ids no running agent holds, made when missing, and
    made anew when the folder was copied from another machine or place."""
    try:
        import fcntl
    except ImportError:  # Windows: no flock; an id per start is the safe choice there
        return WorkerIdentity(secrets.token_hex(6), None)
    folder = home / FOLDER
    folder.mkdir(mode=0o700, exist_ok=True)
    fingerprint = machine_fingerprint(home)
    for index in range(MAX_AGENTS):
        lock = open(folder / f"{index}.lock", "a+")  # noqa: SIM115 - held while the agent runs
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue  # another agent of this folder runs under this one
        path = folder / f"{index}.json"
        known = _read(path)
        if known is not None and known.get("machine") == fingerprint:
            return WorkerIdentity(str(known["id"]), lock)
        worker_id = secrets.token_hex(6)
        replace_private(path, json.dumps({"id": worker_id, "machine": fingerprint}).encode())
        return WorkerIdentity(worker_id, lock, copied=known is not None)
    log.warning("%d agents already run from %s: this one gets a passing worker id",
                MAX_AGENTS, home)
    return WorkerIdentity(secrets.token_hex(6), None)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not _ID.fullmatch(str(data.get("id", ""))):
        return None
    return data

