"""A gate a task waits at until its test opens it (makes the file): the task runs exactly as
long as the test needs it running, instead of for a time that a loaded machine may outlast. A
module of its own, which workers import to run such tasks (no pytest here)."""

from __future__ import annotations

import os
import time


def wait_gate(gate: str, limit: float = 60.0) -> bool:
    """Wait until ``gate`` exists, ``limit`` seconds at most; whether it was opened."""
    deadline = time.monotonic() + limit
    while not os.path.exists(gate):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True
