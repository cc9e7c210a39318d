"""``python -m bench.busypoll``'s argument checks (the measurement itself runs meshes)."""

from __future__ import annotations

import argparse

import pytest

from bench.busypoll import _task_times


def test_task_times_are_milliseconds_comma_separated():
    assert _task_times("0,0.5, 2") == [0.0, 0.5, 2.0]


@pytest.mark.parametrize("bad", ["", ",", "fast", "-1", "0.5,1001", "nan", "inf"])
def test_a_task_time_that_is_not_0_to_1000_ms_is_refused(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="task time"):
        _task_times(bad)
