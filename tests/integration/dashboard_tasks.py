"""Task functions of the dashboard tests: a module of their own, so workers that import it to
unpickle them import neither pytest nor playwright."""

from __future__ import annotations

import time

from gates import wait_gate


def pause(seconds: float, gate: str = "") -> float:
    """Sleeps ``seconds``; given a ``gate`` file, runs until the test makes it (``seconds`` at
    most), so a test that must see the task running does not race its end."""
    if gate:
        wait_gate(gate, seconds)
    else:
        time.sleep(seconds)
    return seconds


def explode(x: int, depth: int = 30) -> int:
    """Fails deep down: its traceback is longer than a job's status keeps of it."""
    if depth:
        return explode(x, depth - 1)
    raise ValueError(f"boom {x}: <b>not bold</b> & <script>alert(1)</script>")
