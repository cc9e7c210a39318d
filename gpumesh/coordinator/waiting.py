"""How the coordinator's loop waits for its next message: while work is moving, it polls for a
short while before it sleeps (busy polling).

A single call crosses the coordinator twice (its task out, its result back), and each time the
loop had gone to sleep in between: the wake-up, and the code after it run on cold caches (on a
VM, on a vCPU that halted), cost a call more than the work did. For ``busy_poll`` seconds after a
turn that handed out a task or a result, the loop asks its socket again and again instead,
yielding the core between looks to any other thread that wants it, and sleeps when that time is
up. It does so only while messages have been coming that quickly (``SHORT_WAITS``): an idle
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

# Waits in a row that a message ended within ``busy_poll`` before a spin is worth its CPU. Over
# a LAN a result takes longer than that to come back, and the next call may not: with one short
# wait in two, a spin would miss every other time, a millisecond of a core each.
SHORT_WAITS = 2


def _no_yield() -> None:
    """Where the system has no ``sched_yield``: the spin goes on without yielding."""


class Waiter:
    """``wait(timeout_ms)`` returns True when the polled sockets have something to read;
    ``work_moved()`` says the turn just handed out a task or a result."""

    def __init__(self, poll: Callable[[int], Any], busy_poll: float,
                 clock: Callable[[], float] = time.perf_counter,
                 yield_core: Callable[[], None] | None = None) -> None:
        self._poll = poll  # zmq.Poller.poll: a timeout in ms, a list of what is ready
        self.busy_poll = busy_poll
        self._clock = clock
        system_yield: Callable[[], None] = getattr(os, "sched_yield", _no_yield)
        self._yield = yield_core if yield_core is not None else system_yield
        self._busy_until = 0.0
        self._short_waits = 0  # the last waits a message ended within busy_poll, up to SHORT_WAITS

    def work_moved(self) -> None:
        """The next message of a call (its result, the client's next call) is likely to come
        within ``busy_poll`` if the last ones did: poll for it until then rather than sleep."""
        if self.busy_poll > 0 and self._short_waits >= SHORT_WAITS:
            self._busy_until = self._clock() + self.busy_poll

    def wait(self, timeout_ms: int) -> bool:
        """Whether something is ready, within ``timeout_ms`` (0: only look)."""
        started = self._clock()
        if started < self._busy_until and timeout_ms > 0:
            until = min(self._busy_until, started + timeout_ms / 1000)
            while True:
                if self._poll(0):
                    self._note(True, started)
                    return True
                if self._clock() >= until:
                    break
                self._yield()
            if until >= self._busy_until:
                # The whole busy time passed and nothing came: sleep, and spin again only
                # once messages come quickly again. (A timer due sooner only interrupts the
                # spin, which goes on at the next wait.)
                self._busy_until = 0.0
                self._short_waits = 0
            spent_ms = math.ceil((self._clock() - started) * 1000)
            timeout_ms = max(0, timeout_ms - spent_ms)
        ready = bool(self._poll(timeout_ms))
        self._note(ready, started)
        return ready

    def _note(self, ready: bool, started: float) -> None:
        """Count a wait a message ended within busy_poll; one that lasted longer ends the
        count. A timer that ended a short wait says nothing either way."""
        waited = self._clock() - started
        if waited >= self.busy_poll:
            self._short_waits = 0
        elif ready:
            self._short_waits = min(self._short_waits + 1, SHORT_WAITS)
