"""Finding the coordinator on the LAN with zeroconf (mDNS/DNS-SD), and choosing addresses.

A coordinator bound beyond loopback advertises ``_gpumesh._tcp.local.`` with a small TXT record:
the TXT schema version, the protocol major, gpumesh's version, the Python it runs, its host
name, and the mesh's fingerprint (derived from the token through the same scrypt as the keys,
so it names the mesh without telling anything about the token). ``gpumesh join`` with no URL,
``gpumesh discover`` and clients with nothing saved browse for it.

Discovery is a hint, never a credential: anyone on the LAN can advertise anything, and only the
CURVE handshake admits a peer. Nothing here sends anything beyond the interfaces it was given:
the LAN addresses of this machine by default (loopback, Docker bridges, VPN and hypervisor
adapters skipped), or ``GPUMESH_DISCOVERY_INTERFACES``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import errno
import ipaddress
import logging
import queue
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ._version import __version__
from .protocol import MAJOR
from .protocol.fields import VERSION_TEXT

log = logging.getLogger("gpumesh.discovery")

SERVICE_TYPE = "_gpumesh._tcp.local."
TXT_VERSION = "1"
# Seconds to keep listening after the first answer, for other coordinators of the same mesh. It
# spans the browser's next startup query (they go out about 1 s apart): a second coordinator
# whose answer to one query was lost or late then still shows up, and two are listed instead of
# one being picked silently. 0.4 s missed it about one browse in eight on a loaded machine.
SETTLE = 1.2
RESOLVE_MS = 1500  # how long to wait for one advertisement's SRV/TXT/A records
MAX_FOUND = 64  # advertisements kept from one browse: a hostile LAN cannot grow it further
MAX_ASKED = 256  # names one browse asks the network to resolve (not found in the cache)
MAX_WANTED = 16  # advertisements of the wanted mesh kept besides MAX_FOUND (its fingerprint is public)
MAX_ADDRESSES = 8  # addresses kept per advertisement
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"

# Adapters that other machines on the LAN cannot usually reach, by name. Docker's bridge once
# cost exo users a day (exo#858): it was the address advertised.
_VIRTUAL = re.compile(r"^(docker|br-|veth|virbr|vboxnet|vmnet|vnet|lxc|lxd|cni|flannel|cali|"
                      r"podman|kube|vEthernet|VirtualBox|VMware|Hyper-V)", re.IGNORECASE)
_VPN = re.compile(r"^(tun|tap|wg|utun|tailscale|zt|ppp|ipsec|nordlynx|proton)", re.IGNORECASE)
_TAILSCALE_NET = ipaddress.ip_network("100.64.0.0/10")  # CGNAT space Tailscale hands out


@dataclass(frozen=True)
class Adapter:
    """One IPv4 address of this machine and what kind of network it is on."""

    name: str
    address: str
    prefix: int
    kind: str  # "lan", "loopback", "link-local", "virtual" (containers, VMs) or "vpn"

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.ip_network(f"{self.address}/{self.prefix}", strict=False)  # type: ignore[return-value]


def classify(name: str, address: str) -> str:
    ip = ipaddress.ip_address(address)
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if _VIRTUAL.match(name):
        return "virtual"
    if _VPN.match(name) or ip in _TAILSCALE_NET:
        return "vpn"
    return "lan"


def adapters() -> list[Adapter]:
    """This machine's IPv4 addresses, read from the interface list without sending anything."""
    import ifaddr  # ships with zeroconf

    found = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str):  # IPv4 (IPv6 entries are tuples)
                name = str(adapter.nice_name or adapter.name)
                found.append(Adapter(name, ip.ip, int(ip.network_prefix),
                                     classify(name, ip.ip)))
    return found


def lan_addresses(all_adapters: Sequence[Adapter] | None = None) -> list[str]:
    """The addresses other machines on the LAN would dial: no loopback, link-local, container,
    VM or VPN adapters (choose those with ``--host-ip``)."""
    return [a.address for a in (adapters() if all_adapters is None else all_adapters)
            if a.kind == "lan"]


def binds_everywhere(host: str) -> bool:
    return host in ("0.0.0.0", "*", "::", "")


def advertised_addresses(host: str, host_ip: str | None = None) -> list[str]:
    """What a coordinator bound to ``host`` advertises and prints: ``host_ip`` when chosen and
    reachable under the bind; nothing when bound to loopback; the LAN addresses when bound to
    every interface; else the bound address itself."""
    if host_ip:
        return [host_ip] if binds_everywhere(host) or host == host_ip else []
    if binds_everywhere(host):
        return lan_addresses()
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return []  # a host name: the user chose it, and it is what they will type
    return [] if ip.is_loopback or ip.version != 4 else [host]


@dataclass(frozen=True)
class Found:
    """One coordinator's advertisement, as parsed (every field checked: it is LAN input)."""

    name: str
    host: str
    addresses: tuple[str, ...]
    port: int
    mesh: str
    proto: int
    version: str
    python: str

    @property
    def url(self) -> str:
        return f"tcp://{self.addresses[0]}:{self.port}" if self.addresses else ""

    def urls(self, local: Sequence[Adapter] = ()) -> list[str]:
        """Its URLs, those on one of this machine's subnets first (a multi-homed coordinator
        advertises several, and only some are routable from here)."""
        def near(address: str) -> bool:
            ip = ipaddress.ip_address(address)
            return any(ip in a.network for a in local if a.kind != "loopback")

        ordered = sorted(self.addresses, key=lambda a: not near(a))
        return [f"tcp://{address}:{self.port}" for address in ordered]


def _text(props: dict[bytes, bytes | None], key: str, limit: int = 64) -> str:
    value = props.get(key.encode())
    if not isinstance(value, bytes) or len(value) > limit:
        return ""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        return ""
    return text if text.isprintable() else ""


def _version(text: str) -> str:
    """An advertised version, only if it looks like one: it is quoted in the advice to
    install it, and any host on the LAN may advertise."""
    return text if VERSION_TEXT.fullmatch(text) else "?"


def parse_advertisement(name: str, port: Any, addresses: Iterable[str],
                        props: dict[bytes, bytes | None]) -> Found | None:
    """A Found from raw records, or None when they do not describe a gpumesh coordinator."""
    if _text(props, "txtvers") != TXT_VERSION or _text(props, "role") != "coord":
        return None
    mesh = _text(props, "mesh")
    proto = _text(props, "proto")
    # ASCII digits only: str.isdigit() also takes "²", which int() then refuses.
    if not re.fullmatch(r"[0-9a-f]{12}", mesh) or not re.fullmatch(r"[0-9]{1,4}", proto):
        return None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        return None
    kept = []
    for address in addresses:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            continue
        # Not 240.0.0.0/4 (reserved, the broadcast address among them): nobody listens there.
        # Loopback stays: a coordinator advertised on loopback only is what the discovery
        # tests use, and dialling this machine reaches no one else's.
        if ip.version == 4 and not ip.is_unspecified and not ip.is_multicast \
                and not ip.is_reserved:
            kept.append(str(ip))
    if not kept:
        return None
    return Found(name=name[:255], host=_text(props, "host") or "?",
                 addresses=tuple(dict.fromkeys(kept))[:MAX_ADDRESSES], port=port, mesh=mesh,
                 proto=int(proto), version=_version(_text(props, "ver", 32)),
                 python=_text(props, "py", 16) or "?")


def txt_record(fingerprint: str) -> dict[str, str]:
    """The TXT of this coordinator: small (RFC 6763 §6.2), txtvers first, no secrets."""
    return {"txtvers": TXT_VERSION, "role": "coord", "proto": str(MAJOR), "mesh": fingerprint,
            "ver": __version__, "py": PYTHON, "host": socket.gethostname()[:63]}


def _zeroconf(interfaces: Sequence[str]) -> Any:
    from zeroconf import IPVersion, Zeroconf

    return Zeroconf(interfaces=list(interfaces), ip_version=IPVersion.V4Only)


def _browsing_zeroconf(interfaces: Sequence[str]) -> Any:
    """A Zeroconf on ``interfaces``, leaving out those whose multicast sockets this machine
    refuses (an address it no longer has, an adapter without multicast). Raises ConfigError,
    saying what to do, when none is left: zeroconf's own OSError was a traceback from
    ``discover``, ``join`` and ``setup``."""
    from .errors import ConfigError

    interfaces = list(dict.fromkeys(interfaces))
    # Only the reason is kept, not the exception: its traceback holds zeroconf's half-made
    # socket open until the garbage collector finds the cycle.
    try:
        return _zeroconf(interfaces)
    except OSError as exc:
        failure, cause = exc.strerror or str(exc), exc.errno
    usable = []
    for address in interfaces if len(interfaces) > 1 else ():
        try:
            _zeroconf([address]).close()
        except OSError:
            continue
        usable.append(address)
    if usable:
        log.warning("cannot look for coordinators on %s (%s): looking on %s only",
                    ", ".join(a for a in interfaces if a not in usable), failure,
                    ", ".join(usable))
        try:
            return _zeroconf(usable)
        except OSError as exc:
            failure, cause = exc.strerror or str(exc), exc.errno
    if cause in (errno.EADDRINUSE, errno.EACCES, errno.EPERM):
        # Not the addresses: the mDNS port (5353) or multicast itself is kept from this user.
        advice = ("another program may hold the mDNS port 5353 without sharing it, or a "
                  "firewall or sandbox keeps multicast from this user")
    else:
        advice = ("set GPUMESH_DISCOVERY_INTERFACES to this machine's address on the "
                  "coordinator's network")
    raise ConfigError(
        f"cannot look for coordinators on {', '.join(interfaces)}: {failure}. Give the "
        f"coordinator's URL, e.g. 'gpumesh join tcp://HOST:8000'; or {advice}")


class Advertiser:
    """Advertise a coordinator while it runs. Registration probes the LAN for about 1.7 s, so
    it happens in the background; a failure is logged, never fatal (joining by URL works)."""

    def __init__(self, *, port: int, addresses: Sequence[str], fingerprint: str,
                 interfaces: Sequence[str] | None = None) -> None:
        self.port = port
        self.addresses = list(addresses)
        self.interfaces = list(interfaces) if interfaces else list(addresses)
        self.fingerprint = fingerprint
        self.registered = threading.Event()
        self._zc: Any = None
        self._info: Any = None
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._register, name="gpumesh-advertise",
                                        daemon=True)
        self._thread.start()

    def _register(self) -> None:
        from zeroconf import ServiceInfo

        host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "gpumesh"
        # Instance names must be unique on the LAN: the port tells two meshes of one host apart,
        # and allow_name_change settles the rest.
        # The SRV target gets a random suffix: machines that share a host name (every fresh
        # "raspberrypi" or "ubuntu") would otherwise answer for each other's addresses.
        info = ServiceInfo(SERVICE_TYPE, f"gpumesh {host} {self.port}.{SERVICE_TYPE}",
                           port=self.port, properties=txt_record(self.fingerprint),
                           server=f"gpumesh-{host}-{secrets.token_hex(3)}.local.",
                           parsed_addresses=self.addresses)
        try:
            zc = _zeroconf(self.interfaces)
        except OSError as exc:
            log.warning("cannot advertise the coordinator on %s: %s (join with a URL instead)",
                        ", ".join(self.interfaces), exc)
            return
        with self._lock:
            if self._closed:
                zc.close()
                return
            self._zc, self._info = zc, info
        try:
            zc.register_service(info, allow_name_change=True)
        except Exception as exc:  # a LAN problem must not stop the coordinator
            log.warning("cannot advertise the coordinator: %s (join with a URL instead)", exc)
            return
        self.registered.set()
        log.debug("advertised %s on %s", info.name, ", ".join(self.addresses))

    def close(self) -> None:
        """Say goodbye (so browsers drop us at once) and stop."""
        with self._lock:
            self._closed = True
            zc, info = self._zc, self._info
        if zc is None:
            return
        if self._thread is not None:
            self._thread.join(3.0)  # unregistering in the middle of probing would race it
        try:
            if self.registered.is_set():
                zc.unregister_service(info)
        except Exception as exc:
            log.debug("zeroconf goodbye failed: %s", exc)
        finally:
            zc.close()


class _Ask:
    """One name asked for on the network: zeroconf's request, run on its own event loop, so
    the browse goes on reading names meanwhile. ``info`` is the resolved record once ``done``,
    or None; ``cancel`` stops the request (a browse that ends first)."""

    def __init__(self, info_type: Any, name: str, zc: Any, wait_ms: int,
                 wake: queue.SimpleQueue[str]) -> None:
        self.name = name
        self.info: Any = None
        self.done = False
        self._future: concurrent.futures.Future[Any] | None = None
        try:
            info = info_type(SERVICE_TYPE, name)
            self._future = asyncio.run_coroutine_threadsafe(info.async_request(zc, wait_ms),
                                                            zc.loop)
        except Exception as exc:  # a name zeroconf cannot make a record of
            log.debug("skipped an advertisement that does not resolve (%s)", exc)
            self.done = True
            return
        self._future.add_done_callback(lambda future: self._finished(future, info, wake))

    def _finished(self, future: concurrent.futures.Future[Any], info: Any,
                  wake: queue.SimpleQueue[str]) -> None:
        try:
            if not future.cancelled() and future.exception() is None and future.result():
                self.info = info
            elif not future.cancelled() and future.exception() is not None:
                log.debug("skipped an advertisement that does not resolve (%s)",
                          future.exception())
        finally:
            self.done = True
            wake.put("")  # the browse loop looks at it now (no name is empty)

    def cancel(self) -> None:
        if self._future is not None:
            self._future.cancel()


def browse(timeout: float, interfaces: Sequence[str], *, want: str | None = None,
           settle: float = SETTLE) -> list[Found]:
    """The gpumesh coordinators advertised on ``interfaces`` within ``timeout`` seconds.

    With ``want`` (a mesh fingerprint), it returns ``settle`` seconds after the first
    advertisement of that mesh, instead of waiting out the timeout. Raises ConfigError when
    this machine cannot listen for advertisements on any of ``interfaces``.
    """
    from zeroconf import ServiceBrowser, ServiceStateChange
    from zeroconf.asyncio import AsyncServiceInfo as ServiceInfo

    if not interfaces:
        return []
    names: queue.SimpleQueue[str] = queue.SimpleQueue()

    def on_change(zeroconf: Any, service_type: str, name: str,
                  state_change: ServiceStateChange) -> None:
        if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            names.put(name)

    found: dict[str, Found] = {}
    wanted_names: set[str] = set()
    # Names whose records were not in zeroconf's cache when they came are asked for on the
    # network, one at a time on zeroconf's event loop (RESOLVE_MS each, _Ask), while every name
    # that comes meanwhile gets its look in the cache. Any host on the LAN can send names that never
    # resolve: taken in the order they came, 20 of them held the real coordinator's name back
    # past the timeout. A coordinator's answer carries its records, so its name is found in
    # the cache as it comes.
    unresolved: collections.deque[str] = collections.deque()
    asked: set[str] = set()
    ask: _Ask | None = None
    zc = _browsing_zeroconf(interfaces)
    browser = ServiceBrowser(zc, SERVICE_TYPE, handlers=[on_change])

    def take(name: str, info: Any) -> bool:
        """Keep the advertisement ``info`` resolved for ``name``; True when it is ``want``'s.
        Any host on the LAN writes these records: one that cannot be read is skipped, on
        the cache's path and the network's alike (a browse never fails for a peer's data)."""
        try:
            entry = parse_advertisement(name, info.port, info.parsed_addresses(),
                                        dict(info.properties or {}))
        except Exception as exc:
            log.debug("skipped an advertisement that cannot be read (%s)", exc)
            return False
        if entry is None:
            return False
        wanted = want is not None and entry.mesh == want
        # Up to MAX_FOUND of any mesh, and up to MAX_WANTED of the wanted one besides: other
        # meshes' adverts cannot crowd it out (its fingerprint is public: copies are bounded).
        if name in found or (len(wanted_names) < MAX_WANTED if wanted
                             else len(found) - len(wanted_names) < MAX_FOUND):
            found[name] = entry
            if wanted:
                wanted_names.add(name)
        return wanted

    def look_up(name: str) -> bool:
        """A name that came: from the cache, or queued to be asked for. True when it is an
        advertisement of ``want``."""
        if not name.endswith("." + SERVICE_TYPE):
            return False  # any host on the LAN can send a record naming another type
        try:
            info = ServiceInfo(SERVICE_TYPE, name)
            if info.load_from_cache(zc):
                return take(name, info)
        except Exception as exc:  # a record zeroconf cannot make sense of: the next one
            log.debug("skipped an advertisement that does not resolve (%s)", exc)
            return False
        if name not in asked and len(asked) < MAX_ASKED:
            asked.add(name)
            unresolved.append(name)
        return False

    try:
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            if now >= deadline:
                break
            if ask is not None and ask.done:
                if ask.info is not None and take(ask.name, ask.info):
                    deadline = min(deadline, time.monotonic() + settle)
                ask = None
            if ask is None and unresolved:
                wait_ms = max(1, min(RESOLVE_MS, int((deadline - now) * 1000)))
                ask = _Ask(ServiceInfo, unresolved.popleft(), zc, wait_ms, names)
            try:
                name = names.get(timeout=min(deadline - now, 0.1))
            except queue.Empty:
                continue
            if look_up(name):
                deadline = min(deadline, time.monotonic() + settle)
        # What came in the last moments is still looked up in the cache (cheap; bounded).
        for _ in range(MAX_ASKED):
            try:
                look_up(names.get_nowait())
            except queue.Empty:
                break
    finally:
        if ask is not None:
            ask.cancel()
        browser.cancel()
        zc.close()
    return sorted(found.values(), key=lambda f: (f.host, f.port))


def browse_interfaces(configured: Sequence[str]) -> list[str]:
    """Where to browse: ``GPUMESH_DISCOVERY_INTERFACES`` when set, else the LAN addresses."""
    return list(configured) if configured else lan_addresses()


def find_coordinator(token: str, interfaces: Sequence[str], timeout: float) -> tuple[str, Found]:
    """The URL of this mesh's coordinator on the LAN (the token says which mesh), and its
    advertisement. Raises ConfigError saying what was seen when there is not exactly one, and
    ProtocolMismatch when the one there speaks another protocol major."""
    from .errors import ConfigError, ProtocolMismatch
    from .security import derive_keys

    if not interfaces:
        raise ConfigError(
            "no LAN interface here to look for the coordinator on (only loopback, container, "
            "VM or VPN adapters): pass its URL, e.g. 'gpumesh join tcp://HOST:8000', or set "
            "GPUMESH_DISCOVERY_INTERFACES to this machine's address on that network")
    fingerprint = derive_keys(token).fingerprint
    found = browse(timeout, interfaces, want=fingerprint)
    ours = [f for f in found if f.mesh == fingerprint]
    if not ours:
        others = sorted({f.host for f in found})
        seen = (f"it saw other meshes only, on: {', '.join(others)}" if others
                else "it saw no gpumesh coordinator at all")
        raise ConfigError(
            f"no coordinator of this mesh answered on the LAN within {timeout:g}s ({seen}). "
            "Check that the coordinator runs with '--host 0.0.0.0', that this machine is on "
            "the same network and has the same token, or pass its URL: "
            "'gpumesh join tcp://HOST:PORT'")
    compatible = [f for f in ours if f.proto == MAJOR]
    if not compatible:
        other = ours[0]
        advice = ("install the gpumesh version it runs here" if other.version == "?" else
                  f"install gpumesh {other.version} here ('pip install "
                  f"gpumesh=={other.version}')")
        raise ProtocolMismatch(
            f"the coordinator of this mesh on {other.host} runs gpumesh {other.version} "
            f"(protocol {other.proto}); this is gpumesh {__version__} (protocol {MAJOR}): "
            f"{advice}")
    here = adapters()
    if len(compatible) > 1:
        # Each at its address nearest this machine: the first one it lists may be on a network
        # this machine is not on.
        listed = "; ".join(f"{f.host} at {f.urls(here)[0]}" for f in compatible)
        raise ConfigError(f"several coordinators of this mesh answered ({listed}): pass the "
                          "one to join as a URL, e.g. 'gpumesh join "
                          + compatible[0].urls(here)[0] + "'")
    chosen = compatible[0]
    return chosen.urls(here)[0], chosen
