"""A producer's big shared-memory files, kept mapped and written again once nobody needs them.

Putting 64 MiB into a new tmpfs file costs the test machine about 35 ms: 16-20 for the kernel
to find and clear the pages, 17 for ``write`` to walk them one by one; and whoever removes the
file pays 8 more to free them. Copying the same bytes into a mapping of a file whose pages exist
and are already mapped costs 7, as much as any memory copy there. So a producer of big frames
(a client's arguments, a runner's results) keeps each file it wrote, maps it while it waits for
its task, and writes a later frame of the same size into it once two things hold:

- the coordinator is done with it. Where it used to remove a frame's file after its last
  journal write, it now *retires* it: renames it ``RETIRED + name``, a name no reference can
  give (sharedmem.SharedFolder.retire_soon). The producer claims it back by renaming it to the
  new frame's name: the rename is atomic, so one file never gets two new names;
- nobody maps it. Every consumer holds a shared ``flock`` on a file while it maps it (the lock
  lives on with the mapping's own descriptor: sharedmem.SharedFolder.open) or reads it (a frame
  under 1 MiB: the lock goes once it has its copy), and the producer
  holds one too while it keeps the file. The producer writes only while it holds the exclusive
  lock, which it gets only when it is the file's one holder.

The coordinator tells a kept file from a forgotten one by the same lock: a file nobody holds is
removed at once, so a producer that never reuses its files (another version, a pool that is
full) leaves no retired file behind. A retired file nobody claims goes after a while
(sharedmem.RETIRE_SECONDS), and a producer lets go of a kept file within CHECK_SECONDS of its
last name going: a kept file costs memory only while its name is retired, since the
coordinator would hold a live name anyway.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no shared folder at all (sharedmem.SharedFolder.create)
    fcntl = None  # type: ignore[assignment]

# The prefix of a file the coordinator no longer needs, for its producer to claim back.
RETIRED = "retired-"
# Files in the folder are opened for reading without blocking: a FIFO under a frame's name (this
# user can make one) would otherwise hold the opener, the coordinator's loop among them, for
# good. Their type is checked next; a regular file reads as usual.
NONBLOCK = getattr(os, "O_NONBLOCK", 0)
# A producer keeps at most this many files, and this many bytes of them (Pool._make_room says
# which go to make room); it looks this often for kept files that lost their last name, and lets
# go of any it has not written for KEEP_IDLE_SECONDS whatever its name.
KEEP_MAX_FILES = 4
KEEP_MAX_BYTES = 1024 * 1024 * 1024
CHECK_SECONDS = 2.0
KEEP_IDLE_SECONDS = 600.0
# A file is kept only while its file system has this many times its size free: Docker gives
# /dev/shm 64 MiB, and kept files must not crowd out the frames of other processes.
KEEP_FREE_FACTOR = 4
# Frames are retired about in the order they were written. When the oldest kept file of a size,
# written less than this long ago, is not retired yet, a write does not look at the younger
# ones (two system calls each, on every frame of a .map with many in flight); one written longer
# ago may be held by a long task, and is passed over.
IN_ORDER_SECONDS = 1.0
# A kept file of a frame's own size makes room for the frame's file only once it has not been
# written for this long (Pool._make_room).
STALE_SECONDS = 10.0


class _Kept:
    """One kept file: its descriptor (holding this process's lock), its current name, and its
    shared writable mapping once made (ahead of its reuse, or at it)."""

    __slots__ = ("fd", "name", "size", "used", "view")

    def __init__(self, fd: int, name: str, size: int, used: float) -> None:
        self.fd = fd
        self.name = name
        self.size = size
        self.used = used
        self.view: mmap.mmap | None = None  # mapped by the pool's thread, or at first reuse

    def close(self) -> None:
        if self.view is not None:
            with contextlib.suppress(BufferError):
                self.view.close()
            self.view = None
        with contextlib.suppress(OSError):
            os.close(self.fd)  # and with it this process's lock


class Pool:
    """The files one process wrote in one folder and may write again; thread-safe (a client
    writes from its engine thread; the pool's own thread maps kept files ahead and lets go of
    those nobody can claim)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._folder = str(folder)  # for the names looked at on every write
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._kept: list[_Kept] = []
        self._unmapped: list[_Kept] = []  # kept, for the thread to map before their reuse
        self._closed = fcntl is None
        self._thread: threading.Thread | None = None
        _LIVE.add(self)

    def refill(self, pieces: Sequence[memoryview], name: str) -> bool:
        """Write ``pieces`` (one frame's bytes, in order) into a kept file of their size that
        nobody needs any more, named ``name`` from now on; False when there is none (the caller
        writes a new file)."""
        size = sum(piece.nbytes for piece in pieces)
        with self._lock:
            if self._closed:
                return False
            now = time.monotonic()
            for kept in sorted((k for k in self._kept if k.size == size), key=lambda k: k.used):
                done = self._refill(kept, pieces, name)
                if done:
                    kept.used = now
                    return True
                if done is None and now - kept.used < IN_ORDER_SECONDS:
                    break  # the younger ones are not retired either, most likely
        return False

    def _refill(self, kept: _Kept, pieces: Sequence[memoryview], name: str) -> bool | None:
        """True once written into; None where the coordinator has not retired it yet; False
        where it cannot be written now for another reason (someone maps it, it went)."""
        retired = f"{self._folder}/{RETIRED}{kept.name}"
        try:
            os.stat(retired, follow_symlinks=False)
        except OSError:  # the coordinator still needs it (no exclusive lock on it), or it went
            return False if self._forget_if_gone(kept) else None
        try:
            fcntl.flock(kept.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # someone maps it still; a failed upgrade dropped our shared lock
            self._lock_shared(kept)
            return False
        try:
            os.rename(retired, self.folder / name)  # the claim: atomic, one name wins
        except OSError:  # removed since
            self._lock_shared(kept)
            self._forget_if_gone(kept)
            return False
        try:
            if kept.view is None:  # not mapped ahead yet (gpumesh-shm-pool does, in the wait)
                kept.view = _map(kept.fd, kept.size)
            at = 0
            for piece in pieces:
                kept.view[at:at + piece.nbytes] = piece
                at += piece.nbytes
            if _UTIME_FD:
                os.utime(kept.fd)  # a fresh frame to the orphan sweep, which goes by its age
            else:
                os.utime(self.folder / name)
        except (OSError, ValueError):
            with contextlib.suppress(OSError):
                os.unlink(self.folder / name)
            self._kept.remove(kept)
            kept.close()
            return False
        kept.name = name
        self._lock_shared(kept)
        return True

    def keep(self, fd: int, name: str, size: int) -> None:
        """Keep the file ``fd`` (open for reading and writing) just written as ``name``: the
        pool owns the descriptor from now on, and closes it when it lets the file go."""
        with self._lock:
            self._kept = [k for k in self._kept if not self._gone(k)]
            if self._closed or size > KEEP_MAX_BYTES or not _room_for(fd, size) \
                    or not self._make_room(size):
                os.close(fd)
                return
            kept = _Kept(fd, name, size, time.monotonic())
            self._lock_shared(kept)
            self._kept.append(kept)
            self._unmapped.append(kept)
            if self._thread is None:
                self._thread = threading.Thread(target=self._tend, daemon=True,
                                                name="gpumesh-shm-pool")
                self._thread.start()
            self._wake.notify()

    def _make_room(self, size: int) -> bool:
        """Let go of kept files until one of ``size`` bytes fits; False where it should not be
        kept. Only files of other sizes make room, the least recently written first, and those
        of this size unwritten for STALE_SECONDS: a kept file of this size will be written again
        once its frame is retired, while a new one that took its place would be mapped, then let
        go a few frames later unused. With more frames of one size in flight than the pool keeps
        (a ``.map`` of big arguments), the first ones are kept and written again in turn, and
        the rest are plain files."""
        def full() -> bool:
            return len(self._kept) >= KEEP_MAX_FILES or \
                sum(k.size for k in self._kept) + size > KEEP_MAX_BYTES
        now = time.monotonic()
        while full():
            # One of this size not written for STALE_SECONDS goes too: held by tasks that wait
            # (parked, or long), it would keep a later stream of this size from being kept.
            others = [k for k in self._kept if k.size != size or now - k.used > STALE_SECONDS]
            if not others:
                return False
            oldest = min(others, key=lambda k: k.used)
            self._kept.remove(oldest)
            oldest.close()
        return True

    def close(self) -> None:
        """Keep nothing from now on; the files kept are let go (their names stay the
        coordinator's to remove)."""
        with self._lock:
            self._closed = True
            kept, self._kept, self._unmapped = self._kept, [], []
            self._wake.notify()
        for each in kept:
            each.close()

    @staticmethod
    def _lock_shared(kept: _Kept) -> None:
        """Take (or go back to) this process's shared lock: the coordinator retires a file
        someone holds instead of removing it, and no other producer writes into it."""
        with contextlib.suppress(OSError):
            fcntl.flock(kept.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)

    def _forget_if_gone(self, kept: _Kept) -> bool:
        if self._gone(kept):
            self._kept.remove(kept)
            return True
        return False

    @staticmethod
    def _gone(kept: _Kept) -> bool:
        """Whether the file has no name left (the coordinator removed it, or its sender did):
        it can never be claimed, so it is let go (closed) now."""
        try:
            gone = os.fstat(kept.fd).st_nlink == 0
        except OSError:
            gone = True
        if gone:
            kept.close()
        return gone

    def _tend(self) -> None:
        """Map each kept file ahead of its reuse, and let go of kept files whose last name
        went (their pages are this process's alone now) or that nobody wrote for
        KEEP_IDLE_SECONDS; the thread ends with none kept."""
        with self._lock:
            while not self._closed:
                while self._unmapped:
                    self._map_ahead(self._unmapped.pop())
                now = time.monotonic()
                for kept in [k for k in self._kept if now - k.used > KEEP_IDLE_SECONDS]:
                    self._kept.remove(kept)
                    kept.close()
                self._kept = [k for k in self._kept if not self._gone(k)]
                if not self._kept:
                    break
                if not self._unmapped:
                    self._wake.wait(CHECK_SECONDS)
            self._thread = None

    def _map_ahead(self, kept: _Kept) -> None:
        """Map (and fault in) a kept file while its producer waits for its task, so that its
        reuse is a memory copy only: mapping 64 MiB writable costs about 12 ms here. Called
        with the lock held; mapping goes without it (the producer may write meanwhile), on a
        duplicate descriptor (the file may be let go meanwhile, its own descriptor closed)."""
        if kept not in self._kept or kept.view is not None:
            return
        try:
            fd = os.dup(kept.fd)
        except OSError:
            return
        self._lock.release()
        try:
            view = _map(fd, kept.size)
        except (OSError, ValueError):
            view = None
        finally:
            os.close(fd)  # the mapping keeps its own duplicate, and the lock stays with kept.fd
            self._lock.acquire()
        if view is not None:
            if kept in self._kept and kept.view is None and not self._closed:
                kept.view = view
            else:
                view.close()

    def after_fork_in_child(self) -> None:
        """A forked child shares the parent's open files and locks: it must neither write
        into them nor unlock them. It forgets them (closing its copies unlocks nothing while
        the parent holds its own) and keeps nothing."""
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread = None
        self._closed = True
        kept, self._kept = self._kept, []
        self._unmapped = []
        for each in kept:
            each.close()


def _map(fd: int, size: int) -> mmap.mmap:
    """A shared, writable mapping of the whole file, its pages faulted in at once."""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE)


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux; elsewhere pages fault in as copied
_UTIME_FD = os.utime in os.supports_fd
_LIVE: weakref.WeakSet[Pool] = weakref.WeakSet()


def _room_for(fd: int, size: int) -> bool:
    try:
        info = os.fstatvfs(fd)
    except OSError:
        return False
    return info.f_bavail * info.f_frsize >= KEEP_FREE_FACTOR * size


def holds(path: Path) -> bool | None:
    """Whether some process holds ``path`` (maps it, or keeps it to write again); None when it
    cannot be opened. The coordinator's question before it retires or removes a file."""
    if fcntl is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | NONBLOCK)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # the exclusive lock, if taken, goes with it
    return False


def _after_fork_in_child() -> None:
    for pool in list(_LIVE):
        pool.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
