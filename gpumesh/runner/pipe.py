"""Framing for the agent <-> runner control socket: a count, the lengths, then the frames.

A local stream socket has no message boundaries, so each message is written as
``[u32 frame count][u32 flags][u32 rest][u64 length]*count[socket frame bytes]*``, where
``rest`` counts the bytes after the head that are read in one go: the lengths, and for a small
message (flag ``_PACKED``) its frames too, so that it takes two reads, not three. Frames of
``SHARED_THRESHOLD`` bytes or more do not pass through the socket at all: they are written
once into a sealed memfd whose descriptor travels with the message (SCM_RIGHTS), and the
receiver maps it, so the bytes are neither copied into the kernel's socket buffers nor out
again. Where memfd or descriptor passing is missing, every frame goes through the socket.
Smaller frames are written straight from their buffers and read straight into preallocated
ones, without an intermediate join.

Both ends treat the other as untrusted: a count, a length, a descriptor or a file that does not
match the header raises ValueError before anything is mapped or allocated.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import stat
import struct
import time
from collections.abc import Sequence
from typing import Any

from ..fileio import write_all

try:
    import fcntl
except ImportError:  # not POSIX: no descriptor passing either
    fcntl = None  # type: ignore[assignment]

_HEAD = struct.Struct("<III")
_LENGTH = struct.Struct("<Q")
MAX_FRAMES = 4096
SHARED_THRESHOLD = 64 * 1024
# flags: one descriptor came with the first bytes of this message
_SHARED = 1
# flags: ``rest`` holds the frames as well as their lengths (a small message)
_PACKED = 2
# in a length: this frame lies in the shared file, not on the socket
_IN_FILE = 1 << 63
# Written on stdout and stderr, with a nonce and a NUL, by a task handed ahead as it starts
# (gpumesh/worker/runners.py): the pipes are not ordered with this socket.
MARKER = b"\x00gpumesh-next-task:"
_ALIGN = 64  # each frame in the shared file starts at a multiple of this (numpy likes it)
_MAX_FDS = 4  # room to see (and close) a few more than the one we accept
_SEALS = ("F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_WRITE", "F_SEAL_SEAL")
# Descriptor passing and memfd seals (Linux): without them every frame uses the socket.
_FD_PASSING = (
    hasattr(socket, "send_fds") and hasattr(socket, "SCM_RIGHTS") and fcntl is not None
    and hasattr(fcntl, "F_GET_SEALS") and all(hasattr(fcntl, name) for name in _SEALS)
)
_memfd_ok = _FD_PASSING and hasattr(os, "memfd_create")  # False after memfd_create failed


class PipeClosed(EOFError):
    """The other end closed the socket (the runner or the agent is gone)."""


def send_message(sock: socket.socket, frames: Sequence[Any]) -> None:
    """Write one message. Frames are bytes-like objects or zmq Frames; none is copied on the way
    to the socket, and big ones are copied once, into the shared file."""
    small = encode_small(frames)
    if small is not None:
        sock.sendall(small)  # every tiny task's message: one system call, not one per frame
        return
    views = [_view(f) for f in frames]
    big = [v.nbytes >= SHARED_THRESHOLD for v in views]
    fd = None
    if any(big) and sock.family == socket.AF_UNIX:
        fd = _shared_file([v for v, b in zip(views, big, strict=True) if b])
    if fd is None:
        big = [False] * len(views)
    inline = [v for v, in_file in zip(views, big, strict=True) if v.nbytes and not in_file]
    lengths = b"".join(_LENGTH.pack(v.nbytes | (_IN_FILE if b else 0))
                       for v, b in zip(views, big, strict=True))
    packed = sum(v.nbytes for v in inline) <= _ONE_WRITE
    flags = (0 if fd is None else _SHARED) | (_PACKED if packed else 0)
    rest = len(lengths) + (sum(v.nbytes for v in inline) if packed else 0)
    head = b"".join([_HEAD.pack(len(views), flags, rest), lengths, *(inline if packed else ())])
    try:
        if fd is None:
            sock.sendall(head)
        else:
            sent = socket.send_fds(sock, [head], [fd])
            if sent < len(head):
                sock.sendall(memoryview(head)[sent:])
    finally:
        if fd is not None:
            os.close(fd)  # the message holds its own reference to the file
    if not packed:
        for view in inline:
            sock.sendall(view)


def encode_small(frames: Sequence[Any]) -> bytes | None:
    """A message with no big frame, whole (its frames joined after the head), ready to be
    written with others in one call; None for one too big for that (``send_message`` then
    writes it frame by frame, or through a shared file)."""
    if all(type(f) is bytes for f in frames):  # a tiny task's frames: no views to make
        lengths = [len(f) for f in frames]
        total = sum(lengths)
        if total > _ONE_WRITE or len(frames) > MAX_FRAMES \
                or max(lengths, default=0) >= SHARED_THRESHOLD:
            return None
        return b"".join([_HEAD.pack(len(frames), _PACKED, _LENGTH.size * len(frames) + total),
                         struct.pack(f"<{len(frames)}Q", *lengths), *frames])
    views = [_view(f) for f in frames]
    total = sum(v.nbytes for v in views)
    if total > _ONE_WRITE or len(views) > MAX_FRAMES \
            or any(v.nbytes >= SHARED_THRESHOLD for v in views):
        return None
    rest = _LENGTH.size * len(views) + total
    return b"".join([_HEAD.pack(len(views), _PACKED, rest),
                     *(_LENGTH.pack(v.nbytes) for v in views), *views])


# Below this, a message's frames are joined and written at once: the copy costs less than the
# system calls it saves.
_ONE_WRITE = 64 * 1024


def _view(frame: Any) -> memoryview:
    buffer = getattr(frame, "buffer", None)  # zmq.Frame, without importing zmq
    view = memoryview(buffer if buffer is not None else frame)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _layout(lengths: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of frames laid out back to back at aligned starts, and the file size."""
    offsets, end = [], 0
    for n in lengths:
        start = -(-end // _ALIGN) * _ALIGN
        offsets.append(start)
        end = start + n
    return offsets, end


def memfd_works() -> bool:
    """Whether big frames go through a memfd (not the socket): False where there is none, or
    once making one failed."""
    return _memfd_ok


def _shared_file(views: Sequence[memoryview]) -> int | None:
    """A sealed memfd holding the frames, or None where there is none (then the socket)."""
    global _memfd_ok
    if not _memfd_ok:
        return None
    try:
        fd = os.memfd_create("gpumesh-frames", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError:  # a kernel or sandbox without memfd: remember, and use the socket
        _memfd_ok = False
        return None
    try:
        offsets, size = _layout([v.nbytes for v in views])
        pieces: list[memoryview] = []
        end = 0
        for view, start in zip(views, offsets, strict=True):
            if start > end:
                pieces.append(memoryview(bytes(start - end)))
            pieces.append(view)
            end = start + view.nbytes
        write_all(fd, pieces)
        # Sealed: the receiver maps it, and a file that shrank under a mapping would kill the
        # receiver with SIGBUS. Nobody can change the bytes after this, the sender included.
        assert fcntl is not None
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                    | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
        if os.fstat(fd).st_size != size:
            raise OSError("short write into the shared file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def recv_message(sock: socket.socket, max_bytes: int, stall: float | None = None) -> list[Any]:
    """One message's frames: bytearrays, or writable memoryviews of a private mapping of the
    shared file, which stays mapped while any of them is referenced. Both are what
    ``pickle.loads(frames[0], buffers=frames[1:])`` takes.

    ``stall``: the message must be whole this many seconds after its read began, plus the
    time its socket bytes take at MIN_PIPE_RATE (the agent's reads: a runner that writes half
    a message and stops, or trickles it, must not hold its loop); None waits as long as it
    takes (the runner, waiting for its next task).

    Raises PipeClosed at end of stream, ValueError for a message that breaks the format or
    the limits, or does not come whole in time (the stream is then out of step: drop the
    pipe)."""
    deadline = None if stall is None else _Deadline(stall)
    head, fds = _recv_head(sock, deadline)
    try:
        count, flags, rest = _HEAD.unpack(head)
        if count > MAX_FRAMES:
            raise ValueError(f"{count} frames on the runner pipe")
        if flags & ~(_SHARED | _PACKED):
            raise ValueError(f"unknown flags {flags:#x} on the runner pipe")
        if len(fds) != (1 if flags & _SHARED else 0):
            raise ValueError(f"{len(fds)} file descriptors with a message on the runner pipe "
                             f"that {'has one' if flags & _SHARED else 'has none'}")
        lengths_size = _LENGTH.size * count
        if rest < lengths_size or rest > lengths_size + (_ONE_WRITE if flags & _PACKED else 0):
            raise ValueError(f"a message on the runner pipe announces {rest} bytes for "
                             f"{count} frames")
        data = memoryview(_recv_exact(sock, rest, deadline))
        words = struct.unpack_from(f"<{count}Q", data)
        lengths = [w & ~_IN_FILE for w in words]
        in_file = [bool(w & _IN_FILE) for w in words]
        if sum(lengths) > max_bytes:
            raise ValueError(
                f"a {sum(lengths)}-byte message on the runner pipe exceeds {max_bytes}")
        if any(in_file) != bool(fds):
            raise ValueError("frames in a shared file without one, or a file without frames")
        inline = sum(n for n, f in zip(lengths, in_file, strict=True) if not f)
        if flags & _PACKED and inline != rest - lengths_size:
            raise ValueError("a small message on the runner pipe whose frames do not add up")
        if deadline is not None and not flags & _PACKED:
            deadline.extend(inline / MIN_PIPE_RATE)  # big frames on the socket (no memfd)
        shared: list[memoryview] = []
        if fds:
            shared = _map_shared(fds[0], [n for n, f in zip(lengths, in_file, strict=True) if f])
    finally:
        for fd in fds:
            os.close(fd)  # a mapping keeps the file; nothing else needs the descriptor
    files = iter(shared)
    if flags & _PACKED:
        # Its socket frames came whole with the lengths: cut them (copies cost less than reads).
        out: list[Any] = []
        at = lengths_size
        for n, f in zip(lengths, in_file, strict=True):
            if f:
                out.append(next(files))
            else:
                out.append(bytearray(data[at:at + n]))
                at += n
        return out
    return [next(files) if f else _recv_exact(sock, n, deadline)
            for n, f in zip(lengths, in_file, strict=True)]


# A read that must not wait, where the system has the flag (elsewhere: select, then read).
_NO_WAIT = getattr(socket, "MSG_DONTWAIT", 0)
# Bytes a second a message's socket frames must at least come at, on top of ``stall``: a local
# socket pair moves over 1 GB/s.
MIN_PIPE_RATE = 256 * 2**20


class _Deadline:
    """When the message being read must be whole (monotonic clock), and how long that was."""

    __slots__ = ("at", "allowed")

    def __init__(self, seconds: float) -> None:
        self.allowed = seconds
        self.at = time.monotonic() + seconds

    def extend(self, seconds: float) -> None:
        self.allowed += seconds
        self.at += seconds

    def wait(self, sock: socket.socket) -> None:
        """Until the socket has more to read, or raise ValueError if the time is up first."""
        left = self.at - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            raise ValueError(f"a message on the runner pipe did not come whole within "
                             f"{self.allowed:.3g} s")


def _read_flags(sock: socket.socket, deadline: _Deadline | None) -> int:
    """recv flags for one read of a message: with a deadline, a read that cannot wait (and
    ``deadline.wait`` when nothing is there), else a plain blocking one."""
    if deadline is None:
        return 0
    if not _NO_WAIT:
        deadline.wait(sock)
    return _NO_WAIT


def _recv_head(sock: socket.socket, deadline: _Deadline | None = None
               ) -> tuple[bytes, list[int]]:
    """The fixed head of a message, and any descriptors that came with it."""
    data = b""
    fds: list[int] = []
    space = socket.CMSG_SPACE(_MAX_FDS * 4) if _FD_PASSING else 0
    try:
        while len(data) < _HEAD.size:
            flags = _read_flags(sock, deadline)
            try:
                if space:
                    chunk, ancdata, msg_flags, _ = sock.recvmsg(_HEAD.size - len(data), space,
                                                               flags)
                else:
                    chunk, ancdata, msg_flags = sock.recv(_HEAD.size - len(data), flags), [], 0
            except BlockingIOError:
                assert deadline is not None  # only a read that cannot wait raises it
                deadline.wait(sock)
                continue
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    whole = len(payload) - len(payload) % 4
                    fds.extend(struct.unpack(f"{whole // 4}i", payload[:whole]))
                else:
                    raise ValueError("unexpected ancillary data on the runner pipe")
            if space and msg_flags & socket.MSG_CTRUNC:
                raise ValueError("too many file descriptors on the runner pipe")
            if not chunk:
                raise PipeClosed("the other end of the runner pipe closed")
            data += chunk
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return data, fds


def _map_shared(fd: int, lengths: Sequence[int]) -> list[memoryview]:
    """Map the sender's sealed memfd privately (copy on write: the views are writable, like a
    bytearray, and writes stay ours) and cut it into the frames."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise ValueError("the runner pipe passed a descriptor that is not a file")
    assert fcntl is not None  # _recv_head takes descriptors only where fcntl is there
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise ValueError("the runner pipe passed a file that is not a memfd") from None
    needed = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE
    if seals & needed != needed:
        raise ValueError("the runner pipe passed a memfd that is not sealed")
    offsets, size = _layout(lengths)
    if info.st_size != size:
        raise ValueError(f"the runner pipe's shared file has {info.st_size} bytes, "
                         f"its frames need {size}")
    try:
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    except PermissionError:  # a kernel that refuses private writable maps of a sealed memfd
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    whole = memoryview(mapped)
    return [whole[start:start + n] for start, n in zip(offsets, lengths, strict=True)]


def _recv_exact(sock: socket.socket, size: int, deadline: _Deadline | None = None
                ) -> bytearray:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        flags = _read_flags(sock, deadline)
        try:
            n = sock.recv_into(view[got:], size - got, flags)
        except BlockingIOError:
            assert deadline is not None  # only a read that cannot wait raises it
            deadline.wait(sock)
            continue
        if n == 0:
            raise PipeClosed("the other end of the runner pipe closed")
        got += n
    return buf
