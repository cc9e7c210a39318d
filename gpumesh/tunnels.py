"""Reaching a coordinator from beyond the LAN: the Tailscale address and the ngrok TCP tunnel.

``serve --tailscale`` asks the ``tailscale`` CLI for this machine's tailnet IPv4 address
(``tailscale_ip``); ``serve --public`` opens an ngrok TCP tunnel through a ``TunnelProvider``
(``NgrokProvider`` by default, which imports pyngrok only when it opens one, so tests pass a
fake and never touch the network). No click here: the CLI turns a ``TunnelError`` into one line
and exit status 1.

Nothing here sees the token: a tunnel forwards bytes, and the CURVE handshake behind it is
still what admits a peer.
"""

from __future__ import annotations

import ipaddress
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Protocol

from .errors import MeshError
from .processes import end_with_this_process, stop_watching

log = logging.getLogger("gpumesh.tunnels")

TAILSCALE_TIMEOUT = 5.0  # seconds; `tailscale ip -4` answers from the local daemon at once
# Where the macOS app keeps its CLI when `tailscale` is not on PATH (App Store and standalone).
_MAC_APP_CLI = Path("/Applications/Tailscale.app/Contents/MacOS/Tailscale")
TAILNET = ipaddress.ip_network("100.64.0.0/10")  # the CGNAT space Tailscale hands out
_SHOWN = 200  # characters of another program's output quoted in a message


class TunnelError(MeshError):
    """Tailscale or the tunnel could not give an address; the message says what to do."""


def _quote(text: str) -> str:
    line = " ".join(text.split())
    return line[:_SHOWN] + ("..." if len(line) > _SHOWN else "")


def find_tailscale() -> str | None:
    """The ``tailscale`` CLI to run, or None when it is not installed."""
    found = shutil.which("tailscale")
    if found is None and sys.platform == "darwin" and _MAC_APP_CLI.exists():
        return str(_MAC_APP_CLI)
    return found


def tailscale_ip(timeout: float = TAILSCALE_TIMEOUT, binary: str | None = None) -> str:
    """This machine's Tailscale IPv4 address, from ``tailscale ip -4``.

    Raises ``TunnelError`` when the CLI is missing, fails (not running, logged out), says
    nothing, answers something that is not one IPv4 address, or takes longer than ``timeout``.
    """
    exe = binary or find_tailscale()
    if exe is None:
        raise TunnelError("--tailscale: the 'tailscale' command was not found: install Tailscale "
                          "(https://tailscale.com/download), run 'tailscale up', and try again")
    try:
        done = subprocess.run([exe, "ip", "-4"], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, errors="replace")
    except subprocess.TimeoutExpired:
        raise TunnelError(f"--tailscale: 'tailscale ip -4' did not answer within {timeout:g}s: "
                          "is tailscaled running? Check 'tailscale status', then try "
                          "again") from None
    except OSError as exc:
        raise TunnelError(f"--tailscale: could not run {exe}: {exc.strerror or exc}") from None
    said = _quote(done.stderr or done.stdout)
    if done.returncode != 0:
        raise TunnelError(f"--tailscale: 'tailscale ip -4' failed (exit {done.returncode})"
                          + (f": {said}" if said else "")
                          + ". Is Tailscale running and logged in? Run 'tailscale up', then try "
                          "again")
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    if not lines:
        raise TunnelError("--tailscale: 'tailscale ip -4' printed no address: this machine has no "
                          "Tailscale IPv4 address yet. Run 'tailscale up' (and check 'tailscale "
                          "status'), then try again")
    try:
        address = ipaddress.IPv4Address(lines[0])
    except ValueError:
        raise TunnelError(f"--tailscale: 'tailscale ip -4' answered {_quote(lines[0])!r}, not an "
                          "IPv4 address. Check 'tailscale status', or bind the address yourself "
                          "with --host ADDRESS instead of --tailscale") from None
    if address.is_unspecified or address.is_multicast:
        raise TunnelError(f"--tailscale: 'tailscale ip -4' answered {address}, which no machine "
                          "can dial. Check 'tailscale status', then try again")
    return str(address)


def outside_tailnet(address: str) -> bool:
    """True when ``address`` is not in Tailscale's 100.64.0.0/10 (worth a warning, not a stop)."""
    return ipaddress.IPv4Address(address) not in TAILNET


class TunnelProvider(Protocol):
    """Opens one public TCP tunnel to a local port and closes it again."""

    def open(self, host: str, port: int) -> str:
        """Forward a public address to ``host:port``; return it as ``tcp://HOST:PORT``.

        Raises ``TunnelError`` with what to do when it cannot.
        """

    def close(self) -> None:
        """Close the tunnel (a no-op when none is open)."""


class NgrokProvider:
    """An ngrok TCP tunnel through pyngrok (the ``tunnel`` extra), imported when first opened."""

    def __init__(self) -> None:
        self._url: str | None = None
        self._watcher: subprocess.Popen[bytes] | None = None

    def open(self, host: str, port: int) -> str:
        try:
            from pyngrok import exception, ngrok  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            raise TunnelError("--public needs pyngrok: pip install 'gpumesh[tunnel]'") from None
        try:
            tunnel = ngrok.connect(f"{host}:{port}", "tcp")
        except exception.PyngrokError as exc:
            raise TunnelError(f"--public: ngrok could not open a TCP tunnel: {_quote(str(exc))}. "
                              "ngrok needs an account: run 'ngrok config add-authtoken "
                              "<your ngrok authtoken>' (TCP tunnels need a verified account), "
                              "check this machine's internet connection, and try again") from None
        url = str(tunnel.public_url or "")
        if not url.startswith("tcp://"):
            self._disconnect(url)
            raise TunnelError(f"--public: ngrok answered {_quote(url)!r}, not a tcp:// address; "
                              "try again, or use --tailscale")
        self._url = url
        self._watcher = _ngrok_ends_with_us(ngrok)
        return url

    def close(self) -> None:
        url, self._url = self._url, None
        if url is not None:
            self._disconnect(url)
        watcher, self._watcher = self._watcher, None
        stop_watching(watcher)

    @staticmethod
    def _disconnect(url: str) -> None:
        from pyngrok import exception, ngrok  # type: ignore[import-not-found,unused-ignore]

        try:
            if url:
                ngrok.disconnect(url)
        except exception.PyngrokError:
            pass  # the ngrok process is killed next, which closes every tunnel it holds
        finally:
            ngrok.kill()


def _ngrok_ends_with_us(ngrok: Any) -> subprocess.Popen[bytes] | None:
    """A watcher that ends pyngrok's ngrok process if this one dies without closing it (kill
    -9): else the tunnel stays up, and holds a free account's only agent session."""
    try:
        pid = int(ngrok.get_ngrok_process().proc.pid)
    except Exception:  # a pyngrok without it, or no process after all: nothing to watch
        log.debug("no ngrok process to watch", exc_info=True)
        return None
    return end_with_this_process(pid)
