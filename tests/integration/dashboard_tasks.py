"""Task functions of the dashboard tests: a module of their own, so workers that import it to
unpickle them import neither pytest nor playwright."""

from __future__ import annotations

import time


def pause(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def explode(x: int) -> int:
    raise ValueError(f"boom {x}: <b>not bold</b> & <script>alert(1)</script>")
