"""The loops' clock (gpumesh/clock.py): wall-clock seconds that a step of the system clock
does not move."""

from __future__ import annotations

import re
import time
from pathlib import Path

from gpumesh import clock


def test_a_step_of_the_system_clock_does_not_move_the_loops_clock(monkeypatch):
    before = clock.now()
    assert abs(before - time.time()) < 1.0  # it reads as the date
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600.0)  # NTP set it an hour ahead
    after = clock.now()
    assert 0.0 <= after - before < 1.0
    monkeypatch.setattr(time, "time", lambda: real() - 3600.0)  # ... or an hour back
    assert 0.0 <= clock.now() - after < 1.0


def test_the_loops_measure_time_on_it_not_on_the_wall_clock():
    """A coordinator whose host's clock jumped an hour ahead took every worker for silent
    (leases released and charged), one whose clock went back stopped its timers until the
    wall clock caught up: these modules time silences, leases and deadlines, and must not
    read time.time() (timestamps shown to people may come from it elsewhere)."""
    package = Path(clock.__file__).parent
    for module in ("coordinator/server.py", "worker/agent.py", "client/engine.py",
                   "client/api.py", "transport.py"):
        text = (package / module).read_text()
        assert not re.search(r"\btime\.time\(\)", text), module
        assert "clock.now()" in text, module
