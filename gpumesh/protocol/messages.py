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
MINOR = 9
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
    # Either way (since v1.3): several messages for one peer in one, so a burst of tiny tasks
    # costs one send, one wake-up and one CURVE box per turn instead of one per message. Sent
    # only to a peer that said it reads them (HELLO/WELCOME ``batch``).
    BATCH = 0x13
    # Coordinator -> a peer that said HELLO ``pieces`` (since v1.8): a big message in slices,
    # paced by the peer's PIECE_ACKs, so neither side holds it whole in ZeroMQ (pieces.py).
    PIECE = 0x14
    PIECE_ACK = 0x15  # peer -> coordinator: how many bytes of a PIECE transfer arrived


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

MAX_BATCHED = 4096  # messages in one BATCH
# A BATCH is one frame: its header holds every message's header and frames, so a burst of tiny
# tasks costs one send and one CURVE box instead of several per message. Messages whose frames
# pass BATCH_ALONE_BYTES go alone (big buffers are not copied into a header); a BATCH holds at
# most BATCH_BYTES, well under the header limit (Limits.max_header_bytes, 1 MiB).
BATCH_ALONE_BYTES = 64 * 1024
BATCH_BYTES = 256 * 1024


def bundle(messages: Sequence[Sequence[Any]]) -> list[Any]:
    """One BATCH carrying ``messages`` (each as ``encode`` made it), in order. Each inner
    header travels as the bytes encode() already packed, its frames as bytes beside it."""
    index = [[frames[1][0], frames[2], [_as_bytes(f) for f in frames[3:]]] for frames in messages]
    return encode(Command.BATCH, {"m": index})


def _as_bytes(frame: Any) -> bytes:
    if isinstance(frame, bytes):
        return frame
    buffer = getattr(frame, "bytes", None)  # a received zmq.Frame
    return buffer if isinstance(buffer, bytes) else bytes(frame)


def batches(messages: Sequence[list[Any]], limits: Limits) -> list[list[Any]]:
    """What to send for ``messages`` to one peer that reads BATCH: runs of small messages as
    BATCHes, a lone or big message as it is; the order is kept."""
    out: list[list[Any]] = []
    run: list[list[Any]] = []
    size = frames = 0
    most = min(BATCH_BYTES, limits.max_header_bytes // 2)

    def close_run() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            out.append(bundle(run))
        run.clear()

    for message in messages:
        # Most messages here are a header alone, or a header and a few small bytes frames.
        head = len(message[2])
        payload = 0
        for frame in message[3:]:
            payload += len(frame) if type(frame) is bytes else frame_size(frame)
        body = head + payload
        if payload >= BATCH_ALONE_BYTES or body >= most:
            close_run()
            size = frames = 0
            out.append(message)
            continue
        inner = len(message) - 3  # its payload frames: unbundle refuses a BATCH of too many
        if run and (len(run) >= MAX_BATCHED or size + body > most
                    or frames + inner > limits.max_frames):
            close_run()
            size = frames = 0
        run.append(message)
        size += body + 8 * (len(message) - 1)
        frames += inner
    close_run()
    return out


def unbundle(batch: Message, limits: Limits) -> list[Message | ProtocolError]:
    """The messages of a BATCH, in order. A structural fault (not a list, a nested BATCH, a
    frame that is not bytes) refuses the whole BATCH; an inner message of a command this side
    does not know becomes an UNSUPPORTED ProtocolError in its place, as it would alone."""
    items = batch.header.get("m")
    if batch.payload or not isinstance(items, list) or not 1 <= len(items) <= MAX_BATCHED:
        raise ProtocolError(ErrorCode.MALFORMED,
                            f"a BATCH is one frame holding 1 to {MAX_BATCHED} messages in 'm'")
    out: list[Message | ProtocolError] = []
    frames_left = limits.max_frames
    for item in items:
        if not (isinstance(item, list) and len(item) == 3):
            raise ProtocolError(ErrorCode.MALFORMED, "a BATCH entry is not [command, header, frames]")
        raw_command, raw_header, frames = item
        if not isinstance(raw_command, int) or isinstance(raw_command, bool):
            raise ProtocolError(ErrorCode.MALFORMED, "a BATCH entry's command is not a byte")
        if not isinstance(raw_header, bytes):
            raise ProtocolError(ErrorCode.MALFORMED, "a BATCH entry's header is not packed bytes")
        if not isinstance(frames, list) or not all(isinstance(f, bytes) for f in frames):
            raise ProtocolError(ErrorCode.MALFORMED, "a BATCH entry's frames are not bytes")
        frames_left -= len(frames)
        if frames_left < 0:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"a BATCH of more than {limits.max_frames} frames")
        command = _COMMANDS.get(raw_command)
        if command is Command.BATCH:
            raise ProtocolError(ErrorCode.MALFORMED, "a BATCH inside a BATCH")
        if command is None:
            out.append(ProtocolError(ErrorCode.UNSUPPORTED, f"unknown command 0x{raw_command & 0xff:02x}"))
            continue
        out.append(Message(command, _unpack_header(raw_header), frames))
    return out


def _unpack_header(raw_header: Any) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(raw_header, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(ErrorCode.MALFORMED, f"undecodable header: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.MALFORMED, "header is not a map")
    return header


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
    return Message(command, _unpack_header(raw_header), list(frames[3:]))


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
