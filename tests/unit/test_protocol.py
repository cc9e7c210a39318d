"""Unit tests for the wire codec in gpumesh.protocol.messages (pure: bytes in, messages out)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumesh.config import Limits
from gpumesh.protocol.messages import (
    MAGIC,
    MAJOR,
    SIGNATURE,
    Command,
    ErrorCode,
    Message,
    ProtocolError,
    check_sizes,
    decode,
    encode,
    field_of,
    frame_size,
)

DEFAULT_LIMITS = Limits()


def _valid(command: Command = Command.HELLO, header: dict | None = None, payload=()) -> list:
    return encode(command, header if header is not None else {"k": 1}, payload)


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("command", list(Command), ids=lambda c: c.name)
def test_encode_decode_round_trip_for_every_command(command: Command) -> None:
    header = {"id": "w-1", "n": 7, "ok": True, "nested": {"a": [1, 2, 3]}, "raw": b"\x00\xff"}
    payload = [b"first", b"", bytes(range(256))]

    frames = encode(command, header, payload)

    assert frames[0] == SIGNATURE == b"GPM\x01"
    assert frames[1] == bytes([int(command)])
    assert len(frames) == 3 + len(payload)

    message = decode(frames, DEFAULT_LIMITS)
    assert isinstance(message, Message)
    assert message.command is command
    assert message.header == header
    assert message.payload == payload


def test_encode_without_header_sends_empty_map() -> None:
    frames = encode(Command.HEARTBEAT)
    assert len(frames) == 3
    assert msgpack.unpackb(frames[2]) == {}
    message = decode(frames, DEFAULT_LIMITS)
    assert message.command is Command.HEARTBEAT
    assert message.header == {}
    assert message.payload == []


def test_decode_accepts_memoryview_and_bytearray_frames() -> None:
    frames = encode(Command.SUBMIT, {"tasks": 2}, [b"abc"])
    mixed = [bytearray(frames[0]), memoryview(frames[1]), memoryview(frames[2]), frames[3]]
    message = decode(mixed, DEFAULT_LIMITS)
    assert message.command is Command.SUBMIT
    assert message.header == {"tasks": 2}
    assert message.payload == [b"abc"]


def test_payload_frames_are_passed_through_untouched() -> None:
    marker = memoryview(b"not decoded here")
    message = decode(encode(Command.TASK, {}, [marker]), DEFAULT_LIMITS)
    assert message.payload[0] is marker


def test_command_bytes_are_unique() -> None:
    values = [int(c) for c in Command]
    assert len(values) == len(set(values))
    assert all(0 < v < 256 for v in values)


# --------------------------------------------------------------------------- decode errors


def _code_of(frames, limits: Limits = DEFAULT_LIMITS) -> ErrorCode:
    with pytest.raises(ProtocolError) as info:
        decode(frames, limits)
    assert info.value.detail == str(info.value)
    return info.value.code


@pytest.mark.parametrize("count", [0, 1, 2])
def test_too_few_frames_is_malformed(count: int) -> None:
    frames = _valid()[:count]
    assert _code_of(frames) is ErrorCode.MALFORMED


@pytest.mark.parametrize(
    "signature",
    [b"XYZ\x01", b"GPM", b"GPM\x01\x00", b"", b"gpm\x01", b"HTTP/1.1"],
)
def test_bad_signature_is_version(signature: bytes) -> None:
    frames = _valid()
    frames[0] = signature
    assert _code_of(frames) is ErrorCode.VERSION


@pytest.mark.parametrize("major", [0, MAJOR + 1, 255])
def test_wrong_major_version_is_version(major: int) -> None:
    frames = _valid()
    frames[0] = MAGIC + bytes([major])
    with pytest.raises(ProtocolError) as info:
        decode(frames, DEFAULT_LIMITS)
    assert info.value.code is ErrorCode.VERSION
    assert f"v{major}" in info.value.detail


def test_signature_is_checked_before_sizes() -> None:
    # A peer of another version gets VERSION, not TOO_LARGE, whatever it sent.
    frames = [b"XYZ\x01", b"\x01", b"\x80", *([b""] * 10)]
    assert _code_of(frames, Limits(max_frames=4)) is ErrorCode.VERSION


@pytest.mark.parametrize("byte", [0x00, 0x0A, 0x16, 0x7F, 0xFF])
def test_unknown_command_byte_is_unsupported(byte: int) -> None:
    frames = _valid()
    frames[1] = bytes([byte])
    with pytest.raises(ProtocolError) as info:
        decode(frames, DEFAULT_LIMITS)
    assert info.value.code is ErrorCode.UNSUPPORTED
    assert f"0x{byte:02x}" in info.value.detail


@pytest.mark.parametrize("command_frame", [b"", b"\x01\x01", b"\x01\x00", b"HELLO"])
def test_command_frame_not_one_byte_is_malformed(command_frame: bytes) -> None:
    frames = _valid()
    frames[1] = command_frame
    assert _code_of(frames) is ErrorCode.MALFORMED


@pytest.mark.parametrize(
    "raw_header",
    [
        b"\xc1",  # reserved/never-used msgpack byte
        b"\x81",  # a map announcing one pair, then nothing
        b"\xa5abc",  # a truncated str
        msgpack.packb({"a": 1}) + b"\x00",  # trailing garbage
        b"",  # nothing at all
        b"\x81\x91\x01\x01",  # {[1]: 1}: unhashable key
    ],
)
def test_garbage_header_is_malformed(raw_header: bytes) -> None:
    frames = _valid()
    frames[2] = raw_header
    assert _code_of(frames) is ErrorCode.MALFORMED


@pytest.mark.parametrize("value", [[1, 2], "text", 5, None, b"bytes", 1.5, True])
def test_header_that_is_not_a_map_is_malformed(value) -> None:
    frames = _valid()
    frames[2] = msgpack.packb(value, use_bin_type=True)
    with pytest.raises(ProtocolError) as info:
        decode(frames, DEFAULT_LIMITS)
    assert info.value.code is ErrorCode.MALFORMED
    assert "not a map" in info.value.detail


def test_too_many_frames_is_too_large() -> None:
    limits = Limits(max_frames=5)
    assert _code_of(_valid(payload=[b"a", b"b", b"c"]), limits) is ErrorCode.TOO_LARGE


def test_oversize_frame_is_too_large() -> None:
    limits = Limits(max_frame_bytes=100, max_message_bytes=10_000)
    with pytest.raises(ProtocolError) as info:
        decode(_valid(payload=[b"x" * 101]), limits)
    assert info.value.code is ErrorCode.TOO_LARGE
    assert "101" in info.value.detail


def test_oversize_memoryview_frame_counts_bytes_not_items() -> None:
    import array

    big = memoryview(array.array("d", [0.0] * 20))  # 20 items, 160 bytes
    limits = Limits(max_frame_bytes=100, max_message_bytes=10_000)
    assert _code_of(_valid(payload=[big]), limits) is ErrorCode.TOO_LARGE


def test_oversize_total_is_too_large() -> None:
    limits = Limits(max_frame_bytes=100, max_message_bytes=250)
    too_big = _valid(header={}, payload=[b"x" * 100, b"y" * 100, b"z" * 100])
    with pytest.raises(ProtocolError) as info:
        decode(too_big, limits)
    assert info.value.code is ErrorCode.TOO_LARGE
    assert "250" in info.value.detail


def test_oversize_header_is_too_large() -> None:
    limits = Limits(max_header_bytes=32)
    assert _code_of(_valid(header={"pad": "x" * 64}), limits) is ErrorCode.TOO_LARGE


def test_messages_exactly_at_the_limits_decode() -> None:
    assert decode(_valid(payload=[b"a", b"b"]), Limits(max_frames=5)).payload == [b"a", b"b"]
    limits = Limits(max_frame_bytes=100, max_message_bytes=10_000)
    assert decode(_valid(payload=[b"x" * 100]), limits).payload == [b"x" * 100]
    limits = Limits(max_frame_bytes=100, max_message_bytes=250)
    header = encode(Command.HELLO)[2]  # b"\x80": one byte
    rest = 250 - len(SIGNATURE) - 1 - len(header) - 200
    ok = _valid(header={}, payload=[b"x" * 100, b"y" * 100, b"z" * rest])
    assert sum(len(f) for f in ok) == 250
    assert len(decode(ok, limits).payload) == 3
    assert decode(_valid(header={"a": 1}), Limits(max_header_bytes=32)).header == {"a": 1}


def test_check_sizes_directly() -> None:
    limits = Limits(max_frame_bytes=10, max_message_bytes=15, max_frames=3)
    check_sizes([b"x" * 10, b"y" * 5], limits)  # at the limits: fine
    for frames in ([b""] * 4, [b"x" * 11], [b"x" * 10, b"y" * 6]):
        with pytest.raises(ProtocolError) as info:
            check_sizes(frames, limits)
        assert info.value.code is ErrorCode.TOO_LARGE


def test_frame_size() -> None:
    assert frame_size(b"abcd") == 4
    assert frame_size(bytearray(3)) == 3
    assert frame_size(memoryview(b"abcdef")[1:4]) == 3
    assert frame_size(memoryview(bytes(16)).cast("d")) == 16


# --------------------------------------------------------------------------- field_of


def test_field_of_returns_present_value() -> None:
    header = {"name": "w1", "slots": 4, "ratio": 0.5, "flag": False, "items": [1]}
    assert field_of(header, "name", str) == "w1"
    assert field_of(header, "slots", int) == 4
    assert field_of(header, "ratio", (int, float)) == 0.5
    assert field_of(header, "slots", (int, float)) == 4
    assert field_of(header, "flag", bool) is False
    assert field_of(header, "items", list) == [1]


def test_field_of_missing_without_default_is_malformed() -> None:
    with pytest.raises(ProtocolError) as info:
        field_of({"other": 1}, "name", str)
    assert info.value.code is ErrorCode.MALFORMED
    assert "'name'" in info.value.detail
    assert "missing" in info.value.detail


def test_field_of_missing_with_default_returns_default() -> None:
    assert field_of({}, "name", str, None) is None
    assert field_of({}, "slots", int, 3) == 3
    sentinel = object()
    assert field_of({}, "thing", dict, sentinel) is sentinel


@pytest.mark.parametrize(
    ("value", "kind"),
    [("4", int), (4, str), (None, str), ([1], dict), (1.5, int), (b"w1", str)],
)
def test_field_of_wrong_type_is_malformed(value, kind) -> None:
    with pytest.raises(ProtocolError) as info:
        field_of({"f": value}, "f", kind)
    assert info.value.code is ErrorCode.MALFORMED
    assert "wrong type" in info.value.detail


def test_field_of_present_but_wrong_type_fails_even_with_default() -> None:
    with pytest.raises(ProtocolError) as info:
        field_of({"f": "x"}, "f", int, 0)
    assert info.value.code is ErrorCode.MALFORMED


@pytest.mark.parametrize("kind", [int, float, (int, float)])
@pytest.mark.parametrize("value", [True, False])
def test_field_of_bool_is_not_a_number(kind, value: bool) -> None:
    with pytest.raises(ProtocolError) as info:
        field_of({"n": value}, "n", kind)
    assert info.value.code is ErrorCode.MALFORMED


# --------------------------------------------------------------------------- property


_frame = st.binary(max_size=64)
_maybe_signature = st.one_of(st.just(SIGNATURE), _frame)
_maybe_command = st.one_of(st.sampled_from([bytes([int(c)]) for c in Command]), _frame)


@settings(max_examples=300, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(_frame, max_size=8))
def test_decode_of_arbitrary_frames_raises_only_protocol_error(frames: list[bytes]) -> None:
    try:
        message = decode(frames, Limits(max_frames=6, max_frame_bytes=48, max_message_bytes=200))
    except ProtocolError as exc:
        assert isinstance(exc.code, ErrorCode)
    else:
        assert isinstance(message.header, dict)


@settings(max_examples=300, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    signature=_maybe_signature,
    command=_maybe_command,
    header=_frame,
    payload=st.lists(_frame, max_size=4),
)
def test_decode_of_nearly_valid_frames_raises_only_protocol_error(
    signature: bytes, command: bytes, header: bytes, payload: list[bytes]
) -> None:
    # Biased towards a valid signature and command so the header decoding is reached often.
    frames = [signature, command, header, *payload]
    try:
        message = decode(frames, Limits(max_frames=6, max_frame_bytes=48, max_message_bytes=200))
    except ProtocolError as exc:
        assert isinstance(exc.code, ErrorCode)
    else:
        assert message.command in set(Command)
        assert isinstance(message.header, dict)
        assert message.payload == payload


# A RESULT header near the common one: the keys of a plain success, odd values among them.
_result_value = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**64, max_value=2**64),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=70), st.binary(max_size=4))
_result_header = st.dictionaries(
    st.sampled_from(["task", "lease", "status", "elapsed", "granted", "error", "encoding"]),
    st.one_of(_result_value, st.sampled_from(["ok", "error", "t-1"])), max_size=6)


def _result_or_error(header: dict):
    from gpumesh.protocol.headers import Result

    try:
        return Result.from_header(header)
    except ProtocolError as exc:
        return exc.code, exc.detail


@settings(max_examples=400, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=st.one_of(_result_header, st.fixed_dictionaries(
    {"task": st.one_of(st.text(max_size=4), st.text(min_size=63, max_size=65)),  # 64 at most
     "lease": st.one_of(st.integers(min_value=-2, max_value=2),
                        st.integers(min_value=2**63 - 2, max_value=2**63)),
     "status": st.just("ok"), "elapsed": st.floats(allow_nan=True, allow_infinity=True)},
    optional={"granted": st.one_of(st.none(), st.integers(min_value=-2, max_value=2**63))})))
def test_the_one_pass_check_of_a_plain_result_agrees_with_the_field_by_field_one(header) -> None:
    # Result.from_header reads a plain success in one pass (a per-task cost of every .map):
    # whatever it is given, it must decide exactly as the general path does.
    from unittest import mock

    from gpumesh.protocol import headers

    fast = _result_or_error(header)
    with mock.patch.object(headers, "_plain_ok", return_value=None):
        general = _result_or_error(header)
    assert fast == general


def test_a_plain_success_takes_the_one_pass_check() -> None:
    from gpumesh.protocol.headers import _plain_ok

    header = {"task": "t-1", "lease": 7, "status": "ok", "elapsed": 0.25, "granted": 3}
    assert _plain_ok(header) is not None
    assert _plain_ok({**header, "elapsed": 0}) is None  # an int: the general path makes it 0.0
