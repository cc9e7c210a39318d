"""What a task may ask of the worker's process environment: variables (spec key ``env``) and
the file name a script runs as (spec key ``name``). Pure checks, no I/O.

The client checks before it sends, the coordinator before it journals, the runner before it
runs; all three call the same functions, so a value one of them accepts, all of them accept.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType

ENV_MAX_ENTRIES = 64
ENV_MAX_BYTES = 32 * 1024  # names plus values, UTF-8
SCRIPT_NAME_MAX_BYTES = 255 - len(".py")  # a file name, with the suffix the runner may add

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

# Variables a submitter may not set, because the worker owns them, and why (said in the error).
_DEVICES = "the worker picks the devices each task sees"
_STARTUP = ("it is read when a process starts, so it cannot reach a function task's runner; the "
            "worker's owner can hand tasks the worker's own value with 'gpumesh join --pass-env'")
ENV_DENIED: Mapping[str, str] = MappingProxyType({
    "CUDA_VISIBLE_DEVICES": _DEVICES, "CUDA_DEVICE_ORDER": _DEVICES,
    "HIP_VISIBLE_DEVICES": _DEVICES, "ROCR_VISIBLE_DEVICES": _DEVICES,
    "GPUMESH_TOKEN": "the mesh token never travels",
    "LD_PRELOAD": _STARTUP, "LD_LIBRARY_PATH": _STARTUP, "LD_AUDIT": _STARTUP,
    "DYLD_INSERT_LIBRARIES": _STARTUP, "DYLD_LIBRARY_PATH": _STARTUP,
    "PYTHONPATH": _STARTUP, "PYTHONHOME": _STARTUP,
})


def check_env_name(name: object) -> str:
    """``name`` if it is a well-formed variable name, else ValueError saying why.

    Does not apply the deny list (the worker's owner may pass any of those with --pass-env).
    """
    if not isinstance(name, str):
        raise ValueError(f"an environment variable name must be a string, not "
                         f"{type(name).__name__}")
    if not _NAME.fullmatch(name):
        raise ValueError(f"{name[:80]!r} is not an environment variable name: use letters, "
                         "digits and '_', not starting with a digit")
    return name


def check_submitted_name(name: object) -> str:
    """``name`` if a submitter may set it: well formed and not on the deny list."""
    name = check_env_name(name)
    if name in ENV_DENIED:
        raise ValueError(f"a task cannot set {name}: {ENV_DENIED[name]}")
    return name


def check_task_env(value: object) -> dict[str, str]:
    """The task spec's ``env``: a map of variable name to value, as a plain dict.

    Raises ValueError naming the first problem: not a map, more than 64 entries, a malformed or
    denied name, a value that is not a string, holds a NUL or is not valid UTF-8, or more than
    32 KiB of names and values in all.
    """
    if not isinstance(value, Mapping):
        raise ValueError(f"env must be a map of variable names to values, not "
                         f"{type(value).__name__}")
    if len(value) > ENV_MAX_ENTRIES:
        raise ValueError(f"env has {len(value)} variables; at most {ENV_MAX_ENTRIES} are allowed")
    env: dict[str, str] = {}
    total = 0
    for name, text in value.items():
        check_submitted_name(name)
        if not isinstance(text, str):
            raise ValueError(f"env {name}: the value must be a string, not {type(text).__name__}")
        if "\x00" in text:
            raise ValueError(f"env {name}: the value holds a NUL character")
        try:
            total += len(name) + len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise ValueError(f"env {name}: the value is not valid UTF-8") from None
        if total > ENV_MAX_BYTES:
            raise ValueError(f"env is over {ENV_MAX_BYTES // 1024} KiB of names and values; "
                             "send large data as an argument or a payload instead")
        env[name] = text
    return env


def check_script_name(name: object) -> str:
    """The file name a script task runs as: the base name of ``name``, or ``task.py`` when it
    is empty. ValueError when it cannot be a file name on a worker: not a string, a NUL or other
    control character, or longer than a file name may be."""
    if not isinstance(name, str):
        raise ValueError(f"the script name must be a string, not {type(name).__name__}")
    if _CONTROL.search(name):
        raise ValueError(f"the script name {name[:80]!r} holds a control character (NUL, newline, "
                         "...): rename the file")
    base = name.replace("\\", "/").rsplit("/", 1)[-1] or "task.py"
    try:
        size = len(base.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"the script name {name[:80]!r} is not valid UTF-8") from None
    if size > SCRIPT_NAME_MAX_BYTES:
        raise ValueError(f"the script name is {size} bytes long; a file name may have at most "
                         f"{SCRIPT_NAME_MAX_BYTES}")
    return base
