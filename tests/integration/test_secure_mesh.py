"""Authentication, hostile input, safe defaults, and the token kept out of every output."""

from __future__ import annotations

import os
import random
import re
import select
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import psutil
import pytest
import zmq
from conftest import wait_for

from gpumesh import AuthenticationError, SubmitRejected
from gpumesh.client import GPUMesh
from gpumesh.config import Settings, parse_url
from gpumesh.protocol import SIGNATURE, Command, encode
from gpumesh.security import configure_client, derive_keys


def double(x):
    return 2 * x


def test_wrong_token_client_fails_fast_and_the_mesh_keeps_serving(mesh_env):
    mesh_env.start_coordinator()
    mesh_env.add_worker()
    started = time.time()
    intruder = mesh_env.client(token="not-the-token-" + "x" * 30)
    with pytest.raises(AuthenticationError, match="token does not match this coordinator"):
        intruder.workers()
    # Seconds, not the retries forever of a link that never learns why it fails (generous:
    # a loaded CI machine takes seconds to derive keys and run two handshakes).
    assert time.time() - started < 15
    assert mesh_env.client().submit(double, 21).result(timeout=30) == 42


def test_wrong_token_worker_fails_fast_with_a_clear_error(mesh_env):
    coordinator = mesh_env.start_coordinator()
    env = {**os.environ, **mesh_env.env, "GPUMESH_TOKEN": "wrong-" + "y" * 40}
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "gpumesh", "join", coordinator.url, "--no-benchmark", "--no-save"],
        env=env, capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 1
    assert "authentication failed: the token does not match this coordinator" in proc.stderr
    assert time.time() - started < 20  # it gives up by itself: the run's timeout is 30 s
    assert env["GPUMESH_TOKEN"] not in proc.stdout + proc.stderr
    # A refused join must not replace the saved connection with its wrong token.
    assert not (mesh_env.home / "config.json").exists()


def _authenticated_dealer(ctx, url, token):
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    configure_client(sock, derive_keys(token))
    sock.connect(url)
    return sock


def test_garbage_from_strangers_and_peers_does_not_stop_the_coordinator(mesh_env):
    coordinator = mesh_env.start_coordinator()
    mesh_env.add_worker()
    endpoint = parse_url(coordinator.url)
    rng = random.Random(7)
    # Unauthenticated: raw TCP bytes, and a ZMTP greeting with garbage after it.
    for _ in range(30):
        with socket.create_connection((endpoint.host, endpoint.port), timeout=5) as raw:
            raw.sendall(rng.randbytes(rng.randint(1, 4096)))
    # Authenticated but malformed: every kind of bad message the decoder must survive.
    ctx = zmq.Context()
    try:
        peer = _authenticated_dealer(ctx, coordinator.url, mesh_env.token)
        bad = [
            [b"nonsense"],
            [b"XYZ\x01", b"\x01", b"\x80"],  # wrong signature
            [b"GPM\x09", b"\x01", msgpack.packb({})],  # wrong major version
            [SIGNATURE, b"\x7f", msgpack.packb({})],  # unknown command
            [SIGNATURE, b"\x01\x02", msgpack.packb({})],  # two-byte command
            [SIGNATURE, bytes([Command.SUBMIT]), b"\xc1\xc1\xc1"],  # garbage msgpack
            [SIGNATURE, bytes([Command.SUBMIT]), msgpack.packb([1, 2])],  # header not a map
            encode(Command.HELLO, {"role": "worker", "id": "x" * 500, "slots": 1}),
            encode(Command.HELLO, {"role": "admin", "id": "abc"}),
            encode(Command.RESULT, {"task": "nope", "lease": 1, "status": "ok"}),  # no session
            encode(Command.HELLO, {"role": "client", "id": "fuzzer", "proto": [1, 1]}),
            encode(Command.SUBMIT, {"tasks": [{"seq": 1, "nf": 5, "kind": "fn"}]}, [b"x"]),
            encode(Command.SUBMIT, {"tasks": "not a list"}),
            encode(Command.QUERY, {"what": "secrets"}),
            encode(Command.RESULT, {"task": "t", "lease": 1, "status": "ok"}),  # client sent RESULT
            encode(Command.FETCH, {"tasks": [1, None, "x"]}),
        ]
        for i in range(2000):
            if i % 4 == 0:
                frames = [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 6))]
            else:
                frames = bad[i % len(bad)]
            peer.send_multipart(frames)
        peer.close()
    finally:
        ctx.term()
    client = mesh_env.client()
    assert client.map(double, range(20)) == [2 * i for i in range(20)]


def test_serve_binds_loopback_by_default_and_writes_the_config_owner_only(mesh_env):
    coordinator = mesh_env.start_coordinator(save=True)
    listening = [c for c in psutil.Process(coordinator.pid).net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN]
    assert [c.laddr.ip for c in listening] == ["127.0.0.1"]
    config = mesh_env.home / "config.json"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert stat.S_IMODE(os.stat(mesh_env.db).st_mode) == 0o600
    saved = Settings.from_env({"GPUMESH_HOME": str(mesh_env.home)}).saved_connection()
    assert saved is not None and saved.url == coordinator.url and saved.token == mesh_env.token


def test_safe_mode_refuses_functions_and_runs_scripts(mesh_env, tmp_path):
    mesh_env.start_coordinator(safe_mode=True)
    mesh_env.add_worker()
    client = mesh_env.client()
    with pytest.raises(SubmitRejected, match="--safe-mode"):
        client.submit(double, 1).result(timeout=30)
    script = tmp_path / "ok.py"
    script.write_text("import json, sys; print(json.load(sys.stdin)['n'] + 1)\n")
    job = client.submit(script=script, payloads=[{"n": 1}])
    assert client.job_futures(job)[0].result(timeout=30) == 2


def _serve_banner(env: dict[str, str], *args: str, timeout: float = 60) -> str:
    """What ``gpumesh serve ARGS`` prints up to its self-check (or its failure), then stop it."""
    proc = subprocess.Popen([sys.executable, "-m", "gpumesh", "serve", "--port", "0", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    assert proc.stdout is not None
    out = b""
    deadline = time.time() + timeout
    try:
        while b"Self-check" not in out and b"error" not in out and proc.poll() is None:
            if time.time() > deadline:
                pytest.fail(f"serve printed no self-check within {timeout}s: {out.decode()}")
            if select.select([proc.stdout], [], [], 0.5)[0]:
                out += os.read(proc.stdout.fileno(), 65536)
    finally:
        proc.terminate()
        out += proc.communicate(timeout=10)[0]
    return out.decode()


def test_exposed_bind_prints_the_warning_banner(mesh_env):
    env = {**os.environ, **mesh_env.env, "GPUMESH_TOKEN": mesh_env.token}
    text = _serve_banner(env, "--host", "0.0.0.0", "--no-self-worker")
    assert "NETWORK-EXPOSED COORDINATOR" in text
    assert "arbitrary code on this machine as" in text
    assert mesh_env.token not in text


@pytest.mark.parametrize("save", [True, False], ids=["saved", "not-saved"])
def test_the_exposed_banner_prints_the_join_command_for_another_machine(mesh_env, save):
    env = {**os.environ, **mesh_env.env, "GPUMESH_TOKEN": mesh_env.token}
    # --host-ip makes the printed address this test's choice, not this machine's LAN address.
    text = _serve_banner(env, "--host", "0.0.0.0", "--host-ip", "127.0.0.2", "--no-self-worker",
                         *([] if save else ["--no-save"]))
    port = re.search(r"Coordinator listening on 0\.0\.0\.0:(\d+)", text)
    assert port is not None, text
    token_file = str(mesh_env.home / "token")
    if token_file.startswith(str(Path.home()) + os.sep):
        token_file = "~" + token_file[len(str(Path.home())):]
    token_arg = f"--token-file {token_file}" if save else "--token-file FILE"
    lines = text.splitlines()
    # Discovery finds the coordinator: the command carries neither an address nor the token.
    assert f"   Join from ANOTHER machine: gpumesh join {token_arg}" in lines, text
    assert f"   (or with the address: gpumesh join tcp://127.0.0.2:{port[1]} {token_arg}; the " \
           "token file copied there, readable only by you)" in lines, text
    assert mesh_env.token not in text


def test_token_never_appears_in_verbose_logs(mesh_env):
    env = {**os.environ, **mesh_env.env, "GPUMESH_TOKEN": mesh_env.token}
    serve = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "-v", "serve", "--port", "0", "--db", mesh_env.db],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    lines = []
    try:
        assert serve.stdout is not None
        for line in serve.stdout:
            lines.append(line)
            if "joined mesh as" in line:
                break
        client = GPUMesh(token=mesh_env.token, quiet=True, settings=mesh_env.settings)
        wait_for(lambda: client.connect(), what="a connection")
        assert client.submit(double, 2).result(timeout=30) == 4
        client.close()
    finally:
        serve.terminate()
        out, _ = serve.communicate(timeout=15)
    text = "".join(lines) + out
    assert "joined mesh as" in text
    assert mesh_env.token not in text
