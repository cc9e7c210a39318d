"""Shared-memory files made ahead of need, so a big frame is written into pages that exist.

Writing 64 MiB into a new tmpfs file costs the test machine 25-30 ms, and about half of that is
the kernel finding and clearing pages; the same write into a file whose pages are allocated
takes 11-17 ms. A producer of big frames (a client sending arguments, a runner returning
results) usually sends the same size again, so after each big write a thread of its own makes
an allocated file of that size (``fallocate``) while the producer waits for its task, and the
next write of that size goes into it.

The file is made with ``O_TMPFILE``: it has no name until it is used, so nobody else can open
it, and it vanishes with its process whatever way that ends. It gets its name (``linkat``
through ``/proc/self/fd``) before a byte is written, and is handed out once: writing a named
file again, which could change it under a consumer's mapping, is gpumesh/shmpool.py's, under
its locks.
Where any of this is missing (another OS, no /proc, a file system without ``O_TMPFILE``) the
producer writes new files as before.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from pathlib import Path

# Spares are made for frames up to this size, no more than this many bytes of them at once
# (one per size, MAX_SPARES sizes at most: a task may send several big arrays), and only while
# the folder's file system has four times the frame free (Docker gives /dev/shm 64 MiB: a
# spare must not crowd out real frames).
SPARE_MAX_BYTES = 256 * 1024 * 1024
# Nor for frames under this size: the writer alone was no faster with a spare there
# (bench.shmwrite), and the thread that makes it takes a core and the GIL beside the writer
# (bench/README.md, "A frame's write into shared memory").
SPARE_MIN_BYTES = 1024 * 1024
MAX_SPARES = 4
SPARE_FREE_FACTOR = 4
# A spare nobody took in this long is given back: an idle process holds no memory for it.
SPARE_IDLE_SECONDS = 30.0
# A size whose spare could not be made (too little free space) is tried again after this long.
SPARE_RETRY_SECONDS = 30.0

_TMPFILE = getattr(os, "O_TMPFILE", 0)


class Spares:
    """Spare files for one folder, one per recent frame size, made on a thread of its own.
    The thread holds only the state, never this object: when nothing refers to it any more (a
    folder dropped without ``close``), ``__del__`` closes the state and the thread ends."""

    def __init__(self, folder: Path) -> None:
        self._state = _State(folder)

    def take(self, size: int) -> int | None:
        """An open, unnamed file of exactly ``size`` allocated bytes, now the caller's to name
        (``name``) and close; None when there is none of that size."""
        return self._state.take(size)

    def want(self, size: int) -> None:
        """Make a spare of ``size`` for the next frame, unless one is ready, being made, or
        cannot be made."""
        self._state.want(size)

    def name(self, fd: int, path: Path) -> bool:
        """Give the spare ``fd`` its name ``path``; False (spares off from now on) where this
        system cannot, and the caller writes a new file instead."""
        try:
            proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            self.close()
            return False
        try:
            os.link(str(fd), path, src_dir_fd=proc, follow_symlinks=True)
        except OSError:
            self.close()
            return False
        finally:
            os.close(proc)
        return True

    def close(self) -> None:
        """No more spares: those ready are given back and the thread ends."""
        self._state.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._state.close(wait=1.0)


class _State:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.ready: dict[int, tuple[int, float]] = {}  # size -> (fd, made at)
        self.wanted: list[int] = []  # sizes to make, in order
        self.making = 0  # the size being made now
        self.failed: tuple[int, float] = (0, 0.0)  # a size that could not be made, until when
        self.thread: threading.Thread | None = None
        self.closed = not _TMPFILE
        _LIVE.add(self)

    def take(self, size: int) -> int | None:
        if size < SPARE_MIN_BYTES:
            return None  # never made
        with self.lock:
            entry = self.ready.pop(size, None)
            return None if entry is None else entry[0]

    def want(self, size: int) -> None:
        if not SPARE_MIN_BYTES <= size <= SPARE_MAX_BYTES:
            return
        with self.lock:
            if self.closed or size == self.making or size in self.ready or size in self.wanted \
                    or (size == self.failed[0] and time.monotonic() < self.failed[1]):
                return
            self.wanted.append(size)
            del self.wanted[:-MAX_SPARES]
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="gpumesh-shm-spares",
                                               daemon=True)
                self.thread.start()
            self.wake.notify()

    def close(self, wait: float = -1) -> None:
        if not self.lock.acquire(timeout=wait):
            return  # from __del__ only, the lock held elsewhere all along: they go at exit
        try:
            self.closed = True
            ready, self.ready = self.ready, {}
            self.wake.notify()
        finally:
            self.lock.release()
        for fd, _ in ready.values():
            os.close(fd)

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self.closed and not self.wanted:
                    self._close_idle(time.monotonic())
                    self.wake.wait(SPARE_IDLE_SECONDS if self.ready else None)
                if self.closed:
                    self.thread = None
                    return
                size = self.making = self.wanted.pop(0)
            fd = _make(self.folder, size)
            with self.lock:
                self.making = 0
                if fd is None:
                    self.failed = (size, time.monotonic() + SPARE_RETRY_SECONDS)
                    continue
                if self.closed:
                    os.close(fd)
                    continue
                self.ready[size] = (fd, time.monotonic())
                self._evict()
                self.wake.notify_all()  # for whoever waits on ``ready`` (the tests)

    def _close_idle(self, now: float) -> None:
        for size, (fd, made) in list(self.ready.items()):
            if now - made > SPARE_IDLE_SECONDS:
                os.close(fd)
                del self.ready[size]
                self.wake.notify_all()

    def _evict(self) -> None:
        """The oldest spares go while there are more than MAX_SPARES, or more bytes than
        SPARE_MAX_BYTES, ready."""
        while len(self.ready) > MAX_SPARES or sum(self.ready) > SPARE_MAX_BYTES:
            oldest = min(self.ready, key=lambda size: self.ready[size][1])
            os.close(self.ready.pop(oldest)[0])

    def after_fork_in_child(self) -> None:
        """A forked child has none of the parent's threads, and its copy of the lock may be
        held: no spares there, and the inherited spares' pages go back with its descriptors."""
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.thread = None
        self.closed = True
        self.wanted = []
        ready, self.ready = self.ready, {}
        for fd, _ in ready.values():
            with contextlib.suppress(OSError):
                os.close(fd)


def _make(folder: Path, size: int) -> int | None:
    try:
        info = os.statvfs(folder)
        if info.f_bavail * info.f_frsize < SPARE_FREE_FACTOR * size:
            return None
        fd = os.open(folder, _TMPFILE | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        os.close(fd)
        return None
    return fd


_LIVE: weakref.WeakSet[_State] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for state in list(_LIVE):
        state.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
