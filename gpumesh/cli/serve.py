"""``gpumesh serve``: bind the coordinator, print the banner, self-check, start the self-worker."""

from __future__ import annotations

import getpass
import hmac
import ipaddress
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import click

from .. import tunnels
from ..config import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    Settings,
    ensure_home,
    parse_url,
    save_connection,
)
from ..coordinator import Coordinator, Event
from ..coordinator.server import tune_garbage_collector
from ..discovery import Advertiser, advertised_addresses, binds_everywhere
from ..errors import ConfigError, MeshError
from ..fileio import raise_descriptor_limit
from ..firewall import firewall_step
from ..protocol.fields import for_terminal
from ..security import derive_keys, note_weak
from ..stopflag import StopFlag
from ..tokens import (
    new_token,
    parse_token,
    read_token_file,
    refuse_weak,
    weak_warning,
    weakness,
    with_salt,
    write_token_file,
)
from ..worker import devices
from ..worker.runners import why_no_runners
from .lifecycle import stop_with_parent
from .output import child_log_flags, fail, is_terminal, ok, say
from .tokens import save_kdf

TOKEN_FILE = "token"
# A self-worker that exits this many times in a row, each within SELF_WORKER_QUICK_EXIT
# seconds of its start, is not started again: it fails at start (a bad environment, a
# platform without runners), and restarting it twice a second would only fill the log.
SELF_WORKER_STARTS = 3
SELF_WORKER_QUICK_EXIT = 10.0

log = logging.getLogger("gpumesh.coordinator")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _home_display(path: Path) -> str:
    home = str(Path.home())
    text = str(path)
    return "~" + text[len(home):] if text.startswith(home + os.sep) else text


def print_event(event: Event) -> None:
    if event.kind == "worker_joined":
        w = event.data["worker"]
        say(f"[mesh] worker joined: {w['hostname']} ({w['device_name']}, "
                   f"score={float(w['score']):.3f})")
    elif event.kind == "worker_lost":
        w = event.data["worker"]
        reason = event.data["reason"]
        verb = "left" if reason in ("left", "drained") else \
            "removed" if reason.startswith("removed") else "lost"
        say(f"[mesh] worker {verb}: {w['hostname']} {w['id'][:8]} ({reason})")
    elif event.kind == "worker_control":
        say(f"[mesh] {event.data['by']} asked worker {event.data['worker'][:8]} to "
            f"{event.data['action']}")


def log_event(event: Event) -> None:
    """A state change as a debug line: `gpumesh -v serve` showed almost nothing of a job's
    life (submitted, each task's end and its error, workers' modes, cancels, retries)."""
    def shown(value: object) -> object:
        if isinstance(value, dict) and "id" in value:  # a worker's summary: who it is
            return f"{value.get('hostname', '')}/{str(value['id'])[:8]}"
        return value

    values = {key: shown(value) for key, value in event.data.items()}
    fields = " ".join(f"{key}={value}" for key, value in values.items()
                      if not isinstance(value, (dict, list)))
    log.debug("%s %s", event.kind, for_terminal(fields))


def serve_token(settings: Settings, token: str | None, weak_token: bool) -> tuple[str, str | None]:
    """The token this coordinator uses, and the salt it added (None if it added none).

    None makes a new token. A weak one is refused unless ``weak_token``; accepted, it gets a
    salt if it has none: the one saved with the same secret, so a restart keeps the mesh's
    keys, or a new one.
    """
    if token is None:
        return new_token(), None
    if weak_warning(token) is None:
        return token, None
    if not weak_token:
        refuse_weak(token)
    given = parse_token(token)
    if given.salt:
        return token, None
    try:
        saved = settings.saved_connection()
    except MeshError:
        saved = None
    if saved is not None:
        kept = parse_token(saved.token)
        if kept.salt and hmac.compare_digest(kept.secret.encode(), given.secret.encode()):
            return kept.text, kept.salt
    salted = with_salt(token)
    return salted, parse_token(salted).salt


@dataclass(frozen=True)
class SavedCoordinator:
    """What this machine's coordinator saved: its token, and the address and port it was bound
    to when known (None: not saved). ``where`` is the file the token was read from."""

    token: str = field(repr=False)
    where: Path
    host: str | None = None
    port: int | None = None


def saved_coordinator(settings: Settings, *, quiet: bool = False) -> SavedCoordinator | None:
    """The token (and bind) that this machine's coordinator saved, for a ``serve`` told none.

    From the saved connection when it is this machine's own coordinator (a connection to
    another machine's is a worker's, whose token belongs to that mesh); else, when no
    connection is saved at all, from the token file alone. A token file that cannot be read is
    a ConfigError, never a reason to make a new token over it; a damaged connection is a
    warning on stderr (unless ``quiet``), as ``serve`` replaces it.
    """
    token_path = settings.home / TOKEN_FILE
    try:
        saved = settings.saved_connection()
    except MeshError as exc:
        if not quiet:
            click.echo(f"warning: {exc}", err=True)
        saved = None
    if saved is not None:
        if not saved.own_coordinator:
            return None
        where = token_path if token_path.exists() else settings.config_path
        if saved.served is not None:
            return SavedCoordinator(saved.token, where, *saved.served)
        return SavedCoordinator(saved.token, where, port=parse_url(saved.url).port)
    if not token_path.exists():
        return None
    try:
        return SavedCoordinator(read_token_file(token_path), token_path)
    except MeshError as exc:
        raise ConfigError(f"{exc}. It holds this machine's saved token: fix or delete it, or "
                          "choose a token with --token-file PATH") from None


def saved_tokens(settings: Settings) -> list[str]:
    """The tokens saved here now (the token file's, the connection's), unreadable ones left out."""
    found = []
    try:
        found.append(read_token_file(settings.home / TOKEN_FILE))
    except MeshError:
        pass
    try:
        saved = settings.saved_connection()
    except MeshError:
        saved = None
    if saved is not None:
        found.append(saved.token)
    return found


def replaces_saved(settings: Settings, token: str) -> bool:
    """Whether saving ``token`` replaces another token saved on this machine."""
    return any(not hmac.compare_digest(old.encode(), token.encode())
               for old in saved_tokens(settings))


def save_served(settings: Settings, url: str, token: str, served: tuple[str, int]) -> Path:
    """What ``serve`` saves (``setup`` too): the connection, ``url`` being how this machine
    dials the coordinator and ``served`` its (bind address, port), and the token file that the
    printed join commands name. A worker's slot count saved with the same token is kept.
    Returns the token file's path."""
    slots = None
    try:
        saved = settings.saved_connection()
    except MeshError:
        saved = None
    if saved is not None and hmac.compare_digest(saved.token.encode(), token.encode()):
        slots = saved.slots
    save_connection(settings.config_path, url, token, served=served, slots=slots,
                    **save_kdf(token))
    token_path = settings.home / TOKEN_FILE
    write_token_file(token_path, token, replace=True)
    return token_path


def tailscale_bind(settings: Settings, host: str | None, host_ip: str | None) -> tuple[str, str]:
    """``--tailscale``: (the address to bind, this machine's Tailscale address to print).

    The bind is the user's ``--host`` (or GPUMESH_HOST) when given, else the Tailscale address
    itself, so only the tailnet can reach the coordinator. Exits with one line when Tailscale
    cannot give an address.
    """
    if host_ip is not None:
        fail("--tailscale chooses the address to print itself: drop --host-ip, or drop "
             "--tailscale and keep --host-ip")
    try:
        address = tunnels.tailscale_ip()
    except tunnels.TunnelError as exc:
        fail(str(exc))
    if tunnels.outside_tailnet(address):
        click.echo(f"warning: 'tailscale ip -4' answered {address}, outside Tailscale's "
                   f"{tunnels.TAILNET}; using it as given", err=True)
    bind = host or (settings.host if settings.host != DEFAULT_HOST else address)
    if bind != address and not binds_everywhere(bind):
        click.echo(f"warning: bound to {bind} only, so machines on your tailnet cannot reach "
                   f"{address}: drop --host (or use --host 0.0.0.0)", err=True)
    return bind, address


def serve(
    settings: Settings, *, host: str | None, port: int | None, token: str | None,
    db: str | None,
    self_worker: bool, slots: int | None, safe_mode: bool, pending_timeout: float | None,
    ready_fd: int | None, quiet: bool, save: bool = True, exit_with_parent: bool = False,
    weak_token: bool = False, host_ip: str | None = None, tailscale: bool = False,
    public: bool = False, tunnel: tunnels.TunnelProvider | None = None,
    dashboard: tuple[str, int, str | None, str | None] | None = None,
) -> None:
    """Run a coordinator until SIGINT/SIGTERM. ``tailscale`` binds and prints this machine's
    Tailscale address; ``public`` opens a TCP tunnel through ``tunnel`` (ngrok by default) once
    the self-check passes, and closes it when serve stops.

    Without ``token`` it reuses the one this machine's coordinator saved, and makes one only
    when none is saved; without ``host``/``port`` (and GPUMESH_HOST) it binds as that
    coordinator was bound, else 127.0.0.1:8000.
    """
    if tailscale and public:
        fail("--tailscale and --public are two ways to reach this coordinator: choose one")
    try:
        own = saved_coordinator(settings) if token is None or host is None or port is None \
            else None
    except MeshError as exc:
        fail(str(exc))
    reused = token is None and own is not None
    if reused and own is not None:
        token = own.token
    generated = token is None
    # A generated token is printed once, to the terminal of the user who ran serve; output
    # that is not a terminal (a log, journald, `docker logs`) would keep it for anyone who
    # reads that. It goes to the saved token file instead, and without one it would be lost.
    shown = is_terminal()
    if generated and not shown and not save:
        fail("no token given, and with --no-save and output that is not a terminal a "
             "generated one would be written into a log or lost: set GPUMESH_TOKEN or pass "
             "--token-file (make one with 'gpumesh token --file mesh.token')")
    tailnet: str | None = None
    if tailscale:
        host, tailnet = tailscale_bind(settings, host, host_ip)
    from_saved = []
    opened_before = None  # a saved bind beyond loopback, not taken again without being asked
    if host is None and not settings.host_given and own is not None and own.host is not None:
        if is_loopback(own.host):
            host = own.host
            from_saved.append("address")
        else:
            # "No flag at all is loopback only": opening the port is asked for each time.
            opened_before = own.host
    if port is None and own is not None and own.port is not None:
        port = own.port
        from_saved.append("port")
    host = host or settings.host
    port = DEFAULT_PORT if port is None else port
    if public and not is_loopback(host) and host not in ("0.0.0.0", "*", "::"):
        # The tunnel would dial that address: every peer through it would arrive from it,
        # which the failed-handshake lockout does not exempt (one stranger's tries would
        # lock every invited peer out), and the README's "from 127.0.0.1" would not hold.
        fail(f"--public with --host {host[:64]}: the tunnel must reach this coordinator on "
             "loopback; leave --host out (the LAN cannot reach it then) or use --host 0.0.0.0")
    if host_ip is not None:
        try:
            ipaddress.IPv4Address(host_ip)
        except ValueError:
            fail(f"--host-ip {host_ip[:64]!r} is not an IPv4 address: give the address other "
                 "machines dial, e.g. --host-ip 192.168.1.20")
        if not advertised_addresses(host, host_ip):
            click.echo(f"warning: --host-ip {host_ip} does not open the port: the coordinator "
                       f"is bound to {host} only, so it is neither advertised nor reachable "
                       "there (add --host 0.0.0.0 to let other machines join)", err=True)
    if reused and own is not None and not weak_token and weakness(own.token):
        # refuse_weak's advice, to leave the token out, would bring this same token back.
        fail(f"the token saved in {_home_display(own.where)} is too weak to guard a "
             f"coordinator: {weakness(own.token)}. Pass --weak-token to keep it (its workers "
             "stay in), or make a strong one with 'gpumesh token --file mesh.token' and pass "
             "--token-file mesh.token (then every worker needs the new one)")
    try:
        token, added_salt = serve_token(settings, token, weak_token)
    except MeshError as exc:
        fail(str(exc))
        return
    warning = weak_warning(token)
    if warning and public:
        # Through the tunnel every peer arrives from 127.0.0.1, which the failed-handshake
        # lockout exempts: only the token's length stands between the internet and this user.
        fail("--public refuses a weak token: through the tunnel every peer comes from "
             "127.0.0.1, which is never locked out, so a short token can be guessed online. "
             "Make a strong one with 'gpumesh token --file mesh.token'")
    if warning and note_weak(token):
        click.echo(f"warning: {warning} (accepted because of --weak-token)", err=True)
    if pending_timeout is not None:
        settings = settings.with_timing(pending_timeout=pending_timeout)
    ensure_home(settings.home)
    db_path = Path(db) if db else settings.home / f"coordinator-{port}.db"
    try:
        coordinator = Coordinator(settings, token, host=host, port=port, db_path=db_path,
                                  safe_mode=safe_mode)
    except MeshError as exc:
        fail(str(exc))
        return
    port = coordinator.port
    local_host = host if not host or host not in ("0.0.0.0", "*", "::") else "127.0.0.1"
    local_url = parse_url(f"[{local_host}]:{port}" if ":" in local_host else f"{local_host}:{port}").zmq
    token_path = settings.home / TOKEN_FILE
    replaced = save and replaces_saved(settings, token)
    if save:
        try:
            save_served(settings, local_url, token, (host, port))
        except (ConfigError, OSError) as exc:  # a full disk: the coordinator runs on, unsaved
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            click.echo(f"warning: this coordinator's connection and token were not saved "
                       f"({why}); it serves as with --no-save, and other commands need "
                       "--url and --token-file until it is saved", err=True)
            save = replaced = False
    coordinator.broker.listeners.append(print_event)
    if log.isEnabledFor(logging.DEBUG):  # -v: every state change, as monitors see it
        coordinator.broker.listeners.append(log_event)
    # How the banner's commands get the token: never the token itself on a command line.
    token_arg = f" --token-file {_home_display(token_path)}" if save else ""

    if save:
        click.echo(f"[gpumesh] config saved to {_home_display(settings.config_path)}")
    ok(f"Coordinator listening on {host}:{port}")
    if from_saved:
        click.echo(f"   (the {' and '.join(from_saved)} as this machine's coordinator saved "
                   f"{'them' if len(from_saved) > 1 else 'it'}; --host and --port choose others)")
    if opened_before is not None:
        click.echo(f"   (the last coordinator here was bound to {opened_before}; without --host "
                   f"it is loopback only: pass --host {opened_before} to let other machines "
                   "join again)")
    if generated and shown:
        click.echo(f"   Token: {token}")
        click.echo("   (generated for you; set GPUMESH_TOKEN or pass --token-file to choose one)")
    elif generated:
        click.echo(f"   Token: <generated> (saved in {_home_display(token_path)}; not printed, "
                   "since this output is not a terminal)")
    elif reused and own is not None:
        click.echo(f"   Token: <your token> (the one saved in {_home_display(own.where)}, "
                   "reused; never printed)")
    elif added_salt:
        click.echo(f"   Token: {added_salt}.<your token> -- share it in this form: the salt "
                   "in front is not secret, and every worker and client needs it")
        if not save:
            # Nothing keeps the salt: the next start would draw another, and lock out every
            # worker holding this one (a container run with --no-save restarts often).
            click.echo(f"   Not saved (--no-save): start it again with the token in this form "
                       f"(GPUMESH_TOKEN={added_salt}.<your token>) to keep the same mesh")
    else:
        click.echo("   Token: <your token> (as given; never printed)")
    if replaced:
        click.echo(f"   Saved, readable only by you, in {_home_display(token_path)}, replacing "
                   "the token saved there before: workers holding the old one are locked out "
                   "until they get this one")
    elif save:
        click.echo(f"   Saved, readable only by you, in {_home_display(token_path)}")
    elif not reused:
        click.echo("   (not saved: give it to 'gpumesh join' as GPUMESH_TOKEN or --token-file)")
    click.echo("")
    click.echo(f"   Join from THIS machine:   gpumesh join {local_url}{token_arg}")
    if tailnet is not None:
        click.echo(f"   Join over Tailscale:      gpumesh join tcp://{tailnet}:{port}"
                   f"{token_arg or ' --token-file FILE'}")
        click.echo("   (from any machine on your tailnet, the token file copied there; the "
                   "tailnet carries no LAN discovery, so the address is needed)")
    if public and is_loopback(host):
        click.echo(f"   Bound to {host} only: the LAN cannot reach it, the tunnel below can.")
    elif is_loopback(host):
        click.echo(f"   Other machines CANNOT reach this coordinator (bound to {host} only).")
        click.echo("   That is the default now: a worker executes code as the user who started it.")
        click.echo("   To let other machines join, re-run with: gpumesh serve --host 0.0.0.0 "
                   f"--port {port}{token_arg or ' and the token as you gave it now'}")
        click.echo("   (or set GPUMESH_HOST=0.0.0.0). Read the warning it prints before you do.")
    else:
        _exposed_banner(host, port, _advertised(settings, host, host_ip), token_arg,
                        tailnet=tailnet, discovery=settings.discovery)
    if safe_mode:
        click.echo("   Safe mode: pickled functions are refused; only scripts are accepted.")
    if coordinator.restored:
        click.echo(f"   Restored {coordinator.restored} unfinished task(s) from {db_path}")
    click.echo("   Ctrl+C to stop")

    tune_garbage_collector()
    raise_descriptor_limit()
    loop = threading.Thread(target=coordinator.run, name="gpumesh-coordinator", daemon=True)
    loop.start()
    stop = StopFlag()  # not a threading.Event: set from a signal handler (stopflag.py)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if exit_with_parent:
        stop_with_parent(stop.set)

    if not _self_check(settings, local_url, token):
        coordinator.stop()
        loop.join(5)
        fail("self-check failed: the coordinator did not answer on "
             f"{local_url}; run 'gpumesh -v serve' for details")
    ok(f"Self-check: server is up (tested on {local_host} only)")
    provider: tunnels.TunnelProvider | None = None
    public_url = ""
    if public:
        provider = tunnel or tunnels.NgrokProvider()
        try:
            public_url = provider.open(local_host, port)
        except tunnels.TunnelError as exc:
            coordinator.stop()
            loop.join(5)
            fail(str(exc))
    advertiser = None
    child = page = None
    child_started, quick_failures = 0.0, 0
    try:
        if public:
            _public_banner(public_url, token_arg)
        if not is_loopback(host):
            step = firewall_step(port)
            if step is not None:
                click.echo(step.message, err=step.warning)
        if tailnet is None:
            advertiser = _advertise(settings, host, host_ip, port, token)
        else:
            click.echo("   Not advertised on the LAN: workers join with the Tailscale address")
        unable = why_no_runners() if self_worker else None
        if unable is not None:
            click.echo(f"   Self-worker not started: {unable}", err=True)
        elif self_worker:
            child = _start_self_worker(local_url, token, slots, quiet)
            child_started = time.monotonic()
            ok("Self-worker started — this machine's CPU/GPU is part of the pool")
            click.echo("   (disable with --no-self-worker)")
        if dashboard is not None:
            from .dashboard import start_child

            page = start_child(local_url, token, *dashboard)
        if ready_fd is not None:
            os.write(ready_fd, f"{port}\n".encode())
            os.close(ready_fd)
        while not stop.wait(0.5):
            if not loop.is_alive():
                fail(coordinator.stopped_because
                     or "the coordinator loop stopped unexpectedly; see the log above")
            if page is not None and page.poll() is not None:
                say("[mesh] the dashboard stopped (see above); the coordinator keeps running")
                page = None
            if child is not None and child.poll() is not None:
                if child.returncode == 0:
                    # Drained or removed on purpose ('gpumesh drain', 'gpumesh kill'): respect it.
                    say("[mesh] self-worker left the mesh; the coordinator keeps running")
                    child = None
                    continue
                quick_failures = quick_failures + 1 if (
                    time.monotonic() - child_started < SELF_WORKER_QUICK_EXIT) else 1
                if quick_failures >= SELF_WORKER_STARTS:
                    say(f"[mesh] self-worker exited with code {child.returncode} "
                        f"{quick_failures} times in a row within {SELF_WORKER_QUICK_EXIT:g} s "
                        "of its start: not restarted again (its lines above say why; "
                        f"'gpumesh join {local_url}' shows it). The coordinator keeps running")
                    child = None
                    continue
                say(f"[mesh] self-worker exited with code {child.returncode}; restarting it")
                child = _start_self_worker(local_url, token, slots, quiet)
                child_started = time.monotonic()
    finally:
        for process in (child, page):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
        if advertiser is not None:
            advertiser.close()
        if provider is not None:
            provider.close()
            click.echo("[gpumesh] public tunnel closed")
        coordinator.stop()
        loop.join(10)
    click.echo("[gpumesh] coordinator stopped")


def _public_banner(url: str, token_arg: str) -> None:
    user = getpass.getuser()
    bar = "  " + "!" * 62
    token_arg = token_arg or " --token-file FILE"
    click.echo(f"   Join from ANYWHERE:       gpumesh join {url}{token_arg}")
    click.echo("   (the token file copied there; the address changes on every run of --public)")
    click.echo("")
    click.echo(bar)
    click.echo("  !! PUBLIC COORDINATOR (ngrok TCP tunnel)")
    click.echo(bar)
    click.echo(f"   Public address: {url}")
    click.echo("   Anyone on the internet who has the token can run arbitrary code on this")
    click.echo(f"   machine as {user}. \"Anywhere\" includes people you did not invite: the token")
    click.echo("   is the only thing keeping them out. Share it only with the people you invite.")
    click.echo("   Ctrl+C stops serve and closes the tunnel.")
    click.echo(bar)
    click.echo("")


def _advertise(settings: Settings, host: str, host_ip: str | None, port: int,
               token: str) -> Advertiser | None:
    """Advertise the mesh on the LAN when other machines can reach it (never on loopback)."""
    addresses = _advertised(settings, host, host_ip)
    if not addresses or not settings.discovery:
        return None
    advertiser = Advertiser(port=port, addresses=addresses, fingerprint=derive_keys(token).fingerprint,
                            interfaces=settings.discovery_interfaces or addresses)
    advertiser.start()
    click.echo(f"   Advertising on the LAN ({', '.join(addresses)}): 'gpumesh join' finds it "
               "without a URL (GPUMESH_DISCOVERY=0 turns this off)")
    return advertiser


def _advertised(settings: Settings, host: str, host_ip: str | None) -> list[str]:
    """The addresses other machines are told: GPUMESH_DISCOVERY_INTERFACES, when set, in
    place of the LAN adapters' (a machine whose network is a VPN, or one of several LANs),
    for a coordinator bound to every address and given no --host-ip."""
    if binds_everywhere(host) and not host_ip and settings.discovery_interfaces:
        return list(settings.discovery_interfaces)
    return advertised_addresses(host, host_ip)


def _exposed_banner(host: str, port: int, addresses: list[str], token_arg: str, *,
                    tailnet: str | None = None, discovery: bool = True) -> None:
    token_arg = token_arg or " --token-file FILE"
    if tailnet is not None:
        addresses = [tailnet]  # its join line is printed already, with the address
    elif addresses and not discovery:
        # Nothing advertises it (GPUMESH_DISCOVERY=0, as in the Docker image): a join without a
        # URL would find nothing. (Marker files such as /.dockerenv are no sure sign of a
        # container: VMs built from images have them too.)
        click.echo(f"   Join from ANOTHER machine: gpumesh join tcp://{addresses[0]}:{port}"
                   f"{token_arg}")
        click.echo("   (LAN discovery is off, so the URL is needed; in a container, give the "
                   f"Docker host's address and the port published for {port} instead)")
    elif addresses:
        click.echo(f"   Join from ANOTHER machine: gpumesh join{token_arg}")
        click.echo(f"   (or with the address: gpumesh join tcp://{addresses[0]}:{port}{token_arg};"
                   " the token file copied there, readable only by you)")
    else:
        click.echo("   No LAN address found to print for other machines (only loopback, container,"
                   " VM or VPN adapters): pass --host-ip with the address they should dial")
    inventory = devices.probe(torch_probe=False)
    bar = "  " + "!" * 62
    click.echo("")
    click.echo(bar)
    click.echo("  !! NETWORK-EXPOSED COORDINATOR")
    click.echo(bar)
    click.echo(f"   Bound to:      {host}:{port} (not loopback — other machines can connect)")
    click.echo(f"   Tasks run as:  {getpass.getuser()}")
    click.echo(f"   On device:     {inventory['device']} {inventory['device_name']}")
    click.echo("")
    click.echo("   Anyone who can reach this port AND has the token can run")
    click.echo(f"   arbitrary code on this machine as {getpass.getuser()}.")
    click.echo("   Only do this on a network you trust, and keep the token secret.")
    click.echo(f"   Loopback-only (the default) is: gpumesh serve --port {port}")
    click.echo(bar)
    click.echo("")
    if addresses:
        click.echo(f"   Reachability of tcp://{addresses[0]}:{port} from other machines is not "
                   "tested here — a worker joining confirms it.")


def _self_check(settings: Settings, url: str, token: str) -> bool:
    from ..client.engine import Engine  # the CLI may use any layer; only here is it needed

    engine = Engine(settings, parse_url(url), token)
    try:
        return engine.wait_connected(10.0)
    except MeshError:
        return False
    finally:
        engine.close()


def _start_self_worker(url: str, token: str, slots: int | None, quiet: bool) -> subprocess.Popen[bytes]:
    env = dict(os.environ, GPUMESH_TOKEN=token)
    # The self-worker goes when this serve goes, even after a kill -9 of the serve.
    args = [sys.executable, "-m", "gpumesh", *child_log_flags(), "join", url, "--no-save",
            "--exit-with-parent"]
    if slots is not None:
        args += ["--slots", str(slots)]
    return subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL if quiet else None)
