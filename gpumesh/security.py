"""Token to CURVE keys, the ZAP allow-list, and the mesh fingerprint.

The token never crosses the wire. Both sides derive the same two Curve25519 keypairs from it
(HKDF-SHA256, after scrypt for tokens too short to trust): the coordinator's server pair and one
client pair shared by every worker and client. The coordinator's ZAP handler admits only the
derived client public key, so a peer must hold the token to complete a handshake, and it must
also hold it to know the server key it encrypts to: authentication is mutual.

The ZAP handler also rate-limits failed handshakes per peer address (``HandshakeGuard``): an
address that fails too often is refused for a while, loopback excepted. Only handshakes that
reach ZAP can be counted: one encrypted to the wrong server key, or bytes that are not ZMTP at
all, fail inside libzmq, which does not say which address sent them.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.auth.thread
from zmq.utils import z85

from .errors import ConfigError, MeshError

ZAP_DOMAIN = "gpumesh"
_SALT = b"gpumesh/v1"
# Tokens shorter than this (about 192 bits of urlsafe base64) are stretched with scrypt first,
# so a hand-chosen passphrase costs an offline guesser real work per guess.
STRONG_TOKEN_CHARS = 32


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
    prk = hmac.new(_SALT, key_material, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


def derive_keys(token: str) -> MeshKeys:
    """Derive the mesh's CURVE keypairs and public fingerprint from the token."""
    if not token or not token.strip():
        raise ConfigError("the token is empty: pass --token or set GPUMESH_TOKEN")
    require_curve()
    material = token.encode("utf-8")
    if len(token) < STRONG_TOKEN_CHARS:
        material = hashlib.scrypt(material, salt=_SALT, n=2**14, r=8, p=1, dklen=32)
    server_secret = z85.encode(_hkdf(material, b"curve-server"))
    client_secret = z85.encode(_hkdf(material, b"curve-client"))
    return MeshKeys(
        server_public=zmq.curve_public(server_secret),
        server_secret=server_secret,
        client_public=zmq.curve_public(client_secret),
        client_secret=client_secret,
        fingerprint=_hkdf(material, b"fingerprint", 6).hex(),
    )


def require_curve() -> None:
    """Refuse to run on a libzmq without CURVE: there is no unencrypted fallback."""
    if not zmq.has("curve"):
        raise MeshError(
            f"this libzmq ({zmq.zmq_version()}) was built without CURVE encryption, which gpumesh "
            "requires: reinstall pyzmq from its wheels (pip install --force-reinstall pyzmq)"
        )


def configure_server(sock: zmq.Socket, keys: MeshKeys) -> None:
    """Make ``sock`` a CURVE server guarded by the ZAP domain. Call before ``bind``."""
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()


def configure_client(sock: zmq.Socket, keys: MeshKeys) -> None:
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
        seconds = min(policy.lockout * 2**record.strikes, policy.max_lockout)
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


class MeshAuthenticator(zmq.auth.thread.ThreadAuthenticator):
    """The coordinator's ZAP handler: the mesh client key only, and a rate limit per address.

    A refused address gets ZAP status 300 (temporary failure), which libzmq turns into a silent
    disconnect, so a locked-out peer learns nothing; a wrong key gets 400. Failures are logged
    as warnings on ``gpumesh.zap``, naming the address and never a key, within the policy's
    log budget.
    """

    def __init__(self, ctx: zmq.Context, keys: MeshKeys, *, policy: HandshakePolicy | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(ctx, log=logging.getLogger("gpumesh.zap"))
        # zmq.auth's own debug lines are noise here; warnings are this handler's output.
        self.log.setLevel(logging.WARNING)
        self._allow = _AllowMeshClient(keys)
        self.guard = HandshakeGuard(policy)
        self._clock = clock

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) < 6:
            if len(msg) >= 2:
                self._send_zap_reply(msg[1], b"400", b"Not enough frames")
            return
        version, request_id, domain, raw_address, _identity, mechanism = msg[:6]
        credentials = msg[6:]
        address = raw_address.decode("utf-8", "replace")
        now = self._clock()
        guard = self.guard
        locked = guard.locked_for(address, now)
        if locked:
            self._send_zap_reply(request_id, b"300", b"Rate limited")
            return
        admitted = (
            version == b"1.0" and mechanism == b"CURVE" and len(credentials) == 1
            and self._allow.callback(domain.decode("utf-8", "replace"), z85.encode(credentials[0]))
        )
        if admitted:
            guard.succeeded(address)
            self._send_zap_reply(request_id, b"200", b"OK", "mesh")
            return
        self._send_zap_reply(request_id, b"400", b"Unknown key")
        lockout = guard.failed(address, now)
        if guard.may_log(now):
            suppressed, guard.suppressed_logs = guard.suppressed_logs, 0
            more = f" ({suppressed} more not logged)" if suppressed else ""
            if lockout:
                self.log.warning("refusing handshakes from %s for %gs: too many failed handshakes "
                                 "(a wrong token?)%s", address, lockout, more)
            else:
                self.log.warning("refused a handshake from %s: its client key does not match this "
                                 "mesh's token%s", address, more)


def start_authenticator(
    ctx: zmq.Context, keys: MeshKeys, *, policy: HandshakePolicy | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> MeshAuthenticator:
    """Start the one ZAP handler of this context. It must run before the server socket binds."""
    auth = MeshAuthenticator(ctx, keys, policy=policy, clock=clock)
    auth.start()
    return auth
