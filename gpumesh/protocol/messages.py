"""Wire protocol v1: the command set and the frame codec. Bytes in, messages out; no I/O.

A message is a list of frames::

    [signature+major][command byte][msgpack header map][payload frame ...]

The coordinator's ROUTER adds the peer's routing id in front; DEALERs send no empty delimiter.
Payload frames are opaque here: the coordinator forwards them and never unpickles them.
``docs/protocol.md`` is the prose form of this module.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ..config import Limits

MAGIC = b"GPM"
MAJOR = 1
MINOR = 2
SIGNATURE = MAGIC + bytes([MAJOR])


class Command(enum.IntEnum):
    HELLO = 0x01  # worker/client -> coordinator: who I am, what I run, what I still hold
    WELCOME = 0x02  # coordinator -> peer: session accepted, timing, limits
    CREDIT = 0x03  # worker -> coordinator: cumulative slot grant
    TASK = 0x04  # coordinator -> worker: run this under this lease
    HEARTBEAT = 0x05  # both ways; from a worker it renews the listed leases
    OUTPUT = 0x06  # worker -> coordinator -> client: what a task printed
    RESULT = 0x07  # worker -> coordinator -> client: a task's terminal outcome
    RESULT_ACK = 0x08  # coordinator -> worker, client -> coordinator: result is safe, forget it
    CANCEL = 0x09  # client -> coordinator -> worker: stop these tasks
    SUBMIT = 0x0B  # client -> coordinator: a batch of tasks
    ACCEPTED = 0x0C  # coordinator -> client: these submissions are durable
    QUERY = 0x0D  # client -> coordinator: ask for workers, status ...
    REPLY = 0x0E  # coordinator -> client: the answer to a QUERY or FETCH
    FETCH = 0x0F  # client -> coordinator: re-deliver results of these tasks
    DISCONNECT = 0x10  # either way: session over, HELLO again (or leave)
    ERROR = 0x11  # coordinator -> peer: a control error, with a code and text
    CONTROL = 0x12  # client -> coordinator: cancel/retry a job, remove a worker (since v1.1)


class Role(str, enum.Enum):
    WORKER = "worker"
    CLIENT = "client"


class ErrorCode(str, enum.Enum):
    VERSION = "version"  # wrong signature or major version: sent once, then disconnect
    MALFORMED = "malformed"  # structurally invalid message
    UNSUPPORTED = "unsupported"  # unknown command byte of this major version
    UNEXPECTED = "unexpected"  # valid message the session's state does not allow
    NO_SESSION = "no_session"  # message before HELLO (e.g. after a coordinator restart)
    SAFE_MODE = "safe_mode"  # pickled function sent to a --safe-mode coordinator
    TOO_LARGE = "too_large"
    BUSY = "busy"


class ProtocolError(Exception):
    """A message that cannot be decoded; ``code`` says which policy applies."""

    def __init__(self, code: ErrorCode, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


@dataclass
class Message:
    command: Command
    header: dict[str, Any]
    payload: list[Any] = field(default_factory=list)


def pack_header(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def encode(command: Command, header: dict[str, Any] | None = None, payload: Sequence[Any] = ()) -> list[Any]:
    """Frames for one message. Payload items are sent as they are (bytes, buffers, frames)."""
    return [SIGNATURE, _COMMAND_BYTES[command], pack_header(header or {}), *payload]


_COMMAND_BYTES = {command: bytes([command]) for command in Command}
_COMMANDS = {int(command): command for command in Command}


def frame_size(frame: Any) -> int:
    if isinstance(frame, (bytes, bytearray)):
        return len(frame)
    if isinstance(frame, memoryview):
        return frame.nbytes
    return len(frame)


def check_sizes(frames: Sequence[Any], limits: Limits) -> None:
    """Refuse a message by frame count and total size before anything is decoded."""
    if len(frames) > limits.max_frames:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"{len(frames)} frames exceed the limit of {limits.max_frames}"
        )
    total = 0
    for frame in frames:
        size = frame_size(frame)
        if size > limits.max_frame_bytes:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"a frame of {size} bytes exceeds the limit of {limits.max_frame_bytes}",
            )
        total += size
    if total > limits.max_message_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"a message of {total} bytes exceeds the limit of {limits.max_message_bytes}",
        )


def decode(frames: Sequence[Any], limits: Limits) -> Message:
    """Turn received frames into a Message or raise ProtocolError.

    The first three frames must be bytes-like; payload frames are passed through untouched.
    """
    if len(frames) < 3:
        raise ProtocolError(ErrorCode.MALFORMED, f"{len(frames)} frames, at least 3 expected")
    signature = bytes(frames[0])
    if signature[:3] != MAGIC or len(signature) != 4:
        raise ProtocolError(ErrorCode.VERSION, "not a gpumesh message (bad signature)")
    if signature[3] != MAJOR:
        raise ProtocolError(
            ErrorCode.VERSION,
            f"peer speaks gpumesh protocol v{signature[3]}, this side speaks v{MAJOR}",
        )
    check_sizes(frames, limits)
    raw_command = bytes(frames[1])
    if len(raw_command) != 1:
        raise ProtocolError(ErrorCode.MALFORMED, "command frame must be one byte")
    command = _COMMANDS.get(raw_command[0])
    if command is None:
        raise ProtocolError(ErrorCode.UNSUPPORTED, f"unknown command 0x{raw_command[0]:02x}")
    raw_header = frames[2]
    if frame_size(raw_header) > limits.max_header_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, "header frame too large")
    try:
        header = msgpack.unpackb(raw_header, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(ErrorCode.MALFORMED, f"undecodable header: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.MALFORMED, "header is not a map")
    return Message(command, header, list(frames[3:]))


def field_of(header: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """Read a typed header field; a missing or mistyped one is a MALFORMED ProtocolError."""
    value = header.get(name, default)
    if value is ...:
        raise ProtocolError(ErrorCode.MALFORMED, f"header field {name!r} is missing")
    if value is not default and not isinstance(value, kind):
        raise ProtocolError(ErrorCode.MALFORMED, f"header field {name!r} has the wrong type")
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise ProtocolError(ErrorCode.MALFORMED, f"header field {name!r} has the wrong type")
    return value
