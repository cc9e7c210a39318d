"""A client process for fault tests that need one inside a network namespace.

It reads one JSON request per line on stdin and answers one JSON line on stdout:
``{"value": ...}`` or ``{"error": "..."}``. The token comes from GPUMESH_TOKEN.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

import faulttasks
import zmq
from zmq.utils.monitor import recv_monitor_message

from gpumesh.client import GPUMesh
from gpumesh.config import Settings
from gpumesh.security import configure_client, derive_keys

mesh: GPUMesh | None = None
jobs: dict[str, list[Any]] = {}

EVENTS = {
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "ok",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no_detail",
}


def connect(url: str) -> bool:
    global mesh
    mesh = GPUMesh(url, os.environ["GPUMESH_TOKEN"], quiet=True, settings=Settings.from_env())
    return mesh.connect(timeout=20)


def workers() -> list[dict[str, Any]]:
    assert mesh is not None
    return mesh.workers()


def submit(name: str, n: int, log_dir: str, delay: float) -> int:
    assert mesh is not None
    jobs[name] = mesh.submit_calls(faulttasks.record_square,
                                   [((i, log_dir, delay), {}) for i in range(n)])
    return len(jobs[name])


def progress(name: str) -> int:
    return sum(1 for f in jobs[name] if f.done())


def gather(name: str, timeout: float) -> dict[str, Any]:
    assert mesh is not None
    futures = jobs[name]
    results = mesh.gather(futures, timeout=timeout)
    return {"results": results, "task_ids": [f.task_id for f in futures],
            "workers": [f.worker for f in futures]}


def handshake(url: str, key: str, timeout: float) -> str:
    """One CURVE handshake with the right client key or a random one: what the client saw."""
    keys = derive_keys(os.environ["GPUMESH_TOKEN"])
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.reconnect_ivl = 60_000  # one attempt: no automatic retry inside the deadline
        configure_client(sock, keys)
        if key == "wrong":
            public, secret = zmq.curve_keypair()
            sock.curve_publickey, sock.curve_secretkey = public, secret
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                          | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                          | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                          | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                          | zmq.EVENT_DISCONNECTED)
        sock.connect(url)
        deadline = time.time() + timeout
        try:
            while time.time() < deadline:
                if not monitor.poll(int(max(deadline - time.time(), 0) * 1000) + 1):
                    break
                event = recv_monitor_message(monitor)
                if event["event"] in EVENTS:
                    name = EVENTS[event["event"]]
                    return name if name == "ok" else f"{name}:{event['value']}"
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    return "disconnected"
            return "timeout"
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
    finally:
        ctx.term()


OPS = {"connect": connect, "workers": workers, "submit": submit, "progress": progress,
       "gather": gather, "handshake": handshake}


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        if op == "quit":
            break
        try:
            reply = {"value": OPS[op](**request)}
        except Exception as exc:  # report, keep serving: the test decides what it means
            reply = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    if mesh is not None:
        mesh.close()


if __name__ == "__main__":
    main()
