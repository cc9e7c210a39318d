"""The worker: an agent process that joins a coordinator and runs tasks in runner children."""

from .agent import WorkerAgent

__all__ = ["WorkerAgent"]
