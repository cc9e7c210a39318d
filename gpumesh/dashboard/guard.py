"""Who may see and steer the mesh through the dashboard: Host, login, session, CSRF, Origin.

- Host: only the names this server answers to (loopback names, the bound address, and on a
  wildcard bind this machine's names and any IP literal), so a DNS-rebinding page cannot
  reach a loopback dashboard under its own name.
- Login: the mesh token (compared with ``hmac.compare_digest``; failed tries limited per
  address and in all) opens a session: a random cookie, HttpOnly and SameSite=Strict, and
  Secure over TLS (off loopback the page is HTTPS: tls.py). On loopback the link the dashboard
  prints opens one too: its ``?key=`` is random, new with every start and printed only to the
  user who started it. Any other account on the machine can reach 127.0.0.1 but holds neither
  (the token is in files only its owner reads).
- Actions: POST with the session's CSRF token in ``X-CSRF-Token`` and an ``Origin`` of this
  very server, on loopback too: any page the user visits can POST to 127.0.0.1.

The token is held only to compare with; it never goes into a response, a log line or an error.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import socket
import threading
import time
from dataclasses import dataclass

SESSION_SECONDS = 12 * 3600
MAX_SESSIONS = 1000
FAILURE_WINDOW = 60.0  # seconds over which failed logins are counted
FAILURES_PER_ADDRESS = 5
FAILURES_IN_ALL = 30  # any addresses together: a spread-out guesser is slowed as well


@dataclass
class Session:
    created: float


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    return True


class Guard:
    def __init__(self, token: str, host: str, port: int, tls: bool = False) -> None:
        self._token = token.encode()
        self.tls = tls  # served over HTTPS: the cookie is Secure, the Origin is https://
        self.host = host
        self.port = port
        self.login_required = not is_loopback(host)
        # The printed link's key (loopback only: off it the link would travel in a URL to
        # another machine); compared in constant time, 144 random bits.
        self.key = secrets.token_urlsafe(18)
        self.cookie = f"gpumesh_dashboard_{port}"  # cookies ignore ports: one name per port
        self._secret = secrets.token_bytes(32)  # signs CSRF tokens; new with every start
        self._sessions: dict[str, Session] = {}
        self._failures: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        wildcard = host in ("", "0.0.0.0", "::", "*")
        self._wildcard = wildcard
        names = {"localhost", "127.0.0.1", "[::1]", host.lower(),
                 f"[{host.lower()}]" if ":" in host else host.lower()}
        if wildcard:  # this machine's own name, as the OS says it (no DNS lookup)
            hostname = socket.gethostname().lower()
            names |= {hostname, f"{hostname}.local"}
        self._names = names

    # ----------------------------------------------------------------- Host and Origin

    def host_ok(self, header: str | None) -> bool:
        """Whether ``Host`` names this server (the port must match too)."""
        if not header or len(header) > 300:
            return False
        name, _, port = header.lower().rpartition(":")
        if not name or "]" in port:  # no port: browsers leave out their scheme's default
            name, port = header.lower(), "443" if self.tls else "80"
        if port != str(self.port):
            return False
        if name in self._names or (name.startswith("127.") and _is_ip(name)):
            return True
        return self._wildcard and _is_ip(name)

    def origin_ok(self, origin: str | None, host: str | None) -> bool:
        """A state change must come from a page of this server: ``Origin`` is its own URL."""
        return bool(origin and host and self.host_ok(host)
                    and hmac.compare_digest(origin.lower(), f"{self.scheme}://{host.lower()}"))

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    # ----------------------------------------------------------------- sessions

    def session(self, cookie_value: str | None) -> str | None:
        """The session id a cookie proves, or None."""
        if not cookie_value or len(cookie_value) > 100:
            return None
        with self._lock:
            found = self._sessions.get(cookie_value)
            if found is None:
                return None
            if time.time() - found.created > SESSION_SECONDS:
                del self._sessions[cookie_value]
                return None
        return cookie_value

    def open_session(self) -> str:
        sid = secrets.token_urlsafe(32)
        with self._lock:
            if len(self._sessions) >= MAX_SESSIONS:  # the oldest go first
                for old in sorted(self._sessions, key=lambda k: self._sessions[k].created)[
                        :len(self._sessions) - MAX_SESSIONS + 1]:
                    del self._sessions[old]
            self._sessions[sid] = Session(time.time())
        return sid

    def close_session(self, sid: str) -> None:
        with self._lock:
            self._sessions.pop(sid, None)

    def set_cookie(self, sid: str) -> str:
        return (f"{self.cookie}={sid}; HttpOnly; SameSite=Strict; Path=/; "
                f"Max-Age={SESSION_SECONDS}{self._secure}")

    def clear_cookie(self) -> str:
        return f"{self.cookie}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0{self._secure}"

    @property
    def _secure(self) -> str:
        return "; Secure" if self.tls else ""  # over TLS, never sent back in the clear

    def csrf(self, sid: str) -> str:
        return hmac.new(self._secret, sid.encode(), hashlib.sha256).hexdigest()

    def csrf_ok(self, sid: str | None, given: str | None) -> bool:
        return bool(sid and given and len(given) <= 100
                    and hmac.compare_digest(given.encode(), self.csrf(sid).encode()))

    # ----------------------------------------------------------------- login

    def login(self, address: str, given: str) -> str:
        """A login try: ``"blocked"`` (too many wrong ones lately, from ``address`` or in all),
        ``"wrong"``, or ``"ok"``. The try is counted before the token is compared, under one
        lock with the check: parallel requests each passed the check before any was counted,
        32 guesses an address a minute instead of 5."""
        now = time.time()
        with self._lock:
            if len(self._failures) > 10_000:
                self._failures.clear()
            recent = sum(1 for tries in self._failures.values() for t in tries
                         if now - t < FAILURE_WINDOW)
            mine = [t for t in self._failures.get(address, []) if now - t < FAILURE_WINDOW]
            if len(mine) >= FAILURES_PER_ADDRESS or recent >= FAILURES_IN_ALL:
                return "blocked"
            self._failures[address] = [*mine, now]
        if not hmac.compare_digest(given.encode("utf-8", "replace"), self._token):
            return "wrong"
        with self._lock:  # the right token: its try does not count against anyone
            tries = self._failures.get(address, [])
            if now in tries:
                tries.remove(now)
        return "ok"

    def key_ok(self, given: str) -> bool:
        """Whether ``given`` is the printed link's key, and such a link opens a session here."""
        return not self.login_required and hmac.compare_digest(
            given.encode("utf-8", "replace"), self.key.encode())

