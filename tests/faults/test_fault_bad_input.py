"""Scenario 7: bad input from an authenticated peer.

A property-based fuzz drives the coordinator's whole receive path in memory (``decode`` and then
``Broker.handle``, as ``Coordinator._drain`` does) with hostile but well-framed messages: the
broker must turn every one into an ERROR reply or nothing, never an exception. The decoder alone
is fuzzed in tests/unit/test_protocol.py. Then a live coordinator takes 10,000 malformed
messages over authenticated connections, keeps answering, keeps its memory bounded, and runs a
normal job.
"""

from __future__ import annotations

import random
import time

import msgpack
import psutil
import pytest
import zmq
from faultlab import Executions, assert_one_correct_result_each
from faulttasks import record_square
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumesh.config import Limits, Timing
from gpumesh.coordinator.broker import Broker
from gpumesh.protocol import SIGNATURE, Command, ProtocolError, decode, encode
from gpumesh.security import configure_client, derive_keys
from gpumesh.store import Store

WORKER, CLIENT, STRANGER = b"w-routing", b"c-routing", b"s-routing"
FIELDS = ["role", "id", "proto", "info", "slots", "credit", "held", "incarnation", "draining",
          "granted", "leases", "task", "lease", "status", "elapsed", "error", "diagnosis",
          "encoding", "stream", "tasks", "job", "what", "qid", "since", "reason", "code",
          "message", "seq", "nf", "kind", "fn", "name", "timeout", "max_attempts", "priority",
          "cost", "req", "gpu", "cores", "memory", "vram", "python", "action", "data"]

_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), st.binary(max_size=20),
    st.sampled_from(["worker", "client", "ok", "error", "crashed", "fn", "script", "workers",
                     "status", "events", "out", "left", "16GB", "3.11", ""]),
)
_value = st.recursive(
    _scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.integers()),
                                            inner, max_size=4)),
    max_leaves=12,
)
_header = st.dictionaries(st.sampled_from(FIELDS), _value, max_size=8)
_message = st.tuples(
    st.sampled_from([WORKER, CLIENT, STRANGER]),
    st.sampled_from(list(Command)),
    _header,
    st.lists(st.binary(max_size=16), max_size=3),
)


def _broker() -> tuple[Broker, str, int]:
    """A broker with a worker and a client session, and one task leased to the worker."""
    limits = Limits()
    b = Broker(Store(":memory:"), Timing(), limits, epoch=1, now=0.0)

    def feed(routing: bytes, command: Command, header: dict, payload: list | None = None) -> None:
        b.handle(routing, decode(encode(command, header, payload or []), limits), 0.0)

    feed(WORKER, Command.HELLO, {"role": "worker", "id": "w1", "slots": 2, "credit": 2,
                                 "proto": [1, 1], "info": {"python": "3.11"}})
    feed(CLIENT, Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]})
    feed(CLIENT, Command.SUBMIT, {"job": "j", "tasks": [{"seq": 1, "nf": 2, "kind": "script",
                                                          "max_attempts": 3}]}, [b"x", b"{}"])
    b.dispatch(0.0)
    tasks = [decode(frames, limits) for _, frames in b.outbox]
    leased = [m.header for m in tasks if m.command is Command.TASK]
    b.outbox.clear()
    return b, leased[0]["task"], leased[0]["lease"]


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(messages=st.lists(_message, min_size=1, max_size=12), real=st.lists(st.booleans(), max_size=12))
def test_the_receive_path_turns_any_well_framed_message_into_a_reply_or_nothing(messages, real):
    broker, task, lease = _broker()
    limits = Limits()
    now = 0.0
    for index, (routing, command, header, payload) in enumerate(messages):
        if index < len(real) and real[index]:
            # Point some messages at the real task and lease, so deep paths are reached.
            header = {**header, "task": task, "lease": lease, "tasks": [task], "leases": [lease]}
        try:
            frames = encode(command, header, payload)
        except (TypeError, ValueError, OverflowError):
            continue  # not sendable: no peer can produce it either
        try:
            msg = decode(frames, limits)
        except ProtocolError:
            continue
        now += 0.1
        broker.handle(routing, msg, now)  # must not raise: server.py would log it as a bug
        broker.tick(now)
        broker.dispatch(now)
    for _, frames in broker.outbox:
        decode(frames, limits)  # everything the coordinator says is itself well formed


@pytest.mark.parametrize("proto", [[], [1]])
def test_a_hello_with_a_short_proto_list_gets_an_error_reply(proto):
    """Found by the fuzz above: Broker._on_hello used to format its version error with proto[0]
    and proto[1] whatever the list's length, so IndexError escaped Broker.handle, the peer got no
    reply and Coordinator._drain logged a traceback per message."""
    broker, _, _ = _broker()
    limits = Limits()
    hello = decode(encode(Command.HELLO, {"role": "client", "id": "p", "proto": proto}), limits)
    broker.handle(STRANGER, hello, 1.0)
    replies = [decode(frames, limits) for routing, frames in broker.outbox if routing == STRANGER]
    assert replies and replies[0].command is Command.ERROR
    assert replies[0].header["code"] in ("version", "malformed")


# ----------------------------------------------------------------- live

def _bad_messages(rng: random.Random) -> list[list[bytes]]:
    """One of each kind; the flood cycles through them."""
    bogus_task = {"task": "0" * 12, "lease": 2**41 + 5, "status": "ok", "elapsed": 0.1,
                  "granted": 1}
    return [
        [b"nonsense"],  # truncated: one frame
        [SIGNATURE, bytes([Command.SUBMIT])],  # truncated: no header
        [b"XYZ\x01", b"\x01", b"\x80"],  # wrong signature
        [b"GPM\x07", bytes([Command.HELLO]), b"\x80"],  # wrong major version
        [SIGNATURE, b"\x7e", b"\x80"],  # unknown command
        [SIGNATURE, b"\x0a", b"\x80"],  # the unassigned byte
        [SIGNATURE, b"\x01\x02", b"\x80"],  # two-byte command
        [SIGNATURE, bytes([Command.SUBMIT]), b"\xc1\xc1\xc1"],  # garbage msgpack
        [SIGNATURE, bytes([Command.SUBMIT]), msgpack.packb([1, 2, 3])],  # header not a map
        [SIGNATURE, bytes([Command.QUERY]), rng.randbytes(40)],  # random header bytes
        encode(Command.HELLO, {"role": "admin", "id": "x"}),
        encode(Command.HELLO, {"role": "worker", "id": "y" * 200, "slots": 1}),
        encode(Command.HELLO, {"role": "worker", "id": "z", "slots": -4}),
        encode(Command.HELLO, {"role": "client", "id": "c", "proto": [7, 9]}),
        encode(Command.WELCOME, {"session": "s"}),  # coordinator-only commands from a peer
        encode(Command.TASK, {"task": "t", "lease": 1}),
        encode(Command.ACCEPTED, {"job": "j"}),
        encode(Command.REPLY, {"qid": 1, "data": None}),
        encode(Command.ERROR, {"code": "malformed", "message": "m"}),
        encode(Command.RESULT, bogus_task),
        encode(Command.RESULT, {**bogus_task, "status": "exploded"}),
        encode(Command.SUBMIT, {"job": "", "tasks": [{"seq": 1, "nf": 5, "kind": "fn"}]}, [b"x"]),
        encode(Command.SUBMIT, {"job": "", "tasks": [{"seq": 2, "nf": 1, "kind": "evil"}]}, [b"x"]),
        encode(Command.SUBMIT, {"tasks": "not a list"}),
        encode(Command.QUERY, {"what": "secrets", "qid": 3}),
        encode(Command.QUERY, {"what": "events", "since": "yesterday"}),
        encode(Command.FETCH, {"tasks": [1, None, "x"], "qid": 0}),
        encode(Command.CANCEL, {"tasks": ["0" * 12]}),
        encode(Command.RESULT_ACK, {"tasks": [["nested"]]}),
        encode(Command.HEARTBEAT, {"leases": [1, 2, "three"]}),
        encode(Command.CREDIT, {"granted": 2**64 - 1}),
        encode(Command.OUTPUT, {"task": "t", "stream": "out"}, [b"a", b"b"]),
    ]


SENTINEL = [SIGNATURE, b"\x7f", b"\x80"]  # "unknown command 0x7f": answered every time


def _connect(ctx: zmq.Context, url: str, token: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndtimeo = 10_000
    sock.rcvtimeo = 0
    configure_client(sock, derive_keys(token))
    sock.connect(url)
    return sock


def _drain(sock: zmq.Socket) -> int:
    got = 0
    while True:
        try:
            sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return got
        got += 1


def _sync(sock: zmq.Socket, wait: float = 30.0) -> int:
    """Send a message that is always answered and wait for its answer: the coordinator then has
    read everything sent before it on this connection (closing with linger=0 would drop it)."""
    sock.send_multipart(SENTINEL)
    deadline = time.time() + wait
    got = 0
    while time.time() < deadline:
        if not sock.poll(100):
            continue
        frames = sock.recv_multipart()
        got += 1
        if frames[1:2] == [bytes([Command.ERROR])] and b"0x7f" in frames[2]:
            return got
    pytest.fail("the coordinator did not answer the sentinel on a flooded connection")


def _flood(mesh_env, tmp_path, total: int, connections: int) -> None:
    coordinator = mesh_env.start_coordinator()
    mesh_env.add_worker(slots=2)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    (tmp_path / "warm").mkdir()
    # Warm up first, so the baseline includes what serving a job allocates anyway.
    assert client.map(record_square, [(i, str(tmp_path / "warm"), 0.0) for i in range(50)]) == \
        [i * i for i in range(50)]
    process = psutil.Process(coordinator.pid)
    rss_before = process.memory_info().rss
    rng = random.Random(total)
    bad = _bad_messages(rng)
    big_header = [SIGNATURE, bytes([Command.QUERY]), b"\x80" + b"\x00" * (1024 * 1024 + 16)]
    many_frames = [SIGNATURE, bytes([Command.SUBMIT]), b"\x80", *[b""] * 5000]
    per_connection = total // connections
    sent = replies = 0
    ctx = zmq.Context()
    try:
        for c in range(connections):
            sock = _connect(ctx, coordinator.url, mesh_env.token)
            try:
                # Half the connections first become a session (as a client or an idle worker), so
                # their garbage reaches the handlers rather than stopping at no_session.
                if c % 4 == 1:
                    sock.send_multipart(encode(Command.HELLO, {"role": "client", "id": f"fz{c}"}))
                elif c % 4 == 3:
                    sock.send_multipart(encode(Command.HELLO, {
                        "role": "worker", "id": f"fw{c}", "slots": 1, "credit": 0,
                        "held": [["0" * 12, 7]], "info": {}}))
                for i in range(per_connection):
                    if i % 500 == 250:
                        frames = big_header  # oversized header
                    elif i % 500 == 499:
                        frames = many_frames  # too many frames
                    elif i % 5 == 0:
                        frames = [rng.randbytes(rng.randint(0, 48)) for _ in range(rng.randint(1, 5))]
                    else:
                        frames = bad[i % len(bad)]
                    sock.send_multipart(frames)
                    sent += 1
                    if i % 200 == 0:
                        replies += _drain(sock)
                # The coordinator keeps serving everyone else while this goes on.
                if c % 10 == 0:
                    assert [w["id"] for w in client.workers() if w["alive"]]
                replies += _sync(sock)
            finally:
                sock.close(linger=0)
    finally:
        ctx.term()
    assert sent >= total
    assert coordinator.alive
    n = 200
    log_dir = tmp_path / "after"
    log_dir.mkdir()
    futures = client.submit_calls(record_square, [((i, str(log_dir), 0.0), {}) for i in range(n)])
    results = client.gather(futures, timeout=120)
    assert_one_correct_result_each(futures, results, n)
    assert Executions(log_dir).runs(n) == [1] * n
    rss_after = process.memory_info().rss
    growth = (rss_after - rss_before) / 2**20
    print(f"{sent} malformed messages on {connections} connections ({replies} replies read); "
          f"coordinator RSS {rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB")
    assert growth < 64, f"the coordinator grew by {growth:.1f} MiB"


def test_ten_thousand_malformed_messages_from_authenticated_peers(mesh_env, tmp_path):
    _flood(mesh_env, tmp_path, total=10_000, connections=40)


@pytest.mark.slow
def test_a_hundred_thousand_malformed_messages_on_two_thousand_connections(mesh_env, tmp_path):
    _flood(mesh_env, tmp_path, total=100_000, connections=2_000)
