"""The wire protocol: commands, frame codec and payload serialization. Does no I/O."""

from .messages import (
    MAJOR,
    MINOR,
    SIGNATURE,
    Command,
    ErrorCode,
    Message,
    ProtocolError,
    Role,
    check_sizes,
    decode,
    encode,
    field_of,
)

__all__ = [
    "MAJOR",
    "MINOR",
    "SIGNATURE",
    "Command",
    "ErrorCode",
    "Message",
    "ProtocolError",
    "Role",
    "check_sizes",
    "decode",
    "encode",
    "field_of",
]
