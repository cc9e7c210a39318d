"""The Dockerfile, .dockerignore and docker-compose.yaml, checked statically (no Docker engine on
these machines): what the image runs and as whom, what compose requires and publishes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from container_files import (
    COMPOSE,
    DOCKERIGNORE,
    ROOT,
    Dockerfile,
    InterpolationError,
    compose,
    instructions,
    interpolate,
    seconds,
    service_environment,
)

PORT = "8732"
TOKEN_ENV = {"GPUMESH_TOKEN": "salt.secret"}


@pytest.fixture(scope="module")
def image() -> Dockerfile:
    return Dockerfile.read()


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return compose(TOKEN_ENV)["services"]


def _option(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


# --- the parsers themselves --------------------------------------------------------------------

def test_the_instruction_parser_joins_continuations_and_drops_comments() -> None:
    parsed = instructions("# c\nFROM x\nRUN a \\\n    # inside\n    && b\nenv A=1 \\\n  B=2\n")
    assert [(i.name, i.value) for i in parsed] == [
        ("FROM", "x"), ("RUN", "a && b"), ("ENV", "A=1 B=2")]
    assert Dockerfile("ENV A=1 B='two words'\nENV C 3 4\n").env() == {
        "A": "1", "B": "two words", "C": "3 4"}
    with pytest.raises(AssertionError, match="shell form"):
        Dockerfile("CMD gpumesh serve\n").exec_form("CMD")
    with pytest.raises(ValueError):
        instructions("RUN a \\\n")


def test_interpolation_follows_compose_rules() -> None:
    assert interpolate("${A:-d}", {}) == "d"
    assert interpolate("${A:-d}", {"A": ""}) == "d"
    assert interpolate("${A-d}", {"A": ""}) == ""
    assert interpolate("x${A}y$$", {"A": "1"}) == "x1y$"
    with pytest.raises(InterpolationError, match="needs it"):
        interpolate("${A:?needs it}", {"A": ""})
    assert interpolate("${A?needs it}", {"A": ""}) == ""
    with pytest.raises(ValueError, match="unsupported"):
        interpolate("$A", {"A": "1"})
    assert seconds("1m30s") == 90 and seconds("500ms") == 0.5
    with pytest.raises(ValueError):
        seconds("10")


# --- Dockerfile -------------------------------------------------------------------------------

def test_the_image_is_slim_python_311_installed_from_the_build_context(image: Dockerfile) -> None:
    assert image.all("FROM") == ["python:3.11-slim"]
    runs = image.all("RUN")
    install = '"/tmp/gpumesh${GPUMESH_EXTRAS:+[$GPUMESH_EXTRAS]}"'  # sh: extras only if given
    assert any(f"pip install {install}" in run for run in runs), runs
    assert 'ARG GPUMESH_EXTRAS=""' in [f"ARG {value}" for value in image.all("ARG")]
    assert image.all("COPY") == [". /tmp/gpumesh"]


def test_the_image_runs_as_a_user_that_is_not_root(image: Dockerfile) -> None:
    user = image.last("USER").split(":")[0]
    assert user not in ("root", "0", "")
    # The user exists, and /data is its own and private before the VOLUME freezes it.
    assert any("useradd" in run and user in run for run in image.all("RUN"))
    assert any(f"-o {user}" in run and "-m 0700 /data" in run for run in image.all("RUN"))
    names = [i.name for i in image.instructions]
    assert names.index("VOLUME") < names.index("USER") < names.index("ENTRYPOINT")


def test_state_lives_in_the_data_volume_and_discovery_is_off(image: Dockerfile) -> None:
    env = image.env()
    assert env["GPUMESH_HOME"] == "/data"
    assert image.volumes() == ["/data"]
    assert env["GPUMESH_DISCOVERY"] == "0"


def test_entrypoint_and_default_command_serve_on_every_container_address(
        image: Dockerfile) -> None:
    assert image.exec_form("ENTRYPOINT") == ["gpumesh"]
    cmd = image.exec_form("CMD")
    assert cmd == ["serve", "--host", "0.0.0.0", "--port", PORT, "--no-save"]
    assert image.exposed() == [PORT]


def test_the_healthcheck_asks_the_coordinator_with_the_token(image: Dockerfile) -> None:
    options, command = image.healthcheck()
    assert command == ["gpumesh", "status", "--url", f"tcp://127.0.0.1:{PORT}"]
    assert command[0] == image.exec_form("ENTRYPOINT")[0]
    assert set(options) <= {"interval", "timeout", "start-period", "retries"}
    # status waits GPUMESH_CONNECT_TIMEOUT (3 s) for an answer: the timeout leaves room for it.
    assert seconds(options["timeout"]) >= 5
    assert int(options["retries"]) >= 1
    # A token the spec's recipe made costs each check an scrypt (--no-save caches no key).
    assert seconds(options["interval"]) >= 30


def test_dockerignore_keeps_local_state_out_and_what_pip_needs_in() -> None:
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert not any(p.startswith("!") for p in patterns)  # the check below ignores exceptions

    def docker_pattern(pattern: str) -> re.Pattern[str]:
        """Docker's matching: from the context's root; ``*`` and ``?`` stay inside one path
        segment, ``**/`` spans any number; a matched folder takes what is in it along."""
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] in "*?":
                out, i = out + ("[^/]*" if pattern[i] == "*" else "[^/]"), i + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(out + "(?:/.*)?$")

    compiled = [docker_pattern(p) for p in patterns]

    def ignored(path: str) -> bool:
        return any(c.match(path) for c in compiled)

    for path in (".venv/bin/python", ".git/HEAD", "gpumesh/__pycache__/x.pyc",
                 "bench/results/run.json", "gpumesh.egg-info/PKG-INFO", ".mypy_cache/x",
                 ".pytest_cache/x", ".hypothesis/x", ".ruff_cache/x", "build/lib/x",
                 # secrets, at the root or in any folder (`*` does not cross a "/")
                 "mesh.token", "token", ".env", ".gpumesh/config.json",
                 "examples/mesh.token", "deploy/.env", "a/b/token"):
        assert ignored(path), path
    needed = ["pyproject.toml", "README.md", "LICENSE", "gpumesh/__init__.py",
              "gpumesh/cli/main.py", "gpumesh/py.typed"]
    for path in needed:
        assert (ROOT / path).exists(), path
        assert not ignored(path), path


# --- docker-compose.yaml ----------------------------------------------------------------------

def test_compose_has_a_coordinator_and_workers(services: dict[str, Any]) -> None:
    assert set(services) == {"coordinator", "worker"}
    for service in services.values():
        assert service["build"] == "."
        assert service["image"] == services["coordinator"]["image"]
        # An init reaps a task's orphaned subprocesses; gpumesh as PID 1 would keep zombies.
        assert service["init"] is True


def test_compose_requires_the_token_with_a_message_that_says_what_to_do() -> None:
    for environ in ({}, {"GPUMESH_TOKEN": ""}):
        with pytest.raises(InterpolationError, match="run 'gpumesh token' and export it"):
            compose(environ)
    for service in compose(TOKEN_ENV)["services"].values():
        assert service_environment(service)["GPUMESH_TOKEN"] == "salt.secret"


def test_compose_publishes_on_loopback_unless_told(services: dict[str, Any]) -> None:
    assert services["coordinator"]["ports"] == [f"127.0.0.1:{PORT}:{PORT}"]
    assert "ports" not in services["worker"]
    opened = compose({**TOKEN_ENV, "GPUMESH_BIND": "0.0.0.0"})["services"]
    assert opened["coordinator"]["ports"] == [f"0.0.0.0:{PORT}:{PORT}"]


def test_compose_coordinator_listens_where_the_port_is_published(services: dict[str, Any],
                                                                 image: Dockerfile) -> None:
    command = services["coordinator"]["command"]
    assert command[0] == "serve"
    assert _option(command, "--host") == "0.0.0.0"  # loopback in a container answers nothing
    container_port = services["coordinator"]["ports"][0].rsplit(":", 1)[1]
    assert _option(command, "--port") == container_port == PORT
    assert "--no-self-worker" in command  # the workers are the replicas
    # The healthcheck the workers wait on is the image's: compose must not turn it off.
    assert "healthcheck" not in services["coordinator"]
    assert image.healthcheck()[1][-1] == f"tcp://127.0.0.1:{PORT}"
    assert service_environment(services["coordinator"])["GPUMESH_URL"] == f"tcp://127.0.0.1:{PORT}"


def test_compose_workers_wait_for_a_healthy_coordinator_and_dial_it_by_name(
        services: dict[str, Any]) -> None:
    worker = services["worker"]
    assert worker["depends_on"] == {"coordinator": {"condition": "service_healthy"}}
    assert worker["command"][0] == "join"
    assert worker["command"][1] == f"tcp://coordinator:{PORT}"
    # Multicast does not cross the bridge network: no discovery, the URL is given.
    assert service_environment(worker)["GPUMESH_DISCOVERY"] == "0"
    assert worker["healthcheck"] == {"disable": True}


def test_compose_worker_replicas_come_from_worker_replicas() -> None:
    def replicas(environ: dict[str, str]) -> int:
        return int(compose({**TOKEN_ENV, **environ})["services"]["worker"]["deploy"]["replicas"])

    assert replicas({}) == 2
    assert replicas({"WORKER_REPLICAS": "4"}) == 4


def test_compose_keeps_the_journal_in_a_named_volume(services: dict[str, Any]) -> None:
    document = compose(TOKEN_ENV)
    assert services["coordinator"]["volumes"] == ["gpumesh-data:/data"]
    assert "gpumesh-data" in document["volumes"]
    # Workers never share it: each replica keeps its own /data, so each has its own identity.
    assert "volumes" not in services["worker"]


def test_compose_gpu_passthrough_is_a_commented_block_that_parses_when_uncommented(
        tmp_path: Path) -> None:
    lines = COMPOSE.read_text().splitlines()
    first = next(n for n, line in enumerate(lines) if line.strip() == "# resources:")
    column = lines[first].index("#")
    block = first
    while block < len(lines) and lines[block][column:column + 2] == "# " and (
            block == first or lines[block][column + 2] == " "):
        block += 1
    uncommented = lines[:first] + [
        line[:column] + line[column + 2:] for line in lines[first:block]] + lines[block:]
    edited = tmp_path / "docker-compose.yaml"
    edited.write_text("\n".join(uncommented) + "\n")
    worker = compose(TOKEN_ENV, edited)["services"]["worker"]
    assert worker["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert worker["deploy"]["replicas"] == "2"
    assert "resources" not in compose(TOKEN_ENV)["services"]["worker"]["deploy"]
