"""How big each measurement is, in the full run and in ``--quick``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

MIB = 1024 * 1024


@dataclass(frozen=True)
class Params:
    workers: int = 2
    tiny_tasks: int = 5000
    round_trips: int = 300
    big_bytes: int = 64 * MIB
    big_repeats: int = 3
    mid_bytes: int = 256 * 1024  # each argument of the mid-size map
    mid_tasks: int = 1000
    sleep_tasks: int = 40
    sleep_seconds: float = 0.05
    warmup_tasks: int = 100
    gpumesh_prefetch: str | None = None  # gpumesh join --prefetch; None: join's default

    @classmethod
    def quick(cls) -> Params:
        return cls(tiny_tasks=2000, round_trips=100, big_repeats=2, mid_tasks=300)

    @property
    def ideal_sleep_seconds(self) -> float:
        """Perfect packing of the sleep tasks onto the workers."""
        rounds = -(-self.sleep_tasks // self.workers)
        return rounds * self.sleep_seconds


def positive_int(text: str) -> int:
    """An argparse type for a count of calls, tasks or rounds: at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: at least 1")
    return value
