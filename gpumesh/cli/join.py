"""``gpumesh join``: probe and benchmark this machine, then serve tasks until stopped."""

from __future__ import annotations

import hmac
import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

import click

from ..config import SavedConnection, Settings, ensure_home, parse_url, save_connection
from ..discovery import browse_interfaces, find_coordinator
from ..errors import ConfigError, MeshError
from ..fileio import raise_descriptor_limit
from ..protocol.taskenv import check_env_name
from ..security import stretch_in_background
from ..tokens import read_token_file
from ..worker import WorkerAgent, benchcache, devices
from ..worker.identity import claim as claim_worker_id
from ..worker.runners import why_no_runners
from .lifecycle import stop_with_parent
from .output import fail, say
from .tokens import save_kdf

DEFAULT_CPU_SLOTS_MAX = 4


def default_slots(inventory: dict[str, Any]) -> int:
    """One slot per GPU; on a CPU-only machine one per core, at most four (polite by default)."""
    if inventory["gpus"]:
        return len(inventory["gpus"])
    return max(1, min(int(inventory["cores"]), DEFAULT_CPU_SLOTS_MAX))


def passed_variables(names: Sequence[str]) -> list[str]:
    """The ``--pass-env`` names, checked; a line for each one this environment lacks."""
    passed: list[str] = []
    for name in names:
        try:
            check_env_name(name)
        except ValueError as exc:
            raise ConfigError(f"--pass-env: {exc}") from None
        if name == "GPUMESH_TOKEN":
            raise ConfigError("--pass-env GPUMESH_TOKEN: the mesh token is never handed to tasks")
        if name not in os.environ:
            click.echo(f"[worker] --pass-env {name}: not set here, so tasks will not get it")
        if name not in passed:
            passed.append(name)
    if passed:
        click.echo(f"[worker] passes to every task: {', '.join(passed)}")
    return passed


NO_TOKEN = ("no token: set GPUMESH_TOKEN, or pass --token-file PATH (the file 'gpumesh serve' "
            "saved as ~/.gpumesh/token, copied here), or run 'gpumesh setup'")


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def keeps_own_coordinator(settings: Settings, token: str) -> bool:
    """Whether this machine's own coordinator saved another token here: in the saved
    connection (``serve``'s), or, with no connection saved, in its token file. Saved over, its
    next plain ``gpumesh serve`` made a new token and locked its workers out."""
    from .serve import TOKEN_FILE

    try:
        saved = settings.saved_connection()
    except MeshError:
        return False
    if saved is not None:
        return saved.served is not None and not _same(saved.token, token)
    try:
        own = read_token_file(settings.home / TOKEN_FILE)
    except MeshError:
        return False  # none, or unreadable: nothing to keep
    return not _same(own, token)


def save_joined(settings: Settings, url: str, token: str, slots: int | None = None) -> None:
    """What ``join`` saves once the coordinator admitted it (``setup`` too): the connection that
    later commands and ``@mesh`` use, and the slot count it was told (None: join's default).
    What this machine's own coordinator saved with the same token is kept."""
    try:
        saved = settings.saved_connection()
    except MeshError:
        saved = None
    served = saved.served if saved is not None and _same(saved.token, token) else None
    save_connection(settings.config_path, parse_url(url).zmq, token, served=served, slots=slots,
                    **save_kdf(token))


def with_saved(settings: Settings, url: str | None, token: str | None,
               slots: int | None) -> tuple[str | None, str, int | None, SavedConnection | None]:
    """(url, token, slots) of this ``join``: what was given (flags, GPUMESH_TOKEN), each missing
    one from the saved connection (its slots only for its own token); and that connection when
    its URL was taken. A URL that is
    still None means nothing is saved: join looks on the LAN."""
    saved = None
    if url is None or token is None or slots is None:
        try:
            saved = settings.saved_connection()
        except MeshError as exc:
            if token is None:
                raise
            click.echo(f"warning: {exc}", err=True)
    if token is None:
        if saved is None:
            raise ConfigError(NO_TOKEN)
        token = saved.token
    if saved is not None and slots is None and _same(saved.token, token):
        slots = saved.slots  # a count told for this mesh
    if url is None and saved is not None and _same(saved.token, token):
        # Only the saved mesh's own address: with another token (a friend's mesh) the saved
        # one is a coordinator that would refuse it; the token's own is found on the LAN.
        return saved.url, token, slots, saved
    return url, token, slots, None


def discovered(settings: Settings, token: str) -> tuple[str, Callable[[], str | None] | None]:
    """The URL of this mesh's coordinator on the LAN, and how to look for it again."""
    if not settings.discovery:
        raise ConfigError("no URL given, and LAN discovery is off (GPUMESH_DISCOVERY=0): pass "
                          "the coordinator's URL, e.g. 'gpumesh join tcp://HOST:8000'")
    interfaces = browse_interfaces(settings.discovery_interfaces)
    timeout = settings.discovery_timeout
    click.echo(f"[worker] looking for this mesh's coordinator on the LAN (up to {timeout:g}s)")
    url, found = find_coordinator(token, interfaces, timeout)
    click.echo(f"[worker] found it on {found.host}: {url}")

    return url, again_on_lan(settings, token)


def again_on_lan(settings: Settings, token: str) -> Callable[[], str | None] | None:
    """How the agent looks for a coordinator that moved (None when discovery is off)."""
    if not settings.discovery:
        return None

    def again() -> str | None:
        return find_coordinator(token, browse_interfaces(settings.discovery_interfaces),
                                settings.discovery_timeout)[0]

    return again


def join(settings: Settings, *, url: str | None, token: str | None, slots: int | None,
         benchmark: bool, rebenchmark: bool = False,
         save: bool, ready_fd: int | None, prefetch: int | None = None, max_slots: int | None = None,
         exit_with_parent: bool = False, pass_env: Sequence[str] = ()) -> None:
    """Join until stopped. A missing URL, token or slot count comes from the saved
    connection (``with_saved``); with no URL saved either, the coordinator is found on the LAN."""
    unable = why_no_runners()
    if unable is not None:
        fail(unable)
        return
    rediscover = None
    found_on_lan = False
    try:
        passed = passed_variables(pass_env)
        url, token, slots, saved = with_saved(settings, url, token, slots)
        if url is None:
            url, rediscover = discovered(settings, token)
            found_on_lan = True
        elif saved is not None:
            click.echo(f"[worker] no URL given: dialling the saved coordinator {saved.url} "
                       "(from the connection saved here; pass a URL to dial another)")
            rediscover = again_on_lan(settings, token)
        endpoint = parse_url(url, token)
    except MeshError as exc:
        fail(str(exc))
        return
    ensure_home(settings.home)  # 0700 before anything is written there
    # The token's scrypt (about 0.4 s) runs beside the device probe: it releases the GIL. The
    # agent then finds the keys cached; a bad token is reported by the agent as before.
    stretching = stretch_in_background(token)
    inventory = devices.probe()
    measured_at = None
    if benchmark:
        figures, measured_at = benchcache.measured(settings.home, inventory, rerun=rebenchmark,
                                                   run=devices.benchmark)
        inventory["score"] = devices.score_of(figures)
        inventory["gflops"] = figures["gflops"]
        inventory["bandwidth_gbps"] = figures["bandwidth_gbps"]
    else:
        inventory["score"] = 0.0
    told = slots
    slots = slots or default_slots(inventory)
    if max_slots is not None:
        slots = min(slots, max_slots)  # the owner's cap wins over the detected hardware
    click.echo(f"[worker] device={inventory['device']} {inventory['device_name']} "
               f"score={inventory['score']:.3f} GFLOP/s" + (
                   f" (measured {time.strftime('%Y-%m-%d', time.localtime(measured_at))}; "
                   "--rebenchmark measures again)" if measured_at is not None else ""))
    click.echo(f"[worker] runs up to {slots} task(s) at once"
               + (f" (capped by --max-slots {max_slots})" if max_slots and max_slots == slots else ""))
    def joined(worker_id: str) -> None:
        # Saved only now: a wrong token must not replace a working saved connection.
        if save and keeps_own_coordinator(settings, token):
            # This machine's coordinator saved its own mesh here: replaced, its next plain
            # `gpumesh serve` found no token of its own and made a new one (its workers out).
            click.echo("[worker] not saved as this machine's default: it keeps the connection "
                       "of this machine's own coordinator ('gpumesh serve'), another mesh")
        elif save:
            try:
                save_joined(settings, endpoint.zmq, token, told)
            except ConfigError as exc:  # a full disk: the worker serves on, unsaved
                click.echo(f"[worker] not saved as this machine's default: {exc}", err=True)
        if ready_fd is not None:
            os.write(ready_fd, f"{worker_id}\n".encode())

    gpu_indices = [int(g["index"]) for g in inventory["gpus"] if g.get("backend") == "cuda"]
    stretching.join()
    identity = claim_worker_id(settings.home)
    if identity.copied:
        click.echo(f"[worker] {settings.home} was copied from another machine or folder: this "
                   f"worker takes a new id ({identity.worker_id}) so the two stay apart")
    raise_descriptor_limit()  # its runners inherit it: big results map a descriptor each
    try:
        agent = WorkerAgent(settings, endpoint, token, slots=slots, info=inventory,
                            worker_id=identity.worker_id,
                            say=say, on_joined=joined,
                            gpu_indices=gpu_indices or None, prefetch=prefetch,
                            pass_env=passed, rediscover=rediscover,
                            found_on_lan=found_on_lan)
    except MeshError as exc:
        fail(str(exc))
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: agent.stop())
    if exit_with_parent:
        stop_with_parent(agent.stop)
    try:
        agent.run()
    except MeshError as exc:
        fail(str(exc))
    finally:
        identity.release()
        if ready_fd is not None:
            try:
                os.close(ready_fd)
            except OSError:
                pass
    click.echo(left_line(agent.joined_once, agent.left_running, agent.left_waiting))


def left_line(joined: bool, running: int, waiting: int) -> str:
    """join's last line: what it gave back to the mesh, and how not to next time."""
    if not joined:
        return "[worker] stopped (it never reached the coordinator)"
    if not running and not waiting:
        return "[worker] left the mesh"
    given = " and ".join(part for part in (
        f"{running} running task(s) stopped" if running else "",
        f"{waiting} waiting" if waiting else "") if part)
    return (f"[worker] left the mesh: {given}, back in the mesh's queue to run on other "
            "workers ('gpumesh drain' on this machine lets running tasks finish first)")
