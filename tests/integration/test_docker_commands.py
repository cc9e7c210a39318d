"""The container command lines, run outside a container (these machines have no Docker engine).

Each command is taken from the Dockerfile (ENTRYPOINT + CMD, HEALTHCHECK) or from
docker-compose.yaml as written; the only changes are the ones a container's network makes for
it: 127.0.0.1 for 0.0.0.0 and for the ``coordinator`` service name, a free port for 8732, and a
temporary folder for /data. Everything stays on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for
from container_files import Dockerfile, compose, seconds, service_environment

from gpumesh.tokens import new_token

IMAGE_PORT = "8732"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Containers:
    """Processes standing in for containers: each in its own process group, logging to a file,
    all killed at teardown."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.running: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        log = (self.logs / f"{name}.log").open("wb")
        with log:
            proc = subprocess.Popen(argv, env=dict(env), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.running.append((name, proc))
        return proc

    def output(self) -> str:
        return "\n".join(f"--- {name}\n{(self.logs / f'{name}.log').read_text(errors='replace')}"
                         for name, _ in self.running)

    def check_alive(self) -> None:
        for name, proc in self.running:
            if proc.poll() is not None:
                pytest.fail(f"{name} exited with {proc.returncode}\n{self.output()}")

    def stop(self) -> None:
        for _, proc in self.running:
            _signal_group(proc, signal.SIGTERM)
        for _, proc in self.running:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc, signal.SIGKILL)  # whatever is left of the group, children too
            proc.wait(10)


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


@pytest.fixture
def containers(tmp_path: Path) -> Iterator[Containers]:
    started = Containers(tmp_path)
    try:
        yield started
    finally:
        started.stop()


class Loopback:
    """The network substitutions for one stand-in host: the container's addresses become
    loopback ones, its port a free one. Any other argument passes through unchanged."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self._map = {
            "0.0.0.0": "127.0.0.1",
            IMAGE_PORT: str(self.port),
            f"tcp://127.0.0.1:{IMAGE_PORT}": self.url,
            f"tcp://coordinator:{IMAGE_PORT}": self.url,
        }

    def argv(self, words: list[str]) -> list[str]:
        """The command with its program resolved to this environment's installed console
        script, as ``pip install`` put it on the image's PATH."""
        program = Path(sys.executable).with_name(words[0])
        assert program.exists(), f"{words[0]} is not installed next to {sys.executable}"
        return [str(program), *(self._map.get(word, word) for word in words[1:])]

    def env(self, image: Dockerfile, service: Mapping[str, Any], data: Path) -> dict[str, str]:
        """The container's environment: the image's ENV, then the service's, with /data here."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMESH_")}
        env["GPUMESH_DISCOVERY_INTERFACES"] = "127.0.0.1"  # TESTING.md, should discovery run
        env.update(image.env())
        env.update({k: self._map.get(v, v) for k, v in service_environment(service).items()})
        assert env["GPUMESH_HOME"] == "/data"
        env["GPUMESH_HOME"] = str(data)
        return env


def _run(argv: list[str], env: Mapping[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=dict(env), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)


def _workers(loopback: Loopback, image: Dockerfile, env: Mapping[str, str],
             *extra: str) -> list[dict[str, Any]]:
    result = _run(loopback.argv([*image.exec_form("ENTRYPOINT"), "workers", "--json", *extra]),
                  env, timeout=30)
    assert result.returncode == 0, result.stderr
    workers = json.loads(result.stdout)
    assert isinstance(workers, list)
    return workers


def _wait_healthy(containers: Containers, healthcheck: list[str], env: Mapping[str, str],
                  timeout: float) -> None:
    def healthy() -> bool:
        containers.check_alive()
        return _run(healthcheck, env, timeout).returncode == 0

    wait_for(healthy, timeout=60, what=f"the HEALTHCHECK to pass\n{containers.output()}")


def test_docker_run_default_command_serves_and_the_healthcheck_tells_whether_it_answers(
        tmp_path: Path, containers: Containers) -> None:
    image = Dockerfile.read()
    loopback = Loopback()
    data = tmp_path / "data"
    env = loopback.env(image, {"environment": {"GPUMESH_TOKEN": new_token()}}, data)
    options, check = image.healthcheck()
    healthcheck, timeout = loopback.argv(check), seconds(options["timeout"])

    before = _run(healthcheck, env, timeout)
    assert before.returncode != 0
    assert "nothing is listening" in before.stderr

    # docker run -e GPUMESH_TOKEN IMAGE: ENTRYPOINT + CMD
    containers.start("run", loopback.argv(image.exec_form("ENTRYPOINT") + image.exec_form("CMD")),
                     env)
    _wait_healthy(containers, healthcheck, env, timeout)

    # Healthy means this token's coordinator answers, not that a port is open.
    stranger = _run(healthcheck, {**env, "GPUMESH_TOKEN": new_token()}, timeout)
    assert stranger.returncode != 0
    assert "authentication failed" in stranger.stderr

    # A container alone is a mesh of one: its own self-worker (docker exec ... gpumesh workers).
    def self_worker() -> bool:
        containers.check_alive()
        return any(w["state"] == "alive" for w in _workers(loopback, image, env, "--url",
                                                            loopback.url))

    wait_for(self_worker, timeout=60, what=f"the self-worker\n{containers.output()}")
    # --no-save: the journal is on the volume, the token is not.
    assert (data / f"coordinator-{loopback.port}.db").exists()
    assert not (data / "token").exists() and not (data / "config.json").exists()


def test_compose_coordinator_and_worker_commands_make_a_mesh(
        tmp_path: Path, containers: Containers) -> None:
    image = Dockerfile.read()
    services = compose({"GPUMESH_TOKEN": new_token()})["services"]
    loopback = Loopback()
    entrypoint = image.exec_form("ENTRYPOINT")
    coordinator_env = loopback.env(image, services["coordinator"], tmp_path / "coordinator-data")
    options, check = image.healthcheck()
    healthcheck, timeout = loopback.argv(check), seconds(options["timeout"])

    assert _run(healthcheck, coordinator_env, timeout).returncode != 0
    containers.start("coordinator",
                     loopback.argv(entrypoint + services["coordinator"]["command"]),
                     coordinator_env)
    # depends_on: condition: service_healthy
    _wait_healthy(containers, healthcheck, coordinator_env, timeout)
    assert _workers(loopback, image, coordinator_env) == []  # --no-self-worker

    worker_env = loopback.env(image, services["worker"], tmp_path / "worker-data")
    assert worker_env["GPUMESH_DISCOVERY"] == "0" and "GPUMESH_URL" not in worker_env
    containers.start("worker", loopback.argv(entrypoint + services["worker"]["command"]),
                     worker_env)

    # docker compose exec coordinator gpumesh workers --json (GPUMESH_URL from the service)
    def joined() -> list[dict[str, Any]]:
        containers.check_alive()
        return [w for w in _workers(loopback, image, coordinator_env) if w["state"] == "alive"]

    workers = wait_for(joined, timeout=60, what=f"the worker to join\n{containers.output()}")
    assert isinstance(workers, list) and len(workers) == 1
    assert (tmp_path / "worker-data" / "workers").is_dir()  # its identity, on its own /data
    assert not (tmp_path / "worker-data" / "config.json").exists()  # --no-save
