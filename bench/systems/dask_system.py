"""Dask distributed on a LocalCluster of worker processes, one thread each."""

from __future__ import annotations

import importlib.util
import logging
import warnings
from collections.abc import Callable
from typing import Any

from .base import System


class DaskSystem(System):
    name = "Dask LocalCluster"
    key = "dask"

    @classmethod
    def missing(cls) -> str | None:
        if importlib.util.find_spec("distributed") is None:
            return "dask.distributed is not installed (pip install 'gpumesh[bench]')"
        return None

    def start(self) -> None:
        from dask.distributed import Client, LocalCluster

        # Dask warns about every large argument and logs each worker start; neither is news here.
        warnings.filterwarnings("ignore", module="distributed")
        logging.getLogger("distributed").setLevel(logging.ERROR)
        self._cluster = LocalCluster(n_workers=self.params.workers, threads_per_worker=1,
                                     processes=True, dashboard_address=None)
        self._client = Client(self._cluster)

    def wait_ready(self) -> None:
        self._client.wait_for_workers(self.params.workers, timeout=60)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._client.submit(fn, *args, pure=False).result()

    def map(self, fn: Callable[..., Any], items: list[Any]) -> list[Any]:
        return self._client.gather(self._client.map(fn, items, pure=False))

    def stop(self) -> None:
        if hasattr(self, "_client"):
            self._client.close()
        if hasattr(self, "_cluster"):
            self._cluster.close()
