"""Processes started on someone's behalf (a serve's self-worker, a mesh started from Python)
stop when that someone is gone, instead of living on as orphans after a ``kill -9``."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

PARENT_POLL = 0.5  # seconds between checks


def stop_with_parent(stop: Callable[[], None]) -> None:
    """Call ``stop()`` once, from a daemon thread, when this process's parent has exited."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(PARENT_POLL)
        stop()

    threading.Thread(target=watch, name="gpumesh-parent-watch", daemon=True).start()
