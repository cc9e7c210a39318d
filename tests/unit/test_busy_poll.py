"""The coordinator's loop waits by polling for a while after work moved, and sleeps otherwise
(gpumesh/coordinator/waiting.py): what it spins for, for how long, and when it stops."""

from __future__ import annotations

import pytest

from gpumesh.config import BUSY_POLL, Limits, Settings, Timing
from gpumesh.coordinator.broker import Broker
from gpumesh.coordinator.server import Coordinator
from gpumesh.coordinator.waiting import MAX_BUSY_POLL, SHORT_GAPS, Waiter
from gpumesh.errors import ConfigError
from gpumesh.protocol import Command, decode, encode
from gpumesh.store import Store
from gpumesh.tokens import new_token


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Sockets:
    """A poller whose socket becomes readable at ``ready_at``; each look costs ``step`` s."""

    def __init__(self, clock: Clock, ready_at: float | None, step: float = 0.0001) -> None:
        self.clock, self.ready_at, self.step = clock, ready_at, step
        self.looks: list[int] = []  # the timeout of each poll, ms

    def poll(self, timeout_ms: int) -> list[tuple[str, int]]:
        self.looks.append(timeout_ms)
        if self.ready_at is not None and self.clock.now >= self.ready_at:
            return [("router", 1)]
        if timeout_ms == 0:
            self.clock.now += self.step
            return []
        # A blocking poll: sleeps until the socket is ready or the timeout passes.
        until = self.clock.now + timeout_ms / 1000
        if self.ready_at is not None and self.ready_at <= until:
            self.clock.now = self.ready_at
            return [("router", 1)]
        self.clock.now = until
        return []


def make(ready_in: float | None, busy_poll: float = 0.001, primed: bool = True):
    """A Waiter on a socket that becomes ready ``ready_in`` s from now; ``primed``: work has
    been moving every 0.5 ms (as in a loop of single calls), so its next move arms a spin."""
    clock = Clock()
    sockets = Sockets(clock, None)
    yields: list[float] = []
    waiter = Waiter(sockets.poll, busy_poll, clock=clock,
                    yield_core=lambda: yields.append(clock.now))
    if primed:
        for _ in range(SHORT_GAPS):
            waiter.work_moved()
            clock.now += 0.0005
        assert waiter._busy_until == 0.0  # the priming itself armed nothing lasting
    sockets.looks.clear()
    sockets.ready_at = None if ready_in is None else clock.now + ready_in
    return waiter, sockets, clock, yields


def arrive(sockets: Sockets, clock: Clock, after: float) -> None:
    sockets.ready_at = clock.now + after


def test_without_work_moving_it_sleeps_in_one_poll():
    # Heartbeats and idle time: never a spin, whatever arrives.
    waiter, sockets, _, yields = make(ready_in=0.0005)
    assert waiter.wait(250) is True
    assert sockets.looks == [250]
    assert yields == []


def test_after_work_moved_it_polls_until_the_message_comes():
    waiter, sockets, clock, yields = make(ready_in=0.0005)
    waiter.work_moved()
    assert waiter.wait(250) is True
    assert set(sockets.looks) == {0}  # never went to sleep
    assert len(sockets.looks) == 6  # looked every 0.1 ms until it came at 0.5 ms
    assert len(yields) == 5  # and gave the core up between looks
    assert clock.now == pytest.approx(sockets.ready_at)


def test_it_sleeps_once_the_busy_time_is_up_and_spins_no_more_until_work_moves_quickly():
    waiter, sockets, clock, _ = make(ready_in=0.005)
    waiter.work_moved()
    assert waiter.wait(250) is True
    looks, blocking = sockets.looks[:-1], sockets.looks[-1]
    assert set(looks) == {0} and len(looks) == 10  # 1 ms of looks, then ...
    assert 248 <= blocking <= 249  # ... a sleep for what was left of the timeout, no more
    for count in range(SHORT_GAPS):  # work moves quickly again, turn after turn:
        waiter.work_moved()
        sockets.looks.clear()
        arrive(sockets, clock, 0.0002)
        assert waiter.wait(250) is True
        assert sockets.looks == [250], count  # not yet: it sleeps
    waiter.work_moved()
    sockets.looks.clear()
    arrive(sockets, clock, 0.0002)
    assert waiter.wait(250) is True
    assert set(sockets.looks) == {0}  # now it spins again


def test_results_slower_than_the_busy_time_never_start_a_spin_whatever_else_comes():
    # Over a LAN: each result takes 3 ms to come back, each next call 0.3 ms, and heartbeats of
    # many workers arrive every 0.4 ms in between. A spin would miss every other time; none
    # starts, since only the turns that move work count.
    waiter, sockets, clock, yields = make(ready_in=None, primed=False)
    for _ in range(10):
        for after in (0.003, 0.0003):
            waiter.work_moved()
            answer = clock.now + after
            while True:
                arrive(sockets, clock, min(0.0004, answer - clock.now))
                assert waiter.wait(250) is True
                if clock.now >= answer - 1e-9:
                    break  # the answer; before it, a heartbeat: no work moved
    assert yields == [] and 0 not in sockets.looks


def test_a_timer_due_sooner_than_the_busy_time_ends_the_spin_on_time():
    waiter, sockets, _, _ = make(ready_in=None)
    waiter.work_moved()
    assert waiter.wait(0) is False  # a timer due now: one look, no spin
    assert sockets.looks == [0]
    waiter, sockets, clock, _ = make(ready_in=None, busy_poll=0.05)
    waiter.work_moved()
    started = clock.now
    assert waiter.wait(2) is False  # 2 ms to the next timer, 50 ms of busy time
    assert clock.now - started == pytest.approx(0.002, abs=0.0002)
    assert set(sockets.looks) == {0}  # the spin used the whole timeout: never slept past it
    sockets.looks.clear()
    arrive(sockets, clock, 0.0003)
    assert waiter.wait(250) is True  # the timer ran; the spin goes on where it stopped
    assert set(sockets.looks) == {0}


def test_busy_poll_zero_or_nonsense_never_spins_and_a_huge_one_is_capped():
    for off in (0.0, -1.0, float("nan"), float("inf")):
        waiter, sockets, clock, yields = make(ready_in=None, busy_poll=off, primed=False)
        for _ in range(5):  # work moving as quickly as it can
            waiter.work_moved()
            arrive(sockets, clock, 0.0001)
            assert waiter.wait(250) is True
        assert yields == [] and 0 not in sockets.looks, off
    waiter, sockets, clock, _ = make(ready_in=None, busy_poll=5.0)
    assert waiter.busy_poll == MAX_BUSY_POLL
    waiter.work_moved()
    started = clock.now
    assert waiter.wait(60_000) is False
    assert clock.now - started == pytest.approx(60.0, abs=0.002)  # a 0.1 s spin, then a sleep
    assert sockets.looks.count(0) == pytest.approx(MAX_BUSY_POLL / sockets.step, abs=2)


def test_busy_poll_is_set_in_microseconds_and_checked(tmp_path):
    assert Settings.from_env({"GPUMESH_HOME": str(tmp_path)}).busy_poll == BUSY_POLL == 0.001
    assert Settings.from_env({"GPUMESH_HOME": str(tmp_path),
                              "GPUMESH_BUSY_POLL_US": "250"}).busy_poll == pytest.approx(0.00025)
    assert Settings.from_env({"GPUMESH_HOME": str(tmp_path),
                              "GPUMESH_BUSY_POLL_US": "0"}).busy_poll == 0.0
    for bad in ("-1", "nan", "inf", "1e9", "0.5", "fast"):
        with pytest.raises(ConfigError, match="GPUMESH_BUSY_POLL_US.*0 turns busy polling off"):
            Settings.from_env({"GPUMESH_HOME": str(tmp_path), "GPUMESH_BUSY_POLL_US": bad})


def test_the_loop_sees_a_task_handed_out_and_a_result_coming_back(tmp_path):
    # What server.run compares to tell a turn that moved work (it then polls for the answer)
    # from one that only heard heartbeats.
    def message(command, header, payload=()):
        return decode(encode(command, header, payload), Limits())

    store = Store(tmp_path / "journal.db")
    try:
        broker = Broker(store, Timing(), Limits(), epoch=1, now=0.0)
        broker.handle(b"w", message(Command.HELLO, {
            "role": "worker", "id": "w1", "slots": 1, "credit": 1, "proto": [1, 1],
            "info": {"python": "3.11"}}), 0.0)
        broker.handle(b"c", message(Command.HELLO, {"role": "client", "id": "c1",
                                                    "proto": [1, 1]}), 0.0)
        ledger = broker.ledger
        broker.handle(b"w", message(Command.HEARTBEAT, {}), 0.5)
        assert (ledger.leased_total, ledger.finished_total) == (0, 0)
        broker.handle(b"c", message(Command.SUBMIT, {"tasks": [{"seq": 1, "nf": 2, "kind": "fn"}]},
                                    [b"f" * 300, b"a" * 60]), 1.0)
        broker.dispatch(1.0)
        assert (ledger.leased_total, ledger.finished_total) == (1, 0)
        ((lease, task),) = broker.workers["w1"].leases.items()
        broker.handle(b"w", message(Command.RESULT, {
            "task": task, "lease": lease, "status": "ok", "encoding": "pickle", "granted": 2},
            [b"r" * 40]), 1.1)
        assert (ledger.leased_total, ledger.finished_total) == (1, 1)
    finally:
        store.close()


class RecordingWaiter:
    """Stands in for the Waiter in a turn of the coordinator's loop: what the turn told it."""

    def __init__(self) -> None:
        self.timeouts: list[int] = []
        self.moves = 0

    def wait(self, timeout_ms: int) -> None:
        self.timeouts.append(timeout_ms)

    def work_moved(self) -> None:
        self.moves += 1


def test_a_turn_of_the_loop_tells_the_waiter_when_work_moved_and_only_then(tmp_path):
    # Coordinator._turn, as run() calls it, with the messages a turn reads handed in directly
    # (no CURVE peers): a turn that only hears heartbeats must not arm a spin; one that hands
    # out a task, or takes a result, must.
    coordinator = Coordinator(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}), new_token(),
                              host="127.0.0.1", port=0, db_path=tmp_path / "journal.db")
    arriving: list[tuple[bytes, Command, dict, list]] = []

    def drain(now):
        while arriving:
            routing, command, header, payload = arriving.pop(0)
            coordinator.broker.handle(routing, decode(encode(command, header, payload),
                                                      Limits()), now)

    coordinator._drain = drain  # type: ignore[method-assign]
    coordinator._send = lambda routing, messages, now: None  # type: ignore[method-assign]
    waiter = RecordingWaiter()
    try:
        arriving += [
            (b"w", Command.HELLO, {"role": "worker", "id": "w1", "slots": 1, "credit": 1,
                                   "proto": [1, 1], "info": {"python": "3.11"}}, []),
            (b"c", Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}, []),
            (b"w", Command.HEARTBEAT, {}, [])]
        coordinator._turn(waiter)
        assert waiter.moves == 0
        assert waiter.timeouts and 0 < waiter.timeouts[-1] <= coordinator._tick_ms
        arriving.append((b"c", Command.SUBMIT, {"tasks": [{"seq": 1, "nf": 2, "kind": "fn"}]},
                         [b"f" * 300, b"a" * 60]))
        coordinator._turn(waiter)
        assert waiter.moves == 1  # the task went to w1 in this turn
        arriving.append((b"w", Command.HEARTBEAT, {}, []))
        coordinator._turn(waiter)
        assert waiter.moves == 1
        ((lease, task),) = coordinator.broker.workers["w1"].leases.items()
        arriving.append((b"w", Command.RESULT, {"task": task, "lease": lease, "status": "ok",
                                                "encoding": "pickle", "granted": 2}, [b"r" * 40]))
        coordinator._turn(waiter)
        assert waiter.moves == 2
        coordinator._turn(waiter)  # nothing arrived
        assert waiter.moves == 2
    finally:
        coordinator.close()
