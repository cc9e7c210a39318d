"""A task or a result no message can carry fails at once and says what to do.

Before: the coordinator dropped an oversize SUBMIT unanswered and the client sent it again every
two seconds, forever; an oversize result looked like a dead runner to its agent, and the task
was retried to the same end on every attempt.

For SUBMIT the coordinator is a stand-in that holds the token's keys and announces small limits
in its WELCOME (the real one announces 1 GiB and 4,096 frames: testing those would move
gigabytes). It decodes every SUBMIT under those limits, as the real one does, and accepts what
parses. The result test uses a real mesh: an array of zeros over 1 GiB costs no memory until
something reads it, and nothing does."""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq
from conftest import FAST, wait_for

from gpumesh.client import GPUMesh
from gpumesh.config import Limits, Settings
from gpumesh.errors import RemoteError, SubmitRejected
from gpumesh.protocol import Command, ProtocolError, decode, encode
from gpumesh.security import configure_server, derive_keys

MiB = 1024 * 1024
LIMITS = Limits(max_message_bytes=4 * MiB, max_frames=16)
# What one SUBMIT may carry with the client's 1 MiB header reserve: 3 MiB, and 13 frames.


def size_of(data: Any) -> int:
    return len(data)


class StubCoordinator:
    """Answers HELLO with a WELCOME of LIMITS, HEARTBEAT with HEARTBEAT, and each SUBMIT that
    decodes under LIMITS with ACCEPTED; counts the SUBMITs that do not."""

    def __init__(self) -> None:
        self.token = secrets.token_urlsafe(32)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        configure_server(self.sock, derive_keys(self.token))
        self.url = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.submits: list[int] = []  # tasks per SUBMIT that parsed
        self.dropped = 0  # SUBMITs over the limits
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        accepted = 0
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            routing, *frames = self.sock.recv_multipart()
            try:
                msg = decode(frames, LIMITS)
            except ProtocolError:
                self.dropped += 1  # the real coordinator drops it without a word
                continue
            if msg.command is Command.HELLO:
                reply = encode(Command.WELCOME, {
                    "session": "stub", "epoch": 1, "heartbeat": 1.0, "liveness": 5,
                    "max_message_bytes": LIMITS.max_message_bytes,
                    "max_frames": LIMITS.max_frames, "fnref": True, "pythons": []})
            elif msg.command is Command.HEARTBEAT:
                reply = encode(Command.HEARTBEAT, {})
            elif msg.command is Command.SUBMIT:
                tasks = msg.header["tasks"]
                self.submits.append(len(tasks))
                ids = []
                for spec in tasks:
                    accepted += 1
                    ids.append([spec["seq"], f"task{accepted}"])
                reply = encode(Command.ACCEPTED, {"job": msg.header["job"], "accepted": ids})
            else:
                continue
            self.sock.send_multipart([routing, *reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def stub() -> Iterator[StubCoordinator]:
    coordinator = StubCoordinator()
    try:
        yield coordinator
    finally:
        coordinator.close()


@pytest.fixture
def client(stub: StubCoordinator, tmp_path) -> Iterator[GPUMesh]:
    # No shared memory: the stand-in offers none, and a client on another machine has none.
    env = {**os.environ, **FAST, "GPUMESH_HOME": str(tmp_path), "GPUMESH_SHARED_MEMORY": "0"}
    mesh = GPUMesh(stub.url, stub.token, quiet=True, settings=Settings.from_env(env))
    try:
        yield mesh
    finally:
        mesh.close()


def accepted(futures: list[Any]) -> bool:
    """Wait until the stand-in accepted every one of ``futures`` (each then has a task id)."""
    return bool(wait_for(lambda: all(getattr(f, "task_id", "") for f in futures),
                         timeout=10.0, what="the tasks accepted"))


def test_a_task_bigger_than_a_message_fails_at_once_and_is_never_sent(stub, client):
    future = client.submit(size_of, bytearray(5 * MiB))  # 5 MiB, sent in 1 MiB slices
    with pytest.raises(SubmitRejected) as caught:
        future.result(timeout=10)
    text = str(caught.value)
    assert "5.0 MiB" in text and "at most 3.0 MiB" in text
    assert "by path" in text and "GPUMESH_SHARED_MEMORY=0" in text
    small = client.submit(size_of, b"fits")  # the session goes on
    assert accepted([small])
    assert stub.submits == [1] and stub.dropped == 0


def test_a_task_of_too_many_frames_fails_with_the_count(stub, client):
    buffers = [np.zeros(64 * 1024, np.uint8) for _ in range(14)]  # each an out-of-band frame
    future = client.submit(size_of, buffers)
    with pytest.raises(SubmitRejected, match=r"is 16 frames.*at most 13"):
        future.result(timeout=10)
    assert stub.dropped == 0


def test_a_batch_too_big_for_one_message_goes_in_several(stub, client):
    # Each task fits; three do not fit one message (bytes), nor do three of the others (frames).
    by_bytes = client.submit_calls(size_of, [((bytearray(1200 * 1024),), {})] * 3)
    by_frames = client.submit_calls(
        size_of, [(([np.zeros(64 * 1024, np.uint8) for _ in range(4)],), {})] * 3)
    assert accepted(by_bytes + by_frames)
    assert stub.dropped == 0
    assert sum(stub.submits) == 6 and len(stub.submits) >= 4


def test_a_refused_task_in_a_map_leaves_the_rest_accepted(stub, client):
    calls = [((b"small",), {}), ((bytearray(5 * MiB),), {}), ((b"small too",), {})]
    futures = client.submit_calls(size_of, calls)
    with pytest.raises(SubmitRejected):
        futures[1].result(timeout=10)
    assert accepted([futures[0], futures[2]])
    assert stub.dropped == 0


def big_zeros() -> Any:
    return np.zeros(1100 * MiB, np.uint8)


def test_a_result_bigger_than_a_message_is_an_error_that_says_so(mesh_env):
    mesh_env.start_coordinator()
    # No shared memory on the worker: its results travel in messages, as from another machine.
    mesh_env.add_worker(env={"GPUMESH_SHARED_MEMORY": "0"})
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    future = client.submit(big_zeros)
    with pytest.raises(RemoteError, match=r"1,100\.0 MiB pickled.*at most 1,023\.0 MiB") as caught:
        future.result(timeout=60)
    assert caught.value.remote_type == "gpumesh.ResultTooLarge"
    assert future.attempts == 1  # refused once, not retried as a crash
    assert client.submit(size_of, b"next").result(timeout=60) == 4  # the runner is fine
