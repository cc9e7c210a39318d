"""Shared-memory files made ahead of need, so a big frame is written into pages that exist.

Writing 64 MiB into a new tmpfs file costs the test machine 25-30 ms, and about half of that is
the kernel finding and clearing pages; the same write into a file whose pages are allocated
takes 11-17 ms. A producer of big frames (a client sending arguments, a runner returning
results) usually sends the same size again, so after each big write a thread of its own makes
an allocated file of that size (``fallocate``) while the producer waits for its task, and the
next write of that size goes into it.

The file is made with ``O_TMPFILE``: it has no name until it is used, so nobody else can open
it, and it vanishes with its process whatever way that ends. It gets its name (``linkat``
through ``/proc/self/fd``) before a byte is written, and is never reused after that: a consumer
that maps a frame keeps what it mapped, which reusing a named file could change under it.
Where any of this is missing (another OS, no /proc, a file system without ``O_TMPFILE``) the
producer writes new files as before.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

# A spare is made for frames up to this size, and only while the folder's file system has four
# times the frame free (Docker gives /dev/shm 64 MiB: a spare must not crowd out real frames).
SPARE_MAX_BYTES = 512 * 1024 * 1024
SPARE_FREE_FACTOR = 4
# A spare nobody took in this long is given back: an idle process holds no memory for it.
SPARE_IDLE_SECONDS = 30.0

_TMPFILE = getattr(os, "O_TMPFILE", 0)


class Spares:
    """At most one spare file at a time for one folder, made on a thread of its own."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ready: tuple[int, int, float] | None = None  # (size, fd, made at)
        self._wanted = 0
        self._failed = 0  # the size whose spare could not be made: not tried again
        self._thread: threading.Thread | None = None
        self._closed = not _TMPFILE

    def take(self, size: int) -> int | None:
        """An open, unnamed file of exactly ``size`` allocated bytes, now the caller's to name
        (``name``) and close; None when there is none of that size."""
        with self._lock:
            if self._ready is None or self._ready[0] != size:
                return None
            fd = self._ready[1]
            self._ready = None
            return fd

    def want(self, size: int) -> None:
        """Make a spare of ``size`` for the next frame, unless one is ready or cannot be."""
        with self._lock:
            if self._closed or size > SPARE_MAX_BYTES or size == self._failed \
                    or (self._ready is not None and self._ready[0] == size):
                return
            self._wanted = size
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gpumesh-shm-spares",
                                                daemon=True)
                self._thread.start()
            self._wake.notify()

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
        """No more spares: the one ready is given back and the thread ends."""
        with self._lock:
            self._closed = True
            ready, self._ready = self._ready, None
            self._wake.notify()
        if ready is not None:
            os.close(ready[1])

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._wanted:
                    if self._ready is not None and \
                            time.monotonic() - self._ready[2] > SPARE_IDLE_SECONDS:
                        os.close(self._ready[1])
                        self._ready = None
                    self._wake.wait(SPARE_IDLE_SECONDS if self._ready is not None else None)
                if self._closed:
                    self._thread = None
                    return
                size, self._wanted = self._wanted, 0
            fd = self._make(size)
            with self._lock:
                if fd is None:
                    self._failed = size
                    continue
                old, self._ready = self._ready, (size, fd, time.monotonic())
                if self._closed:
                    old, self._ready = self._ready, None
            if old is not None:
                os.close(old[1])

    def _make(self, size: int) -> int | None:
        try:
            info = os.statvfs(self._folder)
            if info.f_bavail * info.f_frsize < SPARE_FREE_FACTOR * size:
                return None
            fd = os.open(self._folder, _TMPFILE | os.O_RDWR, 0o600)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.close(fd)
            return None
        return fd
