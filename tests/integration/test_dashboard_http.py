"""The dashboard's HTTP rules, without a browser: Host, login, cookie flags, CSRF and Origin,
security headers, and the token in no response. A stub mesh stands behind the page (the
browser tests use a live one); the CLI test runs ``gpumesh dashboard`` against a live mesh."""

from __future__ import annotations

import http.client
import json
import logging
import os
import queue
import re
import select
import signal
import socket
import ssl
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from conftest import wait_for

from gpumesh.dashboard import Dashboard, tls
from gpumesh.dashboard.guard import FAILURES_PER_ADDRESS, Guard
from gpumesh.dashboard.server import cookie_value as dashboard_cookie_value

TOKEN = "salt.s3cret-token-for-the-dashboard-tests"


class StubMesh:
    def __init__(self) -> None:
        self.cancelled: list[tuple[str, bool]] = []
        self.steered: list[tuple[str, str]] = []
        self.state = "alive"
        self.owner_holds = False  # its owner paused it on the machine: the mesh cannot resume it

    def workers(self) -> list[dict[str, Any]]:
        return [{"id": "w1", "hostname": "<img src=x onerror=alert(1)>", "alive": True,
                 "state": self.state, "running": 0, "slots": 1, "score": 1.0}]

    def status(self, job: str | None = None, *, tasks: bool = True) -> dict[str, Any]:
        if job:
            return {"job": job, "name": job, "tasks": []}
        return {"jobs": [], "counts": {}}

    def health(self) -> dict[str, Any]:
        return {"finished_total": 0}

    def events(self, since: int = 0) -> list[Any]:
        return []

    def cancel_job(self, job: str, *, force: bool = False) -> int:
        self.cancelled.append((job, force))
        return 2

    def steer_worker(self, worker: str, action: str) -> dict[str, Any]:
        self.steered.append((worker, action))
        if not self.owner_holds:
            self.state = {"drain": "draining", "pause": "paused"}.get(action, "alive")
        return {"worker": worker, "action": action}


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[tuple[Dashboard, StubMesh]]:
    stub = StubMesh()
    dashboard = Dashboard(stub, TOKEN, port=0, interval=0.2)  # type: ignore[arg-type]
    # Off loopback a login is asked; the test flips it rather than bind beyond loopback.
    dashboard.guard.login_required = getattr(request, "param", False)
    dashboard.start()
    try:
        yield dashboard, stub
    finally:
        dashboard.close()


class Browser:
    """http.client with full control of Host, Origin and cookies; every response kept. With
    ``trust`` (a CA file) it speaks HTTPS and checks the certificate names 127.0.0.1."""

    def __init__(self, port: int, trust: Path | None = None, timeout: float = 10) -> None:
        self.port = port
        self.host = f"127.0.0.1:{port}"
        self.cookie = ""
        self.seen: list[str] = []
        self.timeout = timeout
        self.context = ssl.create_default_context(cafile=str(trust)) if trust else None

    def request(self, method: str, path: str, body: bytes = b"", **headers: str
                ) -> tuple[http.client.HTTPResponse, bytes]:
        conn = (http.client.HTTPSConnection("127.0.0.1", self.port, timeout=self.timeout,
                                            context=self.context) if self.context
                else http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout))
        sent = {"Host": self.host, **({"Cookie": self.cookie} if self.cookie else {}),
                **{k.replace("_", "-"): v for k, v in headers.items()}}
        conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        data = response.read()
        conn.close()
        self.seen.append(str(response.headers) + data.decode("utf-8", "replace"))
        cookie = response.headers.get("Set-Cookie")
        if cookie:
            self.cookie = cookie.split(";", 1)[0]
        return response, data

    def post(self, path: str, data: dict[str, Any], **headers: str
             ) -> tuple[http.client.HTTPResponse, bytes]:
        return self.request("POST", path, json.dumps(data).encode(),
                            Content_Type="application/json", **headers)

    def open_link(self, url: str) -> http.client.HTTPResponse:
        """Open the link the dashboard printed, as its user's browser does: its key buys a
        session cookie, and the redirect takes the key off the address bar."""
        parts = urlsplit(url)
        response, _ = self.request("GET", f"{parts.path}?{parts.query}")
        assert response.status == 303 and response.headers["Location"] == "/", response.status
        return response

    def csrf(self) -> str:
        response, data = self.request("GET", "/api/session")
        assert response.status == 200
        return str(json.loads(data)["csrf"])


def test_the_page_has_its_security_headers_and_a_strict_cookie(served):
    dashboard, _ = served
    browser = Browser(dashboard.port)
    flags = [part.strip() for part in browser.open_link(dashboard.url).headers[
        "Set-Cookie"].split(";")]
    assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= set(flags)
    response, body = browser.request("GET", "/")
    assert response.status == 200 and b"/app.js" in body
    csp = response.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert "frame-ancestors 'none'" in csp
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert response.headers["X-Frame-Options"] == "DENY"
    assert b"<script>" not in body.replace(b'<script src="/app.js" defer></script>', b"")


@pytest.mark.parametrize("host", ["evil.example:{port}", "127.0.0.1:1", "", "localhost"])
def test_a_foreign_host_header_is_refused(served, host):
    dashboard, _ = served
    browser = Browser(dashboard.port)
    browser.host = host.format(port=dashboard.port)
    response, _ = browser.request("GET", "/")
    assert response.status == 421
    browser.host = f"localhost:{dashboard.port}"
    assert browser.request("GET", "/login")[0].status == 200


def test_actions_need_the_csrf_token_and_this_origin_even_on_loopback(served):
    dashboard, stub = served
    browser = Browser(dashboard.port)
    browser.open_link(dashboard.url)
    csrf = browser.csrf()
    origin = f"http://127.0.0.1:{dashboard.port}"
    refused = [
        browser.post("/api/cancel", {"job": "j"}, Origin=origin),  # no CSRF header
        browser.post("/api/cancel", {"job": "j"}, Origin=origin, X_CSRF_Token="0" * 64),
        browser.post("/api/cancel", {"job": "j"}, X_CSRF_Token=csrf),  # no Origin
        browser.post("/api/cancel", {"job": "j"}, Origin="http://evil.example",
                     X_CSRF_Token=csrf),
        browser.post("/api/cancel", {"job": "j"}, Origin=f"http://localhost:{dashboard.port}",
                     X_CSRF_Token=csrf),  # another origin of the same server
    ]
    assert [r.status for r, _ in refused] == [403] * 5 and stub.cancelled == []
    other = Browser(dashboard.port)  # another session's token does not open this one
    other.open_link(dashboard.url)
    assert other.post("/api/cancel", {"job": "j"}, Origin=origin,
                      X_CSRF_Token=csrf)[0].status == 403
    response, body = browser.post("/api/cancel", {"job": "j", "force": True}, Origin=origin,
                                  X_CSRF_Token=csrf)
    assert response.status == 200 and json.loads(body) == {"cancelled": 2}
    assert stub.cancelled == [("j", True)]
    response, body = browser.post("/api/worker", {"worker": "w1", "action": "drain"},
                                  Origin=origin, X_CSRF_Token=csrf)
    assert response.status == 200 and stub.steered == [("w1", "drain")]
    assert json.loads(body)["state"] == "draining" and json.loads(body)["held"] is False
    response, _ = browser.post("/api/worker", {"worker": "w1", "action": "kill"},
                               Origin=origin, X_CSRF_Token=csrf)
    assert response.status == 404
    assert browser.request("GET", "/api/cancel")[0].status == 404  # never by GET


def test_a_resume_the_workers_owner_overrules_is_reported_as_held(served):
    dashboard, stub = served
    stub.state, stub.owner_holds = "paused", True
    dashboard.monitor.steer_wait = 1.0  # how long the answer waits for a state that won't come
    browser = Browser(dashboard.port)
    browser.open_link(dashboard.url)
    wait_for(lambda: dashboard.monitor._state_of("w1") == "paused", 10, "the paused worker")
    response, body = browser.post("/api/worker", {"worker": "w1", "action": "resume"},
                                  Origin=f"http://127.0.0.1:{dashboard.port}",
                                  X_CSRF_Token=browser.csrf())
    answer = json.loads(body)
    assert response.status == 200 and answer["held"] is True and answer["state"] == "paused"


def test_the_favicon_is_no_404(served):
    dashboard, _ = served
    response, body = Browser(dashboard.port).request("GET", "/favicon.ico")
    assert response.status == 204 and body == b""
    browser = Browser(dashboard.port)
    browser.open_link(dashboard.url)
    page = browser.request("GET", "/")[1]
    assert b'<link rel="icon" href="data:,">' in page  # img-src allows data: (the CSP)


def test_details_past_the_browsers_share_are_too_many_requests(served):
    dashboard, _ = served
    browser = Browser(dashboard.port)
    browser.open_link(dashboard.url)
    answers = [browser.request("GET", f"/api/job?id=j{i}") for i in range(30)]
    assert answers[0][0].status == 200
    refused = [(response, body) for response, body in answers if response.status == 429]
    assert refused, [response.status for response, _ in answers]
    response, body = refused[0]
    assert response.headers["Retry-After"] == "1" and b"try again in a moment" in body


def test_a_live_stream_ends_when_its_session_does(served):
    dashboard, _ = served
    browser = Browser(dashboard.port)
    browser.open_link(dashboard.url)
    csrf = browser.csrf()
    stream = http.client.HTTPConnection("127.0.0.1", dashboard.port, timeout=10)
    stream.request("GET", "/api/stream", headers={"Host": browser.host, "Cookie": browser.cookie})
    response = stream.getresponse()
    assert response.status == 200 and response.readline() == b"event: history\n"
    origin = f"http://127.0.0.1:{dashboard.port}"
    # Logged out in another tab: the open stream must not go on showing the mesh.
    assert browser.post("/logout", {}, Origin=origin, X_CSRF_Token=csrf)[0].status == 200
    ended = threading.Event()

    def read_to_the_end() -> None:
        response.read()  # returns once the server closes the stream
        ended.set()

    threading.Thread(target=read_to_the_end, daemon=True).start()
    assert ended.wait(5), "the stream outlived its session"
    stream.close()


@pytest.mark.parametrize("served", [True], indirect=True)
def test_off_loopback_the_token_is_asked_and_never_shown(served):
    dashboard, _ = served
    browser = Browser(dashboard.port)
    origin = f"http://127.0.0.1:{dashboard.port}"
    response, _ = browser.request("GET", "/")
    assert response.status == 303 and response.headers["Location"] == "/login"
    assert browser.request("GET", "/api/session")[0].status == 401
    assert browser.request("GET", "/api/stream")[0].status == 401
    response, _ = browser.request("GET", "/login?failed")
    assert response.status == 200
    form = b"token=wrong"
    response, _ = browser.request("POST", "/login", form, Origin=origin,
                                  Content_Type="application/x-www-form-urlencoded")
    assert response.headers["Location"] == "/login?failed" and not browser.cookie
    response, _ = browser.request("POST", "/login", f"token={TOKEN}".encode(),
                                  Content_Type="application/x-www-form-urlencoded")
    assert response.status == 403 and not browser.cookie  # no Origin: refused
    response, _ = browser.request("POST", "/login", f"token={TOKEN}".encode(), Origin=origin,
                                  Content_Type="application/x-www-form-urlencoded")
    assert response.headers["Location"] == "/" and browser.cookie
    flags = response.headers["Set-Cookie"]
    assert "HttpOnly" in flags and "SameSite=Strict" in flags
    csrf = browser.csrf()
    assert browser.request("GET", "/")[0].status == 200
    assert browser.post("/logout", {}, Origin=origin, X_CSRF_Token=csrf)[0].status == 200
    assert browser.request("GET", "/api/session")[0].status == 401
    assert not any(TOKEN in text or TOKEN.split(".")[1] in text for text in browser.seen)


@pytest.mark.parametrize("served", [True], indirect=True)
def test_failed_logins_are_limited(served):
    dashboard, _ = served
    browser = Browser(dashboard.port)
    origin = f"http://127.0.0.1:{dashboard.port}"
    for _ in range(FAILURES_PER_ADDRESS):
        browser.request("POST", "/login", b"token=guess", Origin=origin)
    response, _ = browser.request("POST", "/login", f"token={TOKEN}".encode(), Origin=origin)
    assert response.headers["Location"] == "/login?blocked" and not browser.cookie


def test_on_loopback_only_the_printed_link_or_the_token_opens_the_page(served):
    # Every account on the machine reaches 127.0.0.1; a visit used to get a session by itself,
    # so another local user could read job data, cancel jobs and drain workers.
    dashboard, stub = served
    origin = f"http://127.0.0.1:{dashboard.port}"
    stranger = Browser(dashboard.port)
    response, _ = stranger.request("GET", "/")
    assert response.status == 303 and response.headers["Location"] == "/login"
    assert not stranger.cookie and stranger.request("GET", "/api/session")[0].status == 401
    response, _ = stranger.request("GET", "/?key=" + "A" * len(dashboard.guard.key))
    assert response.headers["Location"] == "/login?key" and not stranger.cookie
    assert b"its key changes" in stranger.request("GET", "/login?key")[1]
    assert stranger.post("/api/cancel", {"job": "j"}, Origin=origin)[0].status == 401
    assert stub.cancelled == []
    # The printed link opens it; the mesh token at the login page too.
    Browser(dashboard.port).open_link(dashboard.url)
    user = Browser(dashboard.port)
    response, _ = user.request("POST", "/login", f"token={TOKEN}".encode(), Origin=origin,
                               Content_Type="application/x-www-form-urlencoded")
    assert response.headers["Location"] == "/" and user.cookie
    assert user.request("GET", "/")[0].status == 200
    assert user.request("GET", "/login")[0].status == 303  # already in
    # Off loopback no link is printed with a key, and a key opens nothing.
    dashboard.guard.login_required = True
    assert "?key=" not in dashboard.url
    response, _ = Browser(dashboard.port).request("GET", "/?key=" + dashboard.guard.key)
    assert response.headers["Location"] == "/login?key"


def test_a_long_cookie_header_is_read_in_one_pass_and_keeps_the_session(served):
    # The standard library's cookie parser is quadratic on some inputs (CVE-2024-7592): 60,000
    # bytes cost 19 s of CPU before any login. Refusing long headers instead locked out a
    # browser carrying other 127.0.0.1 servers' cookies (Jupyter's), in a silent login loop.
    dashboard, _ = served
    browser = Browser(dashboard.port)
    browser.open_link(dashboard.url)
    own = browser.cookie
    browser.cookie = "; ".join([f"username-127-0-0-1-{n}=" + "x" * 300 for n in range(12)]
                               + [own, "pad=" + "\\" * 30_000])
    assert browser.request("GET", "/api/session")[0].status == 200
    assert dashboard_cookie_value(f"a=1; {own}; b=2", dashboard.guard.cookie) == \
        own.split("=", 1)[1]


def test_a_peer_that_drops_its_connection_leaves_no_traceback(served, capsys):
    dashboard, _ = served
    try:
        raise ConnectionResetError(104, "Connection reset by peer")
    except ConnectionResetError:
        dashboard.httpd.handle_error(None, ("127.0.0.1", 5555))
    assert "Traceback" not in capsys.readouterr().err


def test_a_bind_beyond_loopback_requires_login():
    assert Guard(TOKEN, "0.0.0.0", 8265).login_required
    assert Guard(TOKEN, "192.0.2.7", 8265).login_required
    assert not Guard(TOKEN, "127.0.0.1", 8265).login_required
    wildcard = Guard(TOKEN, "0.0.0.0", 8265)
    assert wildcard.host_ok("192.0.2.7:8265") and not wildcard.host_ok("evil.example:8265")
    assert Guard(TOKEN, "::1", 8265).host_ok("[::1]:8265")


def test_gpumesh_dashboard_prints_its_link_to_a_terminal_serves_and_stops(mesh_env):
    import pty

    coordinator = mesh_env.start_coordinator()
    env = {**os.environ, **mesh_env.env, "GPUMESH_TOKEN": mesh_env.token}
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "dashboard", "--url", coordinator.url,
         "--dashboard-port", "0"], env=env, stdout=follower, stderr=follower)
    os.close(follower)
    out = ""

    def read_some() -> str:
        nonlocal out
        if select.select([leader], [], [], 0.2)[0]:
            try:
                out += os.read(leader, 4096).decode(errors="replace")
            except OSError:  # the terminal closed with the process
                pass
        return out

    try:
        found = wait_for(lambda: re.search(r"(http://127\.0\.0\.1:(\d+)/\?key=[\w-]+)",
                                           read_some()), 30, "the dashboard's link")
        browser = Browser(int(found.group(2)))  # type: ignore[union-attr]
        assert browser.request("GET", "/")[0].status == 303  # not without the link's key
        browser.open_link(found.group(1))  # type: ignore[union-attr]
        assert browser.request("GET", "/")[0].status == 200
        assert browser.request("GET", "/api/session")[0].status == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0
        wait_for(lambda: "dashboard stopped" in read_some(), 10, "the goodbye")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    assert mesh_env.token not in out


def test_the_dashboard_key_stays_out_of_output_that_is_not_a_terminal_and_of_logs(
        mesh_env, caplog):
    # A log, journald or `docker logs` may be read by others than the user who started it.
    coordinator = mesh_env.start_coordinator()
    env = {**os.environ, **mesh_env.env, "GPUMESH_TOKEN": mesh_env.token}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "dashboard", "--url", coordinator.url,
         "--dashboard-port", "0"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline() + proc.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert found and "?key=" not in line and "Log in with the mesh token" in line, line
        browser = Browser(int(found.group(1)))
        origin = f"http://127.0.0.1:{found.group(1)}"
        response, _ = browser.request("POST", "/login", f"token={mesh_env.token}".encode(),
                                      Origin=origin,
                                      Content_Type="application/x-www-form-urlencoded")
        assert response.headers["Location"] == "/" and browser.request("GET", "/")[0].status == 200
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert mesh_env.token not in line + rest
    # Nor does a request line with the key reach the log.
    stub = StubMesh()
    dashboard = Dashboard(stub, TOKEN, port=0, interval=0.2)  # type: ignore[arg-type]
    dashboard.start()
    try:
        with caplog.at_level(logging.DEBUG, "gpumesh.dashboard"):
            Browser(dashboard.port).open_link(dashboard.url)
        assert "GET /" in caplog.text and dashboard.guard.key not in caplog.text
    finally:
        dashboard.close()


@pytest.mark.parametrize("with_tls", [False, True], ids=["http", "given-certificate"])
def test_serve_dashboard_starts_the_page_beside_the_coordinator_and_stops_with_it(tmp_path,
                                                                                   with_tls):
    env = {**os.environ, "GPUMESH_HOME": str(tmp_path), "GPUMESH_TOKEN": TOKEN}
    flags: list[str] = []
    trust, scheme = None, "http"
    if with_tls:  # the user's pair, passed on to the dashboard's own process
        need_openssl()
        (tmp_path / "mine").mkdir(mode=0o700)
        made = tls.self_signed(tmp_path / "mine", "127.0.0.1")
        flags = ["--dashboard-cert", str(made.cert), "--dashboard-key", str(made.key)]
        trust, scheme = made.cert, "https"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "serve", "--port", "0", "--db", ":memory:",
         "--no-self-worker", "--no-save", "--dashboard", "--dashboard-port", "0", *flags],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or []],
                              daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        def dashboard_line() -> re.Match[str] | None:
            while not lines.empty():
                seen.append(lines.get())
                found = re.search(rf"Dashboard on {scheme}://127\.0\.0\.1:(\d+)/", seen[-1])
                if found:
                    return found
            return None

        link = wait_for(dashboard_line, 30, "the dashboard's URL")
        port = int(link.group(1))  # type: ignore[attr-defined]
        browser = Browser(port, trust=trust)
        # Its output is a pipe, not a terminal: no key is printed, the token logs in.
        response, _ = browser.request("POST", "/login", f"token={TOKEN}".encode(),
                                      Origin=f"{scheme}://127.0.0.1:{port}",
                                      Content_Type="application/x-www-form-urlencoded")
        assert response.headers["Location"] == "/", response.status
        assert browser.request("GET", "/")[0].status == 200
        assert browser.request("GET", "/api/session")[0].status == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0

        def closed() -> bool:
            try:
                Browser(port, trust=trust).request("GET", "/")
            except OSError:
                return True
            return False

        wait_for(closed, 15, "the dashboard to stop with serve")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(10)
        if proc.stdout is not None:
            proc.stdout.close()
    assert TOKEN not in "".join(seen)


# ------------------------------------------------------------------ HTTPS off loopback
# The socket stays on 127.0.0.1 (TESTING.md); login is forced on as for a bind beyond it.


def need_openssl() -> None:
    """The certificate is made by the openssl command: skip without it, fail under CI."""
    if tls.shutil.which("openssl") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("openssl is missing: CI installs it")
        pytest.skip("openssl is not installed")


@pytest.fixture
def tls_served(tmp_path: Path) -> Iterator[tuple[Dashboard, tls.Certificate]]:
    need_openssl()
    made = tls.self_signed(tmp_path, "127.0.0.1")
    dashboard = Dashboard(StubMesh(), TOKEN, port=0, interval=0.2,  # type: ignore[arg-type]
                          tls=tls.server_context(made.cert, made.key))
    dashboard.guard.login_required = True
    dashboard.start()
    try:
        yield dashboard, made
    finally:
        dashboard.close()


def test_the_certificate_is_made_once_per_machine_with_a_private_key(tmp_path):
    need_openssl()
    first = tls.self_signed(tmp_path, "127.0.0.1")
    assert first.generated and first.key.parent == tmp_path
    assert stat.S_IMODE(first.key.stat().st_mode) == 0o600
    again = tls.self_signed(tmp_path, "127.0.0.1")
    assert not again.generated and again.fingerprint == first.fingerprint
    assert stat.S_IMODE(again.key.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == [tls.CERT_FILE, tls.KEY_FILE]
    assert re.fullmatch(r"([0-9A-F]{2}:){31}[0-9A-F]{2}", first.fingerprint)
    # Bound to an address the certificate does not name: made again, naming it (no socket).
    other = tls.self_signed(tmp_path, "192.0.2.7")
    assert other.generated and other.fingerprint != first.fingerprint
    assert not tls.self_signed(tmp_path, "192.0.2.7").generated
    assert "192.0.2.7" in tls.names_for("192.0.2.7")[1]


def test_a_certificate_about_to_expire_is_made_again(tmp_path, monkeypatch):
    need_openssl()
    monkeypatch.setattr(tls, "CERT_DAYS", 1)  # expires within RENEW_SECONDS of being made
    first = tls.self_signed(tmp_path, "127.0.0.1")
    again = tls.self_signed(tmp_path, "127.0.0.1")
    assert again.generated and again.fingerprint != first.fingerprint


def test_a_pair_that_does_not_load_is_made_again(tmp_path):
    # Two starts at one moment can leave one's key beside the other's certificate.
    need_openssl()
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir(mode=0o700)
    elsewhere.mkdir()
    first = tls.self_signed(home, "0.0.0.0")
    other = tls.self_signed(elsewhere, "0.0.0.0")
    first.key.write_bytes(other.key.read_bytes())
    prepared = tls.prepare("0.0.0.0", home, None, None)
    assert prepared is not None
    context, chosen = prepared
    assert chosen.generated and chosen.fingerprint not in (first.fingerprint, other.fingerprint)
    assert isinstance(context, ssl.SSLContext)


def test_over_tls_the_login_works_and_the_cookie_is_secure(tls_served):
    dashboard, made = tls_served
    assert dashboard.url == f"https://127.0.0.1:{dashboard.port}/"
    browser = Browser(dashboard.port, trust=made.cert)  # checks the name 127.0.0.1 too
    response, _ = browser.request("GET", "/")
    assert response.status == 303 and response.headers["Location"] == "/login"
    form = f"token={TOKEN}".encode()
    response, _ = browser.request("POST", "/login", form,
                                  Origin=f"http://127.0.0.1:{dashboard.port}")
    assert response.status == 403 and not browser.cookie  # an http:// page is another origin
    origin = f"https://127.0.0.1:{dashboard.port}"
    response, _ = browser.request("POST", "/login", form, Origin=origin)
    assert response.headers["Location"] == "/"
    flags = [part.strip() for part in response.headers["Set-Cookie"].split(";")]
    assert {"Secure", "HttpOnly", "SameSite=Strict"} <= set(flags)
    csrf = browser.csrf()
    response, _ = browser.post("/logout", {}, Origin=origin, X_CSRF_Token=csrf)
    assert response.status == 200 and "Secure" in response.headers["Set-Cookie"]
    with socket.create_connection(("127.0.0.1", dashboard.port), timeout=10) as raw, \
            browser.context.wrap_socket(raw, server_hostname="127.0.0.1") as wrapped:  # type: ignore[union-attr]
        served = wrapped.getpeercert(binary_form=True)
    assert served is not None
    assert tls.hashlib.sha256(served).hexdigest().upper() == made.fingerprint.replace(":", "")


def test_plain_http_to_the_tls_port_is_told_to_use_https(tls_served):
    # A browser given http:// got a reset connection and no word of why.
    dashboard, _ = tls_served
    response, body = Browser(dashboard.port).request("GET", "/login")
    assert response.status == 400 and b"served over HTTPS: put https://" in body
    assert b"csrf" not in body.lower() and TOKEN.encode() not in body  # nothing of the page


def test_a_silent_client_does_not_hold_up_another(tls_served):
    dashboard, made = tls_served
    with socket.create_connection(("127.0.0.1", dashboard.port), timeout=10):
        # Says nothing: its handshake waits in its own thread, HANDSHAKE_SECONDS at most.
        browser = Browser(dashboard.port, trust=made.cert, timeout=5)
        response, _ = browser.request("GET", "/login")
        assert response.status == 200


def test_off_loopback_without_openssl_the_dashboard_refuses_to_start(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {**os.environ, "GPUMESH_HOME": str(tmp_path / "home"), "GPUMESH_TOKEN": TOKEN,
           "PATH": str(empty)}
    # 192.0.2.7 (TEST-NET) is never bound: the refusal comes before any socket.
    done = subprocess.run(
        [sys.executable, "-m", "gpumesh", "dashboard", "--url", "tcp://127.0.0.1:9",
         "--dashboard-host", "192.0.2.7", "--dashboard-port", "0"],
        env=env, capture_output=True, text=True, timeout=60)
    out = (done.stdout + done.stderr).strip()
    assert done.returncode != 0
    assert len(out.splitlines()) == 1, out
    assert "--dashboard-cert FILE --dashboard-key FILE" in out
    assert "ssh -L 8265:127.0.0.1:8265" in out and "openssl" in out
    assert TOKEN not in out
