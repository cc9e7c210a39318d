"""Token to CURVE keys, the ZAP allow-list, the failed-handshake watch, and the fingerprint.

The token never crosses the wire. Both sides derive the same two Curve25519 keypairs from it:
scrypt (N=2^17, r=8, p=1) of the token's secret part with its salt part (``SALT.SECRET``, see
gpumesh.tokens; a token without one gets a fixed domain salt), then HKDF-SHA256 into the
coordinator's server pair and one client pair shared by every worker and client. A generated
token (a ``rand-`` salt, 192 random bits of secret) skips scrypt: nobody can guess it at any
cost per guess, so stretching it would only cost every process 0.4 s and 128 MiB. The
coordinator's ZAP handler admits only the derived client public key, so a peer must hold the
token to complete a handshake, and it must also hold it to know the server key it encrypts
to: authentication is mutual. scrypt makes each guess at a recorded handshake cost about
0.4 s and 128 MiB; the salt makes the guesses for one mesh useless against another.

Failed handshakes are counted per peer address (``HandshakeGuard``) from two places: the ZAP
handler sees the ones that reach it (a wrong client key), and ``HandshakeWatch`` reads the
ROUTER's socket monitor for the ones libzmq ends before ZAP (a wrong server key, i.e. a wrong
token; bytes that are not ZMTP). An address that fails too often is refused at ZAP for a
while, loopback excepted.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.auth.thread
from zmq.utils import z85

from .closedconns import MATCH_WINDOW, ClosedConnections
from .errors import MeshError
from .tokens import parse_token, weak_warning

log = logging.getLogger("gpumesh.security")

ZAP_DOMAIN = "gpumesh"
# Changing any of these changes every mesh's keys: a breaking change (docs/stability.md).
KDF = "scrypt-n17-r8-p1/gpumesh-v2"
RANDOM_KDF = "hmac-sha256-random/gpumesh-v2"  # generated tokens: HMAC of the secret, no scrypt
_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 2**17, 8, 1
_SCRYPT_MAXMEM = 256 * 1024 * 1024  # needs 128 * r * N = 128 MiB
_SALT_PREFIX = b"gpumesh/v2/salt/"
_DOMAIN_SALT = b"gpumesh/v2/no-salt"
_HKDF_SALT = b"gpumesh/v2"
_CACHE_SIZE = 8

_cache_lock = threading.Lock()
_stretched: OrderedDict[str, bytes] = OrderedDict()  # token -> scrypt output, this process only
_in_flight: dict[str, threading.Event] = {}  # tokens being stretched now, set when done


def _after_fork_in_child() -> None:
    """A forked child (joblib, multiprocessing) has no thread finishing a stretch it saw
    start: it must not wait for one, nor find the lock held."""
    global _cache_lock
    _cache_lock = threading.Lock()
    _in_flight.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
_warned: set[bytes] = set()


@dataclass(frozen=True)
class MeshKeys:
    """Everything derived from one token. ``repr`` hides the secrets."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)
    fingerprint: str


def _hkdf(key_material: bytes, info: bytes, length: int = 32) -> bytes:
    """RFC 5869 HKDF-SHA256 (extract then expand), enough for a few 32-byte subkeys."""
    prk = hmac.new(_HKDF_SALT, key_material, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


def kdf_for(token: str) -> str:
    """The name of the derivation ``stretch`` uses for ``token`` (the saved cache's key)."""
    return RANDOM_KDF if parse_token(token).random else KDF


def stretch(token: str) -> bytes:
    """scrypt of the token's secret with its salt: the one slow step, done once per process
    per token (and cached across commands by the CLI, see ``remember_stretched``). A generated
    token's secret is already random: HMAC-SHA256 with its salt as the key, in microseconds."""
    parsed = parse_token(token)
    if parsed.random:
        assert parsed.salt is not None
        value = hmac.new(_SALT_PREFIX + parsed.salt.encode(), parsed.secret.encode("utf-8"),
                         hashlib.sha256).digest()
        remember_stretched(token, value)  # one path for callers: cached like any other
        return value
    while True:
        with _cache_lock:
            cached = _stretched.get(token)
            if cached is not None:
                _stretched.move_to_end(token)
                return cached
            running = _in_flight.get(token)
            if running is None:  # ours to compute; others asking meanwhile wait for it
                running = _in_flight[token] = threading.Event()
                break
        running.wait()  # one scrypt per token at a time: a second would only double the CPU
    try:
        salt = _SALT_PREFIX + parsed.salt.encode() if parsed.salt else _DOMAIN_SALT
        value = hashlib.scrypt(parsed.secret.encode("utf-8"), salt=salt, n=_SCRYPT_N,
                               r=_SCRYPT_R, p=_SCRYPT_P, maxmem=_SCRYPT_MAXMEM, dklen=32)
        remember_stretched(token, value)
        return value
    finally:
        with _cache_lock:
            _in_flight.pop(token, None)
        running.set()


def remember_stretched(token: str, value: bytes) -> None:
    """Seed this process's cache with a stretched key computed earlier (the saved config's)."""
    with _cache_lock:
        _stretched[token] = value
        _stretched.move_to_end(token)
        while len(_stretched) > _CACHE_SIZE:
            _stretched.popitem(last=False)


def cached_stretch(token: str) -> bytes | None:
    """The stretched key of ``token`` if this process has derived it, else None."""
    with _cache_lock:
        return _stretched.get(token)


def note_weak(token: str) -> bool:
    """Whether a weak ``token`` still needs its warning in this process; marks it as warned."""
    if weak_warning(token) is None:
        return False
    digest = hashlib.sha256(token.encode("utf-8")).digest()
    with _cache_lock:
        if digest in _warned:
            return False
        _warned.add(digest)
    return True


def derive_keys(token: str) -> MeshKeys:
    """Derive the mesh's CURVE keypairs and public fingerprint from the token.

    A weak token is used, with one warning per process on ``gpumesh.security``: refusing it
    is the coordinator's decision (``tokens.refuse_weak``), not a joiner's.
    """
    parse_token(token)  # an empty token is a ConfigError before anything else
    require_curve()
    if note_weak(token):
        log.warning("%s", weak_warning(token))
    material = stretch(token)
    server_secret = z85.encode(_hkdf(material, b"curve-server"))
    client_secret = z85.encode(_hkdf(material, b"curve-client"))
    return MeshKeys(
        server_public=zmq.curve_public(server_secret),
        server_secret=server_secret,
        client_public=zmq.curve_public(client_secret),
        client_secret=client_secret,
        fingerprint=_hkdf(material, b"fingerprint", 6).hex(),
    )


def stretch_in_background(token: str) -> threading.Thread:
    """Start the token's scrypt (about 0.4 s; it releases the GIL) in a thread, so a process can
    do its other start-up work meanwhile; ``join()`` it, then ``derive_keys`` finds the result
    cached. A bad token is not reported here: the later ``derive_keys`` raises it."""

    def stretch_quietly() -> None:
        with contextlib.suppress(Exception):
            stretch(token)

    thread = threading.Thread(target=stretch_quietly, name="gpumesh-scrypt", daemon=True)
    thread.start()
    return thread


def require_curve() -> None:
    """Refuse to run on a libzmq without CURVE: there is no unencrypted fallback."""
    if not zmq.has("curve"):
        raise MeshError(
            f"this libzmq ({zmq.zmq_version()}) was built without CURVE encryption, which gpumesh "
            "requires: reinstall pyzmq from its wheels (pip install --force-reinstall pyzmq)"
        )


def configure_server(sock: zmq.Socket[bytes], keys: MeshKeys) -> None:
    """Make ``sock`` a CURVE server guarded by the ZAP domain. Call before ``bind``."""
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()


def configure_client(sock: zmq.Socket[bytes], keys: MeshKeys) -> None:
    """Make ``sock`` a CURVE client of the mesh's coordinator. Call before ``connect``."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


class _AllowMeshClient:
    """ZAP credentials provider: admit exactly the client key derived from the token."""

    def __init__(self, keys: MeshKeys) -> None:
        self._allowed = keys.client_public

    def callback(self, domain: str, client_key: bytes) -> bool:
        return domain == ZAP_DOMAIN and hmac.compare_digest(client_key, self._allowed)


@dataclass(frozen=True)
class HandshakePolicy:
    """When an address that keeps failing the handshake gets refused, and for how long.

    ``max_failures`` failures within ``window`` seconds lock the address out for ``lockout``
    seconds; each further lockout of the same address doubles that, up to ``max_lockout``. An
    address that stays clean for ``max_lockout`` after its last failure or lockout is forgotten.
    At most ``log_burst`` warnings are logged per ``log_interval``; the rest are counted and
    reported in the next one.
    """

    max_failures: int = 10
    window: float = 60.0
    lockout: float = 60.0
    max_lockout: float = 3600.0
    max_addresses: int = 10_000
    log_burst: int = 10
    log_interval: float = 60.0


@dataclass
class _Record:
    failures: list[float] = field(default_factory=list)
    locked_until: float = 0.0
    strikes: int = 0
    last_seen: float = 0.0


def is_exempt(address: str) -> bool:
    """Loopback peers are never rate limited: they are on this machine already."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


class HandshakeGuard:
    """Per-address failed-handshake bookkeeping. Does no I/O and reads no clock: pass ``now``.

    Memory is bounded by ``policy.max_addresses``: past it, the least recently seen addresses
    that are not locked out are forgotten first.
    """

    def __init__(self, policy: HandshakePolicy | None = None) -> None:
        self.policy = policy or HandshakePolicy()
        self._records: OrderedDict[str, _Record] = OrderedDict()
        self._log_times: list[float] = []
        self.suppressed_logs = 0

    def __len__(self) -> int:
        return len(self._records)

    def locked_for(self, address: str, now: float) -> float:
        """Seconds ``address`` stays refused; 0 when it may try a handshake."""
        record = self._records.get(address)
        if record is None or is_exempt(address):
            return 0.0
        return max(record.locked_until - now, 0.0)

    def failed(self, address: str, now: float) -> float:
        """Count one failed handshake. Returns the lockout it starts, in seconds, or 0."""
        if is_exempt(address):
            return 0.0
        policy = self.policy
        record = self._records.pop(address, None)
        if record is None or now - max(record.last_seen, record.locked_until) > policy.max_lockout:
            record = _Record()
        record.last_seen = now
        self._records[address] = record
        record.failures = [t for t in record.failures if now - t < policy.window]
        record.failures.append(now)
        self._trim(now)
        if len(record.failures) < policy.max_failures or record.locked_until > now:
            return 0.0
        # The exponent is capped: past 2**1023 the product no longer converts to a float, and
        # an address that kept failing that many lockouts would crash the ZAP handler.
        seconds = min(policy.lockout * 2.0 ** min(record.strikes, 64), policy.max_lockout)
        record.strikes += 1
        record.failures.clear()
        record.locked_until = now + seconds
        return seconds

    def succeeded(self, address: str) -> None:
        """A good handshake clears the address's recent failures (not its lockout history)."""
        record = self._records.get(address)
        if record is not None:
            record.failures.clear()

    def may_log(self, now: float) -> bool:
        """Whether one more warning fits the log budget; counts the ones that do not."""
        policy = self.policy
        self._log_times = [t for t in self._log_times if now - t < policy.log_interval]
        if len(self._log_times) < policy.log_burst:
            self._log_times.append(now)
            return True
        self.suppressed_logs += 1
        return False

    def _trim(self, now: float) -> None:
        if len(self._records) <= self.policy.max_addresses:
            return
        for address, record in list(self._records.items()):
            if len(self._records) <= self.policy.max_addresses:
                return
            if record.locked_until <= now:
                del self._records[address]
        while len(self._records) > self.policy.max_addresses:
            self._records.popitem(last=False)


def peer_host(address: str) -> str:
    """One spelling per peer: an IPv4-mapped IPv6 address is written as the IPv4 address."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


class MeshAuthenticator(zmq.auth.thread.ThreadAuthenticator):
    """The coordinator's ZAP handler: the mesh client key only, and a rate limit per address.

    A refused address gets ZAP status 300 (temporary failure), which libzmq turns into a silent
    disconnect, so a locked-out peer learns nothing; a wrong key gets 400. Failures are logged
    as warnings on ``gpumesh.zap``, naming the address and never a key, within the policy's
    log budget. ``failed_before_zap`` takes the failures ``HandshakeWatch`` sees, from its own
    thread: the guard is shared under a lock.
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], keys: MeshKeys, *,
                 policy: HandshakePolicy | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(ctx, log=logging.getLogger("gpumesh.zap"))
        # zmq.auth's own debug lines are noise here; warnings are this handler's output.
        self.log.setLevel(logging.WARNING)
        self._allow = _AllowMeshClient(keys)
        self.guard = HandshakeGuard(policy)
        self._guard_lock = threading.Lock()
        self._clock = clock
        self.unattributed = 0  # failures whose peer closed before its address could be read

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) < 6:
            if len(msg) >= 2:
                self._send_zap_reply(msg[1], b"400", b"Not enough frames")
            return
        version, request_id, domain, raw_address, _identity, mechanism = msg[:6]
        credentials = msg[6:]
        address = peer_host(raw_address.decode("utf-8", "replace"))
        now = self._clock()
        with self._guard_lock:
            locked = self.guard.locked_for(address, now)
        if locked:
            self._send_zap_reply(request_id, b"300", b"Rate limited")
            return
        admitted = (
            version == b"1.0" and mechanism == b"CURVE" and len(credentials) == 1
            and self._allow.callback(domain.decode("utf-8", "replace"), z85.encode(credentials[0]))
        )
        if admitted:
            with self._guard_lock:
                self.guard.succeeded(address)
            self._send_zap_reply(request_id, b"200", b"OK", "mesh")
            return
        self._send_zap_reply(request_id, b"400", b"Unknown key")
        self._count(address, now, "its client key does not match this mesh's token")

    def failed_before_zap(self, address: str | None, why: str) -> None:
        """Count a handshake libzmq ended before asking ZAP (``None``: address unknown)."""
        now = self._clock()
        if address is None:
            with self._guard_lock:
                self.unattributed += 1
                if not self.guard.may_log(now):
                    return
                suppressed, self.guard.suppressed_logs = self.guard.suppressed_logs, 0
            self.log.warning("a handshake failed (%s) on a connection that closed before its "
                             "address could be read%s", why, _more(suppressed))
            return
        self._count(peer_host(address), now, why)

    def _count(self, address: str, now: float, why: str) -> None:
        with self._guard_lock:
            guard = self.guard
            lockout = guard.failed(address, now)
            if not guard.may_log(now):
                return
            suppressed, guard.suppressed_logs = guard.suppressed_logs, 0
        if lockout:
            self.log.warning("refusing handshakes from %s for %gs: too many failed handshakes "
                             "(a wrong token?)%s", address, lockout, _more(suppressed))
        else:
            self.log.warning("refused a handshake from %s: %s%s", address, why, _more(suppressed))


def _more(suppressed: int) -> str:
    return f" ({suppressed} more not logged)" if suppressed else ""


def start_authenticator(
    ctx: zmq.Context[zmq.Socket[bytes]], keys: MeshKeys, *, policy: HandshakePolicy | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> MeshAuthenticator:
    """Start the one ZAP handler of this context. It must run before the server socket binds."""
    auth = MeshAuthenticator(ctx, keys, policy=policy, clock=clock)
    auth.start()
    return auth


# --------------------------------------------------------------- handshakes libzmq ends itself

_FAILED: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "it does not know this mesh's server key (a wrong "
                                         "token?) or does not speak ZMTP",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "it closed or timed out before finishing a handshake",
}
_CLOSED_AT_ONCE = "it closed before any handshake (not ZMTP?)"
SCAN_EVERY = 0.02  # seconds between reads of the kernel's table while failures wait for a name
MAX_UNNAMED = 10_000  # failures waiting for a name at most; beyond, the oldest count as unknown
WATCHED_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                  | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_MONITOR_STOPPED)


class HandshakeEvents:
    """Pairs a ROUTER's monitor events into failed handshakes, each with its peer's address.

    Does no I/O. libzmq's monitor (v1) names the peer only by the fd in ACCEPTED and
    DISCONNECTED; a HANDSHAKE_FAILED_* event carries no fd. With one I/O thread, libzmq emits a
    handshake failure and its DISCONNECTED from one call, so the failure that immediately
    precedes DISCONNECTED(fd) is that connection's. Counted: PROTOCOL and NO_DETAIL failures
    (a wrong server key, bytes that are not ZMTP, a handshake timeout), and a DISCONNECTED
    that immediately follows its own ACCEPTED (closed before any handshake). AUTH failures are
    ZAP's, which counts them itself. ``disconnected`` returns ``(address, why)`` to count, with
    ``address`` None when it could not be read, or None when there is nothing to count.
    """

    def __init__(self) -> None:
        self._peers: dict[int, str | None] = {}
        self._last: tuple[int, int] | None = None  # (event, value) of the previous event

    def __len__(self) -> int:
        return len(self._peers)

    def event(self, event: int, value: int, address: str | None = None
              ) -> tuple[str | None, str] | None:
        last, self._last = self._last, (event, value)
        if event == zmq.EVENT_ACCEPTED:
            self._peers[value] = address
            return None
        if event != zmq.EVENT_DISCONNECTED:
            return None
        known = value in self._peers
        peer = self._peers.pop(value, None)
        if last is None:
            return None
        if last[0] in _FAILED:
            return peer, _FAILED[last[0]]
        if last == (zmq.EVENT_ACCEPTED, value) and known:
            return peer, _CLOSED_AT_ONCE
        return None


def _peer_of(fd: int) -> str | None:
    """The remote address of libzmq's connection ``fd``, read through a duplicate of it."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        with socket.socket(fileno=dup) as sock:
            host = sock.getpeername()[0]
    except OSError:
        with contextlib.suppress(OSError):
            os.close(dup)
        return None
    return host if isinstance(host, str) else None


class HandshakeWatch:
    """A thread that reads the coordinator ROUTER's socket monitor and tells the ZAP handler
    about handshakes libzmq ended before ZAP. Start it before ``bind``; ``stop()`` it from the
    socket's own thread before closing the socket.

    The peer's address is read with ``getpeername`` on a duplicate of the fd that ACCEPTED
    names. A connection that fails within microseconds (a wrong token on a fast link) may be
    closed before this thread gets there, and its fd number reused: so an address is trusted
    only if no DISCONNECTED for that fd was queued by the time the duplicate was taken (libzmq
    queues DISCONNECTED before it closes the fd). Otherwise the failure is counted as one of
    unknown origin. Needs a context with one I/O thread (the default).
    """

    def __init__(self, sock: zmq.Socket[bytes], auth: MeshAuthenticator) -> None:
        if sock.context.get(zmq.IO_THREADS) != 1:
            raise MeshError("the handshake watch needs a context with one I/O thread")
        self._sock = sock
        self._auth = auth
        self._pairs = HandshakeEvents()
        # Failures it could not name (time, why), waiting for the kernel's table to name them:
        # see gpumesh/closedconns.py. Set by bound(); None until then, and off Linux.
        self._closed: ClosedConnections | None = None
        self._unnamed: deque[tuple[float, str]] = deque()
        self._scanned_at = 0.0
        self._scan_gap = SCAN_EVERY
        self._ahead: collections.Counter[int] = collections.Counter()
        endpoint = f"inproc://gpumesh-handshakes-{id(self):x}"
        sock.monitor(endpoint, WATCHED_EVENTS)
        self._monitor = sock.context.socket(zmq.PAIR)
        # libzmq sends monitor events blocking: an unbounded queue on this side means a slow
        # reader can never stall the coordinator's I/O thread.
        self._monitor.rcvhwm = 0
        self._monitor.linger = 0
        self._monitor.connect(endpoint)
        self._thread = threading.Thread(target=self._run, name="gpumesh-handshakes", daemon=True)
        self._thread.start()

    def bound(self, port: int) -> None:
        """The port the socket listens on, once bound: failures the monitor cannot name are
        then named from the kernel's table of connections this side closed."""
        self._closed = ClosedConnections(port)

    def stop(self, timeout: float = 5.0) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._thread.join(timeout)

    def _run(self) -> None:
        monitor = self._monitor
        try:
            while True:
                if self._unnamed and not monitor.poll(int(SCAN_EVERY * 1000)):
                    self._name_unnamed(time.monotonic())
                    continue
                batch = [_read_event(monitor.recv_multipart())]
                batch += _drain(monitor)
                if not self._handle(batch):
                    return
                self._name_unnamed(time.monotonic())
        except zmq.ZMQError:
            return  # the context is going away
        finally:
            monitor.close(linger=0)

    def _name_unnamed(self, now: float) -> None:
        """Name what it can of the failures without an address from the kernel's table (at
        most every SCAN_EVERY), and count the rest as unknown once MATCH_WINDOW has passed."""
        if not self._unnamed:
            return
        if self._closed is not None and now - self._scanned_at >= self._scan_gap:
            self._scanned_at = now
            for peer in self._closed.take(len(self._unnamed)):
                _, why = self._unnamed.popleft()
                self._auth.failed_before_zap(peer, why)
            # The table holds every connection of the machine, and a flood of them makes it
            # long (2.6 µs a line to parse): the next read waits ten times what this one took,
            # so that reading it never takes more than a tenth of this thread's time.
            self._scan_gap = max(SCAN_EVERY, 10 * (time.monotonic() - now))
        while self._unnamed and (self._closed is None or len(self._unnamed) > MAX_UNNAMED
                                 or now - self._unnamed[0][0] > MATCH_WINDOW):
            _, why = self._unnamed.popleft()
            self._auth.failed_before_zap(None, why)

    def _handle(self, batch: list[tuple[int, int]]) -> bool:
        # How many DISCONNECTED events of each descriptor lie ahead of the one being handled:
        # kept as the batch is walked and grows, so the question "does this connection close
        # later in the batch?" costs O(1). (Scanning the rest of the batch for each ACCEPTED
        # cost a flood of thousands of connections quadratic time, the GIL held all along.)
        self._ahead = collections.Counter(
            value for event, value in batch if event == zmq.EVENT_DISCONNECTED)
        index = 0
        while index < len(batch):
            event, value = batch[index]
            if event == zmq.EVENT_DISCONNECTED:
                self._ahead[value] -= 1
            if event == zmq.EVENT_MONITOR_STOPPED:
                return False
            address = None
            if event == zmq.EVENT_ACCEPTED:
                address = self._address(value, batch)
            found = self._pairs.event(event, value, address)
            if found is not None:
                peer, why = found
                if peer is None:
                    self._unnamed.append((time.monotonic(), why))
                else:
                    if self._closed is not None:
                        self._closed.named(peer_host(peer))
                    self._auth.failed_before_zap(peer, why)
            index += 1
        return True

    def _address(self, fd: int, batch: list[tuple[int, int]]) -> str | None:
        """The peer of the ACCEPTED(fd) being handled, or None when it cannot be trusted (the
        descriptor closes later in the batch: it may name another connection by the time it
        is read). Reading it may extend ``batch`` with events that arrived meanwhile."""
        if self._ahead[fd] > 0:
            return None
        address = _peer_of(fd)
        arrived = _drain(self._monitor)
        batch += arrived
        self._ahead.update(value for event, value in arrived
                           if event == zmq.EVENT_DISCONNECTED)
        return None if self._ahead[fd] > 0 else address


def _read_event(frames: list[bytes]) -> tuple[int, int]:
    event, value = struct.unpack("=hi", frames[0][:6])
    return event, value


def _drain(monitor: zmq.Socket[bytes]) -> list[tuple[int, int]]:
    events = []
    while True:
        try:
            events.append(_read_event(monitor.recv_multipart(zmq.NOBLOCK)))
        except zmq.Again:
            return events


def watch_handshakes(sock: zmq.Socket[bytes], auth: MeshAuthenticator) -> HandshakeWatch:
    """Count the handshakes ``sock`` (a CURVE server) fails before ZAP. Call before ``bind``."""
    return HandshakeWatch(sock, auth)
