"""What a task costs the journal: three statements (submit, result, collection), none per lease,
and every run of one statement in a turn goes to SQLite as one executemany."""

from __future__ import annotations

from gpumesh.config import Limits, Timing
from gpumesh.coordinator.broker import Broker
from gpumesh.protocol import Command, Message, decode, encode
from gpumesh.store import Store

W, C = b"worker-routing", b"client-routing"


def msg(command: Command, header: dict, payload: list | None = None) -> Message:
    return decode(encode(command, header, payload or []), Limits())


def test_a_task_costs_three_statements_and_a_lease_none():
    store = Store(":memory:")
    b = Broker(store, Timing(), Limits(), epoch=1, now=0.0)
    b.handle(W, msg(Command.HELLO, {"role": "worker", "id": "w1", "slots": 4, "credit": 4,
                                    "proto": [1, 1], "info": {"python": "3.11"}}), 0.0)
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
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
    for header in tasks:
        b.handle(W, msg(Command.RESULT, {"task": header["task"], "lease": header["lease"],
                                         "status": "ok", "encoding": "text"}, [b"r"]), 1.0)
    b.handle(C, msg(Command.RESULT_ACK, {"tasks": [h["task"] for h in tasks]}), 2.0)
    store.commit()
    writes = [s.split(" SET ")[1].split(" =")[0] for s in statements if s.startswith("UPDATE")]
    assert sorted(writes) == ["state"] * 8  # 4 results, 4 collections: one UPDATE each
    rows = {r.task_id: r for r in store.load()}
    assert all(rows[h["task"]].state == "collected" for h in tasks)
