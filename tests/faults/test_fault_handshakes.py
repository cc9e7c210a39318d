"""Scenario 8: unauthenticated garbage gets nothing in and crashes nothing; repeated handshake
failures from one LAN address are rate limited, loopback exempt (gpumesh.security), and so are
wrong-token handshakes, which libzmq ends before ZAP (gpumesh.security.HandshakeWatch)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess

import psutil
import pytest
import zmq
from conftest import poll_until, wait_for
from faultlab import (
    HERE,
    Driver,
    Executions,
    Lab,
    assert_one_correct_result_each,
    driver_args,
    require_netns,
)
from faulttasks import record_square

from gpumesh.config import parse_url
from gpumesh.security import HandshakePolicy, derive_keys

N = 200
ZMTP_NULL_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL" + b"\x00" * 16 + b"\x00" + b"\x00" * 31
ZMTP_CURVE_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE" + b"\x00" * 15 + b"\x00" + b"\x00" * 31


def _dealer(ctx: zmq.Context, url: str, public: bytes, secret: bytes, server: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.curve_serverkey = server
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.connect(url)
    return sock


def test_unauthenticated_garbage_gets_nothing_in_and_loopback_is_never_locked_out(mesh_env, tmp_path):
    coordinator = mesh_env.start_coordinator()
    mesh_env.add_worker(slots=2)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    endpoint = parse_url(coordinator.url)
    rng = random.Random(8)
    # Raw TCP: random bytes, a NULL-mechanism greeting, a CURVE greeting followed by junk.
    for i in range(60):
        with socket.create_connection((endpoint.host, endpoint.port), timeout=5) as raw:
            raw.settimeout(2)
            head = [b"", ZMTP_NULL_GREETING, ZMTP_CURVE_GREETING][i % 3]
            raw.sendall(head + rng.randbytes(rng.randint(1, 2048)))
    keys = derive_keys(mesh_env.token)
    stranger = derive_keys("another mesh entirely " + "z" * 20)
    ctx = zmq.Context()
    try:
        # A wrong token (wrong server key: libzmq drops it before ZAP), and a key that knows the
        # server's public key but not the client secret (ZAP refuses it): far past the limit,
        # all from loopback.
        socks = []
        policy = HandshakePolicy()
        for _ in range(policy.max_failures * 3):
            public, secret = zmq.curve_keypair()
            socks.append(_dealer(ctx, coordinator.url, stranger.client_public,
                                 stranger.client_secret, stranger.server_public))
            socks.append(_dealer(ctx, coordinator.url, public, secret, keys.server_public))
        for sock in socks:
            sock.send_multipart([b"GPM\x01", b"\x01", b"\x80"], flags=zmq.NOBLOCK)
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        assert poller.poll(2000) == [], "an unauthenticated peer got an answer"
        for sock in socks:
            sock.close(linger=0)
    finally:
        ctx.term()
    assert psutil.Process(coordinator.pid).status() != psutil.STATUS_ZOMBIE
    # Nothing got in: the one real worker is the only worker, and loopback is not locked out.
    assert [w["alive"] for w in client.workers()] == [True]
    fresh = mesh_env.client()
    futures = fresh.submit_calls(record_square, [((i, str(tmp_path), 0.0), {}) for i in range(N)])
    results = fresh.gather(futures, timeout=120)
    assert_one_correct_result_each(futures, results, N)
    assert Executions(tmp_path).runs(N) == [1] * N


def _serve_in(lab: Lab, host: str, env: dict[str, str], db: str, log: object) -> tuple[object, int]:
    proc, line = lab.spawn(host, ["-m", "gpumesh", "serve", "--host", "0.0.0.0", "--port", "0",
                                  "--no-self-worker", "--no-save", "--db", db],
                           env, ready=True, stdout=log, stderr=log)
    return proc, int(line)


def _driver(lab: Lab, host: str, env: dict[str, str]) -> Driver:
    proc, _ = lab.spawn(host, driver_args(), env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    return Driver(proc)


def test_repeated_failures_from_a_lan_address_are_rate_limited(mesh_env, tmp_path):
    require_netns()
    lab = Lab(["coord", "attacker", "friend"])
    env = {**os.environ, **mesh_env.env, "GPUMESH_TOKEN": mesh_env.token}
    log_path = tmp_path / "coordinator.log"
    try:
        with open(log_path, "wb") as log:
            _, port = _serve_in(lab, "coord", env, str(tmp_path / "j.db"), log)
        url = f"tcp://{lab.address('coord')}:{port}"
        attacker = _driver(lab, "attacker", env)
        friend = _driver(lab, "friend", env)
        local = _driver(lab, "coord", env)
        policy = HandshakePolicy()
        assert attacker.call("handshake", url=url, key="right", timeout=10) == "ok"
        outcomes = [attacker.call("handshake", url=url, key="wrong", timeout=10)
                    for _ in range(policy.max_failures)]
        assert outcomes == ["auth:400"] * policy.max_failures
        # Locked out: even the right key from that address is turned away, and silently (ZAP
        # 300: libzmq holds the connection until its handshake window ends, then drops it).
        assert attacker.call("handshake", url=url, key="right", timeout=3) in (
            "timeout", "no_detail:32", "disconnected")
        # Nobody else is: another LAN host, and loopback on the coordinator's own machine.
        assert friend.call("handshake", url=url, key="right", timeout=10) == "ok"
        local_url = f"tcp://127.0.0.1:{port}"
        for _ in range(policy.max_failures * 2):
            assert local.call("handshake", url=local_url, key="wrong", timeout=10) == "auth:400"
        assert local.call("handshake", url=local_url, key="right", timeout=10) == "ok"
        # The mesh still works from the friend's machine.
        assert friend.call("connect", url=url) is True
        assert friend.call("workers") == []
        text = wait_for(lambda: (lambda t: t if "refusing handshakes from" in t else None)(
            log_path.read_text()), timeout=10, what="the lockout warning in the coordinator log")
        assert f"refusing handshakes from {lab.address('attacker')} for 60s" in text
        assert mesh_env.token not in text
        assert lab.address("friend") not in text
        # Bounded logging: at most one burst of warnings however many failures.
        assert text.count("[gpumesh.zap]") + text.count("gpumesh.zap") <= policy.log_burst + 1
    finally:
        lab.close()


def _log_entries(path) -> list[dict]:
    """The JSON log lines (``gpumesh --json-logs``) among the coordinator's output."""
    entries = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                entries.append(json.loads(line))
            except ValueError:
                continue
    return entries


# Wrong-key handshakes fail inside libzmq before ZAP, so the coordinator learns of each one only
# from socket-monitor events, read by a Python thread (security.HandshakeWatch). When it falls
# behind it cannot read the peers' addresses, and names them from the kernel's table of
# connections it closed (gpumesh/closedconns.py): the lockout then comes later (94-437
# handshakes in, seen here) but comes. Before that second way, 1 in 2 to 5 in 6 floods locked
# out. A flood is tried up to FLOOD_ATTEMPTS times on fresh coordinators, so that one slow run of
# a shared machine does not fail CI; the attempts it took are printed, and 10 runs in 10 locked
# out at the first.
FLOOD_ATTEMPTS = 3


def test_wrong_token_handshakes_from_a_lan_address_lock_it_out(mesh_env, tmp_path):
    """1,000 handshakes with a wrong token (so a wrong server key: libzmq fails them before
    ZAP) from another namespace: the address is locked out and logged, and prints how fast."""
    require_netns()
    for attempt in range(1, FLOOD_ATTEMPTS + 1):
        if _flood_locks_out(mesh_env, tmp_path / f"attempt-{attempt}", attempt):
            return
    pytest.fail(f"{FLOOD_ATTEMPTS} floods of wrong-token handshakes, none locked the address out")


def _flood_locks_out(mesh_env, where, attempt: int) -> bool:
    where.mkdir()
    lab = Lab(["coord", "attacker"])
    env = {**os.environ, **mesh_env.env, "GPUMESH_TOKEN": mesh_env.token}
    log_path = where / "coordinator.log"
    try:
        with open(log_path, "wb") as log:
            _, line = lab.spawn("coord", ["-m", "gpumesh", "--json-logs", "serve", "--host",
                                          "0.0.0.0", "--port", "0", "--no-self-worker",
                                          "--no-save", "--db", str(where / "j.db")],
                                env, ready=True, stdout=log, stderr=log)
        url = f"tcp://{lab.address('coord')}:{int(line)}"
        flood, _ = lab.spawn("attacker", [str(HERE / "handshake_flood.py"), url, "1000"], env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = flood.communicate(timeout=240)
        assert flood.returncode == 0, err.decode(errors="replace")
        report = json.loads(out)
        assert report["outcomes"].get("ok", 0) == 0
        attacker = lab.address("attacker")
        # A lockout is logged at once; none comes later.
        lockouts: list[dict] = poll_until(
            lambda: [e for e in _log_entries(log_path)
                     if f"refusing handshakes from {attacker} " in e["message"]], 3) or []
        text = log_path.read_text(errors="replace")
        assert mesh_env.token not in text
        assert mesh_env.token.split(".", 1)[-1] not in text
        # Bounded logging: one burst of warnings however many failures.
        assert text.count("gpumesh.zap") <= HandshakePolicy().log_burst + 1
        if not lockouts:
            print(f"\n[handshake flood] attempt {attempt}: the watch named too few peers to "
                  f"lock out; outcomes {report['outcomes']}")
            return False
        locked_at = lockouts[0]["ts"]
        if report["right_after"] == "ok" and locked_at >= report["finished"]:
            # Named late (from the kernel's table, after the flood ended): the right token's
            # handshake went before the lockout, so this attempt cannot tell. Seen once in CI.
            print(f"\n[handshake flood] attempt {attempt}: locked out only "
                  f"{(locked_at - report['finished']) * 1000:.0f} ms after the flood ended, "
                  f"after the right token's try; outcomes {report['outcomes']}")
            return False
        # Locked out: the right token from that address is now turned away (silently).
        assert report["right_after"] != "ok"
        started = report["started"]
        before = sum(1 for t in started if t <= locked_at)
        seconds = max(locked_at - started[0], 1e-6)
        whole = report["finished"] - started[0]
        print(f"\n[handshake flood] attempt {attempt}: {len(started)} wrong-token handshakes in "
              f"{whole:.2f}s ({len(started) / whole:.0f}/s); locked out after {before} of them, "
              f"{seconds * 1000:.0f} ms after the first ({before / seconds:.0f}/s before the "
              f"lockout); outcomes {report['outcomes']}; right token afterwards: "
              f"{report['right_after']}")
        return True
    finally:
        lab.close()
