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
import importlib.abc
import importlib.util
import sys
import threading
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
        TaskCancelled,
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
    "TaskCancelled": "errors",
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
    "TaskCancelled",
    "TaskError",
    "TaskFuture",
    "TaskOptions",
    "TaskTimeout",
    "Unschedulable",
    "__version__",
    "accelerate",
    "mesh",
]


def _joblib_backend(*args: Any, **kwargs: Any) -> Any:
    """joblib's factory for ``backend="gpumesh"``: the client is imported when it is used."""
    from .client.joblib_backend import MeshBackend

    return MeshBackend(*args, **kwargs)


def _register_joblib(joblib: Any) -> None:
    try:
        joblib.register_parallel_backend("gpumesh", _joblib_backend)
    except Exception:  # a joblib without the API: the backend is simply not there
        pass


class _JoblibWatch(importlib.abc.MetaPathFinder):
    """Registers the joblib backend once joblib is imported, so importing gpumesh never
    imports joblib (runners and the CLI start fast) and needs no joblib installed.

    It stays on ``sys.meta_path`` until joblib's module has run: a probe such as
    ``importlib.util.find_spec("joblib")`` (how libraries check for optional packages) asks
    for a spec that is never executed, and must not use the watch up."""

    def __init__(self) -> None:
        self._finding = threading.local()  # inside our own find_spec: let the others answer

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "joblib" or getattr(self._finding, "on", False):
            return None
        self._finding.on = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding.on = False
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module") \
                or getattr(loader, "_gpumesh_watched", False):
            return spec  # no loader to watch, or one watched already (a finder that reuses it)
        original = loader.exec_module
        watch = self

        def exec_module(module: Any) -> None:
            original(module)
            if watch in sys.meta_path:
                sys.meta_path.remove(watch)
            _register_joblib(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        loader._gpumesh_watched = True  # type: ignore[attr-defined]
        return spec


if "joblib" in sys.modules:
    _register_joblib(sys.modules["joblib"])
elif not any(isinstance(f, _JoblibWatch) for f in sys.meta_path):
    sys.meta_path.insert(0, _JoblibWatch())


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext gpumesh``: ``mesh`` in the notebook, and the ``%%mesh`` cell magic."""
    from .client.notebook import load_ipython_extension as load

    load(ipython)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpumesh' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
