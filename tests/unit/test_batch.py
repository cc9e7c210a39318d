"""BATCH: many small messages to one peer as one, read back one by one, hostile or not; and the
worker's automatic prefetch, which is what makes a coordinator's TASKs come in runs."""

from __future__ import annotations

import msgpack
import pytest

from gpumesh.config import Limits, Settings, Timing, parse_url
from gpumesh.coordinator.broker import Broker
from gpumesh.protocol import (
    Command,
    ErrorCode,
    Message,
    ProtocolError,
    batches,
    bundle,
    decode,
    encode,
    unbundle,
)
from gpumesh.protocol.messages import BATCH_ALONE_BYTES, MAX_BATCHED
from gpumesh.store import Store
from gpumesh.worker import agent as agent_module
from gpumesh.worker.agent import PREFETCH_HORIZON, WorkerAgent

LIMITS = Limits()


def _messages(count: int) -> list[list]:
    return [encode(Command.RESULT, {"task": f"t{i}", "lease": i, "status": "ok"}, [b"x" * i, b"y"])
            for i in range(count)]


def _read(frames: list) -> list[Message]:
    msg = decode(frames, LIMITS)
    if msg.command is not Command.BATCH:
        return [msg]
    items = unbundle(msg, LIMITS)
    assert all(isinstance(i, Message) for i in items)
    return items  # type: ignore[return-value]


def test_a_run_of_messages_goes_as_one_batch_and_reads_back_in_order():
    out = batches(_messages(50), LIMITS)
    assert len(out) == 1 and len(out[0]) == 3  # one frame of header: the frames ride inside
    got = _read(out[0])
    assert [(m.command, m.header["lease"], m.payload) for m in got] == \
        [(Command.RESULT, i, [b"x" * i, b"y"]) for i in range(50)]


def test_a_lone_message_and_a_big_one_go_as_they_are_and_the_order_holds():
    big = encode(Command.RESULT, {"lease": 99}, [b"z" * BATCH_ALONE_BYTES])
    small = _messages(3)
    out = batches([small[0], small[1], big, small[2]], LIMITS)
    assert [decode(f, LIMITS).command for f in out] == [Command.BATCH, Command.RESULT, Command.RESULT]
    assert [m.header["lease"] for f in out for m in _read(f)] == [0, 1, 99, 2]
    assert batches([small[0]], LIMITS) == [small[0]]


def test_batches_stay_under_the_header_limit_and_the_message_count():
    limits = Limits(max_header_bytes=64 * 1024)
    many = [encode(Command.HEARTBEAT, {"leases": [1]}) for _ in range(MAX_BATCHED + 10)]
    out = batches(many, LIMITS)
    assert sum(len(_read(f)) for f in out) == len(many) and len(out) >= 2
    wide = [encode(Command.OUTPUT, {"task": "t", "stream": "out"}, [b"o" * 20_000]) for _ in range(10)]
    for frames in batches(wide, limits):
        assert len(frames[2]) < limits.max_header_bytes
        decode(frames, limits)


def test_a_run_is_cut_before_its_frames_pass_the_limit_unbundle_enforces():
    # Small messages of many small frames: within the bytes and message count, over the frames.
    many = [encode(Command.RESULT, {"lease": i}, [b"f"] * 300) for i in range(30)]
    out = batches(many, LIMITS)
    assert len(out) >= 3
    assert [m.header["lease"] for f in out for m in _read(f)] == list(range(30))


def _batch(entries, payload=()) -> Message:
    return Message(Command.BATCH, {"m": entries}, list(payload))


@pytest.mark.parametrize("entries", [
    None, [], "x", [[1, 2]], [[Command.HEARTBEAT, {"not": "bytes"}, []]],
    [[Command.HEARTBEAT, msgpack.packb({}), [1, 2]]],  # frames that are not bytes
    [[True, msgpack.packb({}), []]],
    [[Command.BATCH, msgpack.packb({"m": []}), []]],  # nested
    [[Command.HEARTBEAT, b"\xc1", []]],  # not msgpack
    [[Command.HEARTBEAT, msgpack.packb([1]), []]],  # not a map
])
def test_a_malformed_batch_is_refused_whole(entries):
    with pytest.raises(ProtocolError) as info:
        unbundle(_batch(entries), LIMITS)
    assert info.value.code is ErrorCode.MALFORMED


def test_a_batch_with_frames_outside_or_too_many_is_refused():
    with pytest.raises(ProtocolError):
        unbundle(_batch([[Command.HEARTBEAT, msgpack.packb({}), []]], [b"stray"]), LIMITS)
    many = [[Command.OUTPUT, msgpack.packb({}), [b"f"] * 3000]] * 2
    with pytest.raises(ProtocolError) as info:
        unbundle(_batch(many), LIMITS)
    assert info.value.code is ErrorCode.TOO_LARGE


def test_an_unknown_command_inside_a_batch_is_answered_alone():
    items = unbundle(_batch([[0x7E, msgpack.packb({}), []],
                             [Command.HEARTBEAT, msgpack.packb({}), []]]), LIMITS)
    assert isinstance(items[0], ProtocolError) and items[0].code is ErrorCode.UNSUPPORTED
    assert isinstance(items[1], Message) and items[1].command is Command.HEARTBEAT


# ----------------------------------------------------------------- the coordinator

W, C = b"worker-routing", b"client-routing"


@pytest.fixture
def broker() -> Broker:
    b = Broker(Store(":memory:"), Timing(), LIMITS, epoch=1, now=0.0)
    b.handle(W, decode(encode(Command.HELLO, {
        "role": "worker", "id": "w1", "slots": 1, "credit": 4, "prefetch": 3, "batch": True,
        "proto": [1, 1], "info": {"python": "3.11", "cores": 1}}), LIMITS), 0.0)
    b.handle(C, decode(encode(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}),
                       LIMITS), 0.0)
    return b


def test_welcome_says_batch_and_the_sessions_remember_who_reads_them(broker):
    welcomes = [decode(f, LIMITS).header for _, f in broker.outbox]
    assert all(w.get("batch") is True for w in welcomes)
    assert broker.ledger.reads_batches(W) and not broker.ledger.reads_batches(C)
    assert not broker.ledger.reads_batches(b"stranger")


def test_a_batched_submit_and_results_act_as_if_sent_alone(broker):
    broker.outbox.clear()
    specs = [{"seq": i, "nf": 1, "kind": "script"} for i in range(4)]
    submit = encode(Command.SUBMIT, {"tasks": specs}, [b"p"] * 4)
    broker.handle(C, decode(bundle([submit, encode(Command.HEARTBEAT, {})]), LIMITS), 0.0)
    assert len(broker.tasks) == 4
    broker.dispatch(0.0)
    leases = {t.lease_id: t.task_id for t in broker.tasks.values() if t.lease_id}
    assert len(leases) == 4  # slots 1 + prefetch 3: all four went to the worker at once
    results = [encode(Command.RESULT, {"task": task, "lease": lease, "status": "ok",
                                       "encoding": "text", "granted": 4 + n}, [b"v"])
               for n, (lease, task) in enumerate(leases.items(), 1)]
    bogus = encode(Command.RESULT, {"task": "nope", "lease": "x", "status": "ok"})
    broker.handle(W, decode(bundle([*results[:2], bogus, *results[2:]]), LIMITS), 1.0)
    assert all(t.state.terminal for t in broker.tasks.values())
    errors = [decode(f, LIMITS).header for r, f in broker.outbox
              if r == W and decode(f, LIMITS).command is Command.ERROR]
    assert [e["code"] for e in errors] == ["malformed"]  # the bad one alone


def test_a_malformed_batch_is_an_error_and_the_broker_goes_on(broker):
    broker.outbox.clear()
    broker.handle(W, Message(Command.BATCH, {"m": [[Command.BATCH, b"\x80", []]]}), 1.0)
    assert [decode(f, LIMITS).header["code"] for _, f in broker.outbox] == ["malformed"]
    assert broker.workers["w1"].state.value == "alive"


# ----------------------------------------------------------------- the worker's prefetch

@pytest.fixture
def agent(tmp_path):
    a = WorkerAgent(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}),
                    parse_url("tcp://127.0.0.1:9"), "t" * 32, slots=2, info={},
                    local_control=False, prefetch=None)
    a.link.send = lambda frames: True
    a.link.post = lambda frames: None
    yield a
    a.link.close()
    a._ctx.term()


def test_auto_prefetch_queues_only_while_tasks_are_short(agent):
    agent.session.hello()
    assert agent.prefetch == 128 and agent.granted == 2  # announces room, grants none yet
    for _ in range(5):
        agent._note_run_time(0.0001)
        agent.granted += 1  # what _report adds per finished task
    assert agent.prefetch_depth() == 128 and agent._granted_depth == 128  # 64 per slot at most
    granted_short = agent.granted
    for _ in range(50):
        agent._note_run_time(0.05)
    assert agent.prefetch_depth() == 2  # one per slot: enough to hide the round trip
    for _ in range(200):
        agent._note_run_time(PREFETCH_HORIZON * 4)
    assert agent.prefetch_depth() == 0 and agent._granted_depth == 0
    assert agent.granted == granted_short - 128  # taken back one finished task at a time


def test_auto_prefetch_of_tiny_tasks_with_big_inputs_stays_shallow(agent, monkeypatch):
    monkeypatch.setattr(agent_module, "PREFETCH_BYTES", 1 << 20)
    agent.session.welcomed = True
    for lease in range(1, 30):
        agent._on_task(decode(encode(Command.TASK, {"task": f"T{lease}", "lease": lease,
                                                    "kind": "fn"}, [bytes(256 << 10)]),
                              Limits()), 0.0)
        agent._note_run_time(0.0001)
        agent.queue.clear()
    # About PREFETCH_BYTES of input per slot (4 of these), not 64 tiny tasks per slot.
    assert agent.prefetch_depth() == 2 * 4


def test_a_fixed_prefetch_never_moves(tmp_path):
    a = WorkerAgent(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}),
                    parse_url("tcp://127.0.0.1:9"), "t" * 32, slots=1, info={},
                    local_control=False, prefetch=0)
    try:
        a._note_run_time(0.0001)
        assert a.prefetch_depth() == 0 and a._granted_depth == 0
    finally:
        a.link.close()
        a._ctx.term()
