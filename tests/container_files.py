"""The repository's Dockerfile and docker-compose.yaml read as Docker reads them, for tests on
machines without a Docker engine: Dockerfile instructions, and the compose file parsed with
PyYAML and interpolated from a given environment (``${VAR:-default}``, ``${VAR:?message}``)."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yaml"
DOCKERIGNORE = ROOT / ".dockerignore"


@dataclass(frozen=True)
class Instruction:
    name: str  # upper case: FROM, RUN, ...
    value: str  # the rest of the logical line, continuations joined


def instructions(text: str) -> list[Instruction]:
    """Logical lines of a Dockerfile: comments dropped, backslash continuations joined (a
    comment line inside a continued instruction is skipped, as Docker does)."""
    result: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        logical = (pending + line).strip()
        pending = ""
        name, _, value = logical.partition(" ")
        result.append(Instruction(name.upper(), value.strip()))
    if pending:
        raise ValueError(f"Dockerfile ends inside a continued line: {pending!r}")
    return result


class Dockerfile:
    def __init__(self, text: str) -> None:
        self.instructions = instructions(text)

    @classmethod
    def read(cls, path: Path = DOCKERFILE) -> Dockerfile:
        return cls(path.read_text(encoding="utf-8"))

    def all(self, name: str) -> list[str]:
        return [i.value for i in self.instructions if i.name == name]

    def last(self, name: str) -> str:
        """The instruction that wins: Docker keeps the last CMD, ENTRYPOINT, USER, HEALTHCHECK."""
        values = self.all(name)
        if not values:
            raise AssertionError(f"the Dockerfile has no {name}")
        return values[-1]

    def exec_form(self, name: str) -> list[str]:
        """A JSON-array (exec form) instruction; the shell form is refused: it would run under
        /bin/sh, which neither forwards signals nor keeps arguments as written."""
        return _exec_form(name, self.last(name))

    def env(self) -> dict[str, str]:
        """Every ENV, in order (``KEY=VALUE`` pairs; the legacy ``ENV KEY VALUE`` form too)."""
        env: dict[str, str] = {}
        for value in self.all("ENV"):
            words = shlex.split(value)
            if words and "=" not in words[0]:
                env[words[0]] = value.split(None, 1)[1] if len(words) > 1 else ""
                continue
            for word in words:
                key, sep, val = word.partition("=")
                if not sep:
                    raise ValueError(f"ENV word without '=': {word!r}")
                env[key] = val
        return env

    def volumes(self) -> list[str]:
        paths: list[str] = []
        for value in self.all("VOLUME"):
            paths += json.loads(value) if value.startswith("[") else value.split()
        return paths

    def exposed(self) -> list[str]:
        return [port for value in self.all("EXPOSE") for port in value.split()]

    def healthcheck(self) -> tuple[dict[str, str], list[str]]:
        """The last HEALTHCHECK: its ``--option=value`` settings and its exec-form command."""
        value = self.last("HEALTHCHECK")
        options: dict[str, str] = {}
        rest = value
        while rest.startswith("--"):
            option, _, rest = rest.partition(" ")
            key, _, val = option[2:].partition("=")
            options[key] = val
            rest = rest.lstrip()
        if rest.upper() == "NONE":
            raise AssertionError("HEALTHCHECK NONE: the image has no healthcheck")
        kind, _, command = rest.partition(" ")
        if kind.upper() != "CMD":
            raise AssertionError(f"HEALTHCHECK without CMD: {value!r}")
        return options, _exec_form("HEALTHCHECK CMD", command.strip())


def _exec_form(what: str, value: str) -> list[str]:
    if not value.startswith("["):
        raise AssertionError(f"{what} is in shell form: {value!r}; use a JSON array")
    words = json.loads(value)
    if not (isinstance(words, list) and all(isinstance(w, str) for w in words)):
        raise AssertionError(f"{what} is not an array of strings: {value!r}")
    return words


def seconds(duration: str) -> float:
    """A Docker duration such as ``30s``, ``1m30s`` or ``500ms``."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"not a Docker duration: {duration!r}")
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * scale[u] for n, u in parts)


class InterpolationError(Exception):
    """What ``docker compose`` stops with: a required variable is missing."""


_VARIABLE = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|(\S))")


def interpolate(value: str, environ: Mapping[str, str]) -> str:
    """Compose's substitution for the forms this repository uses; any other ``$`` use is an
    error here, so the file cannot grow a form these tests do not understand."""

    def one(match: re.Match[str]) -> str:
        escaped, name, operator, argument, other = match.groups()
        if escaped:
            return "$"
        if other is not None:
            raise ValueError(f"unsupported substitution in {value!r}: use ${{NAME...}}")
        present = name in environ
        set_and_not_empty = present and environ[name] != ""
        if operator is None:
            return environ.get(name, "")
        usable = set_and_not_empty if operator.startswith(":") else present
        if usable:
            return environ[name]
        if operator.endswith("-"):
            return argument
        raise InterpolationError(f"required variable {name} is missing a value: {argument}")

    return _VARIABLE.sub(one, value)


def _interpolated(node: Any, environ: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, environ)
    if isinstance(node, list):
        return [_interpolated(item, environ) for item in node]
    if isinstance(node, dict):
        return {key: _interpolated(item, environ) for key, item in node.items()}
    return node


def compose(environ: Mapping[str, str], path: Path = COMPOSE) -> dict[str, Any]:
    """The compose file as ``docker compose config`` would see it with ``environ``: YAML
    (anchors and ``<<`` merges resolved), ``x-`` extension fields dropped, values interpolated.
    Raises InterpolationError when a required variable is unset."""
    import yaml

    loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(loaded, dict), "the compose file is not a mapping"
    document = {key: item for key, item in loaded.items() if not str(key).startswith("x-")}
    result = _interpolated(document, environ)
    assert isinstance(result, dict)
    return result


def service_environment(service: Mapping[str, Any]) -> dict[str, str]:
    """A service's ``environment``, mapping or ``KEY=VALUE`` list form."""
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        pairs = (item.partition("=") for item in environment)
        return {key: value for key, _, value in pairs}
    return {str(key): "" if value is None else str(value) for key, value in environment.items()}
