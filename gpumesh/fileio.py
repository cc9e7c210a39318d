"""Writing files: many buffers to a file descriptor at once (the journal's blob files, the runner
pipe's memfd and the shared-memory folder write frames straight from their buffers), reading one
back into a buffer, small owner-only files replaced whole (worker ids, the benchmark cache), and
telling a UTF-16 text file (token and payload files from PowerShell) by its first bytes."""

from __future__ import annotations

import os
import secrets
from collections import deque
from collections.abc import Sequence
from pathlib import Path

try:
    IOV_MAX = min(int(os.sysconf("SC_IOV_MAX")), 1024)
except (AttributeError, ValueError, OSError):
    IOV_MAX = 16
# Open descriptors a long-running gpumesh process asks for (its soft limit, up to the hard one).
DESCRIPTORS_WANTED = 65536


def utf16_marked(raw: bytes) -> bool:
    """Whether a file's bytes start with a UTF-16 byte order mark, as PowerShell 5's ``>`` and
    ``Out-File`` write text: the usual reason a file meant as UTF-8 does not decode."""
    return raw[:2] in (b"\xff\xfe", b"\xfe\xff")


def raise_descriptor_limit(wanted: int = DESCRIPTORS_WANTED) -> int:
    """Raise this process's soft limit on open descriptors toward ``wanted``, within its hard
    limit; the limit it has after. For ``serve`` and ``join``: a coordinator holds a socket per
    peer and a descriptor per mapped or streamed frame, and many desktops start every process
    at 1,024 with a hard limit far above it. Nothing is lowered; where it cannot be raised
    (another OS's ceiling), it stays."""
    try:
        import resource
    except ImportError:  # Windows
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # macOS: above OPEN_MAX
            pass
    return soft


def write_all(fd: int, views: Sequence[memoryview]) -> None:
    """Write every byte of ``views``, in order, with as few system calls as writev allows
    (a short write goes on from where it stopped; no buffer is copied or joined)."""
    pending = deque(v for v in views if v.nbytes)
    while pending:
        written = os.writev(fd, [pending[i] for i in range(min(len(pending), IOV_MAX))])
        while written:
            head = pending[0]
            if written >= head.nbytes:
                written -= head.nbytes
                pending.popleft()
            else:
                pending[0] = head[written:]
                written = 0


def read_into(fd: int, view: memoryview) -> int:
    """Fill ``view`` from ``fd``'s current offset; the bytes read, fewer only at the file's end."""
    got = 0
    while got < view.nbytes:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            break
        got += n
    return got


def replace_private(path: Path, data: bytes) -> None:
    """Put ``data`` at ``path``, owner-only (0600) from the first byte and swapped in whole: a
    crash leaves the old file or the new one, never half of either. Raises OSError; the
    temporary file is removed then."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            write_all(fd, [memoryview(data)])
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


class SharedFd:
    """A read-only descriptor that several spans read: closed once none refers to it (when
    the message they make up has gone, or was dropped). Opened before the file may be
    unlinked, it keeps the bytes readable until then."""

    __slots__ = ("fd", "__weakref__")  # a weak reference tells whether a message still reads it
    opened = 0  # how many are open in this process: the coordinator keeps it bounded

    def __init__(self, fd: int) -> None:
        self.fd = fd
        SharedFd.opened += 1

    def span(self, offset: int, length: int) -> FileSpan:
        return FileSpan(self, offset, length)

    def __del__(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            SharedFd.opened -= 1


class FileSpan:
    """A frame whose bytes wait in a file: ``length`` bytes from ``offset`` of a descriptor,
    read only when they are sent (protocol/pieces.py), so a big payload on disk is never held
    whole in memory."""

    __slots__ = ("fd", "offset", "length")

    def __init__(self, fd: SharedFd, offset: int, length: int) -> None:
        self.fd = fd
        self.offset = offset
        self.length = length

    def __len__(self) -> int:
        return self.length

    @property
    def nbytes(self) -> int:
        return self.length

    def read(self, start: int, size: int) -> bytes:
        """``size`` bytes from ``start`` within the span. Raises OSError, or EOFError when the
        file has grown short."""
        data = os.pread(self.fd.fd, size, self.offset + start)
        if len(data) < size:
            raise EOFError(f"a file ended {size - len(data)} bytes early")
        return data
