"""The worker's local control channel: ``gpumesh pause|resume|drain`` on the worker's own machine.

Borrowing a friend's GPU must be polite, so the machine's owner can take it back without the
coordinator's token. Each running worker listens on a loopback port and registers itself in
``GPUMESH_HOME/workers/ID.json`` (owner-only permissions) with a random secret; a command reads
the registry and must present that secret, so only the user who runs the worker can steer it.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq

from ..config import ensure_home
from ..processes import is_alive

log = logging.getLogger("gpumesh.worker")

ACTIONS = ("pause", "resume", "drain", "drain-now", "status")
MAX_REQUEST_BYTES = 4096
# Requests answered in one turn of the agent's loop, at most: any local user can send them,
# and a flood must not keep the loop from its coordinator and its runners.
MAX_REQUESTS_PER_TURN = 64
REGISTRY = "workers"


def registry_dir(home: Path) -> Path:
    return home / REGISTRY


class ControlServer:
    """The listening side, owned and polled by the worker agent's loop."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], home: Path, worker_id: str,
                 url: str) -> None:
        self.secret = secrets.token_hex(16)
        self.sock = ctx.socket(zmq.REP)
        self.sock.linger = 0
        self.sock.maxmsgsize = MAX_REQUEST_BYTES  # any local user can connect: keep it cheap
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        folder = registry_dir(ensure_home(home))  # GPUMESH_HOME itself 0700, not just this
        folder.mkdir(exist_ok=True, mode=0o700)
        self.path = folder / f"{worker_id}.json"
        entry = {"worker": worker_id, "pid": os.getpid(), "port": port, "secret": self.secret,
                 "url": url, "started": time.time()}
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(entry, handle)

    def serve(self, handle: Callable[[str], dict[str, Any]]) -> None:
        """Answer the requests waiting on the socket with ``handle(action)``, up to
        MAX_REQUESTS_PER_TURN (the rest wait for the next turn).

        Anything may arrive here (any local user can connect), so every request gets exactly
        one reply, whatever it holds, and nothing it holds can raise out of here.
        """
        for _ in range(MAX_REQUESTS_PER_TURN):
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                answer = self._answer(parts, handle)
            except Exception as exc:  # a bug in handling must not stop the worker
                log.exception("local control request failed")
                answer = {"error": f"the worker could not do that: {exc}"}
            self.sock.send(msgpack.packb(answer, use_bin_type=True))

    def _answer(self, parts: list[bytes], handle: Callable[[str], dict[str, Any]]
                ) -> dict[str, Any]:
        try:
            request = msgpack.unpackb(parts[0], raw=False) if len(parts) == 1 else None
        except Exception:
            request = None
        if not isinstance(request, dict):
            return {"error": "unreadable request"}
        secret, action = request.get("secret"), request.get("action")
        if not isinstance(secret, str) or not hmac.compare_digest(
                secret.encode("utf-8", "replace"), self.secret.encode()):
            return {"error": "wrong secret: run the command as the user who runs the worker"}
        if action not in ACTIONS:
            return {"error": f"unknown action {action!r}"}
        return handle(str(action))

    def close(self) -> None:
        self.sock.close()
        try:
            self.path.unlink()
        except OSError:
            pass


def local_workers(home: Path) -> list[dict[str, Any]]:
    """Workers registered on this machine under ``home`` whose process still runs."""
    found = []
    folder = registry_dir(home)
    if not folder.is_dir():
        return []
    for path in sorted(folder.glob("*.json")):
        try:
            entry = json.loads(path.read_text())
            pid = int(entry["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not is_alive(pid):
            try:
                path.unlink()  # left behind by a worker that was killed
            except OSError:
                pass
            continue
        found.append(entry)
    return found


def is_registered(home: Path, worker_id: str) -> bool:
    """Whether the worker still announces itself (it removes its entry as it leaves)."""
    return (registry_dir(home) / f"{worker_id}.json").exists()


def send(entry: dict[str, Any], action: str, timeout: float = 5.0) -> dict[str, Any]:
    """Ask one local worker; the answer, or ``{'error': ...}`` when it does not answer."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.linger = 0
    try:
        sock.connect(f"tcp://127.0.0.1:{int(entry['port'])}")
        sock.send(msgpack.packb({"secret": entry["secret"], "action": action}, use_bin_type=True))
        if not sock.poll(int(timeout * 1000)):
            return {"error": f"worker {entry['worker']} did not answer within {timeout:g}s"}
        return msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close()
