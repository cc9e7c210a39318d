"""How the coordinator's loop waits for its next message: while work is moving, it polls for a
short while before it sleeps (busy polling).

A single call crosses the coordinator twice (its task out, its result back), and each time the
loop had gone to sleep in between: the wake-up, and the code after it run on cold caches (on a
VM, on a vCPU that halted), cost a call more than the work did. For ``busy_poll`` seconds after a
turn that handed out a task or finished one, the loop asks its socket again and again instead,
yielding the core between looks to any other thread that wants it, and sleeps when that time is
up. It does so only while work has been moving that quickly (``SHORT_GAPS``): an idle
coordinator, one that only hears heartbeats (1,000 workers' of them move no work), or one whose
results come back over a slower LAN never spins. On the 2-core test VM (``python -m bench.ab``,
16 interleaved rounds) back-to-back single calls took 0.71x the time at p50, a map ran as fast
as before (0.99x), and a call cost 11% more CPU in all (bench/README.md).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

# Work-moving turns in a row that came within ``busy_poll`` of the one before, before a spin is
# worth its CPU. Only those count: heartbeats (1,000 workers send one every millisecond) and
# other traffic say nothing of when a call's answer comes. Over a LAN a result takes longer
# than that to come back, and the next call may not: with one short gap in two, a spin would
# miss every other time, a millisecond of a core each.
SHORT_GAPS = 2
MAX_BUSY_POLL = 0.1  # seconds: whatever a caller passes, a spin ends


def _no_yield() -> None:
    """Where the system has no ``sched_yield``: let another thread run (``sleep(0)``)."""
    time.sleep(0)


class Waiter:
    """``wait(timeout_ms)`` returns True when the polled sockets have something to read;
    ``work_moved()`` says the turn just handed out a task or finished one."""

    def __init__(self, poll: Callable[[int], Any], busy_poll: float,
                 clock: Callable[[], float] = time.perf_counter,
                 yield_core: Callable[[], None] | None = None) -> None:
        self._poll = poll  # zmq.Poller.poll: a timeout in ms, a list of what is ready
        # Anything but a finite positive number turns it off; it never spins past MAX_BUSY_POLL.
        self.busy_poll = (min(busy_poll, MAX_BUSY_POLL)
                          if math.isfinite(busy_poll) and busy_poll > 0 else 0.0)
        self._clock = clock
        system_yield: Callable[[], None] = getattr(os, "sched_yield", _no_yield)
        self._yield = yield_core if yield_core is not None else system_yield
        self._busy_until = 0.0
        self._last_move = -math.inf
        self._short_gaps = 0  # up to SHORT_GAPS

    def work_moved(self) -> None:
        """The next message of a call (its result, the client's next call) is likely to come
        within ``busy_poll`` if the last ones did: poll for it until then rather than sleep."""
        if not self.busy_poll:
            return
        now = self._clock()
        quick = now - self._last_move < self.busy_poll
        self._last_move = now
        self._short_gaps = min(self._short_gaps + 1, SHORT_GAPS) if quick else 0
        if self._short_gaps >= SHORT_GAPS:
            self._busy_until = now + self.busy_poll

    def wait(self, timeout_ms: int) -> bool:
        """Whether something is ready, within ``timeout_ms`` (0: only look)."""
        started = self._clock()
        if started < self._busy_until and timeout_ms > 0:
            until = min(self._busy_until, started + timeout_ms / 1000)
            while True:
                if self._poll(0):
                    return True
                if self._clock() >= until:
                    break
                self._yield()
            if until >= self._busy_until:
                # The whole busy time passed and nothing came: sleep, and spin again only
                # once work moves quickly again. (A timer due sooner only interrupts the
                # spin, which goes on at the next wait.)
                self._busy_until = 0.0
                self._short_gaps = 0
            spent_ms = math.ceil((self._clock() - started) * 1000)
            timeout_ms = max(0, timeout_ms - spent_ms)
        return bool(self._poll(timeout_ms))
