"""Who the coordinator just hung up on, from the kernel: for handshakes libzmq ends before ZAP.

A wrong-token handshake fails within microseconds, often before the handshake watch (a Python
thread reading libzmq's socket monitor) can read the peer's address; then the failure has no
address and locks nobody out. But the coordinator closes such a connection itself, and a
socket that closes first stays in TIME_WAIT for a minute, with the peer's address, in Linux's
``/proc/net/tcp`` and ``tcp6``. ``ClosedConnections`` reads those entries for the
coordinator's port and hands out the peers of connections it had not seen before; the watch
matches them against its failures without an address (security.HandshakeWatch).

A TIME_WAIT entry says only that this side closed a connection, not why. So an entry is used
only to name a failure the monitor did report, each entry at most once, and an entry for a
failure the watch did name is set aside first. Elsewhere than Linux this finds nothing, and
failures without an address stay unnamed, as before.
"""

from __future__ import annotations

import ipaddress
import time
from collections import deque
from collections.abc import Callable, Iterable

TIME_WAIT = "06"
TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
# How long a new entry or an unnamed failure waits for its other half: the kernel's table and
# the monitor's events race each other by a few milliseconds.
MATCH_WINDOW = 2.0
MAX_TRACKED = 200_000  # entries remembered as seen (TIME_WAIT lasts 60 s): a bounded set
# Failures the watch named itself, kept per peer for MATCH_WINDOW: at most this many a peer,
# and peers; the oldest marks go first (a mark only sets an entry aside).
MAX_MARKS_PER_PEER = 4096
MAX_NAMED_PEERS = 10_000


def parse_time_wait(text: str, port: int) -> list[tuple[str, int]]:
    """``(peer address, peer port)`` of the TIME_WAIT entries on local ``port`` in the text of
    /proc/net/tcp or tcp6. Lines that do not parse are skipped."""
    found = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 4 or parts[3] != TIME_WAIT:
            continue
        try:
            local_port = int(parts[1].rsplit(":", 1)[1], 16)
            remote_hex, remote_port_hex = parts[2].rsplit(":", 1)
            if local_port != port:
                continue
            found.append((_address(remote_hex), int(remote_port_hex, 16)))
        except (ValueError, IndexError):
            continue
    return found


def _address(hex_text: str) -> str:
    """The kernel prints addresses as 32-bit words in host order (little-endian here)."""
    raw = bytes.fromhex(hex_text)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    if len(raw) != 16:
        raise ValueError("not an address")
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    address = ipaddress.IPv6Address(words)
    return str(address.ipv4_mapped or address)


class ClosedConnections:
    """Peers of connections on ``port`` that this side closed recently, each handed out once."""

    def __init__(self, port: int, tables: Iterable[str] = TABLES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.port = port
        self._tables = tuple(tables)
        self._clock = clock
        self._seen: set[tuple[str, int]] = set()
        self._fresh: deque[tuple[float, str]] = deque()  # (when found, peer), not yet used
        # Failures the watch named itself, by peer: each sets one entry of that peer aside.
        self._named: dict[str, deque[float]] = {}
        self._marks_swept_at = clock()

    def named(self, peer: str) -> None:
        """The watch named one failure's peer itself: one entry of that peer is its own. Kept
        MATCH_WINDOW, as long as one could still set an entry aside: a peer that hangs up first
        leaves no entry of this side's, and its marks were kept for good (32 bytes a failed
        handshake, never freed; behind --public every peer is 127.0.0.1)."""
        now = self._clock()
        marks = self._named.get(peer)
        if marks is None:
            marks = self._named[peer] = deque(maxlen=MAX_MARKS_PER_PEER)
        while marks and now - marks[0] > MATCH_WINDOW:
            marks.popleft()
        marks.append(now)
        if len(self._named) > MAX_NAMED_PEERS:
            self._forget_old_marks(now)

    def _forget_old_marks(self, now: float) -> None:
        self._marks_swept_at = now
        for peer in list(self._named):
            marks = self._named[peer]
            while marks and now - marks[0] > MATCH_WINDOW:
                marks.popleft()
            if not marks:
                del self._named[peer]
        if len(self._named) > MAX_NAMED_PEERS:  # that many peers within the window: a flood
            self._named.clear()

    def take(self, count: int) -> list[str]:
        """Peers for up to ``count`` failures without an address, oldest entries first."""
        now = self._clock()
        self._refresh(now)
        peers: list[str] = []
        while self._fresh and len(peers) < count:
            _, peer = self._fresh.popleft()
            if not self._set_aside(peer, now):
                peers.append(peer)
        return peers

    def _set_aside(self, peer: str, now: float) -> bool:
        named = self._named.get(peer)
        while named and now - named[0] > MATCH_WINDOW:
            named.popleft()
        if not named:
            self._named.pop(peer, None)
            return False
        named.popleft()
        return True

    def _refresh(self, now: float) -> None:
        current: set[tuple[str, int]] = set()
        for table in self._tables:
            try:
                with open(table, encoding="ascii", errors="replace") as source:
                    current.update(parse_time_wait(source.read(), self.port))
            except OSError:
                continue  # not Linux, or no IPv6
        for entry in sorted(current - self._seen):
            self._fresh.append((now, entry[0]))
        # An entry that left TIME_WAIT does not come back: forget it, so the set stays bounded.
        self._seen = current if len(current) <= MAX_TRACKED else set()
        while self._fresh and now - self._fresh[0][0] > MATCH_WINDOW:
            self._fresh.popleft()
        if now - self._marks_swept_at > MATCH_WINDOW:
            self._forget_old_marks(now)
