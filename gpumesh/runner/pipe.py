"""Framing for the agent <-> runner control socket: a count, the lengths, then the frames.

A local stream socket has no message boundaries, so each message is written as
``[u32 frame count][u64 length]*count[frame bytes]*count``. Large frames are written straight
from their buffers and read straight into preallocated ones, without an intermediate join.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from typing import Any

_COUNT = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")
MAX_FRAMES = 4096


class PipeClosed(EOFError):
    """The other end closed the socket (the runner or the agent is gone)."""


def send_message(sock: socket.socket, frames: Sequence[Any]) -> None:
    views = [memoryview(_buffer(f)).cast("B") for f in frames]
    head = _COUNT.pack(len(views)) + b"".join(_LENGTH.pack(v.nbytes) for v in views)
    sock.sendall(head)
    for view in views:
        if view.nbytes:
            sock.sendall(view)


def _buffer(frame: Any) -> Any:
    buffer = getattr(frame, "buffer", None)  # zmq.Frame, without importing zmq
    return buffer if buffer is not None else frame


def recv_message(sock: socket.socket, max_bytes: int) -> list[bytearray]:
    (count,) = _COUNT.unpack(_recv_exact(sock, _COUNT.size))
    if count > MAX_FRAMES:
        raise ValueError(f"{count} frames on the runner pipe")
    lengths = [_LENGTH.unpack(_recv_exact(sock, _LENGTH.size))[0] for _ in range(count)]
    if sum(lengths) > max_bytes:
        raise ValueError(f"a {sum(lengths)}-byte message on the runner pipe exceeds {max_bytes}")
    return [_recv_exact(sock, n) for n in lengths]


def _recv_exact(sock: socket.socket, size: int) -> bytearray:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise PipeClosed("the other end of the runner pipe closed")
        got += n
    return buf
