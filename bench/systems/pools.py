"""The standard library's process pools, with the start method this platform defaults to."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import multiprocessing.pool
from collections.abc import Callable
from typing import Any

from .base import System


class PoolSystem(System):
    name = "multiprocessing.Pool"
    key = "pool"

    def start(self) -> None:
        self._pool: multiprocessing.pool.Pool = multiprocessing.Pool(self.params.workers)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._pool.apply(fn, args)

    def map(self, fn: Callable[..., Any], items: list[Any]) -> list[Any]:
        return self._pool.map(fn, items, chunksize=1)

    def stop(self) -> None:
        if hasattr(self, "_pool"):
            # close, not terminate: terminate can deadlock on a worker that holds the task
            # queue's lock (seen here after a cold-start pool); every task is done by now.
            self._pool.close()
            self._pool.join()


class ProcessPoolSystem(System):
    name = "ProcessPoolExecutor"
    key = "ppe"

    def start(self) -> None:
        self._pool = concurrent.futures.ProcessPoolExecutor(self.params.workers)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._pool.submit(fn, *args).result()

    def map(self, fn: Callable[..., Any], items: list[Any]) -> list[Any]:
        return list(self._pool.map(fn, items, chunksize=1))

    def stop(self) -> None:
        if hasattr(self, "_pool"):
            self._pool.shutdown(wait=True, cancel_futures=True)
