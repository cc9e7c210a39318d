"""Turning a Python call or a script run into a task spec and payload frames."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..protocol import serialize
from ..scheduler import Requirements

PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


@dataclass(frozen=True)
class TaskOptions:
    """Per-task controls. ``requirements`` are filters the scheduler applies."""

    timeout: float | None = None
    max_attempts: int = 3
    priority: int = 0
    cost: float = 1.0
    requirements: Requirements = Requirements()

    def spec(self, kind: str) -> dict[str, Any]:
        spec: dict[str, Any] = {"kind": kind, "max_attempts": self.max_attempts}
        if self.timeout is not None:
            spec["timeout"] = float(self.timeout)
        if self.priority:
            spec["priority"] = int(self.priority)
        if self.cost != 1.0:
            spec["cost"] = float(self.cost)
        req = self.requirements.to_mapping()
        if kind == "fn":
            req["python"] = PYTHON  # a pickled function needs the same Python on the worker
        if req:
            spec["req"] = req
        return spec


class PickledFunction:
    """A function pickled once and shared by every task of a batch."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.frame = serialize.dumps(fn)
        if len(self.frame) != 1:  # a function that closes over big buffers: keep them in-band
            import cloudpickle

            self.frame = [cloudpickle.dumps(fn, protocol=serialize.PROTOCOL)]
        self.digest = serialize.function_digest(self.frame[0])

    def task(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], options: TaskOptions
             ) -> tuple[dict[str, Any], list[Any]]:
        spec = options.spec("fn")
        spec["fn"] = self.digest
        return spec, [self.frame[0], *serialize.dumps((args, dict(kwargs)))]


def call_arguments(item: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """How a ``.map`` item becomes a call: a dict is keyword arguments, a tuple positional ones,
    anything else a single positional argument."""
    if isinstance(item, Mapping):
        return (), dict(item)
    if isinstance(item, tuple):
        return item, {}
    return (item,), {}


def script_task(name: str, source: bytes, payload: Any, options: TaskOptions
                ) -> tuple[dict[str, Any], list[Any]]:
    spec = options.spec("script")
    spec["name"] = name
    return spec, [source, json.dumps(payload).encode("utf-8")]
