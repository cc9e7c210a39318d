"""A worker as the coordinator sees it across restarts, copied homes and version skew."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import pytest
import zmq
from conftest import FAST, wait_for

from gpumesh.client import GPUMesh
from gpumesh.client.launch import start_worker
from gpumesh.config import Limits, Settings
from gpumesh.errors import ProtocolMismatch
from gpumesh.protocol import Command, decode, encode
from gpumesh.protocol.messages import MAGIC
from gpumesh.security import configure_server, derive_keys


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
def future_coordinator(tmp_path):
    """A stand-in for a coordinator of gpumesh protocol 2: it holds the token's keys (so the
    CURVE handshake passes) and answers every message in its own major."""
    token = "f" * 43
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    configure_server(sock, derive_keys(token))
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not sock.poll(100):
                continue
            routing, *frames = sock.recv_multipart()
            decode(frames, Limits())  # what the peer said parses as protocol 1
            sock.send_multipart([routing, MAGIC + bytes([2]), *encode(Command.WELCOME, {})[1:]])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"tcp://127.0.0.1:{port}", token
    stop.set()
    thread.join(5)
    sock.close()
    ctx.term()


def test_a_worker_of_another_protocol_is_told_at_join_what_differs(future_coordinator, tmp_path):
    url, token = future_coordinator
    env = {**os.environ, **FAST, "GPUMESH_HOME": str(tmp_path), "GPUMESH_TOKEN": token}
    done = subprocess.run([sys.executable, "-m", "gpumesh", "join", url, "--no-benchmark",
                           "--no-save"], env=env, capture_output=True, text=True, timeout=60)
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
