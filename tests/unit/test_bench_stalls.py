"""bench.stalls: windows in which every core sat idle, read from perf's context switches, and
which of the slowest calls they fell into."""

from __future__ import annotations

import shutil
import sys

import pytest

from bench import stalls
from bench.stalls import idle_windows, sitting, table


def switch(cpu: int, at: float, next_pid: int) -> str:
    """A line as ``perf script -F cpu,time,event,trace`` writes a sched_switch."""
    comm = f"swapper/{cpu}" if next_pid == 0 else "python"
    return (f"[{cpu:03d}] {at:.6f}: sched:sched_switch: prev_comm=python prev_pid=7 "
            f"prev_prio=120 prev_state=S ==> next_comm={comm} next_pid={next_pid} "
            "next_prio=120")


def test_a_window_is_counted_only_while_every_core_is_idle():
    lines = [
        switch(0, 10.000, 5), switch(1, 10.000, 6),
        switch(0, 10.001, 0),  # one core idle: no window
        switch(0, 10.002, 5),
        switch(1, 10.003, 0), switch(0, 10.004, 0),  # both idle from 10.004 ...
        "some other line perf printed",
        switch(1, 10.007, 9),  # ... to 10.007
        switch(1, 10.008, 0),  # both idle again (core 0 still is) ...
        switch(0, 10.0085, 0),  # (an idle core switching to idle changes nothing)
        switch(0, 10.009, 3),  # ... to 10.009
    ]
    windows = idle_windows(lines, 0.0, 100.0)
    assert [round(length, 6) for _, length in windows] == [0.003, 0.001]
    assert windows[0][0] == pytest.approx(10.004)


def test_windows_outside_the_calls_and_cores_not_seen_yet_do_not_count():
    # Core 1 never switched before 10.002: taken as busy, so core 0 alone is no window.
    lines = [switch(0, 10.000, 0), switch(0, 10.001, 5), switch(1, 10.002, 0),
             switch(0, 10.003, 0), switch(0, 10.010, 5),  # began at 10.003: before start
             switch(0, 10.020, 0), switch(1, 10.021, 4)]  # began at 10.020: counted
    assert [round(length, 6) for _, length in idle_windows(lines, 10.005, 10.030)] == [0.001]


def test_the_slowest_calls_are_matched_to_the_windows_that_overlap_them():
    # 200 calls of 1 ms; the two slowest (1%) take 5 ms, one of them across a 2 ms window.
    calls = [(i * 0.01, i * 0.01 + 0.001) for i in range(198)]
    calls += [(5.0, 5.005), (6.0, 6.005)]
    windows = [(5.002, 0.002), (7.0, 0.0005), (8.0, 0.003)]
    s = sitting("gpumesh", calls, 10.0, windows)
    assert (s.calls, s.tail_calls, s.tail_with_window) == (200, 2, 1)
    assert s.p50_ms == pytest.approx(1.0)
    assert s.p99_ms == pytest.approx(5.0)
    assert s.slow_calls == 2
    assert s.idle_windows == {"over 1 ms": 2, "over 2 ms": 1}
    assert s.idle_ms == pytest.approx(5.0)  # the two windows over 1 ms
    row = table([s]).splitlines()[-1]
    assert row == "| gpumesh | 200 | 1.000 | 5.000 | 2 | 0.2 | 0.1 | 0.5 | 1 of 2 |"


def test_without_perf_it_says_what_it_needs(monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(sys, "argv", ["bench.stalls", "--rounds", "1"])
    with pytest.raises(SystemExit) as stopped:
        stalls.main()
    assert "needs perf" in str(stopped.value)
    assert "perf_event_paranoid" in str(stopped.value)
