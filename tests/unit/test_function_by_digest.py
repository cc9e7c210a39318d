"""A function travels once: once per SUBMIT from the client (its function table), once per
worker session to a worker (``fnkeep``, then ``fnref``), and is journaled once. Broker and agent
driven by hand, no sockets."""

from __future__ import annotations

import pytest

from gpumesh.config import Limits, Timing
from gpumesh.coordinator.broker import Broker
from gpumesh.coordinator.ledger import FUNCTIONS_PER_WORKER
from gpumesh.protocol import Command, Message, decode, encode, serialize
from gpumesh.store import Store

W, C = b"worker-routing", b"client-routing"


def msg(command: Command, header: dict, payload: list | None = None) -> Message:
    return decode(encode(command, header, payload or []), Limits())


def function(name: str) -> tuple[bytes, str]:
    frame = serialize.dumps(len)[0] + name.encode()
    return frame, serialize.function_digest(frame)


@pytest.fixture
def broker() -> Broker:
    b = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0)
    b.handle(W, msg(Command.HELLO, {"role": "worker", "id": "w1", "slots": 1, "credit": 500,
                                    "prefetch": 256, "proto": [1, 1], "fnref": True,
                                    "info": {"python": "3.11", "cores": 64}}), 0.0)
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    b.outbox.clear()
    return b


def sent(b: Broker, command: Command) -> list[Message]:
    return [m for m in (decode(frames, Limits()) for _, frames in b.outbox) if m.command is command]


def test_a_submit_carries_each_function_once_and_its_tasks_name_it(broker):
    fn, digest = function("f")
    specs = [{"seq": i, "nf": 1, "kind": "fn", "fn": digest, "fnref": True} for i in range(3)]
    broker.handle(C, msg(Command.SUBMIT, {"tasks": specs, "fns": [digest]},
                         [fn, b"a0", b"a1", b"a2"]), 0.0)
    (answer,) = sent(broker, Command.ACCEPTED)
    assert len(answer.header["accepted"]) == 3 and answer.header["rejected"] == []
    tasks = sorted(broker.tasks.values(), key=lambda t: t.seq)
    assert [t.payload[1] for t in tasks] == [b"a0", b"a1", b"a2"]
    assert tasks[0].payload[0] == fn and tasks[0].payload[0] is tasks[2].payload[0]
    assert "fnref" not in tasks[0].spec  # stored as if the function had come with it


def test_a_task_naming_a_function_the_submit_lacks_or_forged_is_refused(broker):
    fn, digest = function("f")
    other, other_digest = function("g")
    specs = [{"seq": 1, "nf": 1, "kind": "fn", "fn": other_digest, "fnref": True},
             {"seq": 2, "nf": 1, "kind": "fn", "fn": digest, "fnref": True},
             {"seq": 3, "nf": 1, "kind": "script", "fnref": True, "name": "x.py"}]
    # The table says "digest" but carries other bytes: nothing may be filed under it.
    broker.handle(C, msg(Command.SUBMIT, {"tasks": specs, "fns": [digest]},
                         [other, b"a", b"b", b"c"]), 0.0)
    (answer,) = sent(broker, Command.ACCEPTED)
    assert answer.header["accepted"] == []
    assert [r[0] for r in answer.header["rejected"]] == [1, 2, 3]
    assert "not in this SUBMIT's function table" in answer.header["rejected"][0][2]
    assert broker.tasks == {}
    broker.outbox.clear()
    broker.handle(C, msg(Command.SUBMIT, {"tasks": [], "fns": [digest, digest]}, [fn]), 0.0)
    assert sent(broker, Command.ERROR)[-1].header["code"] == "malformed"


def test_a_worker_gets_a_function_once_per_session_then_its_name(broker):
    fn, digest = function("f")
    specs = [{"seq": i, "nf": 2, "kind": "fn", "fn": digest} for i in range(4)]
    broker.handle(C, msg(Command.SUBMIT, {"tasks": specs},
                         [x for i in range(4) for x in (fn, b"a%d" % i)]), 0.0)
    broker.outbox.clear()
    broker.dispatch(0.0)
    tasks = sent(broker, Command.TASK)
    assert len(tasks) == 4
    assert tasks[0].header.get("fnkeep") is True and tasks[0].payload[0] == fn
    for later in tasks[1:]:
        seq = broker.tasks[later.header["task"]].seq
        assert later.header.get("fnref") is True and later.payload == [b"a%d" % seq]
    # A new session (the worker said HELLO again) starts from nothing kept.
    broker.handle(W, msg(Command.HELLO, {"role": "worker", "id": "w1", "slots": 1, "credit": 500,
                                         "prefetch": 256, "proto": [1, 1], "fnref": True,
                                         "held": [[t.header["task"], t.header["lease"]]
                                                  for t in tasks],
                                         "info": {"python": "3.11", "cores": 64}}), 1.0)
    assert broker.workers["w1"].functions == set()


def test_a_worker_told_to_forget_starts_afresh_after_its_limit(broker):
    frames, specs = [], []
    for i in range(FUNCTIONS_PER_WORKER + 1):
        fn, digest = function(f"f{i}")
        specs.append({"seq": i, "nf": 2, "kind": "fn", "fn": digest})
        frames += [fn, b"x"]
    broker.handle(C, msg(Command.SUBMIT, {"tasks": specs}, frames), 0.0)
    broker.outbox.clear()
    broker.dispatch(0.0)
    tasks = sent(broker, Command.TASK)
    assert all(t.header.get("fnkeep") for t in tasks)
    assert [t.header.get("fnreset", False) for t in tasks] == [False] * FUNCTIONS_PER_WORKER + [True]
    assert len(broker.workers["w1"].functions) == 1


def test_a_worker_without_fnref_gets_every_function_as_before():
    b = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0)
    b.handle(W, msg(Command.HELLO, {"role": "worker", "id": "w1", "slots": 4, "credit": 4,
                                    "proto": [1, 1], "info": {"python": "3.11", "cores": 4}}), 0.0)
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    fn, digest = function("f")
    b.handle(C, msg(Command.SUBMIT, {"tasks": [{"seq": i, "nf": 2, "kind": "fn", "fn": digest}
                                               for i in range(2)]}, [fn, b"a", fn, b"b"]), 0.0)
    b.outbox.clear()
    b.dispatch(0.0)
    tasks = sent(b, Command.TASK)
    assert [t.payload[0] for t in tasks] == [fn, fn]
    assert not any(k in t.header for t in tasks for k in ("fnref", "fnkeep"))


# ----------------------------------------------------------------- the worker's side

@pytest.fixture
def agent(tmp_path):
    from test_worker_agent import recording_agent

    yield from recording_agent(tmp_path)


def test_the_agent_keeps_what_it_is_told_and_puts_it_back_when_named(agent):
    fn, digest = function("f")
    assert agent._with_function({"fn": digest, "fnkeep": True}, [fn, b"a"]) == [fn, b"a"]
    assert agent._with_function({"fn": digest, "fnref": True}, [b"b"]) == [fn, b"b"]
    other, other_digest = function("g")
    agent._with_function({"fn": other_digest, "fnkeep": True, "fnreset": True}, [other, b"c"])
    assert agent.functions == {other_digest: other}
    agent.session.hello()
    assert agent.functions == {}  # a new session: the coordinator's count starts over too
    assert [m.header.get("fnref") for m in agent.sent if m.command is Command.HELLO][-1] is True


def test_a_function_that_came_as_a_zmq_frame_is_kept_as_bytes(agent):
    # The first TASK of a run often arrives alone, its frames as zmq.Frames: the function is
    # kept as bytes, so the tasks that name it go to the runner the short way (all bytes).
    import zmq

    fn, digest = function("f")
    agent._with_function({"fn": digest, "fnkeep": True}, [zmq.Frame(fn), b"a"])
    frames = agent._with_function({"fn": digest, "fnref": True}, [b"b"])
    assert frames == [fn, b"b"] and all(type(f) is bytes for f in frames)


def test_a_coordinator_that_never_says_forget_cannot_grow_the_agents_table(agent):
    # Every field a peer sends is hostile until parsed: a coordinator of another build (or a
    # broken one) saying fnkeep forever must not fill the worker's memory with functions.
    for i in range(FUNCTIONS_PER_WORKER * 3):
        fn, digest = function(f"f{i}")
        agent._with_function({"fn": digest, "fnkeep": True}, [fn, b"a"])
        assert len(agent.functions) <= FUNCTIONS_PER_WORKER
    assert digest in agent.functions  # the newest is kept: its next fnref finds it
    fn, kept = function("f0")
    agent._with_function({"fn": kept, "fnkeep": True}, [fn, b"a"])
    again = len(agent.functions)
    agent._with_function({"fn": kept, "fnkeep": True}, [fn, b"a"])  # kept again: no reset
    assert len(agent.functions) == again


def test_a_named_function_the_agent_lacks_starts_a_new_session_not_a_wrong_run(agent):
    _, digest = function("f")
    agent.session.welcomed = True
    agent._on_task(msg(Command.TASK, {"task": "T", "lease": 5, "kind": "fn", "fn": digest,
                                      "fnref": True}, [b"args"]), 0.0)
    assert not agent.queue and not agent.session.welcomed
    hello = [m.header for m in agent.sent if m.command is Command.HELLO][-1]
    assert hello["held"] == []  # the coordinator takes the task back and sends it whole


def test_a_task_journaled_in_slices_or_shared_memory_always_travels_whole(broker):
    fn, digest = function("f")
    broker.handle(C, msg(Command.SUBMIT, {"tasks": [{"seq": i, "nf": 2, "kind": "fn", "fn": digest}
                                                    for i in range(2)]},
                         [fn, b"a", fn, b"b"]), 0.0)
    for task in broker.tasks.values():
        # As if its function frame had come in slices: never checked against its digest, so
        # it must never be kept under that digest on a worker.
        task.spec["split"] = [1, 1]
    broker.outbox.clear()
    broker.dispatch(0.0)
    tasks = sent(broker, Command.TASK)
    assert len(tasks) == 2 and not any("fnkeep" in t.header or "fnref" in t.header for t in tasks)
    assert broker.workers["w1"].functions == set()


def test_several_missing_functions_make_one_new_session_not_one_each(agent):
    _, digest = function("f")
    agent.session.welcomed = True
    for lease in (5, 6, 7):
        agent._on_task(msg(Command.TASK, {"task": f"T{lease}", "lease": lease, "kind": "fn",
                                          "fn": digest, "fnref": True}, [b"args"]), 0.0)
    assert [m.command for m in agent.sent].count(Command.HELLO) == 1
    agent.session.on_message(msg(Command.WELCOME, {}), 1.0)
    agent._on_task(msg(Command.TASK, {"task": "T8", "lease": 8, "kind": "fn", "fn": digest,
                                      "fnref": True}, [b"args"]), 2.0)
    assert [m.command for m in agent.sent].count(Command.HELLO) == 2  # a later miss: again


def test_tasks_sent_before_the_new_hello_was_read_are_not_run_and_the_missed_one_goes_back(agent):
    """After a function miss the agent says HELLO on the same socket; the TASKs already on
    their way were queued and run, while the coordinator, reading a HELLO that did not claim
    them, put them back in the queue (charged an attempt): the same task ran twice at once.
    And the task whose function was missing, never started, was charged too."""
    fn, digest = function("f")
    agent.session.hello()
    agent.session.on_message(msg(Command.WELCOME, {}), 0.0)
    agent.session.on_message(msg(Command.TASK, {"task": "T5", "lease": 5, "kind": "fn",
                                                "fn": digest, "fnref": True}, [b"args"]), 1.0)
    hello = [m.header for m in agent.sent if m.command is Command.HELLO][-1]
    assert hello["release"] == [5]  # handed back unstarted: no attempt charged
    received = agent.received
    agent.session.on_message(msg(Command.TASK, {"task": "T6", "lease": 6, "kind": "fn",
                                                "fn": digest, "fnkeep": True}, [fn, b"a"]), 1.1)
    assert not agent.queue and agent.received == received  # sent before that HELLO was read
    agent.session.on_message(msg(Command.WELCOME, {}), 2.0)
    agent.session.on_message(msg(Command.TASK, {"task": "T6", "lease": 9, "kind": "fn",
                                                "fn": digest, "fnkeep": True}, [fn, b"a"]), 2.1)
    assert [q.task.lease_id for q in agent.queue] == [9]  # what the new session sends runs
