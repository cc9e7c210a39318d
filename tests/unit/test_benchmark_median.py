"""The join benchmark's timing: the median of several rounds' bests, so one disturbed round
(another process, this one's start-up) does not move the score (issue 12: 6x between runs)."""

from __future__ import annotations

import pytest

from gpumesh.worker import devices


class FakeClock:
    """A clock that each call of the timed function advances by the next planned duration."""

    def __init__(self, durations: list[float]) -> None:
        self.now = 0.0
        self.durations = iter(durations)

    def __call__(self) -> float:
        return self.now

    def work(self) -> None:
        self.now += next(self.durations, 0.01)


def test_one_slow_round_does_not_move_the_figure():
    # Warm-up, then 5 rounds of 3 calls: round 2 is slowed down 6x throughout.
    plan = [1.0] + [0.01] * 3 + [0.06] * 3 + [0.01] * 9
    clock = FakeClock(plan)
    assert devices._timed(clock.work, 0.0, rounds=5, clock=clock) == pytest.approx(0.01)


def test_one_fast_fluke_does_not_move_it_either():
    plan = [1.0] + [0.05] * 3 + [0.001, 0.05, 0.05] + [0.05] * 9
    clock = FakeClock(plan)
    assert devices._timed(clock.work, 0.0, rounds=5, clock=clock) == pytest.approx(0.05)

