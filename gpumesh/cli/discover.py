"""``gpumesh discover``: the gpumesh coordinators advertised on the LAN."""

from __future__ import annotations

import json

import click

from ..config import Settings
from ..discovery import Adapter, Found, adapters, browse, browse_interfaces
from ..errors import MeshError
from ..protocol import MAJOR
from ..security import derive_keys
from .output import fail


def discover(settings: Settings, token: str | None, timeout: float, as_json: bool) -> None:
    """Browse for ``timeout`` seconds and list what answered; with a token, mark its mesh."""
    if not settings.discovery:
        fail("LAN discovery is off (GPUMESH_DISCOVERY=0)")
    interfaces = browse_interfaces(settings.discovery_interfaces)
    if not interfaces:
        fail("no LAN interface to browse on (only loopback, container, VM or VPN adapters): "
             "set GPUMESH_DISCOVERY_INTERFACES to this machine's address on that network")
    try:
        ours = derive_keys(token).fingerprint if token else None
    except MeshError as exc:
        fail(str(exc))
    if not as_json:
        click.echo(f"Looking for gpumesh coordinators on {', '.join(interfaces)} "
                   f"({timeout:g}s)...", err=True)
    try:
        found = browse(timeout, interfaces)
    except MeshError as exc:
        fail(str(exc))
    local = adapters()
    if as_json:
        click.echo(json.dumps([_entry(f, ours, local) for f in found], indent=2))
        return
    if not found:
        click.echo("No coordinator answered. One advertises itself when started with "
                   "'--host 0.0.0.0' (or a LAN address) on a machine of this network.")
        return
    width = max(len(f.host) for f in found)
    for f in found:
        entry = _entry(f, ours, local)
        click.echo(f"  {f.host:<{width}}  {entry['url']:<24} gpumesh {f.version:<8} "
                   f"Python {f.python:<5} {entry['mesh']}")
    if ours is None:
        click.echo("(give the token with GPUMESH_TOKEN or --token-file to see which is yours)")


def _entry(found: Found, ours: str | None, local: list[Adapter]) -> dict[str, object]:
    mesh = ("this mesh" if found.mesh == ours else "another mesh") if ours else "?"
    if found.proto != MAJOR:
        mesh += f" (protocol {found.proto}: cannot join from this gpumesh)"
    return {"host": found.host, "url": found.urls(local)[0], "urls": found.urls(local),
            "version": found.version, "python": found.python, "protocol": found.proto,
            "mesh": mesh}
