"""The dashboard's HTTP server: static page, a server-sent event stream, and two actions.

Standard library only (``ThreadingHTTPServer``). Every request passes the Guard (guard.py) first;
every response carries a Content-Security-Policy without inline script, ``nosniff`` and
``X-Frame-Options: DENY``. The page gets mesh data as JSON and shows it with ``textContent``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import re
import socket
import ssl
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..client import GPUMesh
from ..errors import MeshError
from ..protocol.fields import for_terminal
from .guard import Guard
from .monitor import Monitor, TooManyRequests

log = logging.getLogger("gpumesh.dashboard")

DEFAULT_PORT = 8265
MAX_BODY = 4096
MAX_STREAMS = 32  # browsers watching at once; each holds a thread
# Connections served at once, each a thread: beyond this a new one is closed before anything
# of it is read (anybody on the network can open them, before any check).
MAX_CONNECTIONS = 128
# ... of which one address may hold this many: a browser opens six or so, and one host holding
# every slot (a connection that trickles its request keeps one for the read timeout) would lock
# the other browsers out. Per address, not per IPv6 /64: on a SLAAC LAN every host shares one,
# and a host using many addresses is a limit this does not reach. Loopback is not held to it:
# every viewer through an SSH tunnel or a local proxy comes from there.
MAX_PER_ADDRESS = 32
KEEPALIVE = 15.0  # seconds between comments on an idle event stream
HANDSHAKE_SECONDS = 10.0  # a TLS client that says nothing gives its thread back after this
STATIC = {"/": ("index.html", "text/html"), "/app.js": ("app.js", "text/javascript"),
          "/style.css": ("style.css", "text/css"), "/login": ("login.html", "text/html")}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; connect-src 'self'; form-action 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    # Not "no-referrer": under it Chromium sends "Origin: null" with the page's own form POSTs.
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
LOGIN_MESSAGES = {"failed": "That is not this mesh's token.",
                  "blocked": "Too many wrong tokens: wait a minute and try again.",
                  "key": "That link is not this dashboard's: its key changes each time the "
                         "dashboard starts. Open the link it printed last, or enter the token."}


def _assets() -> dict[str, bytes]:
    folder = resources.files("gpumesh.dashboard") / "static"
    return {name: (folder / name).read_bytes() for name, _ in STATIC.values()}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    dashboard: Dashboard
    tls: ssl.SSLContext | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connections = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._by_address: dict[str, int] = {}  # connections served, by the peer's address
        self._by_address_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        address = _address_key(client_address)
        if not self._take_slot(address):
            log.debug("closed a connection from %s: as many are served already",
                      for_terminal(address))
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._give_slot(address)  # its thread never started
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer that resets or drops its connection mid-answer is its own business: a line
        at debug, not a traceback on stderr (which any peer could repeat at will, around
        --json-logs). Anything else is a bug of ours and is logged with its traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            log.debug("a connection from %s ended early: %s",
                      for_terminal(_address_key(client_address)), exc)
        else:
            log.exception("the dashboard failed to answer %s",
                          for_terminal(_address_key(client_address)))

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._give_slot(_address_key(client_address))

    def _take_slot(self, address: str) -> bool:
        """A slot of the MAX_CONNECTIONS, and of the address's MAX_PER_ADDRESS (none for
        loopback, ``""``); False when either is full."""
        with self._by_address_lock:
            held = self._by_address.get(address, 0)
            if (held >= MAX_PER_ADDRESS and address) \
                    or not self.connections.acquire(blocking=False):
                return False
            self._by_address[address] = held + 1
            return True

    def _give_slot(self, address: str) -> None:
        with self._by_address_lock:
            held = self._by_address.get(address, 0) - 1
            if held > 0:
                self._by_address[address] = held
            else:
                self._by_address.pop(address, None)
            self.connections.release()


def _address_key(client_address: Any) -> str:
    """What a connection counts against for MAX_PER_ADDRESS: its address (an IPv4 peer of a
    dual-stack bind as IPv4, without an IPv6 scope), or ``""`` for loopback (not capped) and
    anything that is not an address."""
    try:
        ip = ipaddress.ip_address(str(client_address[0]).split("%", 1)[0])
    except (TypeError, ValueError, IndexError, KeyError):
        return ""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # a dual-stack bind sees IPv4 peers so
    return "" if ip.is_loopback else str(ip)


class Dashboard:
    """Serve the page at ``host:port`` for the mesh ``client`` reaches; ``token`` is that
    mesh's token, asked of browsers when the bind is not loopback. With ``tls`` (tls.py) the
    page is HTTPS: each connection's handshake runs in its own thread, never the accepting one."""

    def __init__(self, client: GPUMesh, token: str, host: str = "127.0.0.1",
                 port: int = DEFAULT_PORT, interval: float = 1.0,
                 tls: ssl.SSLContext | None = None) -> None:
        self.monitor = Monitor(client, interval)
        self.assets = _assets()
        server_class = type("Server", (_Server,), {
            "address_family": socket.AF_INET6 if ":" in host else socket.AF_INET})
        self.httpd = server_class((host, port), Handler)  # raises OSError when taken
        self.httpd.dashboard = self
        self.httpd.tls = tls
        self.port = self.httpd.server_address[1]
        self.guard = Guard(token, host, self.port, tls=tls is not None)
        self.streams = 0
        self._lock = threading.Lock()
        self._serving = False

    @property
    def url(self) -> str:
        """The page's address; on loopback with the key that opens a session (print it only
        to the user who started the dashboard)."""
        host = self.guard.host
        shown = "127.0.0.1" if host in ("", "0.0.0.0", "::", "*") else host
        scheme = self.guard.scheme
        key = "" if self.guard.login_required else f"?key={self.guard.key}"
        return (f"{scheme}://[{shown}]:{self.port}/{key}" if ":" in shown
                else f"{scheme}://{shown}:{self.port}/{key}")

    def serve_forever(self) -> None:
        self._serving = True
        self.monitor.start()
        self.httpd.serve_forever(poll_interval=0.25)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="gpumesh-dashboard",
                                  daemon=True)
        self._serving = True
        thread.start()
        return thread

    def close(self) -> None:
        self.monitor.stop()
        if self._serving:  # shutdown() waits for serve_forever, which would never come
            self.httpd.shutdown()
        self.httpd.server_close()


class Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "gpumesh-dashboard"
    sys_version = ""
    timeout = 30  # seconds a silent connection holds its thread (a read or a send that stalls)

    @property
    def dashboard(self) -> Dashboard:
        return self.server.dashboard

    def setup(self) -> None:
        self._refused = False
        context = self.server.tls
        if context is not None:  # the handshake, here in this connection's thread
            self.request.settimeout(HANDSHAKE_SECONDS)
            if self._plain_http():
                self._refused = True
                return
            try:
                self.request = context.wrap_socket(self.request, server_side=True)
            except (OSError, ssl.SSLError, ValueError) as exc:  # silent, plain HTTP, or gone
                log.debug("dashboard: TLS handshake from %s failed: %s",
                          self.client_address[0], exc)
                self._refused = True
                return  # nothing to read or write: handle() and finish() do nothing
        super().setup()

    def _plain_http(self) -> bool:
        """A browser that asked for http:// on the HTTPS port: told, in plain HTTP, to use
        https:// (a TLS handshake starts with 0x16; a request with its method's letters)."""
        try:
            start = self.request.recv(8, socket.MSG_PEEK)
        except OSError:
            return False  # silent or gone: the handshake says so
        if not start or not start[:1].isalpha():
            return False
        body = (b"This dashboard is served over HTTPS: put https:// in front of the address "
                b"(the link the dashboard printed has it).\n")
        with contextlib.suppress(OSError):
            self.request.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; "
                                 b"charset=utf-8\r\nConnection: close\r\nContent-Length: "
                                 + str(len(body)).encode() + b"\r\n\r\n" + body)
        return True

    def handle(self) -> None:
        if not self._refused:
            super().handle()

    def finish(self) -> None:
        if self._refused:
            return
        try:
            super().finish()
        finally:
            if self.server.tls is not None:  # the server closes only the socket it accepted
                self.request.close()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        # The request line is anybody's on the network, before any check: written out, not
        # passed to the terminal that shows the log. Without its query: the printed link's
        # key travels in one, and a log may be read by others than the user who started it.
        line = format % args
        if "?" in line:
            line = _QUERY.sub(" ", line)
        log.debug("%s %s", self.address_string(), for_terminal(line))

    # ----------------------------------------------------------------- plumbing

    def _send(self, status: int, body: bytes = b"", content_type: str = "application/json",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in {**SECURITY_HEADERS, **(headers or {})}.items():
            self.send_header(name, value)
        self.send_header("Content-Type", f"{content_type}; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, data: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(data, default=str).encode(), headers=headers)

    def _redirect(self, where: str, headers: dict[str, str] | None = None) -> None:
        self._send(HTTPStatus.SEE_OTHER, b"", "text/plain", {"Location": where, **(headers or {})})

    def _sid(self) -> str | None:
        return self.dashboard.guard.session(
            cookie_value(self.headers.get("Cookie", ""), self.dashboard.guard.cookie))

    def _body(self) -> bytes | None:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            return None
        if not 0 <= length <= MAX_BODY:
            self.close_connection = True  # its body is not read: nothing more can follow it
            return None
        return self.rfile.read(length)

    def _host_ok(self) -> bool:
        if self.dashboard.guard.host_ok(self.headers.get("Host")):
            return True
        self._json(HTTPStatus.MISDIRECTED_REQUEST, {
            "error": "unknown Host: open the page at the address the dashboard printed, or by "
                     "this machine's IP address"})
        return False

    # ----------------------------------------------------------------- GET

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        if not self._host_ok():
            return
        guard = self.dashboard.guard
        url = urlsplit(self.path)
        sid = self._sid()
        if url.path in ("/app.js", "/style.css"):
            self._static(url.path)
        elif url.path == "/favicon.ico":  # the pages say href="data:,"; a direct ask gets nothing
            self._send(HTTPStatus.NO_CONTENT, b"", "image/x-icon")
        elif url.path == "/login":
            if sid is not None:
                self._redirect("/")
                return
            message = LOGIN_MESSAGES.get(url.query, "")
            page = self.dashboard.assets["login.html"].replace(
                b"<!--MESSAGE-->", message.encode())  # a fixed text: nothing is echoed
            self._send(HTTPStatus.OK, page, "text/html")
        elif url.path == "/":
            key = parse_qs(url.query).get("key", [""])[0] if url.query else ""
            if key:  # the printed link: a session from its key, and the key off the address bar
                if sid is not None:
                    self._redirect("/")
                elif guard.key_ok(key):
                    self._redirect("/", {"Set-Cookie": guard.set_cookie(guard.open_session())})
                else:
                    self._redirect("/login?key")
            elif sid is None:
                self._redirect("/login")
            else:
                self._static("/")
        elif sid is None:
            self._json(HTTPStatus.UNAUTHORIZED, {"error": "log in first", "login": "/login"})
        elif url.path == "/api/session":
            self._json(HTTPStatus.OK, {"csrf": guard.csrf(sid),
                                       "login_required": guard.login_required})
        elif url.path == "/api/stream":
            self._stream(sid)
        elif url.path == "/api/job":
            job = parse_qs(url.query).get("id", [""])[0][:200]
            self._answer(lambda: self.dashboard.monitor.job(job))
        elif url.path == "/api/task":
            task = parse_qs(url.query).get("id", [""])[0][:64]
            self._answer(lambda: self.dashboard.monitor.task(task))
        else:
            self._json(HTTPStatus.NOT_FOUND, {"error": "not found"})

    def _static(self, path: str, headers: dict[str, str] | None = None) -> None:
        name, kind = STATIC[path]
        self._send(HTTPStatus.OK, self.dashboard.assets[name], kind, headers)

    def _answer(self, work: Any) -> None:
        try:
            self._json(HTTPStatus.OK, work())
        except TooManyRequests:
            self._json(HTTPStatus.TOO_MANY_REQUESTS, {
                "error": "more details asked for than the mesh answers at once: try again in a "
                         "moment"}, {"Retry-After": "1"})
        except MeshError as exc:  # the coordinator's words: they never hold the token
            self._json(HTTPStatus.CONFLICT, {"error": str(exc)[:1000]})

    def _stream(self, sid: str) -> None:
        dashboard = self.dashboard
        with dashboard._lock:
            if dashboard.streams >= MAX_STREAMS:
                self._json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": "too many viewers"})
                return
            dashboard.streams += 1
        try:
            self.send_response(HTTPStatus.OK)
            for name, value in SECURITY_HEADERS.items():
                self.send_header(name, value)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            monitor = dashboard.monitor
            self._event("history", monitor.history_json())
            seen = -1
            # Until the session ends too (a log-out in another tab, its 12 hours over): the
            # browser's reconnect then meets the login like any other request.
            while not monitor.stopped and dashboard.guard.session(sid) is not None:
                version = monitor.wait_change(seen, KEEPALIVE)
                if version == seen:
                    self.wfile.write(b": keepalive\n\n")
                else:
                    seen = version
                    self._event("snapshot", monitor.encoded)
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the browser went away
        finally:
            with dashboard._lock:
                dashboard.streams -= 1

    def _event(self, kind: str, encoded: str) -> None:
        """One server-sent event; JSON has no raw newline, so one ``data`` line holds it."""
        self.wfile.write(f"event: {kind}\ndata: {encoded}\n\n".encode())

    # ----------------------------------------------------------------- POST

    def do_POST(self) -> None:
        if not self._host_ok():
            return
        guard = self.dashboard.guard
        if not guard.origin_ok(self.headers.get("Origin"), self.headers.get("Host")):
            self._json(HTTPStatus.FORBIDDEN, {"error": "cross-origin request refused"})
            return
        body = self._body()
        if body is None:
            self._json(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": "request too large"})
            return
        path = urlsplit(self.path).path
        if path == "/login":
            self._login(body)
            return
        sid = self._sid()
        if sid is None:
            self._json(HTTPStatus.UNAUTHORIZED, {"error": "log in first", "login": "/login"})
            return
        if not guard.csrf_ok(sid, self.headers.get("X-CSRF-Token")):
            self._json(HTTPStatus.FORBIDDEN, {"error": "missing or wrong CSRF token: reload"})
            return
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            request = None
        if not isinstance(request, dict):
            self._json(HTTPStatus.BAD_REQUEST, {"error": "send a JSON object"})
            return
        monitor = self.dashboard.monitor
        if path == "/logout":
            guard.close_session(sid)
            self._json(HTTPStatus.OK, {}, {"Set-Cookie": guard.clear_cookie()})
        elif path == "/api/cancel" and isinstance(request.get("job"), str):
            self._answer(lambda: monitor.cancel(request["job"][:200],
                                                force=request.get("force") is True))
        elif path == "/api/worker" and isinstance(request.get("worker"), str) \
                and request.get("action") in ("drain", "pause", "resume"):
            self._answer(lambda: monitor.steer(request["worker"][:200], request["action"]))
        else:
            self._json(HTTPStatus.NOT_FOUND, {"error": "no such action"})

    def _login(self, body: bytes) -> None:
        guard = self.dashboard.guard
        address = self.client_address[0]
        given = parse_qs(body.decode("utf-8", "replace")).get("token", [""])[0]
        outcome = guard.login(address, given.strip())
        if outcome == "blocked":
            self._redirect("/login?blocked")
            return
        if outcome != "ok":
            log.info("dashboard: a wrong token from %s", address)
            self._redirect("/login?failed")
            return
        self._redirect("/", {"Set-Cookie": guard.set_cookie(guard.open_session())})


_QUERY = re.compile(r"\?\S*\s")  # a request line's query, up to the space before HTTP/1.x


def cookie_value(header: str, name: str) -> str | None:
    """The value of cookie ``name`` in a Cookie header, read in one pass. Not SimpleCookie:
    the standard library's parser takes quadratic time on some inputs (CVE-2024-7592, fixed in
    Python 3.11.10 and 3.12.6) and ran before any login (60,000 bytes: 19 s of CPU). Other
    servers on 127.0.0.1 set cookies the browser sends here too, so the header may be long;
    this server's own value is URL-safe text and needs no unquoting."""
    for part in header.split(";"):
        key, sep, value = part.partition("=")
        if sep and key.strip() == name:
            return value.strip()
    return None
