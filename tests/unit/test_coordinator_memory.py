"""What the coordinator keeps after a drain: no per-task record of a collected task in memory,
tables right-sized once idle, and the C heap trimmed where glibc allows (and never otherwise)."""

from __future__ import annotations

import sys

import pytest

from gpumesh.config import Limits, Timing
from gpumesh.coordinator import broker as broker_module
from gpumesh.coordinator import memory
from gpumesh.coordinator.broker import Broker
from gpumesh.protocol import Command, Message, decode, encode
from gpumesh.store import Store

W, C = b"worker-routing", b"client-routing"


def msg(command: Command, header: dict, payload: list | None = None) -> Message:
    return decode(encode(command, header, payload or []), Limits())


def sent(b: Broker, command: Command) -> list[dict]:
    return [m.header for m in (decode(f, Limits()) for _, f in b.outbox) if m.command is command]


def drained_broker(count: int) -> tuple[Broker, list[str]]:
    """``count`` script tasks of job ``j1`` submitted, run, and their results acknowledged."""
    b = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0)
    b.handle(W, msg(Command.HELLO, {"role": "worker", "id": "w1", "slots": 1, "credit": 10**6,
                                    "prefetch": 16, "proto": [1, 1],
                                    "info": {"python": "3.11"}}), 0.0)
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    specs = [{"seq": s, "nf": 1, "kind": "script"} for s in range(count)]
    b.handle(C, msg(Command.SUBMIT, {"tasks": specs, "job": "j1", "name": "nightly"},
                    [b"p"] * count), 0.0)
    ids = [task_id for _, task_id in sent(b, Command.ACCEPTED)[-1]["accepted"]]
    while b.dispatch(0.5):
        tasks = sent(b, Command.TASK)
        b.outbox.clear()
        for header in tasks:
            b.handle(W, msg(Command.RESULT, {"task": header["task"], "lease": header["lease"],
                                             "status": "ok", "encoding": "text"},
                            [header["task"].encode()]), 1.0)
    for start in range(0, count, 500):
        b.handle(C, msg(Command.RESULT_ACK, {"tasks": ids[start:start + 500]}), 2.0)
    b.outbox.clear()
    b.store.commit()
    return b, ids


def test_a_collected_task_leaves_no_record_in_memory_but_status_lists_it_from_the_journal():
    b, ids = drained_broker(50)
    job = b.jobs["j1"]
    assert b.tasks == {} and job.task_ids == {} and job.summaries == {}
    assert job.collected == 50 and job.finished_at == 1.0
    view = b.status("nightly", 3.0)
    assert view["counts"] == {"done": 50} and view["total"] == 50
    assert [t["id"] for t in view["tasks"]] == ids  # submission order, from the journal
    assert view["tasks"][7] == {**view["tasks"][7], "state": "done", "worker": "w1",
                                "result": ids[7], "index": 7}


def test_a_job_lists_its_live_tasks_and_its_collected_ones_in_submission_order():
    b = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0)
    b.handle(W, msg(Command.HELLO, {"role": "worker", "id": "w1", "slots": 1, "credit": 1,
                                    "proto": [1, 1], "info": {"python": "3.11"}}), 0.0)
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    specs = [{"seq": s, "nf": 1, "kind": "script"} for s in range(3)]
    b.handle(C, msg(Command.SUBMIT, {"tasks": specs, "job": "j1"}, [b"p"] * 3), 0.0)
    ids = [task_id for _, task_id in sent(b, Command.ACCEPTED)[-1]["accepted"]]
    b.dispatch(0.5)
    (task,) = sent(b, Command.TASK)
    b.handle(W, msg(Command.RESULT, {"task": task["task"], "lease": task["lease"],
                                     "status": "ok", "encoding": "text"}, [b"r"]), 1.0)
    b.handle(C, msg(Command.RESULT_ACK, {"tasks": [task["task"]]}), 2.0)
    view = b.status("j1", 3.0)
    assert [(t["id"], t["state"]) for t in view["tasks"]] == [
        (ids[0], "done"), (ids[1], "pending"), (ids[2], "pending")]
    assert view["total"] == 3 and view["counts"] == {"done": 1, "pending": 2}


def test_idle_maintenance_right_sizes_the_tables_once_enough_tasks_left(monkeypatch):
    trims: list[bool] = []
    monkeypatch.setattr(broker_module, "trim_heap", lambda: trims.append(True) or True)
    b, _ = drained_broker(2000)
    assert b.ledger.released >= broker_module.MEMORY_AFTER
    grown = sys.getsizeof(b.tasks), sys.getsizeof(b.ledger.by_seq)
    b.tick(3.0)  # idle, but memory was given back less than MEMORY_INTERVAL ago (at start)
    assert trims == [] and sys.getsizeof(b.tasks) == grown[0]
    b.tick(10.0)
    assert trims == [True] and b.ledger.released == 0
    assert sys.getsizeof(b.tasks) < grown[0] and sys.getsizeof(b.ledger.by_seq) < grown[1]
    b.tick(20.0)  # nothing left since: no second pass
    assert trims == [True]


def test_memory_is_not_given_back_while_tasks_are_queued(monkeypatch):
    trims: list[bool] = []
    monkeypatch.setattr(broker_module, "trim_heap", lambda: trims.append(True) or True)
    b, _ = drained_broker(1000)
    b.handle(C, msg(Command.SUBMIT, {"tasks": [{"seq": 5000, "nf": 1, "kind": "script",
                                                "req": {"gpu": True}}]}, [b"p"]), 9.0)
    b.tick(10.0)
    assert trims == []


def test_trim_heap_is_a_no_op_without_malloc_trim(monkeypatch):
    monkeypatch.setattr(memory, "_malloc_trim", None)
    assert memory.trim_heap() is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_heap_calls_glibc_where_it_exists(monkeypatch):
    monkeypatch.setattr(memory, "_malloc_trim", memory._UNSET)
    if memory._find_malloc_trim() is None:
        pytest.skip("this C library has no malloc_trim (not glibc)")
    assert isinstance(memory.trim_heap(), bool)
    assert memory._malloc_trim is not None and memory._malloc_trim is not memory._UNSET


def test_a_queue_empty_between_single_calls_is_not_idle_for_the_journal_or_the_heap(monkeypatch):
    trims: list[bool] = []
    monkeypatch.setattr(broker_module, "trim_heap", lambda: trims.append(True) or True)
    b, _ = drained_broker(2000)
    b.tick(3.0)
    now = 10.0
    for seq in range(5000, 5005):  # one call a second, each over before the next check
        b.handle(C, msg(Command.SUBMIT, {"tasks": [{"seq": seq, "nf": 1, "kind": "script"}]},
                        [b"p"]), now)
        b.dispatch(now)
        task = sent(b, Command.TASK)[-1]
        b.handle(W, msg(Command.RESULT, {"task": task["task"], "lease": task["lease"],
                                         "status": "ok", "encoding": "text"}, [b"r"]), now)
        b.outbox.clear()
        now += 1.0
        b.tick(now)  # nothing queued or leased at this instant, but a task finished meanwhile
    assert trims == []
    b.tick(now + 1.0)  # a whole second without a task: idle now
    assert trims == [True]


def test_a_queued_task_holds_no_empty_containers_and_little_python():
    # Issue 9's bound is 2 KiB of coordinator memory per queued task beyond its payload, and
    # the Python objects are most of it: 1,146 B here, of which 176 B were an empty list for
    # its failures, one for its result and a dict for its leases, until they were made only
    # when needed. The rest of the 2 KiB is SQLite's page cache and the allocator's slack.
    import tracemalloc

    b = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0)
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)

    def submit(first: int, count: int) -> None:
        specs = [{"seq": s, "nf": 1, "kind": "script"} for s in range(first, first + count)]
        b.handle(C, msg(Command.SUBMIT, {"tasks": specs, "job": "j1", "name": "grid"},
                        [b"p"] * count), 0.0)
        b.outbox.clear()

    submit(0, 500)  # the job, its tables and the interned strings exist before the count
    count = 4000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for first in range(500, 500 + count, 500):
            submit(first, 500)
        per_task = (tracemalloc.get_traced_memory()[0] - before) / count
    finally:
        tracemalloc.stop()
    assert len(b.tasks) == 500 + count
    task = b.tasks[next(iter(b.tasks))]
    assert task.failures == () and task.result_payload == () and task.granted is None
    assert per_task < 1536, f"{per_task:.0f} B of Python objects per queued task"
