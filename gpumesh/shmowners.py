"""Who wrote a shared frame, and whether they are still there.

A frame a client wrote for a SUBMIT the coordinator never accepted (the client was killed
first), or a result whose worker died before sending it, is named by nothing the coordinator
keeps. Age alone cannot tell such a file from one whose SUBMIT is on its way or parked (a
client over its quota sends it again later, minutes on), so until 2026-12-06 these files stayed
in the folder, taking the machine's memory, until the coordinator restarted.

Now every process that writes frames into a folder holds an exclusive ``flock`` on a file of its
own there, ``owner-`` and 16 hex characters, for as long as it lives, and begins the name of
each frame it writes with the same 16 characters ("1" and 15 random ones follow: still the 32
hex characters of protocol.refs.NAME_PATTERN, so older peers read the names as before). The lock
goes with the process however it ends, ``kill -9`` included, so the coordinator can ask of any
frame nothing refers to whether its producer is still there (``alive``): if not, nobody will
ever send a message naming it (sharedmem.SharedFolder.sweep).

A runner writes its results under its worker agent's prefix (the agent says which in each task):
the agent keeps a result until the coordinator acknowledges it, also while the coordinator is
away, and outlives its runners. After the prefix comes a tag the agent gave the task, so that the
agent can remove what a runner wrote for a task it stopped (cancelled, timed out, or whose
runner died) before the runner could say so. A forked child starts without its parent's owner:
its frames are its own.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no shared folder at all (sharedmem.SharedFolder.create)
    fcntl = None  # type: ignore[assignment]

from .shmpool import holds

OWNER = "owner-"
NAME_CHARS = 32  # a frame's name (protocol.refs.NAME_PATTERN)
PREFIX_CHARS = 16
TAG_CHARS = 8
# What a SharedFolder's ``owner`` may say besides a prefix: its process's own, or nobody's.
OWN_PREFIX = "own"
ANONYMOUS = "anonymous"
_HEX = frozenset("0123456789abcdef")


def is_prefix(value: object) -> bool:
    """Whether ``value`` can begin a frame's name as an owner's prefix."""
    return isinstance(value, str) and len(value) == PREFIX_CHARS and set(value) <= _HEX


def is_name_start(value: object) -> bool:
    """Whether ``value`` can begin a frame's name: an owner's prefix, and a task's tag after
    it or not (``tagged``)."""
    return (isinstance(value, str) and len(value) in (PREFIX_CHARS, PREFIX_CHARS + TAG_CHARS)
            and set(value) <= _HEX)


def tagged(prefix: str, number: int) -> str:
    """How a runner's results for one task begin: the agent's prefix and a tag the agent gave
    the task (a count of its own: lease ids start again with each coordinator run), so it can
    remove what a runner wrote for a task it stopped before the runner could say so
    (SharedFolder.remove_starting). A tag begins with "0", a name of the owner's own with "1"
    after the prefix (frame_name): the two never meet."""
    return f"{prefix}0{number & 0xFFFFFFF:07x}"


def is_owner_file(name: str) -> bool:
    """An owner's lock file, or one being made (``.owner-...``: renamed once locked)."""
    return name.startswith(OWNER) or name.startswith("." + OWNER)


def frame_name(start: str | None) -> str:
    """A new frame's name: how it begins (is_name_start) and random characters, or all random
    without a start."""
    if start is None:
        return secrets.token_hex(NAME_CHARS // 2)
    rest = secrets.token_hex((NAME_CHARS - len(start)) // 2)
    return start + ("1" + rest[1:] if len(start) == PREFIX_CHARS else rest)


class _Owner:
    __slots__ = ("fd", "path", "prefix")

    def __init__(self, fd: int, path: Path, prefix: str) -> None:
        self.fd = fd
        self.path = path
        self.prefix = prefix

    def still_named(self) -> bool:
        """Whether the lock file is still in the folder: a coordinator that stops with no frame
        left removes the folder, and one started later in its place knows nothing of it."""
        try:
            named = os.stat(self.path, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError:
            return True  # cannot tell now (out of memory, say): its lock must not go for that
        try:
            held = os.fstat(self.fd)
        except OSError:
            return False  # the descriptor itself is gone: nothing holds the lock
        return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)  # never LOCK_UN: a forked copy of the descriptor shares the lock


_OWNERS: dict[str, _Owner] = {}
_LOCK = threading.Lock()


def prefix_in(folder: Path) -> str | None:
    """This process's prefix in ``folder``, its lock file made (or made again) first; None where
    it cannot be made (no ``flock``, out of descriptors): frames are then named at random, and
    the coordinator keeps them until it restarts, as before owners."""
    if fcntl is None:
        return None
    key = str(folder)
    with _LOCK:
        owner = _OWNERS.get(key)
        if owner is not None and owner.still_named():
            return owner.prefix
        if owner is not None:
            owner.close()
            del _OWNERS[key]
        for other_key, other in list(_OWNERS.items()):  # folders since removed: let go
            if not other.still_named():
                other.close()
                del _OWNERS[other_key]
        owner = _make(folder)
        if owner is None:
            return None
        _OWNERS[key] = owner
        return owner.prefix


def _make(folder: Path) -> _Owner | None:
    """A lock file made under a passing name, locked, then renamed: whoever sees the final name
    sees it locked."""
    prefix = secrets.token_hex(PREFIX_CHARS // 2)
    making = folder / f".{OWNER}{prefix}"
    final = folder / f"{OWNER}{prefix}"
    try:
        fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(making, final)
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(making)
        return None
    return _Owner(fd, final, prefix)


def alive(folder: Path, prefix: str) -> bool | None:
    """Whether the producer of frames named with ``prefix`` is still there: True while some
    process holds its lock file (or it cannot be asked now: out of descriptors), False once
    nobody does, None when there is no such file (a frame of an older gpumesh, or of an owner
    whose file went with an earlier folder)."""
    if fcntl is None or not is_prefix(prefix):
        return None
    path = folder / f"{OWNER}{prefix}"
    held = holds(path)
    if held is None:  # not opened: gone, or this process is short of descriptors now
        return True if os.path.lexists(path) else None
    return held


def _after_fork_in_child() -> None:
    """The child's frames are its own: it makes an owner at its first write. Its copies of the
    parent's descriptors are closed without unlocking (the lock is the parent's too), and the
    module lock made anew (another thread may have held it at the fork)."""
    global _LOCK
    _LOCK = threading.Lock()
    for owner in _OWNERS.values():
        owner.close()
    _OWNERS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
