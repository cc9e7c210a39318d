"""What every compared system offers the measurements: start, one call, a map, stop, and which
of this machine's processes are its own (for CPU per task)."""

from __future__ import annotations

import abc
import os
from collections.abc import Callable
from typing import Any

from ..params import Params
from ..procs import descendants


class System(abc.ABC):
    """One system under test. ``start`` may return before the workers are up: the first
    ``call`` waits for them, which is what cold start measures."""

    name: str = ""
    key: str = ""  # short, stable name for JSON and plots

    def __init__(self, params: Params) -> None:
        self.params = params

    @classmethod
    def missing(cls) -> str | None:
        """Why this system cannot run here (a package not installed), or None."""
        return None

    @abc.abstractmethod
    def start(self) -> None: ...

    def wait_ready(self) -> None:
        """Block until every worker is up, so that measurements see all of them. Systems
        without a way to ask rely on the warm-up map that follows."""
        return None

    @abc.abstractmethod
    def call(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    @abc.abstractmethod
    def map(self, fn: Callable[..., Any], items: list[Any]) -> list[Any]: ...

    @abc.abstractmethod
    def stop(self) -> None: ...

    def processes(self) -> dict[int, str]:
        """pid -> role of every process doing this system's work. By default: this process
        (the client side) and everything it started."""
        roles = {os.getpid(): "client"}
        roles.update({pid: "workers and helpers" for pid in descendants(os.getpid())})
        return roles
