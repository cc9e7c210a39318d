"""Frames in the coordinator's shared memory reach only peers that map it unless they fit one
message: a task whose input is bigger goes only to a worker on the coordinator's machine (or
fails as unschedulable, saying why), and a result that big reaches a client elsewhere as an
error that says so. Before, either was sent in a message over the limits, which the peer drops
unanswered: the task was retried to no end, the result never came."""

from __future__ import annotations

import pytest

from gpumesh.config import Limits, Timing
from gpumesh.coordinator.broker import Broker
from gpumesh.coordinator.state import TaskState
from gpumesh.protocol import Command, Message, decode, encode, unbundle
from gpumesh.protocol.serialize import function_digest
from gpumesh.scheduler import (
    Requirements,
    TaskView,
    WorkerView,
    choose,
    explain_unschedulable,
    placement_class,
)
from gpumesh.store import Store

GiB = 1024**3
NAME = "a" * 32  # a shared file's name (the tests never open it)


def msg(command, header, payload=None):
    return decode(encode(command, header, payload or []), Limits())


def test_a_local_only_task_goes_only_to_a_worker_that_maps_the_memory():
    task = TaskView("t", local_only=True)
    here = WorkerView("here", free=1, shares_memory=True)
    elsewhere = WorkerView("elsewhere", free=1)
    assert choose(task, [elsewhere]) is None
    assert choose(task, [elsewhere, here]) is here
    assert choose(TaskView("t"), [elsewhere]) is elsewhere
    assert placement_class(Requirements(), False, 1.0, True) != \
        placement_class(Requirements(), False, 1.0, False)
    text = explain_unschedulable(Requirements(), [elsewhere], local_only=True)
    assert "needs" not in text and "coordinator's machine" in text
    assert "satisfies nothing" not in text


def _sent(broker: Broker, command: Command) -> list[tuple[bytes, Message]]:
    out = []
    for routing, frames in broker.outbox:
        message = decode(frames, Limits())
        inner = unbundle(message, Limits()) if message.command is Command.BATCH else [message]
        out += [(routing, m) for m in inner if isinstance(m, Message) and m.command is command]
    return out


def make_broker(*workers: str, pending_timeout: float = 60.0) -> Broker:
    """A client that reads the shared folder, and workers: ``here`` maps it, ``far`` does not."""
    b = Broker(Store(":memory:"), Timing(pending_timeout=pending_timeout), Limits(), epoch=1,
               now=0.0)
    b.handle(b"client", msg(Command.HELLO, {"role": "client", "id": "c", "proto": [1, 1]}), 0.0)
    b.clients["c"].shm = True  # as after its HEARTBEAT proved it reads the folder
    for name in workers:
        add_worker(b, name, 0.0)
    b.outbox.clear()
    return b


def add_worker(b: Broker, name: str, now: float) -> None:
    b.handle(name.encode(), msg(Command.HELLO, {"role": "worker", "id": name, "slots": 1,
                                                "credit": 1, "proto": [1, 1], "shmlock": True}),
             now)
    b.workers[name].shm = name == "here"  # as after its HEARTBEAT proved it maps the folder


@pytest.fixture
def broker() -> Broker:
    return make_broker("far")


FUNCTION = b"a pickled function"


def _spec(seq: int, shared_size: int) -> dict:
    return {"seq": seq, "nf": 3, "kind": "fn", "fn": function_digest(FUNCTION),
            "shm": [[2, NAME, shared_size]]}


def _submit(b: Broker, shared_size: int, seq: int = 1) -> str:
    spec = _spec(seq, shared_size)
    b.handle(b"client", msg(Command.SUBMIT, {"tasks": [spec]}, [FUNCTION, b"args", b""]), 0.0)
    accepted = _sent(b, Command.ACCEPTED)[-1][1].header
    assert accepted.get("rejected", []) == [], accepted
    return accepted["accepted"][0][1]


def test_a_big_shared_input_waits_for_a_worker_on_this_machine(broker):
    task_id = _submit(broker, 2 * GiB)
    assert broker.tasks[task_id].local_only
    assert broker.dispatch(0.1) == 0  # the worker elsewhere could only be sent 2 GiB at once
    add_worker(broker, "here", 0.2)
    assert broker.dispatch(0.3) == 1
    assert broker.tasks[task_id].worker_id == "here"


def test_a_small_shared_input_may_go_anywhere(broker):
    task = broker.tasks[_submit(broker, 100 * 1024 * 1024)]
    assert not task.local_only
    assert choose(task.view(), [broker.workers["far"].view()]) is not None


def test_with_no_worker_on_this_machine_it_fails_as_unschedulable_saying_why():
    broker = make_broker("far", pending_timeout=1.0)
    task_id = _submit(broker, 2 * GiB)
    broker.tick(1.5)
    task = broker.tasks[task_id]
    assert task.state is TaskState.FAILED
    assert "far" in task.result_header["diagnosis"]
    assert "is not on the coordinator's machine" in task.result_header["diagnosis"]


def test_a_big_shared_result_reaches_a_client_elsewhere_as_an_error():
    broker = make_broker("here")
    task_id = _submit(broker, 10)
    assert broker.dispatch(0.1) == 1
    broker.clients["c"].shm = False  # as a client on another machine
    broker.outbox.clear()
    broker.handle(b"here", msg(Command.RESULT, {
        "task": task_id, "lease": broker.tasks[task_id].lease_id, "status": "ok",
        "shm": [[0, "b" * 32, 2 * GiB]]}, [b""]), 0.2)
    results = [m.header for _, m in _sent(broker, Command.RESULT)]
    assert results and results[-1]["status"] == "error"
    assert results[-1]["error"]["type"] == "gpumesh.ResultTooLarge"
    assert "2,048.0 MiB" in results[-1]["error"]["message"]


def test_an_input_over_a_clients_whole_quota_is_refused_not_parked(broker):
    broker.handle(b"client", msg(Command.SUBMIT, {"tasks": [_spec(7, 5 * GiB)]},
                                 [FUNCTION, b"args", b""]), 0.0)
    rejected = _sent(broker, Command.ACCEPTED)[-1][1].header["rejected"]
    assert rejected[0][:2] == [7, "too_large"]
    assert "GPUMESH_MAX_QUEUED_GB" in rejected[0][2]


def _finish_big_result(broker: Broker, task_id: str, now: float) -> None:
    broker.outbox.clear()
    broker.handle(b"here", msg(Command.RESULT, {
        "task": task_id, "lease": broker.tasks[task_id].lease_id, "status": "ok",
        "shm": [[0, "b" * 32, 2 * GiB]]}, [b""]), now)


@pytest.mark.parametrize("proves", [True, False])
def test_a_big_result_waits_for_a_reconnected_clients_proof_of_shared_memory(proves):
    broker = make_broker("here")
    task_id = _submit(broker, 10)
    assert broker.dispatch(0.1) == 1
    # The client reconnects: a new session, its proof of the folder not read yet.
    broker.handle(b"client2", msg(Command.HELLO, {"role": "client", "id": "c", "proto": [1, 1],
                                                  "shmlock": True}), 10.0)
    _finish_big_result(broker, task_id, 10.1)
    assert _sent(broker, Command.RESULT) == []  # not the error: the proof may be on its way
    if proves:
        broker.clients["c"].shm = True  # its HEARTBEAT proved it
    broker.tick(11.0)
    assert _sent(broker, Command.RESULT) == []  # still within the grace
    broker.tick(12.5)
    (routing, result), = _sent(broker, Command.RESULT)
    assert routing == b"client2"
    if proves:
        assert result.header["status"] == "ok" and result.header["shm"][0][2] == 2 * GiB
    else:
        assert result.header["error"]["type"] == "gpumesh.ResultTooLarge"
