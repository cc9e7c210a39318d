"""The process environment a task runs with, function or script alike.

Three layers, later ones winning: the worker's allow-listed variables (what programs, Python and
the GPU stack need, nothing that usually holds a credential; the agent has already set
``CUDA_VISIBLE_DEVICES`` to pin the slot), then the variables the worker's owner passes with
``gpumesh join --pass-env NAME``, then the task's own ``env`` from its submitter (which may not
name the variables in ``protocol.taskenv.ENV_DENIED``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

ALLOWED = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ",
    "TMPDIR", "TEMP", "TMP", "SYSTEMROOT",
    "VIRTUAL_ENV", "PYTHONPATH", "LD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
})
ALLOWED_PREFIXES = ("LC_",)  # the locale: LC_ALL, LC_CTYPE, ...
# What function tasks inherit and script tasks never see: the worker's --color/--no-color
# choice (the spec: "the function-task subprocess a worker spawns ... inherits the
# environment"; scripts run with the allow-list alone).
FUNCTIONS_ONLY = frozenset({"GPUMESH_COLOR"})
# What every task runs with unless the worker's owner passes its own value: a @mesh function
# called inside a task runs in place (README: decorated functions run locally with
# GPUMESH_LOCAL=1). Sent back to the mesh, a task waiting for its callees could hold the very
# slots they wait for, and a worker's saved connection would make every task a client.
IN_TASK = {"GPUMESH_LOCAL": "1"}


def base_environment(environ: Mapping[str, str], passed: Iterable[str] = ()) -> dict[str, str]:
    """What every function task on this worker sees: ``environ`` cut to the allow-list, plus
    ``passed`` and ``FUNCTIONS_ONLY`` (which ``script_environment`` takes out again), and
    ``IN_TASK`` where the owner passed no value of its own."""
    keep = ALLOWED | FUNCTIONS_ONLY | set(passed)
    return {**IN_TASK, **{k: v for k, v in environ.items()
                          if k in keep or k.startswith(ALLOWED_PREFIXES)}}


def script_environment(base: Mapping[str, str]) -> dict[str, str]:
    """What a script task starts from: the base without what only function tasks inherit."""
    return {k: v for k, v in base.items() if k not in FUNCTIONS_ONLY}


def runner_process_environment(environ: Mapping[str, str], passed: Iterable[str] = ()
                               ) -> dict[str, str]:
    """The environment a runner process starts with: the tasks' base, plus the ``PYTHON*``
    variables the interpreter reads at start (so the runner imports as the agent does), which
    the runner drops before any task runs.

    Filtering here, not only inside the runner, keeps what a task must not see out of the
    runner's initial environment block, which ``/proc/self/environ`` would show it.
    """
    env = base_environment(environ, passed)
    env.update((k, v) for k, v in environ.items() if k.startswith("PYTHON"))
    return env


def set_environ(env: Mapping[str, str]) -> None:
    """Make ``os.environ`` exactly ``env`` (each change also reaches the C library's copy)."""
    for name in [k for k in os.environ if k not in env]:
        del os.environ[name]
    for name, value in env.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


# Read once, when a GPU library starts in the process: a task that changed one (the common
# ``os.environ["CUDA_VISIBLE_DEVICES"] = "0"``) pinned every later task of this runner to its
# choice, whatever the slot's own GPU; putting the variable back does not undo that.
DEVICE_PINNING = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                  "CUDA_DEVICE_ORDER")


class TaskEnviron:
    """What ``task_environ`` saw: ``moved_pinning`` names a device-pinning variable the task
    changed in this process (the runner then restarts after it)."""

    __slots__ = ("moved_pinning",)

    def __init__(self) -> None:
        self.moved_pinning = ""


@contextmanager
def task_environ(base: Mapping[str, str], task_env: Mapping[str, str]) -> Iterator[TaskEnviron]:
    """``os.environ`` is ``base`` plus ``task_env`` inside, and ``base`` again after: what one
    task set, or was sent, is not left for the next task in this runner."""
    if task_env or not _still(base):
        set_environ({**base, **task_env})
    seen = TaskEnviron()
    try:
        yield seen
    finally:
        if task_env or not _still(base):
            for name in DEVICE_PINNING:
                if os.environ.get(name) != base.get(name):
                    seen.moved_pinning = name
                    break
            set_environ(base)
            _remember(base)


# os.environ's own dict (CPython's ``_data``) as it was when it last equalled a base: a task
# that changed nothing costs a dict comparison instead of two walks through the environment.
_clean: tuple[int, dict[Any, Any]] | None = None


def _remember(base: Mapping[str, str]) -> None:
    global _clean
    data = getattr(os.environ, "_data", None)
    _clean = (id(base), dict(data)) if isinstance(data, dict) else None


def _still(base: Mapping[str, str]) -> bool:
    data = getattr(os.environ, "_data", None)
    return _clean is not None and _clean[0] == id(base) and data == _clean[1]
