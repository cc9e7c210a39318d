"""bench.profile's summary: py-spy's collapsed samples turned into µs per task or call."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.profile import RATE, summarize


def test_samples_become_microseconds_per_run_charged_to_the_innermost_gpumesh_function(
        tmp_path: Path) -> None:
    raw = tmp_path / "profile.txt"
    raw.write_text(
        "thread (7): MainThread;run (gpumesh/coordinator/server.py:140);"
        "poll (zmq/sugar/poll.py:100) 30\n"
        "thread (7): MainThread;run (gpumesh/coordinator/server.py:140);"
        "commit (gpumesh/store.py:90);execute (sqlite3/x.py:1) 10\n")
    runs = 100
    per_sample = 1e6 / RATE / runs
    summary = dict(summarize(raw, runs))
    assert summary["total (sampled, not idle)"] == pytest.approx(40 * per_sample)
    assert summary["MainThread: coordinator.server.run [pyzmq]"] == pytest.approx(30 * per_sample)
    assert summary["MainThread: store.commit [sqlite3]"] == pytest.approx(10 * per_sample)
