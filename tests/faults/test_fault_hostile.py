"""Issue 8, first check: hostile input from peers holding the token never stops the coordinator.

A live coordinator (``python -m gpumesh serve``, its own process) and a real ``gpumesh join``
worker. Hostile peers authenticate with the mesh's CURVE keys, say a valid HELLO as a worker and
as a client, then send batches of well-framed but ill-typed messages of every command
(hypothesis builds them from the documented field set: see hostile.py). After each batch the
coordinator must still be running; it is then killed with SIGKILL, started again on the same
journal, must stay up through its restore grace and its timers, and must serve a normal task.
Its memory must stay bounded throughout. Bad input that fails decoding, and the in-memory fuzz
of ``Broker.handle``, are in test_fault_bad_input.py; this suite is about what gets past them.

And before authentication: peers without the token that announce a huge CURVE handshake frame
must cost the coordinator next to no memory, and be cut off within the handshake window.
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import threading
import time
from pathlib import Path

import pytest
import zmq
from conftest import wait_for
from faulttasks import record_square
from hostile import (
    Deep,
    Hostile,
    Mutation,
    Peer,
    World,
    hello_header,
    hostile_messages,
    template,
)
from hypothesis import HealthCheck, Phase, given, seed, settings
from serveproc import Coordinator, PeakRss, survives

from gpumesh.client import GPUMesh
from gpumesh.client.launch import start_worker
from gpumesh.config import Settings
from gpumesh.security import derive_keys

MIB = 2**20
RSS_GROWTH_LIMIT = 64 * MIB  # a memory bound, generous on purpose; not a speed
RESTORE_GRACE = 1.0
PENDING_TIMEOUT = 1.0
# Long enough for the coordinator's once-a-second checks (liveness, unschedulable tasks) to run
# on what a batch left behind, before the kill and after the restart.
OBSERVE = 1.5
MAX_FRESH = 24  # new connections per batch for HELLOs under other identities
KEEPALIVE = 0.15  # seconds between heartbeats of every hostile session (liveness is 1 s here)
NORMAL_TASKS = 6
SETTLE = 15.0  # at most this long, for all hostile connections together, to hear the sentinels

# The findings of issue 8 and of this suite's first runs, sent after the generated messages of
# every run (batch b gets SEEDS[b::batches]). Inventories go out on connections of their own, so
# each stays in force (a later HELLO on the same session would replace it).
SEEDS = [
    Hostile("SUBMIT", "client", (Mutation("set", ("tasks", 0, "req", "python"), ["3.11"]),)),
    Hostile("SUBMIT", "client", (Mutation("set", ("tasks", 1, "req", "gpu"), 5),)),
    Hostile("HELLO", "fresh-worker", (Mutation("set", ("info", "gpus"), "x"),)),
    Hostile("HELLO", "fresh-worker", (Mutation("set", ("info", "cores"), "many"),)),
    Hostile("HELLO", "fresh-worker", (Mutation("set", ("info", "gpus"),
                                               [{"name": "A100", "vram": "40GB"}]),)),
    Hostile("SUBMIT", "client", (Mutation("set", ("tasks", 0, "req", "memory"), "40GB"),)),
    Hostile("RESULT", "worker", (Mutation("set", ("lease",), 2**62),)),  # a made-up lease
    Hostile("SUBMIT", "client", (Mutation("set", ("tasks", 1, "req", "vram"), [1]),)),
    Hostile("HELLO", "fresh-worker", (Mutation("set", ("info", "score"), "fast"),)),
    Hostile("SUBMIT", "client", (Mutation("set", ("tasks", 0, "seq"), 2**63),)),
    Hostile("HELLO", "fresh-worker", (Mutation("set", ("info", "gpus"), None),)),
    Hostile("HELLO", "fresh-worker", (Mutation("set", ("info", "hostname"), Deep(1000)),)),
]


def _env(mesh_env) -> dict[str, str]:
    return {**os.environ, **mesh_env.env, "GPUMESH_TOKEN": mesh_env.token,
            "GPUMESH_RESTORE_GRACE": str(RESTORE_GRACE),
            "GPUMESH_PENDING_TIMEOUT": str(PENDING_TIMEOUT)}


def _normal_task(coordinator: Coordinator, worker_id: str, settings: Settings, token: str,
                 log_dir: Path) -> None:
    """A real client maps a square over the real worker, within a deadline."""
    log_dir.mkdir(exist_ok=True)
    try:
        with GPUMesh(coordinator.url, token, quiet=True, settings=settings) as client:
            wait_for(lambda: any(w["id"] == worker_id and w["alive"] for w in client.workers()),
                     timeout=30, what="the real worker to rejoin")
            results = client.map(record_square, [(i, str(log_dir), 0.0)
                                                 for i in range(NORMAL_TASKS)], timeout=30)
    except Exception as exc:
        if not coordinator.alive:
            raise AssertionError(coordinator.dead_message("while serving a normal task")) from exc
        raise
    assert results == [i * i for i in range(NORMAL_TASKS)]


class _Attack:
    """One batch: the hostile worker, the hostile client and fresh connections, sharing what
    they learnt (task ids, leases) so later messages can name real things."""

    def __init__(self, coordinator: Coordinator, token: str, protected: set[str], log: Path) -> None:
        self.coordinator = coordinator
        self.ctx = zmq.Context()
        self.keys = derive_keys(token)
        self.world = World(protected=protected)
        worker_id, client_id = f"hw{secrets.token_hex(5)}", f"hc{secrets.token_hex(7)}"
        self.world.workers.append(worker_id)
        self.peers = {
            "worker": Peer(self.ctx, coordinator.url, self.keys,
                           hello_header("worker", worker_id), self.world),
            "client": Peer(self.ctx, coordinator.url, self.keys,
                           hello_header("client", client_id), self.world),
        }
        self.fresh: list[Peer] = []
        self.log = log.open("w")
        self.sent = self.unpackable = 0
        self.beat_at = time.time()

    def send(self, message: Hostile, seeded: bool = False) -> None:
        if not self.coordinator.alive:
            return  # the checks after the batch say why; the log names what was sent
        role = message.sender.removeprefix("fresh-")
        peer = self.peers[role]
        base = template(message.kind, role)
        if message.kind == "HELLO":
            assert peer.hello is not None
            base = dict(peer.hello)
            if message.sender.startswith("fresh") and (seeded or len(self.fresh) < MAX_FRESH):
                peer = Peer(self.ctx, self.coordinator.url, self.keys, None, self.world)
                self.fresh.append(peer)
                base = hello_header(role, f"hf{secrets.token_hex(5)}")
        self.log.write(f"{self.sent} {message!r}\n")
        self.log.flush()
        if peer.send(message, base):
            self.sent += 1
        else:
            self.unpackable += 1
        if time.time() - self.beat_at > KEEPALIVE:
            self.keepalive()

    @property
    def all_peers(self) -> list[Peer]:
        return [*self.peers.values(), *self.fresh]

    def keepalive(self) -> None:
        """Heartbeat every session, so what each one said (an inventory, say) stays in force
        while the coordinator's once-a-second checks run, instead of timing out."""
        self.beat_at = time.time()
        for peer in self.all_peers:
            peer.heartbeat()

    def settle(self) -> int:
        """Wait until the coordinator has read everything the hostile peers sent; how many of
        them it answered. Best effort: a coordinator may cut off a peer that misbehaves, and a
        hung one fails the normal task anyway."""
        deadline = time.time() + SETTLE
        return sum(peer.sync(max(deadline - time.time(), 0.5), lambda: self.coordinator.alive)
                   for peer in self.all_peers)

    def close(self) -> None:
        for peer in self.all_peers:
            peer.close()
        self.ctx.term()
        self.log.close()


def _hostile_batches(mesh_env, tmp_path: Path, batches: int, messages: int) -> None:
    env = _env(mesh_env)
    settings = Settings.from_env(env)
    coordinator = Coordinator(tmp_path, tmp_path / "journal.db", env)
    coordinator.start()
    try:
        worker = start_worker(coordinator.url, token=mesh_env.token, slots=2, home=str(tmp_path),
                              env=mesh_env.env)
        mesh_env.handles.append(worker)
        protected = {worker.worker_id, socket.gethostname()}
        _normal_task(coordinator, worker.worker_id, settings, mesh_env.token, tmp_path / "warm")
        for batch in range(batches):
            log = tmp_path / f"batch-{batch}.log"
            attack = _Attack(coordinator, mesh_env.token, protected, log)
            sampler = PeakRss(coordinator.pid)
            started = time.time()
            where = f"during hostile batch {batch} (messages in {log})"
            try:
                try:
                    _send_batch(attack, batch, batches, messages)
                    answered = attack.settle()
                    assert coordinator.alive, coordinator.dead_message(where)
                    survives(coordinator, OBSERVE, attack.all_peers, when=where)
                finally:
                    attack.close()
                # The hostile peers vanish without a word: their sessions go silent, then lost.
                survives(coordinator, OBSERVE, when=f"after the peers of batch {batch} left ({log})")
                peak, end = sampler.stop(), coordinator.rss()
            finally:
                sampler.stop()
            world = attack.world
            print(f"batch {batch}: {attack.sent} hostile messages ({attack.unpackable} could not "
                  f"be packed) on {len(attack.all_peers)} connections ({answered} answered the "
                  f"last), {world.replies} replies read, {world.accepted} hostile tasks "
                  f"accepted, {world.leased} leased to the hostile worker, "
                  f"{time.time() - started:.1f} s; "
                  f"coordinator RSS {sampler.start_rss / MIB:.1f} -> peak {peak / MIB:.1f}, "
                  f"{end / MIB:.1f} MiB at the end")
            assert peak - sampler.start_rss < RSS_GROWTH_LIMIT, \
                f"batch {batch}: the coordinator grew from {sampler.start_rss / MIB:.0f} to " \
                f"{peak / MIB:.0f} MiB (messages in {log})"
            coordinator.kill()
            coordinator.start()
            survives(coordinator, RESTORE_GRACE + OBSERVE,
                     when=f"after its restart on the journal of hostile batch {batch} ({log})")
            assert worker.alive, f"the real worker died during hostile batch {batch} ({log})"
            _normal_task(coordinator, worker.worker_id, settings, mesh_env.token,
                         tmp_path / f"after-{batch}")
    finally:
        coordinator.kill()


def _send_batch(attack: _Attack, batch: int, batches: int, messages: int) -> None:
    # Generation only: a failure shows up after the batch, in another process, so hypothesis
    # has nothing to shrink; the seed makes every run send the same messages.
    @settings(max_examples=messages, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @seed(80_000 + batch)
    @given(message=hostile_messages())
    def batch_of(message: Hostile) -> None:
        attack.send(message)

    batch_of()
    for known in SEEDS[batch::batches]:  # last, so what they leave behind is still there
        attack.send(known, seeded=True)


def test_hostile_peers_never_stop_the_coordinator(mesh_env, tmp_path):
    _hostile_batches(mesh_env, tmp_path, batches=3, messages=300)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hostile_peers_never_stop_the_coordinator_long(mesh_env, tmp_path):
    _hostile_batches(mesh_env, tmp_path, batches=12, messages=2000)


# ----------------------------------------------------------------- before authentication

ZMTP_CURVE_GREETING = (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\x00")
                       + b"\x00" + b"\x00" * 31)
PUSHED = 96 * MIB  # at most this much of the announced frame: never the whole frame
CLOSE_WITHIN = 6.0  # the handshake window (about 2 s) with room to spare on a busy machine
HOLD_AT_MOST = 15.0  # how long a peer keeps trying before it gives up by itself
STRANGERS = 3


def _stranger(port: int, announced: int, out: dict[str, float | int | None]) -> None:
    """Greet as a ZMTP 3.0 CURVE client, announce a command frame (flags 0x06: command, 8-byte
    length), send most of it, then trickle; note when the coordinator hangs up."""
    pushing = min(PUSHED, announced // 2)  # the trickle never completes the frame
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    start = time.time()
    pushed, chunk = 0, b"\x00" * (256 * 1024)
    out["closed_after"] = None
    try:
        sock.sendall(ZMTP_CURVE_GREETING + b"\x06" + announced.to_bytes(8, "big"))
        sock.setblocking(False)
        last_trickle = 0.0
        while time.time() - start < HOLD_AT_MOST:
            want_write = pushed < pushing or time.time() - last_trickle > 0.1
            readable, writable, _ = select.select([sock], [sock] if want_write else [], [], 0.05)
            try:
                if readable and not sock.recv(65536):
                    break  # the coordinator closed the connection
                if writable:
                    pushed += sock.send(chunk[:pushing - pushed] if pushed < pushing else b"\x00")
                    last_trickle = time.time()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:  # reset or broken pipe: closed by the coordinator
                break
        else:
            return
        out["closed_after"] = time.time() - start
    finally:
        out["pushed"] = pushed
        sock.close()


def _seconds(value: float | int | None) -> str:
    return "never" if value is None else f"{value:.2f}"


# A frame over the 1 MiB limit is refused as soon as its header is read; one just under it is
# buffered, then dropped when the handshake window ends.
@pytest.mark.parametrize("announced", [450 * MIB, MIB - 4096], ids=["450MiB", "just-under-1MiB"])
def test_memory_before_authentication_stays_small(mesh_env, tmp_path, announced):
    env = _env(mesh_env)
    coordinator = Coordinator(tmp_path, tmp_path / "journal.db", env)
    coordinator.start()
    try:
        with GPUMesh(coordinator.url, mesh_env.token, quiet=True,
                     settings=Settings.from_env(env)) as client:
            assert client.workers() == []  # warmed up: the baseline includes a served client
            sampler = PeakRss(coordinator.pid, every=0.01)
            results: list[dict[str, float | int | None]] = [{} for _ in range(STRANGERS)]
            threads = [threading.Thread(target=_stranger, args=(coordinator.port, announced, r))
                       for r in results]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(HOLD_AT_MOST + 10)
            peak = sampler.stop()
            growth = peak - sampler.start_rss
            print(f"{STRANGERS} unauthenticated peers announcing {announced / MIB:.2f} MiB frames: "
                  f"coordinator RSS {sampler.start_rss / MIB:.1f} -> peak {peak / MIB:.1f} MiB; "
                  f"pushed {[round(r.get('pushed', 0) / MIB, 2) for r in results]} MiB; closed by the "
                  f"coordinator after {[_seconds(r.get('closed_after')) for r in results]} s")
            assert coordinator.alive, coordinator.dead_message("under unauthenticated big frames")
            assert client.workers() == []  # still serving the authenticated
        assert growth < RSS_GROWTH_LIMIT, \
            f"unauthenticated peers grew the coordinator by {growth / MIB:.0f} MiB"
        for r in results:
            closed = r.get("closed_after")
            assert closed is not None and closed <= CLOSE_WITHIN, \
                f"an unauthenticated connection stayed open {closed or HOLD_AT_MOST:.1f} s"
    finally:
        coordinator.kill()
