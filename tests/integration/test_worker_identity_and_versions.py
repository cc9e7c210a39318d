"""A worker as the coordinator sees it across restarts, copied homes and version skew."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import threading
from typing import Any

import pytest
import zmq
from conftest import FAST, wait_for

from gpumesh import __version__
from gpumesh.client import GPUMesh
from gpumesh.client.launch import start_worker
from gpumesh.config import Limits, Settings
from gpumesh.errors import ProtocolMismatch
from gpumesh.protocol import MAJOR, Command, ErrorCode, decode, encode
from gpumesh.protocol.messages import MAGIC
from gpumesh.security import configure_client, configure_server, derive_keys


def test_a_restarted_worker_keeps_its_id_and_a_copied_home_makes_another(mesh_env, tmp_path):
    mesh_env.start_coordinator()
    url = mesh_env.coordinator.url
    home = tmp_path / "machine"
    home.mkdir()
    first = start_worker(url, mesh_env.token, home=str(home), slots=1, env=mesh_env.env)
    first.stop()
    again = start_worker(url, mesh_env.token, home=str(home), slots=1, env=mesh_env.env)
    copy = tmp_path / "copied"
    shutil.copytree(home, copy)  # the folder taken to another machine
    other = start_worker(url, mesh_env.token, home=str(copy), slots=1, env=mesh_env.env)
    try:
        assert again.worker_id == first.worker_id  # a restart is the same worker
        assert other.worker_id != again.worker_id  # a copy is not
        client = mesh_env.client()
        wait_for(lambda: {again.worker_id, other.worker_id}
                 <= {w["id"] for w in client.workers() if w["alive"]}, what="both workers")
        assert len(client.workers()) == 2  # no ghost of the restarted one
    finally:
        other.stop()
        again.stop()


@pytest.fixture
def stub_coordinator():
    """Stand-ins for coordinators of another gpumesh: each holds the token's keys (so the CURVE
    handshake passes) and answers every message with one reply, signed with ``major``."""
    ctx = zmq.Context()
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start(major: int, command: Command, header: dict[str, Any]) -> tuple[str, str]:
        token = secrets.token_urlsafe(32)
        sock = ctx.socket(zmq.ROUTER)
        sock.linger = 0
        configure_server(sock, derive_keys(token))
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        reply = [MAGIC + bytes([major]), *encode(command, header)[1:]]

        def serve() -> None:
            try:
                while not stop.is_set():
                    if not sock.poll(100):
                        continue
                    routing, *frames = sock.recv_multipart()
                    decode(frames, Limits())  # what the peer said parses as protocol 1
                    sock.send_multipart([routing, *reply])
            finally:
                sock.close()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        threads.append(thread)
        return f"tcp://127.0.0.1:{port}", token

    yield start
    stop.set()
    for thread in threads:
        thread.join(5)
    ctx.term()


@pytest.fixture
def future_coordinator(stub_coordinator):
    """A coordinator of gpumesh protocol 2 that names no version: it answers WELCOME."""
    return stub_coordinator(2, Command.WELCOME, {})


def _join(url: str, token: str, home) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **FAST, "GPUMESH_HOME": str(home), "GPUMESH_TOKEN": token}
    return subprocess.run([sys.executable, "-m", "gpumesh", "join", url, "--no-benchmark",
                           "--no-save"], env=env, capture_output=True, text=True, timeout=60)


def test_a_worker_of_another_protocol_is_told_at_join_what_differs(future_coordinator, tmp_path):
    url, token = future_coordinator
    done = _join(url, token, tmp_path)
    assert done.returncode == 1
    assert "speaks gpumesh protocol 2 and this gpumesh" in done.stderr
    assert "install the coordinator's gpumesh version here" in done.stderr
    assert token not in done.stdout + done.stderr


def test_a_client_of_another_protocol_gets_protocol_mismatch(future_coordinator, tmp_path):
    url, token = future_coordinator
    settings = Settings.from_env({**os.environ, **FAST, "GPUMESH_HOME": str(tmp_path)})
    with GPUMesh(url, token, quiet=True, settings=settings) as mesh, \
            pytest.raises(ProtocolMismatch, match="speaks gpumesh protocol 2"):
        mesh.connect(timeout=10)


def _coordinators_answer(mesh_env, frames: list) -> Any:
    """What a live coordinator answers a token holder's raw DEALER that sends ``frames``."""
    mesh_env.start_coordinator()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        configure_client(sock, derive_keys(mesh_env.token))
        sock.connect(mesh_env.coordinator.url)
        sock.send_multipart(frames)
        assert sock.poll(15_000), "no answer from the coordinator"
        return decode(sock.recv_multipart(), Limits())
    finally:
        sock.close()
        ctx.term()


HELLO_OF_PROTOCOL_2 = {"role": "worker", "id": "w-of-protocol-2", "proto": [2, 2]}


def test_the_coordinator_names_its_gpumesh_version_when_it_refuses_a_protocol(mesh_env):
    # A peer of protocol 2 only, framed so that this coordinator reads its HELLO.
    answer = _coordinators_answer(mesh_env, encode(Command.HELLO, HELLO_OF_PROTOCOL_2))
    assert answer.command is Command.ERROR and answer.header["code"] == ErrorCode.VERSION.value
    assert answer.header["gpumesh"] == __version__
    assert f"runs gpumesh {__version__} and speaks protocol v{MAJOR}" in answer.header["message"]


def test_a_message_of_another_major_is_refused_with_the_coordinators_version(mesh_env):
    # What a peer of protocol 2 would send: its own signature, which this one cannot read.
    hello = encode(Command.HELLO, HELLO_OF_PROTOCOL_2)
    answer = _coordinators_answer(mesh_env, [hello[0][:-1] + bytes([MAJOR + 1]), *hello[1:]])
    assert answer.command is Command.ERROR and answer.header["code"] == ErrorCode.VERSION.value
    assert answer.header["gpumesh"] == __version__


REFUSAL = {"code": ErrorCode.VERSION.value,
           "message": "this coordinator runs gpumesh 2.0.0 and speaks protocol v2, the peer [1, 1]"}


def test_a_worker_refused_for_its_protocol_is_told_which_gpumesh_to_install(stub_coordinator,
                                                                            tmp_path):
    url, token = stub_coordinator(MAJOR, Command.ERROR, {**REFUSAL, "gpumesh": "2.0.0"})
    done = _join(url, token, tmp_path)
    assert done.returncode == 1
    assert f"refused this worker: {REFUSAL['message']}; this is gpumesh {__version__}: install " \
           "gpumesh 2.0.0 here ('pip install gpumesh==2.0.0')" in done.stderr
    assert token not in done.stdout + done.stderr


def test_a_refusal_from_a_coordinator_older_than_the_version_field_still_reads(stub_coordinator,
                                                                               tmp_path):
    url, token = stub_coordinator(MAJOR, Command.ERROR, REFUSAL)
    done = _join(url, token, tmp_path)
    assert done.returncode == 1
    assert f"refused this worker: {REFUSAL['message']}" in done.stderr
    assert "install gpumesh" not in done.stderr  # no number to quote, and none made up


def test_a_peer_of_another_major_quotes_the_version_its_error_names(stub_coordinator, tmp_path):
    url, token = stub_coordinator(2, Command.ERROR, {**REFUSAL, "gpumesh": "2.0.0"})
    done = _join(url, token, tmp_path)
    assert done.returncode == 1
    assert f"runs gpumesh 2.0.0 (protocol 2) and this gpumesh ({__version__}) speaks {MAJOR}: " \
           "install gpumesh 2.0.0 here ('pip install gpumesh==2.0.0')" in done.stderr
    assert token not in done.stdout + done.stderr
    settings = Settings.from_env({**os.environ, **FAST, "GPUMESH_HOME": str(tmp_path)})
    with GPUMesh(url, token, quiet=True, settings=settings) as mesh, \
            pytest.raises(ProtocolMismatch, match=r"install gpumesh 2\.0\.0 here"):
        mesh.connect(timeout=10)
