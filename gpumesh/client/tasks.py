"""Turning a Python call or a script run into a task spec and payload frames."""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..errors import ConfigError
from ..protocol import serialize
from ..scheduler import Requirements
from .portable import SourceForm

# Keys of a payload dict (a `.map` item, a script payload) that the scheduler reads instead of
# handing them to the code: four filters and the placement weight. docs/protocol.md lists them.
SCHEDULER_KEYS = ("gpu", "cores", "memory", "vram", "cost")
Call = tuple[tuple[Any, ...], dict[str, Any], "TaskOptions"]

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
        self.name = getattr(fn, "__qualname__", repr(fn))
        try:
            self.frame = serialize.dumps(fn)
        except Exception as exc:
            raise _unpicklable(f"the function {self.name}", exc) from exc
        if len(self.frame) != 1:  # a function that closes over big buffers: keep them in-band
            import cloudpickle

            self.frame = [cloudpickle.dumps(fn, protocol=serialize.PROTOCOL)]
        self.digest = serialize.function_digest(self.frame[0])

    def task(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], options: TaskOptions,
             portable: SourceForm | None = None) -> tuple[dict[str, Any], list[Any]]:
        """Spec and frames of one call; with ``portable``, the source form rides along (last
        two frames) for workers on another Python, when the arguments are plain data."""
        spec = options.spec("fn")
        spec["fn"] = self.digest
        try:
            frames = [self.frame[0], *serialize.dumps((args, dict(kwargs)))]
        except Exception as exc:
            raise _unpicklable(f"the arguments of {self.name}", exc) from exc
        extra = portable.frames(args, kwargs) if portable is not None else None
        if extra is not None:
            spec["src"] = portable.name  # type: ignore[union-attr]
            spec["py"] = PYTHON  # the worker compares it with its own to pick the form
            frames += extra
        return spec, frames


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


def scheduler_options(payload: Any, base: TaskOptions, *, keep: Iterable[str] = (),
                      where: str = "payload") -> tuple[Any, TaskOptions]:
    """Split the scheduler's keys off a payload dict: (what the code gets, the task's options).

    Keys named in ``keep`` (parameters the function declares by that name) are read by the
    scheduler and still passed on. A bad value raises ConfigError naming ``where``.
    """
    if not isinstance(payload, Mapping) or not any(key in payload for key in SCHEDULER_KEYS):
        return payload, base
    kept = set(keep)
    rest = {k: v for k, v in payload.items() if k not in SCHEDULER_KEYS or k in kept}
    wanted = {**base.requirements.to_mapping(),
              **{k: payload[k] for k in SCHEDULER_KEYS if k in payload and k != "cost"}}
    try:
        requirements = Requirements.from_mapping(wanted)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    cost = payload.get("cost", base.cost)
    if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 0 <= cost < 1e12:
        raise ConfigError(f"{where}: cost must be a number >= 0 (a relative weight), not {cost!r}")
    return rest, replace(base, requirements=requirements, cost=float(cost))


def plan_calls(fn: Callable[..., Any], items: Iterable[Any], options: TaskOptions) -> list[Call]:
    """The calls of a ``.map``: arguments per item, and per-item options from a dict's
    scheduler keys."""
    declared = _parameter_names(fn)
    calls: list[Call] = []
    for index, item in enumerate(items):
        item, item_options = scheduler_options(item, options, keep=declared,
                                               where=f"item {index} of the .map")
        args, kwargs = call_arguments(item)
        calls.append((args, kwargs, item_options))
    return calls


def _parameter_names(fn: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return set()


def _unpicklable(what: str, exc: Exception) -> TypeError:
    """A pickling failure, with what the spec's Limitations section says to do about it."""
    return TypeError(
        f"cannot send {what} to the mesh: {exc}. Everything a task takes must be picklable: "
        "open files, sockets, locks, database connections and CUDA handles cannot cross "
        "machines; pass plain data (paths, numbers, arrays, tensors) and open the resource "
        "inside the function instead"
    )
