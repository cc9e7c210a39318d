"""Turning a Python call or a script run into a task spec and payload frames."""

from __future__ import annotations

import inspect
import json
import math
import numbers
import os
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from cloudpickle import cloudpickle as cloudpickle_internals

from ..errors import ConfigError
from ..protocol import serialize
from ..protocol.taskenv import (
    ENV_MAX_ENTRIES,
    check_script_name,
    check_submitted_name,
    check_task_env,
)
from ..scheduler import Requirements
from .portable import SourceForm

# Keys of a payload dict (a `.map` item, a script payload) that the scheduler reads instead of
# handing them to the code: four filters and the placement weight. docs/protocol.md lists them.
SCHEDULER_KEYS = ("gpu", "cores", "memory", "vram", "cost")
Call = tuple[tuple[Any, ...], dict[str, Any], "TaskOptions"]
# A task's env as TaskOptions keeps it: (name, value), value None for "the submitter's own value,
# read when the task is sent".
EnvEntries = tuple[tuple[str, "str | None"], ...]

PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


@dataclass(frozen=True)
class TaskOptions:
    """Per-task controls. ``requirements`` are filters the scheduler applies.

    ``env`` adds variables to the task's environment on the worker (which otherwise holds only
    the worker's allow-listed variables): a list of names sends this process's values of them,
    read each time a task is sent (a missing one is a ConfigError then); a dict sends the values
    given. Names the worker owns (``CUDA_VISIBLE_DEVICES``, ``LD_PRELOAD``, ``PYTHONPATH``, ...)
    are refused here, at once.
    """

    timeout: float | None = None
    max_attempts: int = 3
    priority: int = 0
    cost: float = 1.0
    requirements: Requirements = Requirements()
    env: EnvEntries | Mapping[str, str] | Iterable[str] | None = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", env_entries(self.env))
        # The coordinator refuses these at submit; say so at once, where the option was given.
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) \
                or not 1 <= self.max_attempts <= 100:
            raise ConfigError(f"max_attempts must be a whole number 1-100, not "
                              f"{self.max_attempts!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) \
                or abs(self.priority) > 2**62:
            raise ConfigError(f"priority must be a whole number, not {self.priority!r}")
        if isinstance(self.cost, bool) or not isinstance(self.cost, (int, float)) \
                or not 0 <= self.cost <= 1e12:
            raise ConfigError(f"cost must be a number 0-1e12, not {self.cost!r}")
        if self.timeout is not None and (
                isinstance(self.timeout, bool) or not isinstance(self.timeout, numbers.Real)
                or not math.isfinite(self.timeout)):
            # A string failed at the first call with float()'s words; "300" and True passed
            # as 300 and 1 s; nan and inf only the coordinator refused, at call time.
            raise ConfigError(f"timeout must be a number of seconds (None, or 0 or less, for "
                              f"none), not {self.timeout!r}")

    def task_env(self) -> dict[str, str]:
        """The env a task sent now carries: this process's values for the names given alone."""
        entries: EnvEntries = self.env  # type: ignore[assignment]  # __post_init__ stored it so
        if all(value is not None for _, value in entries):
            # Values given: checked once, when the options were made.
            return {name: value for name, value in entries if value is not None}
        missing = [name for name, value in entries if value is None and name not in os.environ]
        if missing:
            one = len(missing) == 1
            raise ConfigError(f"env: {', '.join(missing)} {'is' if one else 'are'} not set in "
                              f"this process's environment: set {'it' if one else 'them'} "
                              "before the call, or pass the values as env={'NAME': 'value'}")
        try:
            return check_task_env({name: os.environ[name] if value is None else value
                                   for name, value in entries})
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def spec(self, kind: str) -> dict[str, Any]:
        spec: dict[str, Any] = {"kind": kind, "max_attempts": self.max_attempts}
        if self.env:
            spec["env"] = self.task_env()
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


def env_entries(env: object) -> EnvEntries:
    """``TaskOptions.env`` in its stored form, checked as far as it can be before a call."""
    if env is None:
        return ()
    if isinstance(env, str):
        raise ConfigError(f"env must be a list of variable names or a dict, not the string "
                          f"{env[:80]!r}: write env=[{env[:80]!r}]")
    try:
        if isinstance(env, Mapping):
            return tuple(check_task_env(env).items())
        if isinstance(env, tuple) and all(isinstance(e, tuple) for e in env):
            # Already in the stored form (dataclasses.replace builds TaskOptions again).
            entries = tuple((check_submitted_name(name), value) for name, value in env)
            check_task_env({name: value for name, value in entries if value is not None})
            return entries
        if not isinstance(env, Iterable):
            raise ValueError(f"env must be a list of variable names or a dict, not "
                             f"{type(env).__name__}")
        names = list(dict.fromkeys(check_submitted_name(name) for name in env))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if len(names) > ENV_MAX_ENTRIES:
        raise ConfigError(f"env names {len(names)} variables; at most {ENV_MAX_ENTRIES} are allowed")
    return tuple((name, None) for name in names)



# The options of a call that sets none, made once: TaskOptions is frozen, and a call of its own
# cost a few µs of checks in every single submit.
DEFAULT_OPTIONS = TaskOptions()

class PickledFunction:
    """A function pickled once and shared by every task of a batch."""

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> PickledFunction:
        """The pickled form of ``fn``, made once per function that pickles by reference (an
        importable module's function: its pickle is only a module and a name, which cannot
        change), so a loop of single calls does not pickle and digest it every call. Other
        functions (``__main__``'s, lambdas, closures) are pickled by value every time: what
        they close over may have changed since the last call."""
        if not _by_reference(fn):
            return cls(fn)
        try:
            return _BY_REFERENCE[fn]
        except KeyError:
            pickled = _BY_REFERENCE[fn] = cls(fn)
            return pickled

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

    def spec(self, options: TaskOptions) -> dict[str, Any]:
        """The spec of its calls under ``options``: one dict that the calls made together share
        (nothing changes it once made; a call whose source form rides along gets a copy)."""
        spec = options.spec("fn")
        spec["fn"] = self.digest
        return spec

    def task(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], spec: dict[str, Any],
             portable: SourceForm | None = None) -> tuple[dict[str, Any], list[Any]]:
        """Spec and frames of one call (``spec`` from ``self.spec``); with ``portable``, the
        source form rides along (last two frames) for workers on another Python, when the
        arguments are plain data."""
        try:
            frames = [self.frame[0], *serialize.dumps((args, dict(kwargs)))]
        except Exception as exc:
            raise _unpicklable(f"the arguments of {self.name}", exc) from exc
        extra = portable.frames(args, kwargs) if portable is not None else None
        if portable is not None and extra is not None:
            # The worker compares ``py`` with its own Python to pick the form.
            spec = {**spec, "src": portable.name, "py": PYTHON}
            frames += extra
        return spec, frames


# Functions pickled by reference, weakly held: a module reloaded or a function deleted drops out.
_BY_REFERENCE: weakref.WeakKeyDictionary[Callable[..., Any], PickledFunction] = (
    weakref.WeakKeyDictionary())


def _by_reference(fn: Callable[..., Any]) -> bool:
    """Whether cloudpickle sends ``fn`` as a module and a name (it asks the same question for
    every object it pickles; a cloudpickle without the function caches nothing)."""
    if not isinstance(fn, types.FunctionType):
        return False  # bound methods and callable objects carry state of their own
    should = getattr(cloudpickle_internals, "_should_pickle_by_reference", None)
    try:
        return bool(should(fn)) if should is not None else False
    except Exception:  # a private helper: any surprise means "pickle it again"
        return False


def call_arguments(item: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """How a ``.map`` item becomes a call: a dict is keyword arguments, a tuple positional ones,
    anything else a single positional argument."""
    if isinstance(item, Mapping):
        return (), dict(item)
    if isinstance(item, tuple):
        return item, {}
    return (item,), {}


def script_task(name: str, source: bytes, payload: Any, options: TaskOptions,
                where: str = "payload") -> tuple[dict[str, Any], list[Any]]:
    try:
        check_script_name(name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    spec = options.spec("script")
    spec["name"] = name
    try:
        text = json.dumps(payload)
    except (TypeError, ValueError) as exc:  # an object() or a set, a cycle: JSON has none
        raise ConfigError(f"{where} cannot be written as JSON for the script's stdin ({exc}): "
                          "give it only dicts, lists, strings, numbers, booleans and "
                          "None") from None
    return spec, [source, text.encode("utf-8")]


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
    if isinstance(items, (str, bytes, bytearray, Mapping)):
        # Iterated, these are characters, bytes or keys: never what was meant.
        raise TypeError(f".map takes an iterable of items, one per task, not one "
                        f"{type(items).__name__}: put it in a list ([item]); a dict item is "
                        "one call's keyword arguments")
    declared = _parameter_names(fn)
    calls: list[Call] = []
    plain: set[type] = set()  # types seen to be neither a tuple nor a Mapping
    for index, item in enumerate(items):
        # Plain values and tuples first, without the Mapping check (an ABC's, slow) or the
        # error's wording: 1.8 -> 0.2 µs an item, on the way of a .map's first SUBMIT.
        kind = type(item)
        if kind is tuple:
            calls.append((item, {}, options))
            continue
        if kind in plain or (kind is not dict and not isinstance(item, (tuple, Mapping))):
            plain.add(kind)
            calls.append(((item,), {}, options))
            continue
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
