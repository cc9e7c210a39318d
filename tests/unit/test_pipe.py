"""Unit tests for gpumesh.runner.pipe: the agent <-> runner framing, over real socket pairs."""

from __future__ import annotations

import gc
import os
import pickle
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumesh.runner import pipe
from gpumesh.runner.pipe import MAX_FRAMES, SHARED_THRESHOLD, PipeClosed, recv_message, send_message

BIG = SHARED_THRESHOLD
fd_passing = pytest.mark.skipif(not pipe._FD_PASSING or not hasattr(os, "memfd_create"),
                                reason="needs memfd and SCM_RIGHTS (Linux)")


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(10)  # nothing here may hang: a stuck send or receive fails the test
    b.settimeout(10)
    yield a, b
    a.close()
    b.close()


def _send_in_thread(sock: socket.socket, frames: Sequence[Any]) -> threading.Thread:
    thread = threading.Thread(target=send_message, args=(sock, frames), daemon=True)
    thread.start()
    return thread


def _frames() -> list[Any]:
    return [b"header", b"", bytearray(b"small" * 10), memoryview(os.urandom(BIG)),
            b"\x01" * (BIG - 1), bytes(range(256)) * (3 * BIG // 256 + 7)]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_small_and_big_frames_round_trip(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    frames = _frames()
    sender = _send_in_thread(a, frames)
    got = recv_message(b, 1 << 30)
    sender.join(10)
    assert [bytes(f) for f in got] == [bytes(f) for f in frames]


def test_many_messages_in_a_row_stay_in_step(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    messages = [[b"h%d" % i, b"x" * (BIG * (i % 3))] for i in range(20)]

    def send_all() -> None:
        for message in messages:
            send_message(a, message)

    sender = threading.Thread(target=send_all, daemon=True)
    sender.start()
    for message in messages:
        assert [bytes(f) for f in recv_message(b, 1 << 30)] == message
    sender.join(10)


def test_frames_unpickle_and_outlive_the_socket(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    data = os.urandom(3 * BIG)
    buffers: list[pickle.PickleBuffer] = []
    main = pickle.dumps({"data": pickle.PickleBuffer(bytearray(data)), "n": 7}, protocol=5,
                        buffer_callback=buffers.append)
    assert buffers  # the buffer left the pickle stream, as numpy arrays do
    sender = _send_in_thread(a, [main, *(buf.raw() for buf in buffers)])
    frames = recv_message(b, 1 << 30)
    sender.join(10)
    restored = pickle.loads(frames[0], buffers=frames[1:])
    del frames
    a.close()
    b.close()
    gc.collect()
    assert restored["n"] == 7 and bytes(restored["data"]) == data
    restored["data"][0] ^= 0xFF  # writable, like the bytearrays the socket path gives


@fd_passing
def test_big_frames_do_not_pass_through_the_socket(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.settimeout(2)
    # Far more than a socket buffer holds, sent with nobody reading: only the head is queued.
    send_message(a, [b"header", bytes(16 << 20)])
    frames = recv_message(b, 1 << 30)
    assert isinstance(frames[1], memoryview) and frames[1].nbytes == 16 << 20
    assert not any(frames[1][::4096])


def test_without_memfd_every_frame_uses_the_socket(
        pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipe, "_memfd_ok", False)
    a, b = pair
    frames = _frames()
    sender = _send_in_thread(a, frames)
    got = recv_message(b, 1 << 30)
    sender.join(10)
    assert all(isinstance(f, bytearray) for f in got)
    assert [bytes(f) for f in got] == [bytes(f) for f in frames]


def test_the_limits_still_hold(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    sender = _send_in_thread(a, [b"x" * 100, b"y" * BIG])
    with pytest.raises(ValueError, match="exceeds"):
        recv_message(b, BIG)
    sender.join(10)


def test_end_of_stream_is_pipe_closed(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.close()
    with pytest.raises(PipeClosed):
        recv_message(b, 1 << 30)


_CHILD = r"""
import socket, sys
from gpumesh.runner.pipe import PipeClosed, recv_message, send_message
sock = socket.socket(fileno=int(sys.argv[1]))
while True:
    try:
        frames = recv_message(sock, 1 << 30)
    except PipeClosed:
        break
    send_message(sock, [b"echo", *frames[::-1]])
"""


def test_round_trip_through_a_child_process() -> None:
    parent, child = socket.socketpair()
    parent.settimeout(30)
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(child.fileno())],
                            pass_fds=[child.fileno()])
    child.close()
    try:
        for frames in (_frames(), [b"only-small", b"s" * 100], [b"h", b"z" * (8 << 20)]):
            send_message(parent, frames)
            got = recv_message(parent, 1 << 30)
            assert [bytes(f) for f in got] == [b"echo", *(bytes(f) for f in frames[::-1])]
    finally:
        parent.close()
        assert proc.wait(timeout=30) == 0


# ----------------------------------------------------------------- hostile input


def _raw(sock: socket.socket, words: Sequence[int], flags: int, fds: Sequence[int] = (),
         count: int | None = None, rest: int | None = None) -> None:
    head = struct.pack("<III", len(words) if count is None else count, flags,
                       8 * len(words) if rest is None else rest) + b"".join(
        struct.pack("<Q", w) for w in words)
    if fds:
        socket.send_fds(sock, [head], list(fds))
    else:
        sock.sendall(head)


def _memfd(size: int, *, seal: bool = True) -> int:
    import fcntl

    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                    | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
    return fd


IN_FILE = 1 << 63


def _expect_value_error(b: socket.socket, match: str) -> None:
    before = _open_fds()
    with pytest.raises(ValueError, match=match):
        recv_message(b, 1 << 30)
    assert _open_fds() <= before  # every descriptor that came with it was closed


def test_too_many_frames(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    _raw(a, [], 0, count=MAX_FRAMES + 1)
    _expect_value_error(b, "frames")


def test_unknown_flags(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    _raw(a, [1], 0x80)
    _expect_value_error(b, "flags")


@pytest.mark.parametrize("rest", [0, 7, 8 + 64 * 1024 + 1])
def test_a_rest_that_does_not_fit_its_frames(pair: tuple[socket.socket, socket.socket],
                                             rest: int) -> None:
    a, b = pair
    _raw(a, [5], 2, rest=rest)  # _PACKED: the rest is the lengths and the frames
    _expect_value_error(b, "announces")


def test_a_packed_message_whose_frames_do_not_add_up(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    _raw(a, [5], 2, rest=8 + 4)  # one frame of 5 bytes, 4 bytes sent
    a.sendall(b"abcd")
    _expect_value_error(b, "do not add up")


def test_shared_flag_without_a_descriptor(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    _raw(a, [BIG | IN_FILE], 1)
    _expect_value_error(b, "0 file descriptors")


def test_frame_in_a_file_without_the_flag(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    _raw(a, [BIG | IN_FILE], 0)
    _expect_value_error(b, "shared file")


@fd_passing
def test_a_descriptor_without_the_flag(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    fd = _memfd(BIG)
    try:
        _raw(a, [5], 0, [fd])
    finally:
        os.close(fd)
    _expect_value_error(b, "1 file descriptors")


@fd_passing
def test_two_descriptors(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    fds = [_memfd(BIG), _memfd(BIG)]
    try:
        _raw(a, [BIG | IN_FILE], 1, fds)
    finally:
        for fd in fds:
            os.close(fd)
    _expect_value_error(b, "2 file descriptors")


@fd_passing
def test_more_descriptors_than_there_is_room_for(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    fds = [_memfd(16) for _ in range(pipe._MAX_FDS + 3)]
    try:
        _raw(a, [BIG | IN_FILE], 1, fds)
    finally:
        for fd in fds:
            os.close(fd)
    _expect_value_error(b, "too many file descriptors")


@fd_passing
def test_a_descriptor_that_is_not_a_file(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    r, w = os.pipe()
    try:
        _raw(a, [BIG | IN_FILE], 1, [r])
    finally:
        os.close(r)
        os.close(w)
    _expect_value_error(b, "not a file")


@fd_passing
def test_a_regular_file_that_is_not_a_sealed_memfd(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    with tempfile.TemporaryFile() as handle:
        handle.truncate(BIG)
        _raw(a, [BIG | IN_FILE], 1, [handle.fileno()])
    _expect_value_error(b, "not a memfd")
    fd = _memfd(BIG, seal=False)  # a memfd the sender could still shrink under our mapping
    try:
        _raw(a, [BIG | IN_FILE], 1, [fd])
    finally:
        os.close(fd)
    _expect_value_error(b, "not sealed")


@fd_passing
@pytest.mark.parametrize("size", [0, BIG - 1, BIG + 1])
def test_a_file_of_the_wrong_size(pair: tuple[socket.socket, socket.socket], size: int) -> None:
    a, b = pair
    fd = _memfd(size)
    try:
        _raw(a, [BIG | IN_FILE], 1, [fd])
    finally:
        os.close(fd)
    _expect_value_error(b, "bytes")


@fd_passing
def test_a_huge_length_is_refused_before_anything_is_mapped(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    fd = _memfd(BIG)
    try:
        _raw(a, [(1 << 62) | IN_FILE], 1, [fd])
    finally:
        os.close(fd)
    _expect_value_error(b, "exceeds")


@settings(max_examples=200, database=None, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=64), st.sampled_from(
    [b"", b"x" * (64 * 1024 - 1), b"x" * (64 * 1024), b"x" * (64 * 1024 + 1)])), max_size=6))
def test_a_message_of_bytes_is_encoded_as_the_same_message_of_buffers(frames):
    # Bytes frames (every tiny task's) take a shorter way to the same bytes, and are refused
    # (None: written frame by frame) exactly where buffers are.
    from gpumesh.runner.pipe import encode_small

    assert encode_small(frames) == encode_small([memoryview(f) for f in frames])
