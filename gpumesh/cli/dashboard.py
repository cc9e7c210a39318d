"""``gpumesh dashboard``: serve the live web page of a mesh until Ctrl+C (or its parent goes)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys

import click

from ..config import Settings
from ..errors import MeshError
from ..stopflag import StopFlag
from .lifecycle import stop_with_parent
from .output import child_log_flags, fail, is_terminal, ok


def run(settings: Settings, *, url: str | None, token: str | None, host: str, port: int,
        cert: str | None = None, key: str | None = None,
        exit_with_parent: bool = False) -> None:
    from ..client import GPUMesh
    from ..dashboard import Dashboard
    from ..dashboard.tls import prepare

    try:
        # Before anything connects or binds: off loopback there is HTTPS or no dashboard.
        tls = prepare(host, settings.home, cert, key)
    except MeshError as exc:
        fail(str(exc))
    try:
        endpoint, token = settings.resolve_connection(url, token)
        client = GPUMesh(endpoint.zmq, token, quiet=True, settings=settings)
    except MeshError as exc:
        fail(str(exc))
    try:
        dashboard = Dashboard(client, token, host=host, port=port,
                              tls=tls[0] if tls else None)
    except OSError as exc:  # socket.gaierror too: a host name that names nothing
        client.close()
        fail(_bind_failure(host, port, exc))
    stop = StopFlag()  # not a threading.Event: set from a signal handler (stopflag.py)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if exit_with_parent:
        stop_with_parent(stop.set)
    thread = dashboard.start()
    if dashboard.guard.login_required or is_terminal():
        ok(f"Dashboard on {dashboard.url} (mesh {endpoint.zmq})")
    else:
        # The link's key opens the page to whoever reads it: a log, journald or `docker logs`
        # may be read by others than the user who started the dashboard.
        ok(f"Dashboard on {dashboard.url.split('?', 1)[0]} (mesh {endpoint.zmq})")
        click.echo("   Log in with the mesh token (the link with its key is printed only to a "
                   "terminal)")
    if tls is not None:
        made = "made now, " if tls[1].generated else ""
        click.echo(f"   HTTPS with {tls[1].cert} ({made}SHA-256 fingerprint {tls[1].fingerprint})")
        if dashboard.guard.login_required:
            click.echo("   Reachable from other machines: the page asks for the mesh token before "
                       "it shows anything. A browser warns about a self-signed certificate: "
                       "go on only if the fingerprint it shows is the one above.")
    try:
        while not stop.wait(0.5):
            if not thread.is_alive():
                fail("the dashboard stopped unexpectedly; run 'gpumesh -v dashboard' for details")
    finally:
        dashboard.close()
        client.close()
    click.echo("[gpumesh] dashboard stopped")


def start_child(url: str, token: str, host: str, port: int, cert: str | None = None,
                key: str | None = None) -> subprocess.Popen[bytes]:
    """``gpumesh serve --dashboard``: the page in a process of its own, so its JSON and HTTP
    work never takes the coordinator's loop's time (one GIL each); it stops with serve."""
    env = dict(os.environ, GPUMESH_TOKEN=token)
    tls = ["--dashboard-cert", cert, "--dashboard-key", key] if cert and key else []
    args = [sys.executable, "-m", "gpumesh", *child_log_flags(), "dashboard", "--url", url,
            "--dashboard-host", host, "--dashboard-port", str(port), *tls, "--exit-with-parent"]
    return subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL)


def _bind_failure(host: str, port: int, exc: OSError) -> str:
    """What went wrong binding the page's port, and the flag that fixes it."""
    where = f"cannot serve the dashboard on {host}:{port}: {exc.strerror or exc}"
    if exc.errno == errno.EADDRINUSE:
        return f"{where}. Pick another port with --dashboard-port"
    if exc.errno == errno.EACCES:
        return (f"{where}. Ports below 1024 need administrator rights: pick one from 1024 up "
                "with --dashboard-port (8265 is the default)")
    return (f"{where}. --dashboard-host must be an address of this machine (127.0.0.1, the "
            "default, or 0.0.0.0 for all of its addresses)")
