"""What a task costs the journal: two statements (submit, collection) when its client collects the
result within RESULT_JOURNAL_DELAY, three (the result too) when it does not; none per lease. Every
run of one statement in a turn goes to SQLite as one executemany."""

from __future__ import annotations

from gpumesh.config import Limits, Timing
from gpumesh.coordinator.broker import Broker
from gpumesh.coordinator.ledger import RESULT_JOURNAL_DELAY
from gpumesh.protocol import Command, Message, decode, encode
from gpumesh.store import Store

W, C = b"worker-routing", b"client-routing"


def msg(command: Command, header: dict, payload: list | None = None) -> Message:
    return decode(encode(command, header, payload or []), Limits())


def worker_acks(b: Broker) -> list[dict]:
    acks = [decode(f, Limits()) for r, f in b.outbox if r == W]
    return [m.header for m in acks if m.command is Command.RESULT_ACK]


def mesh(slots: int) -> tuple[Store, Broker]:
    """A broker with a journal in memory, one worker of ``slots`` slots and one client."""
    store = Store(":memory:")
    b = Broker(store, Timing(), Limits(), epoch=1, now=0.0)
    b.handle(W, msg(Command.HELLO, {"role": "worker", "id": "w1", "slots": slots,
                                    "credit": slots, "proto": [1, 1],
                                    "info": {"python": "3.11"}}), 0.0)
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    return store, b


def test_a_collected_task_costs_two_statements_and_a_lease_none():
    store, b = mesh(slots=4)
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    specs = [{"seq": s, "nf": 1, "kind": "script"} for s in range(4)]
    b.handle(C, msg(Command.SUBMIT, {"tasks": specs, "job": "j1"}, [b"p"] * 4), 0.0)
    store.commit()
    inserts = [s for s in statements if s.startswith("INSERT INTO tasks")]
    assert len(inserts) == 4
    statements.clear()
    assert b.dispatch(0.5) == 4
    store.commit()
    assert statements == []  # leasing writes nothing: attempts are journaled with the result
    tasks = [m.header for m in (decode(f, Limits()) for _, f in b.outbox)
             if m.command is Command.TASK]
    b.outbox.clear()
    for header in tasks:
        b.handle(W, msg(Command.RESULT, {"task": header["task"], "lease": header["lease"],
                                         "status": "ok", "encoding": "text"}, [b"r"]), 1.0)
    store.commit()
    # Not journaled yet, so the worker keeps each result: its RESULT_ACK waits.
    assert statements == [] and worker_acks(b) == []
    late = tasks.pop()  # its client does not collect it in time
    b.handle(C, msg(Command.RESULT_ACK, {"tasks": [h["task"] for h in tasks]}), 1.01)
    b.ledger.journal_held_results(1.01)
    store.commit()
    writes = [s.split(" SET ")[1].split(" =")[0] for s in statements if s.startswith("UPDATE")]
    assert writes == ["state"] * 3  # 3 collections, one UPDATE each; no result was written
    assert "result_payload = x" not in " ".join(statements)
    assert sorted(a["task"] for a in worker_acks(b)) == sorted(h["task"] for h in tasks)
    statements.clear()
    b.outbox.clear()
    b.ledger.journal_held_results(1.0 + RESULT_JOURNAL_DELAY)
    store.commit()
    assert len(statements) == 3 and "result_payload = x" in statements[1]  # BEGIN, it, COMMIT
    assert [a["task"] for a in worker_acks(b)] == [late["task"]]
    rows = {r.task_id: r for r in store.load()}
    assert all(rows[h["task"]].state == "collected" for h in tasks)
    assert rows[late["task"]].state == "done" and rows[late["task"]].result_payload == [b"r"]


def _one_task_leased(b: Broker) -> dict:
    """Submit one script task and hand it to the worker: the TASK's header."""
    b.handle(C, msg(Command.SUBMIT, {"tasks": [{"seq": 1, "nf": 1, "kind": "script"}]}, [b"p"]),
             0.0)
    b.dispatch(0.0)
    (task,) = [m.header for m in (decode(f, Limits()) for _, f in b.outbox)
               if m.command is Command.TASK]
    return task


def test_a_result_for_an_absent_client_is_journaled_at_once():
    store, b = mesh(slots=1)
    task = _one_task_leased(b)
    b.handle(C, msg(Command.DISCONNECT, {}), 0.5)
    b.outbox.clear()
    b.handle(W, msg(Command.RESULT, {"task": task["task"], "lease": task["lease"],
                                     "status": "ok", "encoding": "text"}, [b"r"]), 1.0)
    store.commit()
    assert b.ledger.held_results == {} and worker_acks(b)[0]["disposition"] == "accepted"
    assert [r.state for r in store.load()] == ["done"]


def test_a_held_result_sent_again_is_not_acknowledged_before_it_is_journaled():
    # A worker re-sends its unacknowledged results after every WELCOME: the copy found the
    # task finished (in memory) and was told "duplicate" at once, so the worker forgot the
    # result while the journal still said the task was to run.
    store, b = mesh(slots=1)
    task = _one_task_leased(b)
    b.outbox.clear()
    result = {"task": task["task"], "lease": task["lease"], "status": "ok", "encoding": "text"}
    b.handle(W, msg(Command.RESULT, result, [b"r"]), 1.0)
    b.handle(W, msg(Command.RESULT, result, [b"r"]), 1.001)  # sent again
    assert task["task"] in b.ledger.held_results and worker_acks(b) == []
    b.ledger.journal_held_results(1.0 + RESULT_JOURNAL_DELAY)
    store.commit()
    assert [a["disposition"] for a in worker_acks(b)] == ["accepted", "duplicate"]
