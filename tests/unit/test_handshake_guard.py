"""Unit tests for the handshake rate limit (gpumesh.security.HandshakeGuard) and the pairing of
monitor events into failed handshakes (HandshakeEvents): plain values, no clock, no sockets."""

from __future__ import annotations

import struct

import pytest
import zmq

from gpumesh.security import HandshakeEvents, HandshakeGuard, HandshakePolicy, is_exempt, peer_host

POLICY = HandshakePolicy(max_failures=3, window=10.0, lockout=5.0, max_lockout=20.0,
                         max_addresses=4, log_burst=2, log_interval=10.0)
ATTACKER = "192.0.2.7"  # TEST-NET-1: a documentation address, never contacted
FRIEND = "192.0.2.9"


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


def test_an_address_that_never_stops_stays_at_the_cap() -> None:
    # Past 1,024 lockouts the doubling overflowed a float and raised in the ZAP handler.
    guard = HandshakeGuard(POLICY)
    now = 0.0
    for _ in range(1100):
        got = fail_times(guard, ATTACKER, now, now + 0.1, now + 0.2)
        now += got[-1] + 1
    assert got[-1] == POLICY.max_lockout


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


# --------------------------------------------------------------- pairing monitor events

ACCEPTED, DISCONNECTED = zmq.EVENT_ACCEPTED, zmq.EVENT_DISCONNECTED
SUCCEEDED = zmq.EVENT_HANDSHAKE_SUCCEEDED
PROTOCOL, NO_DETAIL = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
AUTH = zmq.EVENT_HANDSHAKE_FAILED_AUTH


def feed(pairs: HandshakeEvents, *events: tuple) -> list:
    """Feed (event, value[, address]) tuples; what each DISCONNECTED asked to count."""
    found = []
    for event in events:
        result = pairs.event(*event)
        if event[0] == DISCONNECTED:
            found.append(result)
    return found


def test_a_wrong_server_key_is_counted_for_the_accepted_address() -> None:
    # The order libzmq emits for a wrong token: the failure, then DISCONNECTED of its fd.
    found = feed(HandshakeEvents(), (ACCEPTED, 21, ATTACKER), (PROTOCOL, 0x11000001),
                 (DISCONNECTED, 21))
    assert len(found) == 1 and found[0][0] == ATTACKER and "server key" in found[0][1]


def test_a_timeout_or_a_close_mid_handshake_is_counted() -> None:
    found = feed(HandshakeEvents(), (ACCEPTED, 9, ATTACKER), (NO_DETAIL, 11), (DISCONNECTED, 9))
    assert found[0][0] == ATTACKER


def test_a_connection_closed_right_after_accept_is_counted() -> None:
    # Bytes that are not ZMTP (no 0xff signature) end without any HANDSHAKE_FAILED event.
    found = feed(HandshakeEvents(), (ACCEPTED, 7, ATTACKER), (DISCONNECTED, 7))
    assert found[0][0] == ATTACKER and "closed before any handshake" in found[0][1]


def test_zap_failures_and_normal_sessions_are_not_counted_here() -> None:
    pairs = HandshakeEvents()
    assert feed(pairs, (ACCEPTED, 5, ATTACKER), (AUTH, 400), (DISCONNECTED, 5)) == [None]
    assert feed(pairs, (ACCEPTED, 6, FRIEND), (SUCCEEDED, 0), (ACCEPTED, 8, ATTACKER),
                (DISCONNECTED, 6)) == [None]
    assert len(pairs) == 1  # fd 8 still open


def test_failures_of_interleaved_connections_go_to_their_own_address() -> None:
    pairs = HandshakeEvents()
    found = feed(pairs, (ACCEPTED, 5, FRIEND), (ACCEPTED, 6, ATTACKER), (SUCCEEDED, 0),
                 (PROTOCOL, 1), (DISCONNECTED, 6), (DISCONNECTED, 5))
    assert [f and f[0] for f in found] == [ATTACKER, None]
    assert len(pairs) == 0


def test_an_unreadable_address_is_counted_as_unknown_and_fds_are_reused() -> None:
    pairs = HandshakeEvents()
    found = feed(pairs, (ACCEPTED, 5, None), (PROTOCOL, 1), (DISCONNECTED, 5),
                 (ACCEPTED, 5, FRIEND), (SUCCEEDED, 0), (DISCONNECTED, 5))
    assert found[0] is not None and found[0][0] is None
    assert found[1] is None


def test_a_disconnect_of_an_fd_never_seen_accepted_is_not_counted() -> None:
    assert feed(HandshakeEvents(), (DISCONNECTED, 3)) == [None]
    assert feed(HandshakeEvents(), (ACCEPTED, 4, ATTACKER), (DISCONNECTED, 3)) == [None]


@pytest.mark.parametrize(("raw", "host"), [("::ffff:10.250.0.2", "10.250.0.2"),
                                           ("10.250.0.2", "10.250.0.2"), ("::1", "::1"),
                                           ("2001:DB8::7", "2001:db8::7"), ("odd", "odd")])
def test_one_spelling_per_peer(raw: str, host: str) -> None:
    assert peer_host(raw) == host


def _watch(monkeypatch, arriving=()):
    """A HandshakeWatch without its socket and thread: its monitor answers what ``arriving``
    holds, then nothing; the addresses it reads are recorded."""
    from collections import deque

    from gpumesh import security

    class Monitor:
        def __init__(self):
            self.frames = deque(struct.pack("=hi", event, value) for event, value in arriving)

        def recv_multipart(self, flags=0):
            if not self.frames:
                raise zmq.Again()
            return [self.frames.popleft()]

    class Auth:
        def __init__(self):
            self.failed = []

        def failed_before_zap(self, peer, why):
            self.failed.append(peer)

    watch = security.HandshakeWatch.__new__(security.HandshakeWatch)
    watch._pairs, watch._auth, watch._closed = HandshakeEvents(), Auth(), None
    watch._unnamed, watch._monitor = deque(), Monitor()
    read: list[int] = []
    monkeypatch.setattr(security, "_peer_of", lambda fd: read.append(fd) or f"10.0.0.{fd}")
    return watch, read


def test_an_address_is_read_only_for_a_connection_that_does_not_close_later_in_the_batch(
        monkeypatch):
    # Whether it closes later was found by scanning the rest of the batch for each ACCEPTED:
    # a flood of thousands of connections cost quadratic time. Counted as the batch is walked
    # and as it grows; the answers are the same.
    watch, read = _watch(monkeypatch, arriving=[(DISCONNECTED, 8)])  # comes while 8 is read
    batch = [(ACCEPTED, 5), (PROTOCOL, 1), (DISCONNECTED, 5),  # 5 read: it closes later...
             (ACCEPTED, 5), (DISCONNECTED, 5),  # ... no: its close is ahead, so not read
             (ACCEPTED, 7), (PROTOCOL, 1), (DISCONNECTED, 7),
             (ACCEPTED, 8), (PROTOCOL, 1)]
    assert watch._handle(batch)
    assert read == [8]  # the only one with no close ahead when it was handled
    assert len(batch) == 11  # the close of 8 that arrived meanwhile joined the batch
    assert watch._auth.failed.count(None) + len(watch._unnamed) >= 2
