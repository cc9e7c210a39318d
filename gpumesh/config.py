"""Settings: defaults, environment variables, coordinator URLs and the saved connection file.

Everything configurable is read here, once, into frozen values. Nothing reads the environment at
import time: callers ask for ``Settings.from_env()`` when they start.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import os
import re
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .tokens import new_token as new_token  # re-exported: callers have always found it here
from .tokens import parse_token

log = logging.getLogger("gpumesh.config")

DEFAULT_PORT = 8000
DEFAULT_HOST = "127.0.0.1"
CONFIG_FILE = "config.json"

_URL_SCHEMES = ("tcp", "gpumesh", "http", "https")
# A DNS name (RFC 1123 labels, a trailing dot allowed) or an IPv4 address; IPv6 is bracketed.
# ZeroMQ refuses a host whose first character is not a letter or digit (EINVAL, a traceback).
_HOST_NAME = re.compile(r"(?=.{1,253}\.?$)(?=[A-Za-z0-9])[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
                        r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?")
_HOST_PORT = re.compile(r"^(?:\[(?P<v6>[0-9a-fA-F:.]+)\]|(?P<host>[^:/\[\]]+))(?::(?P<port>\d{1,5}))?/?$")


@dataclass(frozen=True)
class Endpoint:
    """Where a coordinator listens. ``zmq`` is the canonical ``tcp://host:port`` form."""

    host: str
    port: int

    @property
    def zmq(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    def __str__(self) -> str:
        return self.zmq


def parse_url(url: str, token: str | None = None) -> Endpoint:
    """Parse ``tcp://h:p``, ``gpumesh://h:p``, ``http://h:p`` or bare ``h:p`` / ``h``.

    All spellings name the same ZeroMQ endpoint; ``http://`` survives from the spec's first
    transport and is accepted without complaint. A URL that is the mesh's ``token`` (or holds
    it), or whose host looks like a token, is refused without being quoted: taken for a host,
    it would be printed by every retry and sent to DNS.
    """
    text = url.strip()
    if not text:
        raise ConfigError("empty coordinator URL: pass one like tcp://192.0.2.10:8000")
    if _holds_token(text, token):
        raise ConfigError(_TOKEN_AS_URL)
    scheme = ""
    if "://" in text:
        scheme, _, rest = text.partition("://")
        if scheme.lower() not in _URL_SCHEMES:
            raise ConfigError(
                f"unsupported URL scheme {scheme[:32]!r} in {url[:80]!r}: use tcp://HOST:PORT"
            )
        text = rest
    match = _HOST_PORT.match(text)
    if not match:
        raise ConfigError(f"cannot read a host and port from {url[:80]!r}: use tcp://HOST:PORT")
    host = match.group("v6") or match.group("host")
    if match.group("v6"):
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"[{host[:64]}] in {url[:80]!r} is not an IPv6 address: use "
                              "tcp://[ADDRESS]:PORT, e.g. tcp://[fd00::20]:8000") from None
    if match.group("host") and _looks_like_token(host):
        raise ConfigError(_TOKEN_AS_URL)
    if match.group("host") and not _HOST_NAME.fullmatch(host):
        # ZeroMQ would refuse it later with a traceback ("a b", "*", ";").
        raise ConfigError(f"{host[:64]!r} in {url[:80]!r} is not a host name or an IP address: "
                          "use tcp://HOST:PORT, e.g. tcp://192.168.1.20:8000")
    if scheme.lower() == "https" and not match.group("port"):
        # An https address with no port (an ngrok web tunnel's, or the spec's first --public)
        # would be dialled at 8000 and time out: nothing of HTTPS reaches a coordinator.
        raise ConfigError(f"{url[:80]!r} is a web address: a coordinator speaks ZeroMQ, not "
                          "HTTPS. Use the tcp://HOST:PORT that 'gpumesh serve' printed (with "
                          "--public: tcp://N.tcp.ngrok.io:PORT)")
    port = int(match.group("port") or DEFAULT_PORT)
    if not 0 < port < 65536:
        raise ConfigError(f"port {port} in {url[:80]!r} is out of range (1-65535)")
    return Endpoint(host, port)


_GENERATED_TOKEN = re.compile(r"rand-[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{20,}")
_TOKEN_AS_URL = (
    "the coordinator URL given is a token, not an address (it is not shown here, nor dialled): "
    "pass the coordinator's address as the URL (tcp://HOST:PORT, what 'gpumesh serve' prints) "
    "and the token with --token-file PATH or GPUMESH_TOKEN")


def _holds_token(text: str, token: str | None) -> bool:
    """Whether ``text`` is the token or its secret, or holds either: a secret of 16 characters
    or more anywhere in it, a shorter (weak) one only as the whole host (``gpubox01`` must not
    refuse ``gpubox01.lab``)."""
    if not token or not token.strip():
        return False
    whole = token.strip()
    secret = parse_token(whole).secret
    if any(len(part) >= 16 and part in text for part in (whole, secret)):
        return True
    host = text.partition("://")[2] or text
    return host.rsplit(":", 1)[0].strip("/") in (whole, secret)


def _looks_like_token(host: str) -> bool:
    """A host name shaped as a token: what ``gpumesh token`` makes (``rand-`` and a salt, a
    dot, then a long random secret), or what the spec tells users to make with
    ``secrets.token_urlsafe(32)``: a run of 16 or more characters between dashes, dots or
    underscores that mixes upper and lower case and digits. (Mixed case alone is no sign:
    ``Alexandras-MacBook-Pro-14-inch-M3-2023`` is a host, made of words; a person does not
    name a machine with a 16-character random run.)"""
    if _GENERATED_TOKEN.fullmatch(host) is not None:
        return True
    return any(len(run) >= 16 and any(c.isupper() for c in run)
               and any(c.islower() for c in run) and any(c.isdigit() for c in run)
               for run in _WORDS.split(host))


_WORDS = re.compile(r"[-_.]")  # a host name's words; a token's random runs are long


def _env_bool(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """A GPUMESH_* switch read on its own, for what must work when another variable does not
    parse (``Settings.from_env`` raises then): GPUMESH_LOCAL, GPUMESH_VERBOSE."""
    return _env_bool((os.environ if environ is None else environ).get(name))


def _addresses(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    """A comma-separated list of IPv4 addresses; a ConfigError names a bad one."""
    raw = env.get(name, "")
    addresses = tuple(part.strip() for part in raw.split(",") if part.strip())
    for address in addresses:
        try:
            ipaddress.IPv4Address(address)
        except ValueError:
            raise ConfigError(f"{name}: {address[:64]!r} is not an IPv4 address "
                              "(give this machine's interface addresses, comma-separated)") from None
    return addresses


YEAR = 365 * 86400.0  # the longest any duration setting may be, in seconds


def _env_float(env: Mapping[str, str], name: str, default: float, high: float = YEAR) -> float:
    """A positive number from ``env``; at most ``high``, since a huge one overflows where it is
    used (a poll's milliseconds, a byte count) instead of failing here with its name."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw[:40]!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={raw[:40]!r} must be a finite number greater than zero")
    if value > high:
        raise ConfigError(f"{name}={raw[:40]!r} is more than the {high:g} it may be at most")
    return value


BUSY_POLL = 0.001  # seconds (GPUMESH_BUSY_POLL_US)
MAX_BUSY_POLL_US = 100_000


def _env_busy_poll(env: Mapping[str, str]) -> float:
    """GPUMESH_BUSY_POLL_US in seconds; 0 turns busy polling off."""
    raw = env.get("GPUMESH_BUSY_POLL_US")
    if raw is None or raw == "":
        return BUSY_POLL
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"GPUMESH_BUSY_POLL_US={raw!r} is not a number of microseconds "
                          "(0 turns busy polling off)") from None
    if not (value == 0 or 1 <= value <= MAX_BUSY_POLL_US):  # also refuses nan and inf
        raise ConfigError(f"GPUMESH_BUSY_POLL_US={raw!r} must be 0, or 1 to {MAX_BUSY_POLL_US} "
                          "microseconds (0 turns busy polling off)")
    return value / 1e6


@dataclass(frozen=True)
class Timing:
    """Heartbeat, lease and timeout figures, shared by every role so they agree.

    ``heartbeat`` is the interval both ways; a peer silent for ``heartbeat * liveness`` is lost.
    A lease lives ``lease_ttl`` seconds unless a heartbeat renews it.
    """

    heartbeat: float = 1.0
    liveness: int = 5
    lease_ttl: float = 10.0
    restore_grace: float = 5.0
    pending_timeout: float = 60.0
    connect_timeout: float = 3.0
    reconnect_grace: float = 60.0
    # Results nobody collects (a detached `gpumesh submit`, a client that went away) are kept
    # this long after their owner was last seen, then dropped.
    result_ttl: float = 86400.0
    backoff_min: float = 1.0
    backoff_max: float = 32.0

    @property
    def silence_limit(self) -> float:
        return self.heartbeat * self.liveness


@dataclass(frozen=True)
class Limits:
    """Size guards applied to every received message before it is decoded, and the quotas on
    what one client may keep queued.

    ``max_frame_bytes`` is also libzmq's MAXMSGSIZE, which bounds the CURVE handshake: a peer
    without the token can make the coordinator hold at most this much per connection, for at
    most the handshake window. Bigger payloads travel as many frames (serialize.split_frames).
    """

    max_frame_bytes: int = 1024 * 1024
    max_message_bytes: int = 1024 * 1024 * 1024
    max_frames: int = 4096
    max_header_bytes: int = 1024 * 1024
    max_queued_tasks: int = 1_000_000  # unfinished tasks per client
    max_queued_bytes: int = 4 * 1024**3  # input bytes of a client's unfinished tasks
    # Queued inputs the coordinator keeps in memory besides their journal files; the rest wait
    # on disk and are read back when sent (coordinator/inputs.py), on the loop's thread: ~50 µs
    # per 256 KiB from the page cache here, but a disk's latency once the cache has let go.
    queue_memory_bytes: int = 512 * 1024**2

    @property
    def chunk_bytes(self) -> int:
        """The largest payload frame to send: CURVE adds its own bytes to every frame on the
        wire, and MAXMSGSIZE counts them."""
        return self.max_frame_bytes - 4096

    @property
    def message_room(self) -> tuple[int, int]:
        """The payload bytes and frames one message may carry, as every sender counts them
        (serialize.wire_cost): the total less a full header, the frames less the signature,
        command and header frames."""
        return self.max_message_bytes - self.max_header_bytes, self.max_frames - 3


def sizes_over_room(nbytes: int, room: int) -> tuple[str, str]:
    """``nbytes`` and the ``room`` it is over, as a user reads them side by side: MiB, or bytes
    where MiB would print both alike."""
    mib = 1024 * 1024
    shown, most = f"{nbytes / mib:,.1f} MiB", f"{room / mib:,.1f} MiB"
    if shown == most:
        shown, most = f"{nbytes:,} bytes", f"{room:,} bytes"
    return shown, most


def home_folder(environ: Mapping[str, str] | None = None) -> Path:
    """Where gpumesh keeps its files: ``GPUMESH_HOME``, else ``~/.gpumesh``."""
    env = os.environ if environ is None else environ
    return Path(env.get("GPUMESH_HOME") or Path.home() / ".gpumesh").expanduser()


@dataclass(frozen=True)
class Settings:
    """All of gpumesh's configuration, read once from the environment and the config file."""

    home: Path
    url: str | None = None
    token: str | None = field(default=None, repr=False)
    host: str = DEFAULT_HOST
    # Whether GPUMESH_HOST chose ``host``: only then does it win over the address the saved
    # coordinator was bound to (``serve`` without --host).
    host_given: bool = False
    local_only: bool = False
    verbose: bool = False
    # A coordinator started with a weak token refuses it unless this is set (GPUMESH_WEAK_TOKEN).
    weak_token: bool = False
    # Big frames between processes of one machine travel through a shared-memory folder
    # instead of the sockets (gpumesh.sharedmem). GPUMESH_SHARED_MEMORY=0 turns it off.
    share_memory: bool = True
    # LAN discovery (gpumesh.discovery): GPUMESH_DISCOVERY=0 turns advertising and browsing off;
    # GPUMESH_DISCOVERY_INTERFACES (comma-separated IPv4 addresses) says where to browse and
    # advertise instead of this machine's LAN addresses.
    discovery: bool = True
    discovery_interfaces: tuple[str, ...] = ()
    discovery_timeout: float = 3.0
    # Seconds the coordinator's loop polls for its next message, instead of sleeping, after a
    # turn that handed out a task or finished one (gpumesh/coordinator/waiting.py).
    # GPUMESH_BUSY_POLL_US=0 turns it off.
    busy_poll: float = BUSY_POLL
    timing: Timing = field(default_factory=Timing)
    limits: Limits = field(default_factory=Limits)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        home = home_folder(env)
        timing = Timing(
            heartbeat=_env_float(env, "GPUMESH_HEARTBEAT", Timing.heartbeat, high=3600.0),
            lease_ttl=_env_float(env, "GPUMESH_LEASE_TTL", Timing.lease_ttl),
            pending_timeout=_env_float(env, "GPUMESH_PENDING_TIMEOUT", Timing.pending_timeout),
            connect_timeout=_env_float(env, "GPUMESH_CONNECT_TIMEOUT", Timing.connect_timeout),
            reconnect_grace=_env_float(env, "GPUMESH_RECONNECT_GRACE", Timing.reconnect_grace),
            restore_grace=_env_float(env, "GPUMESH_RESTORE_GRACE", Timing.restore_grace),
            result_ttl=_env_float(env, "GPUMESH_RESULT_TTL", Timing.result_ttl),
        )
        return cls(
            home=home,
            url=env.get("GPUMESH_URL") or None,
            token=env.get("GPUMESH_TOKEN") or None,
            host=env.get("GPUMESH_HOST") or DEFAULT_HOST,
            host_given=bool(env.get("GPUMESH_HOST")),
            local_only=_env_bool(env.get("GPUMESH_LOCAL")),
            verbose=_env_bool(env.get("GPUMESH_VERBOSE")),
            weak_token=_env_bool(env.get("GPUMESH_WEAK_TOKEN")),
            share_memory=_env_bool(env.get("GPUMESH_SHARED_MEMORY", "1")),
            discovery=_env_bool(env.get("GPUMESH_DISCOVERY", "1")),
            discovery_interfaces=_addresses(env, "GPUMESH_DISCOVERY_INTERFACES"),
            discovery_timeout=_env_float(env, "GPUMESH_DISCOVERY_TIMEOUT", 3.0),
            busy_poll=_env_busy_poll(env),
            timing=timing,
            limits=Limits(
                max_queued_bytes=int(2**30 * _env_float(
                    env, "GPUMESH_MAX_QUEUED_GB", Limits.max_queued_bytes / 2**30, high=1e6)),
                queue_memory_bytes=int(2**20 * _env_float(
                    env, "GPUMESH_QUEUE_MEMORY_MB", Limits.queue_memory_bytes / 2**20,
                    high=1e9))),
        )

    def with_timing(self, **changes: Any) -> Settings:
        """A copy with the named ``Timing`` fields replaced (``liveness`` is an int)."""
        return replace(self, timing=replace(self.timing, **changes))

    @property
    def config_path(self) -> Path:
        return self.home / CONFIG_FILE

    def saved_connection(self) -> SavedConnection | None:
        return load_connection(self.config_path)

    def resolve_connection(
        self, url: str | None = None, token: str | None = None
    ) -> tuple[Endpoint, str]:
        """Pick the coordinator and token: explicit values, then env vars, then the saved file."""
        # The saved file only fills in what was not given: a damaged one must not stand in
        # the way of an explicit --url and --token.
        given_url, given_token = url or self.url, token or self.token
        saved = None if given_url and given_token else self.saved_connection()
        chosen_url = given_url or (saved.url if saved else None)
        chosen_token = given_token or (saved.token if saved else None)
        if not chosen_url:
            raise ConfigError(
                "no coordinator configured: pass --url, set GPUMESH_URL, or run "
                "'gpumesh serve' / 'gpumesh join' on this machine first"
            )
        if not chosen_token:
            raise ConfigError(
                "no token configured: set GPUMESH_TOKEN, pass --token-file PATH, or run "
                "'gpumesh serve' / 'gpumesh join' on this machine first"
            )
        return parse_url(chosen_url, chosen_token), chosen_token


@dataclass(frozen=True)
class SavedConnection:
    """The coordinator this machine last served or joined, as kept in ``config.json``.

    ``served`` is (the address bound, the port) when this machine's own coordinator saved it
    (``serve``, ``setup``); ``slots`` is the slot count a worker here was told (``join
    --slots``, ``setup``), None for join's default. ``stretched`` caches the slow key-derivation step for ``token`` (see gpumesh.security), so
    each command does not pay it again: the file already holds the token in the clear, so the
    cache exposes nothing new. It is bound to the token and the KDF by ``check``.
    """

    url: str
    token: str = field(repr=False)
    kdf: str | None = None
    stretched: bytes | None = field(default=None, repr=False)
    served: tuple[str, int] | None = None
    slots: int | None = None

    @property
    def own_coordinator(self) -> bool:
        """Whether this is this machine's coordinator: saved by ``serve``/``setup``, or (a
        file from before they said so) dialled on loopback."""
        if self.served is not None:
            return True
        try:
            host = parse_url(self.url).host
        except ConfigError:
            return False
        return host == "localhost" or _is_loopback(host)

    def stretched_for(self, token: str, kdf: str) -> bytes | None:
        """The cached stretched key for ``token`` under ``kdf``, or None."""
        if (self.stretched is None or self.kdf != kdf
                or not hmac.compare_digest(self.token.encode(), token.encode())):
            return None
        return self.stretched


def load_connection(path: Path) -> SavedConnection | None:
    """Read the saved connection; a missing file is None, a damaged one is a ConfigError."""
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raw = ""
    try:
        data = json.loads(raw)
        url, token = data["url"], data["token"]
        if not (isinstance(url, str) and isinstance(token, str) and url and token):
            raise TypeError("url and token must be non-empty strings")
        kdf, stretched = _cached_stretch(data, token)
        return SavedConnection(url=url, token=token, kdf=kdf, stretched=stretched,
                               served=_served(data.get("serve")), slots=_slots(data.get("slots")))
    except (ValueError, KeyError, TypeError):
        raise ConfigError(
            f"{path} is not a gpumesh config file: delete it and run 'gpumesh serve' or "
            "'gpumesh join' again"
        ) from None


def _served(value: object) -> tuple[str, int] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError("serve must be an object")
    host, port = value.get("host"), value.get("port")
    if not (isinstance(host, str) and host and isinstance(port, int)
            and not isinstance(port, bool) and 0 < port < 65536):
        raise TypeError("serve needs a host and a port")
    return host, port


def _slots(value: object) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1024:
        raise TypeError("slots must be a number from 1 to 1024")
    return value


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check(stretched: bytes, token: str, kdf: str) -> str:
    return hmac.new(stretched, f"{kdf}\0{token}".encode(), hashlib.sha256).hexdigest()[:16]


def _cached_stretch(data: Mapping[str, object], token: str) -> tuple[str | None, bytes | None]:
    """The stretched-key cache of a config file, when present and bound to its token."""
    cache = data.get("kdf")
    if not isinstance(cache, dict):
        return None, None
    kdf, key, check = cache.get("name"), cache.get("key"), cache.get("check")
    if not (isinstance(kdf, str) and isinstance(key, str) and isinstance(check, str)):
        return None, None
    try:
        stretched = bytes.fromhex(key)
    except ValueError:
        return None, None
    if not hmac.compare_digest(_check(stretched, token, kdf), check):
        return None, None  # edited by hand, or from another token: derive afresh
    return kdf, stretched


def save_connection(path: Path, url: str, token: str, *, kdf: str | None = None,
                    stretched: bytes | None = None, served: tuple[str, int] | None = None,
                    slots: int | None = None) -> None:
    """Write the connection with mode 0600 from the first byte (never world-readable), in a
    folder that is 0700. ``kdf``/``stretched`` cache the token's slow derivation step;
    ``served`` and ``slots`` are kept as ``SavedConnection`` describes them."""
    ensure_home(path.parent)
    data: dict[str, object] = {"url": url, "token": token}
    if served is not None:
        data["serve"] = {"host": served[0], "port": served[1]}
    if slots is not None:
        data["slots"] = slots
    if kdf and stretched:
        data["kdf"] = {"name": kdf, "key": stretched.hex(), "check": _check(stretched, token, kdf)}
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle)
        os.replace(tmp, path)
    except OSError as exc:  # a full disk: a traceback, and the half-written file left behind
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise ConfigError(f"could not save the connection in {path}: {exc.strerror or exc}"
                          + (" (the disk is full)" if exc.errno == errno.ENOSPC else "")) from None


def ensure_home(home: Path) -> Path:
    """Make GPUMESH_HOME owner-only: created 0700, or tightened to 0700 with a one-line notice.

    It holds the token, the journal (task code and data) and the worker control secrets. A
    folder this user does not own, a shared one (sticky bit, like /tmp) and the home folder
    itself are left as they are, with a warning instead.
    """
    if os.name == "nt":
        # Windows has no mode bits to check: stat says 0777 for every writable folder and
        # chmod cannot change that; the folder under the user's profile is theirs by its ACL.
        home.mkdir(parents=True, exist_ok=True)
        return home
    try:
        home.mkdir(parents=True, mode=0o700)
    except FileExistsError:
        pass
    else:
        os.chmod(home, 0o700)  # mkdir's mode passes through the umask; make sure
        return home
    info = home.stat()
    mode = stat.S_IMODE(info.st_mode)
    if not mode & 0o077:
        return home
    if (info.st_uid != os.geteuid() or mode & stat.S_ISVTX
            or home.resolve() == Path.home().resolve()):
        log.warning("%s is readable by other users (mode %04o) and is not this gpumesh's own "
                    "folder: set GPUMESH_HOME to a private folder", home, mode)
        return home
    os.chmod(home, 0o700)
    log.warning("tightened %s from mode %04o to 0700: it holds the mesh token and the journal",
                home, mode)
    return home
