"""The functions every system runs. Module-level, so each system can pickle them by reference
(its workers import ``bench.tasks``) and none pays for shipping code by value."""

from __future__ import annotations

import time
from typing import Any


def noop(x: Any) -> Any:
    return x


def echo(payload: Any) -> Any:
    """Receive a large buffer and send it back: the round trip of ``payload`` both ways."""
    return payload


def first_element(array: Any) -> int:
    """Receive a mid-size array (or bytes) and return its first element: the arguments' way."""
    return int(array[0])


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds
