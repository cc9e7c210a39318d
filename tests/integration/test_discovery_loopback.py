"""LAN discovery's zeroconf round trip, on loopback only (TESTING.md: the root namespace never
multicasts on a real interface; tests/lan covers real fake hosts)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FAST, wait_for

from gpumesh import discovery
from gpumesh.discovery import Advertiser, browse, find_coordinator
from gpumesh.errors import ConfigError, ProtocolMismatch
from gpumesh.protocol import MAJOR
from gpumesh.security import derive_keys

LOOPBACK = ["127.0.0.1"]


@pytest.fixture
def advertise():
    started: list[Advertiser] = []

    def start(token: str, port: int) -> Advertiser:
        advertiser = Advertiser(port=port, addresses=LOOPBACK, interfaces=LOOPBACK,
                                fingerprint=derive_keys(token).fingerprint)
        advertiser.start()
        started.append(advertiser)
        assert advertiser.registered.wait(15), "zeroconf registration did not finish"
        return advertiser

    yield start
    for advertiser in started:
        advertiser.close()


def test_a_mesh_is_found_by_its_token_and_others_only_by_host(advertise):
    ours, theirs = "o" * 40, "x" * 40
    advertise(ours, 45001)
    advertise(theirs, 45002)
    url, found = find_coordinator(ours, LOOPBACK, 10.0)
    assert url == "tcp://127.0.0.1:45001" and found.mesh == derive_keys(ours).fingerprint
    with pytest.raises(ConfigError, match="it saw other meshes only, on: ") as refused:
        find_coordinator("n" * 40, LOOPBACK, 6.0)
    assert "45002" not in str(refused.value)  # other meshes by host name only
    # Each browse is a new zeroconf that must hear both within its time: on a loaded machine
    # an answer can come late, so it may take more than one.
    wait_for(lambda: len(browse(3.0, LOOPBACK)) == 2, 30, "both meshes found by one browse")


def test_two_coordinators_of_one_mesh_are_listed_not_guessed(advertise, monkeypatch):
    # Browsing settles SETTLE seconds after the first of this mesh; on a loaded machine the
    # second's answer may come later than that, and only one would be found.
    monkeypatch.setitem(browse.__kwdefaults__, "settle", 5.0)
    token = "s" * 40
    advertise(token, 45011)
    advertise(token, 45012)
    with pytest.raises(ConfigError, match="several coordinators of this mesh") as several:
        find_coordinator(token, LOOPBACK, 5.0)
    assert "45011" in str(several.value) and "45012" in str(several.value)


def test_a_coordinator_of_another_protocol_is_named_with_what_to_install(advertise, monkeypatch):
    monkeypatch.setattr(discovery, "txt_record",
                        lambda fp: {"txtvers": "1", "role": "coord", "proto": str(MAJOR + 1),
                                    "mesh": fp, "ver": "9.0.0", "py": "3.13", "host": "desk"})
    token = "p" * 40
    advertise(token, 45021)
    with pytest.raises(ProtocolMismatch, match=r"runs gpumesh 9.0.0 .*install gpumesh 9.0.0"):
        find_coordinator(token, LOOPBACK, 5.0)


def test_no_interface_means_a_clear_error_without_browsing():
    with pytest.raises(ConfigError, match="no LAN interface"):
        find_coordinator("t" * 40, [], 1.0)


# ----------------------------------------------------------------- the commands, on loopback

def _gpumesh(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpumesh", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def advertised_serve(tmp_path):
    """``serve`` bound to 127.0.0.1 and advertising it (--host-ip), as a one-machine stand-in
    for a LAN coordinator: (port, env with the token)."""
    token = secrets.token_urlsafe(32)
    env = {**os.environ, **FAST, "GPUMESH_HOME": str(tmp_path / "coord"), "GPUMESH_TOKEN": token,
           "GPUMESH_DISCOVERY_TIMEOUT": "10"}
    env.pop("GPUMESH_URL", None)
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "gpumesh", "serve", "--port", "0",
                             "--host-ip", "127.0.0.1", "--no-self-worker", "--no-save",
                             "--ready-fd", str(write_fd)], env=env, pass_fds=[write_fd],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    os.close(write_fd)
    try:
        with os.fdopen(read_fd, "rb") as ready:
            port = int(ready.readline() or b"0")
        assert port, "serve did not start"
        # Ready means it listens; its zeroconf registration (probing included) goes on.
        find_coordinator(token, LOOPBACK, 30.0)
        yield port, env, proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=15)


def test_join_discover_and_a_client_find_the_mesh_by_token_alone(advertised_serve, tmp_path):
    port, env, serve = advertised_serve
    worker_env = {**env, "GPUMESH_HOME": str(tmp_path / "worker")}
    read_fd, write_fd = os.pipe()
    worker = subprocess.Popen([sys.executable, "-m", "gpumesh", "join", "--no-benchmark",
                               "--slots", "1", "--ready-fd", str(write_fd)], env=worker_env,
                              pass_fds=[write_fd], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    os.close(write_fd)
    try:
        with os.fdopen(read_fd, "rb") as ready:
            assert ready.readline().strip(), "the worker did not join"
        listed = json.loads(_gpumesh("discover", "--json", env=worker_env).stdout)
        assert [(e["url"], e["mesh"]) for e in listed] == [(f"tcp://127.0.0.1:{port}", "this mesh")]
        # The worker saved what it found: later commands there need nothing more.
        saved = json.loads((tmp_path / "worker" / "config.json").read_text())
        assert saved["url"] == f"tcp://127.0.0.1:{port}"
        # A client with only the token (nothing saved, no URL) finds it too.
        client_env = {**env, "GPUMESH_HOME": str(tmp_path / "client")}
        code = ("from gpumesh import GPUMesh\n"
                "with GPUMesh(quiet=True) as m:\n"
                "    print(m.url, len([w for w in m.workers() if w['alive']]))\n")
        done = subprocess.run([sys.executable, "-c", code], env=client_env, capture_output=True,
                              text=True, timeout=60)
        assert done.stdout.split() == [f"tcp://127.0.0.1:{port}", "1"], done.stderr
        # So does a monitoring command with nothing saved and no --url.
        workers = _gpumesh("workers", "--json", env={**env, "GPUMESH_HOME": str(tmp_path / "cli")})
        assert [w["alive"] for w in json.loads(workers.stdout)] == [True], workers.stderr
        for out in (done.stdout + done.stderr, json.dumps(listed), workers.stdout + workers.stderr):
            assert env["GPUMESH_TOKEN"] not in out
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        output = worker.communicate(timeout=15)[0]
    assert "[worker] found it on " in output and env["GPUMESH_TOKEN"] not in output


def test_join_without_url_says_what_it_saw_and_how_to_go_on(advertised_serve, tmp_path):
    _, env, _ = advertised_serve
    stranger = {**env, "GPUMESH_HOME": str(tmp_path / "s"), "GPUMESH_TOKEN": "w" * 40,
                "GPUMESH_DISCOVERY_TIMEOUT": "6"}
    failed = _gpumesh("join", "--no-benchmark", env=stranger)
    assert failed.returncode == 1
    assert "no coordinator of this mesh answered on the LAN within 6s" in failed.stderr
    assert "it saw other meshes only, on: " in failed.stderr
    assert "gpumesh join tcp://HOST:PORT" in failed.stderr
    off = _gpumesh("join", "--no-benchmark", env={**stranger, "GPUMESH_DISCOVERY": "0"})
    assert off.returncode == 1 and "LAN discovery is off" in off.stderr


def test_the_second_machine_example_prints_the_join_command_of_the_live_mesh(advertised_serve,
                                                                             tmp_path):
    port, env, _ = advertised_serve
    example = Path(__file__).parents[2] / "examples" / "second_machine.py"
    run_env = {**env, "GPUMESH_HOME": str(tmp_path / "here"), "GPUMESH_URL": f"127.0.0.1:{port}"}
    done = subprocess.run([sys.executable, str(example)], env=run_env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "gpumesh join --token-file mesh.token" in done.stdout
    assert f"gpumesh join tcp://127.0.0.1:{port} --token-file mesh.token" in done.stdout
    assert env["GPUMESH_TOKEN"] not in done.stdout + done.stderr
    # Against a mesh nobody advertises, it says how to open it instead.
    quiet = subprocess.run([sys.executable, str(example)], env={**run_env, "GPUMESH_DISCOVERY": "0"},
                           capture_output=True, text=True, timeout=60)
    assert "Other machines cannot find this mesh" in quiet.stdout, quiet.stderr
    # Filled in with this mesh's port and token file (it printed ~/.gpumesh/token and no port,
    # wherever GPUMESH_HOME put them).
    assert f"gpumesh serve --host 0.0.0.0 --port {port} --token-file " in quiet.stdout
    assert "here/token" in quiet.stdout and f"tcp://THAT_ADDRESS:{port}" in quiet.stdout
    assert "~/.gpumesh/token" not in quiet.stdout + done.stdout
    assert env["GPUMESH_TOKEN"] not in quiet.stdout + quiet.stderr
