"""``--two-hosts``: 64 MiB round trips between two network namespaces joined by a veth pair.

gpumesh (coordinator and worker in namespace A, client in B) next to a plain pyzmq CURVE pair
and a plain unencrypted pyzmq pair between the same namespaces. Needs root and ``ip netns``;
the namespaces, the veth pair and the guard route are removed whatever happens.

As a module it is the processes that run inside a namespace:

    python -m bench.twohosts echo-server PORT [curve]
    python -m bench.twohosts echo-client URL BYTES REPEATS [curve]
    python -m bench.twohosts gpumesh-client URL BYTES REPEATS
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from .params import Params
from .procs import python_env, python_exe, spawn, stop_group
from .systems.gpumesh_system import Mesh
from .tasks import echo

PORT = 47000
TIMEOUT = 300


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Lab:
    """Two namespaces, a veth pair between them, and an unreachable route for the lab subnet
    in the root namespace, so that a process started outside the lab cannot send there."""

    def __init__(self) -> None:
        tag = secrets.token_hex(2)
        self.a, self.b = f"gmb{tag}a", f"gmb{tag}b"
        octet = int(tag, 16) % 250 + 1
        self.subnet = f"10.250.{octet}.0/24"
        self.addr_a, self.addr_b = f"10.250.{octet}.1", f"10.250.{octet}.2"
        self.guarded = False

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0:
            return "needs root (network namespaces)"
        if shutil.which("ip") is None:
            return "needs iproute2's ip command"
        return None

    def __enter__(self) -> Lab:
        try:
            _ip("netns", "add", self.a)
            _ip("netns", "add", self.b)
            _ip("link", "add", "v" + self.a, "netns", self.a, "type", "veth", "peer", "name",
                "v" + self.b, "netns", self.b)
            for ns, addr in ((self.a, self.addr_a), (self.b, self.addr_b)):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "v" + ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", "v" + ns, "up")
            self.guarded = _ip("route", "add", "unreachable", self.subnet, check=False).returncode == 0
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in (self.a, self.b):
            _ip("netns", "del", ns, check=False)
        if self.guarded:
            _ip("route", "del", "unreachable", self.subnet, check=False)

    def prefix(self, ns: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", ns)


def run_two_hosts(params: Params, *, log: Callable[[str], None]) -> dict[str, Any]:
    reason = Lab.unavailable()
    if reason is not None:
        log(f"two hosts: skipped ({reason})")
        return {"skipped": reason}
    rows = []
    try:
        with Lab() as lab:
            log(f"two hosts: namespaces {lab.a} ({lab.addr_a}) and {lab.b} ({lab.addr_b})")
            for name, curve in (("plain pyzmq pair, unencrypted", False),
                                ("plain pyzmq pair, CURVE", True)):
                rows.append({"name": name, **_pair(lab, params, curve)})
                log(f"two hosts: {name} done")
            rows.append({"name": "gpumesh (coordinator + worker in A, client in B)",
                         **_gpumesh(lab, params)})
            log("two hosts: gpumesh done")
    except Exception as exc:
        log(f"two hosts: FAILED: {type(exc).__name__}: {exc}")
        rows.append({"name": "failed", "note": f"{type(exc).__name__}: {exc}"})
    return {"rows": rows}


def _client_result(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    proc = spawn(args, env=env, stdout_pipe=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        stop_group(proc)
    lines = out.decode().strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the client in the namespace failed (exit {proc.returncode})")
    return dict(json.loads(lines[-1]))


def _pair(lab: Lab, params: Params, curve: bool) -> dict[str, Any]:
    server_public, server_secret = zmq.curve_keypair()
    env = python_env({"BENCH_SERVER_PUBLIC": server_public.decode(),
                      "BENCH_SERVER_SECRET": server_secret.decode()})
    flag = ["curve"] if curve else []
    server = spawn([*lab.prefix(lab.a), python_exe(), "-m", "bench.twohosts", "echo-server",
                    str(PORT), *flag], env=env)
    try:
        return _client_result([*lab.prefix(lab.b), python_exe(), "-m", "bench.twohosts",
                               "echo-client", f"tcp://{lab.addr_a}:{PORT}",
                               str(params.big_bytes), str(params.big_repeats), *flag], env)
    finally:
        stop_group(server)


def _gpumesh(lab: Lab, params: Params) -> dict[str, Any]:
    from gpumesh.tokens import new_token

    mesh = Mesh(new_token(), Path(tempfile.mkdtemp(prefix="gpumesh-bench-")), PORT + 1,
                host=lab.addr_a)
    try:
        mesh.start_coordinator(prefix=lab.prefix(lab.a))
        mesh.wait_listening()
        mesh.add_worker(prefix=lab.prefix(lab.a))
        # Namespaces share /dev/shm, which two real hosts do not: the client in B must not use
        # the coordinator's shared-memory folder, or nothing would cross the veth.
        return _client_result([*lab.prefix(lab.b), python_exe(), "-m", "bench.twohosts",
                               "gpumesh-client", mesh.url, str(params.big_bytes),
                               str(params.big_repeats)],
                              {**mesh.env(), "GPUMESH_SHARED_MEMORY": "0"})
    finally:
        mesh.stop()


# ----------------------------------------------------------------- inside a namespace

def _keys_socket(ctx: zmq.Context[zmq.Socket[bytes]], kind: int, curve: bool,
                 server: bool) -> zmq.Socket[bytes]:
    sock = ctx.socket(kind)
    sock.linger = 0
    if curve:
        public = os.environ["BENCH_SERVER_PUBLIC"].encode()
        if server:
            sock.curve_secretkey = os.environ["BENCH_SERVER_SECRET"].encode()
            sock.curve_publickey = public
            sock.curve_server = True
        else:
            sock.curve_serverkey = public
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    return sock


def echo_server(port: int, curve: bool) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = _keys_socket(ctx, zmq.ROUTER, curve, server=True)
    sock.bind(f"tcp://*:{port}")
    while True:
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)


def echo_client(url: str, size: int, repeats: int, curve: bool) -> dict[str, Any]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = _keys_socket(ctx, zmq.DEALER, curve, server=False)
    sock.rcvtimeo = TIMEOUT * 1000
    sock.connect(url)
    sock.send(b"warm")
    sock.recv()
    payload = bytes(size)
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        sock.send(payload, copy=False)
        back = sock.recv(copy=False)
        timings.append(time.perf_counter() - started)
        assert len(back) == size
    return {"mb_s": 2 * size / min(timings) / 1e6, "seconds": timings}


def gpumesh_client(url: str, size: int, repeats: int) -> dict[str, Any]:
    from .measure import filled
    from .systems.gpumesh_system import wait_for_workers

    home = tempfile.mkdtemp(prefix="gpumesh-bench-client-")
    os.environ["GPUMESH_HOME"] = home
    from gpumesh import GPUMesh

    with GPUMesh(url, os.environ["GPUMESH_TOKEN"], quiet=True, connect_timeout=30) as mesh:
        wait_for_workers(mesh, 1)
        mesh.submit(echo, b"warm").result(TIMEOUT)
        payload = filled(size, 1)
        timings = []
        for _ in range(repeats):
            started = time.perf_counter()
            back = mesh.submit(echo, payload).result(TIMEOUT)
            timings.append(time.perf_counter() - started)
            assert len(back) == size
    shutil.rmtree(home, ignore_errors=True)
    return {"mb_s": 2 * size / min(timings) / 1e6, "seconds": timings}


def _main(argv: list[str]) -> None:
    command, *rest = argv
    curve = rest[-1:] == ["curve"]
    if command == "echo-server":
        echo_server(int(rest[0]), curve)
        return
    if command == "echo-client":
        result = echo_client(rest[0], int(rest[1]), int(rest[2]), curve)
    else:
        result = gpumesh_client(rest[0], int(rest[1]), int(rest[2]))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    try:
        _main(sys.argv[1:])
    except KeyboardInterrupt:
        pass
