"""gpumesh: borrow your friends' GPUs.

Run Python across the machines on your LAN with one decorator::

    from gpumesh import mesh

    @mesh
    def train(lr, epochs):
        ...

    train(lr=0.01, epochs=100)            # one worker (or locally, if no mesh is up)
    train.map([{"lr": 0.01}, {"lr": 0.05}])  # every worker

Names are imported on first use, so runner processes and ``gpumesh --version`` start fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from .client import GPUMesh, MeshFunction, TaskFuture, TaskOptions, accelerate, mesh
    from .client.executor import MeshExecutor
    from .errors import (
        AuthenticationError,
        ConfigError,
        ConnectionFailed,
        MeshError,
        MeshTimeout,
        ProtocolMismatch,
        RemoteError,
        RunnerCrashed,
        SubmitRejected,
        TaskError,
        TaskTimeout,
        Unschedulable,
    )

_LAZY = {
    "GPUMesh": "client",
    "MeshExecutor": "client.executor",
    "MeshFunction": "client",
    "TaskFuture": "client",
    "TaskOptions": "client",
    "accelerate": "client",
    "mesh": "client",
    "AuthenticationError": "errors",
    "ConfigError": "errors",
    "ConnectionFailed": "errors",
    "MeshError": "errors",
    "MeshTimeout": "errors",
    "ProtocolMismatch": "errors",
    "RemoteError": "errors",
    "RunnerCrashed": "errors",
    "SubmitRejected": "errors",
    "TaskError": "errors",
    "TaskTimeout": "errors",
    "Unschedulable": "errors",
}

__all__ = [
    "AuthenticationError",
    "ConfigError",
    "ConnectionFailed",
    "GPUMesh",
    "MeshError",
    "MeshExecutor",
    "MeshFunction",
    "MeshTimeout",
    "ProtocolMismatch",
    "RemoteError",
    "RunnerCrashed",
    "SubmitRejected",
    "TaskError",
    "TaskFuture",
    "TaskOptions",
    "TaskTimeout",
    "Unschedulable",
    "__version__",
    "accelerate",
    "mesh",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpumesh' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
