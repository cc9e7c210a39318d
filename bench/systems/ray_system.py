"""Ray, a local instance started by ``ray.init(num_cpus=workers)``."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import Any

from .base import System


class RaySystem(System):
    name = "Ray"
    key = "ray"

    @classmethod
    def missing(cls) -> str | None:
        if importlib.util.find_spec("ray") is None:
            return "ray is not installed (pip install 'gpumesh[bench]')"
        return None

    def start(self) -> None:
        import ray

        ray.init(num_cpus=self.params.workers, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR, configure_logging=True)
        self._remotes: dict[Callable[..., Any], Any] = {}

    def _remote(self, fn: Callable[..., Any]) -> Any:
        import ray

        if fn not in self._remotes:
            self._remotes[fn] = ray.remote(fn)
        return self._remotes[fn]

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        import ray

        return ray.get(self._remote(fn).remote(*args))

    def map(self, fn: Callable[..., Any], items: list[Any]) -> list[Any]:
        import ray

        remote = self._remote(fn)
        return list(ray.get([remote.remote(item) for item in items]))

    def stop(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
