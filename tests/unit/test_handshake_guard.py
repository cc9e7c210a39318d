"""Unit tests for the handshake rate limit (gpumesh.security.HandshakeGuard): plain values, no clock."""

from __future__ import annotations

import pytest

from gpumesh.security import HandshakeGuard, HandshakePolicy, is_exempt

POLICY = HandshakePolicy(max_failures=3, window=10.0, lockout=5.0, max_lockout=20.0,
                         max_addresses=4, log_burst=2, log_interval=10.0)
ATTACKER = "192.0.2.7"  # TEST-NET-1: a documentation address, never contacted


def fail_times(guard: HandshakeGuard, address: str, *times: float) -> list[float]:
    return [guard.failed(address, t) for t in times]


def test_failures_under_the_threshold_lock_nothing() -> None:
    guard = HandshakeGuard(POLICY)
    assert fail_times(guard, ATTACKER, 0, 1) == [0, 0]
    assert guard.locked_for(ATTACKER, 1.5) == 0


def test_the_threshold_within_the_window_locks_the_address_out_until_it_expires() -> None:
    guard = HandshakeGuard(POLICY)
    assert fail_times(guard, ATTACKER, 0, 1, 2) == [0, 0, 5.0]
    assert guard.locked_for(ATTACKER, 2) == 5.0
    assert guard.locked_for(ATTACKER, 6.5) == pytest.approx(0.5)
    assert guard.locked_for(ATTACKER, 7) == 0
    assert guard.locked_for("192.0.2.8", 3) == 0  # only that address


def test_failures_spread_wider_than_the_window_never_lock() -> None:
    guard = HandshakeGuard(POLICY)
    assert fail_times(guard, ATTACKER, 0, 6, 12, 18, 24) == [0] * 5


def test_repeat_offenders_get_doubling_lockouts_up_to_the_cap() -> None:
    guard = HandshakeGuard(POLICY)
    lockouts = []
    now = 0.0
    for _ in range(4):
        got = fail_times(guard, ATTACKER, now, now + 0.1, now + 0.2)
        lockouts.append(got[-1])
        now += got[-1] + 1  # come back just after each lockout ends
    assert lockouts == [5.0, 10.0, 20.0, 20.0]


def test_an_address_clean_for_the_longest_lockout_starts_afresh() -> None:
    guard = HandshakeGuard(POLICY)
    fail_times(guard, ATTACKER, 0, 0.1, 0.2)
    assert fail_times(guard, ATTACKER, 100, 100.1, 100.2)[-1] == 5.0


def test_a_good_handshake_clears_recent_failures() -> None:
    guard = HandshakeGuard(POLICY)
    fail_times(guard, ATTACKER, 0, 1)
    guard.succeeded(ATTACKER)
    assert fail_times(guard, ATTACKER, 2, 3) == [0, 0]
    assert guard.locked_for(ATTACKER, 3) == 0


@pytest.mark.parametrize("address", ["127.0.0.1", "127.9.9.9", "::1", "::ffff:127.0.0.1"])
def test_loopback_is_exempt(address: str) -> None:
    guard = HandshakeGuard(POLICY)
    assert is_exempt(address)
    assert fail_times(guard, address, *[i * 0.01 for i in range(100)]) == [0] * 100
    assert guard.locked_for(address, 1) == 0
    assert len(guard) == 0


@pytest.mark.parametrize("address", ["192.0.2.7", "2001:db8::7", "10.250.0.2", "", "not an ip"])
def test_other_addresses_are_not_exempt(address: str) -> None:
    assert not is_exempt(address)


def test_the_table_is_bounded_and_keeps_locked_addresses() -> None:
    guard = HandshakeGuard(POLICY)
    fail_times(guard, ATTACKER, 0, 0.1, 0.2)  # locked until 5.2
    for i in range(50):
        guard.failed(f"198.51.100.{i}", 1 + i * 0.01)
    assert len(guard) == POLICY.max_addresses
    assert guard.locked_for(ATTACKER, 2) > 0


def test_the_log_budget_counts_what_it_suppresses() -> None:
    guard = HandshakeGuard(POLICY)
    assert [guard.may_log(t) for t in (0, 1, 2, 3)] == [True, True, False, False]
    assert guard.suppressed_logs == 2
    assert guard.may_log(10.5)  # the first two left the interval
