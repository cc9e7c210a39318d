"""Issue 8's findings, each pinned with plain values: hostile peers holding the token, a poisoned
journal, and bugs of our own, none of which may stop the coordinator, the agent or the client."""

from __future__ import annotations

import logging
import pickle
import secrets

import msgpack
import pytest

from gpumesh import scheduler
from gpumesh.client.engine import decode_result
from gpumesh.config import Limits, Timing
from gpumesh.coordinator.broker import Broker
from gpumesh.coordinator.state import TaskState
from gpumesh.errors import TaskError
from gpumesh.protocol import Command, Message, decode, encode, serialize
from gpumesh.store import Store

W, W2, C = b"w1-routing", b"w2-routing", b"c1-routing"
CLIENT_INFO = {"user": "ana", "host": "lab"}


def msg(command: Command, header: dict, payload: list | None = None) -> Message:
    return decode(encode(command, header, payload or []), Limits())


def sent(b: Broker, command: Command, to: bytes | None = None) -> list[dict]:
    out = [(routing, decode(frames, Limits())) for routing, frames in b.outbox]
    return [m.header for routing, m in out if m.command is command and to in (None, routing)]


def worker_hello(worker_id: str = "w1", **extra) -> dict:
    return {"role": "worker", "id": worker_id, "slots": 1, "proto": [1, 1],
            "info": {"python": "3.11", "cores": 4}, **extra}


def new_broker(store: Store, now: float = 0.0, limits: Limits | None = None) -> Broker:
    b = Broker(store, Timing(), limits or Limits(), epoch=store.next_epoch(), now=now)
    b.restore(now)
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1],
                                    "info": CLIENT_INFO}), now)
    return b


@pytest.fixture
def broker() -> Broker:
    b = new_broker(Store(":memory:"))
    b.handle(W, msg(Command.HELLO, worker_hello()), 0.0)
    b.outbox.clear()
    return b


def submit(b: Broker, spec: dict, payload: list | None = None, seq: int = 1) -> list:
    payload = payload if payload is not None else [b"payload"]
    b.handle(C, msg(Command.SUBMIT, {"tasks": [{"seq": seq, "nf": len(payload), "kind": "fn",
                                                **spec}]}, payload), 0.0)
    return sent(b, Command.ACCEPTED)[-1]["accepted"]


# ----------------------------------------------------------------- 1. a poisoned journal

def test_a_requirement_of_the_wrong_type_is_refused_before_the_journal_and_restarts_stay_up(tmp_path):
    store = Store(tmp_path / "j.db")
    b = new_broker(store)
    b.handle(C, msg(Command.SUBMIT, {"tasks": [{"seq": 1, "nf": 1, "kind": "fn",
                                                "req": {"python": ["3.11"]}}]}, [b"f"]), 0.0)
    (rejected,) = sent(b, Command.ACCEPTED)[-1]["rejected"]
    assert rejected[1] == "malformed" and "python" in rejected[2]
    store.commit()
    assert list(store.load()) == []
    store.close()
    again = new_broker(Store(tmp_path / "j.db"), now=10.0)
    again.tick(20.0)  # the old coordinator died here, every time, about 5 s after a restart
    assert again.tasks == {}
    again.store.close()


def test_a_journal_row_that_no_longer_parses_fails_its_task_at_restore(tmp_path, caplog):
    store = Store(tmp_path / "j.db")
    b = new_broker(store)
    (good,) = [t for _, t in submit(b, {})]
    store.add_task("bad000000001", "c1", 2, "job", {"kind": "fn", "req": {"python": ["3.11"]}},
                   [b"f"], 0.0)  # as a bug of ours, or a hand edit, might have left it
    store.commit()
    store.close()
    with caplog.at_level(logging.WARNING, "gpumesh.coordinator"):
        again = new_broker(Store(tmp_path / "j.db"), now=10.0)
    bad = again.tasks["bad000000001"]
    assert bad.state is TaskState.FAILED
    assert "journal entry for this task no longer parses" in bad.result_header["diagnosis"]
    assert again.tasks[good].state is TaskState.RESTORED
    assert "no longer parses" in caplog.text
    again.tick(10.0 + Timing().restore_grace + 1)  # and the loop goes on
    assert again.tasks[good].state is TaskState.PENDING
    again.store.commit()
    again.store.close()
    # Its input stays in the journal (the cause may pass): it was erased, for good.
    journal = Store(tmp_path / "j.db")
    (row,) = [r for r in journal.load() if r.task_id == "bad000000001"]
    journal.close()
    assert row.state == "failed" and row.payload == [b"f"]


# ----------------------------------------------------------------- 2. a worker's inventory

@pytest.mark.parametrize("info", [
    {"cores": "many"}, {"memory": [1]}, {"gpus": "x"}, {"gpus": [{"name": 5}]},
    {"score": "fast"}, {"score": float("nan")}, {"python": ["3.11"]}, {"hostname": "h" * 5000},
    {"gpus": [{"name": "A100", "vram": "a lot"}]},
])
def test_a_mistyped_inventory_is_refused_at_hello_and_the_coordinator_goes_on(info):
    b = new_broker(Store(":memory:"))
    b.handle(W, msg(Command.HELLO, {**worker_hello(), "info": info}), 0.0)
    assert "w1" not in b.workers
    assert sent(b, Command.ERROR, W)[-1]["code"] == "malformed"
    for now in (0.5, 1.5, 2.5):  # `state.py` called int()/float() on peer data once a second
        b.tick(now)
        b.dispatch(now)


def test_an_inventory_with_sizes_as_the_readme_writes_them_is_understood():
    b = new_broker(Store(":memory:"))
    info = {"cores": 8, "memory": "64GB", "gpus": [{"name": "A100", "vram": "40GB"}]}
    b.handle(W, msg(Command.HELLO, {**worker_hello(), "info": info}), 0.0)
    view = b.workers["w1"].view()
    assert view.memory == 64 * 10**9 and view.gpus == (scheduler.Gpu("A100", 40 * 10**9),)


# ----------------------------------------------------------------- 3. forged results

def test_a_result_for_a_lease_never_granted_to_that_worker_decides_nothing(broker):
    broker.handle(W2, msg(Command.HELLO, worker_hello("w2")), 0.0)
    ((_, task_id),) = submit(broker, {})
    broker.dispatch(0.0)
    task = broker.tasks[task_id]
    holder = W if task.worker_id == "w1" else W2
    forger = W2 if holder == W else W
    for lease in (2**62, task.lease_id):  # a made-up lease, and the real one from another worker
        broker.handle(forger, msg(Command.RESULT, {"task": task_id, "lease": lease,
                                                   "status": "ok"}, [b"forged"]), 0.1)
        assert task.state is TaskState.LEASED
        assert sent(broker, Command.RESULT_ACK, forger)[-1]["disposition"] == "rejected"
    assert sent(broker, Command.RESULT, C) == []
    broker.handle(holder, msg(Command.RESULT, {"task": task_id, "lease": task.lease_id,
                                               "status": "ok"}, [b"real"]), 0.2)
    assert task.state is TaskState.DONE


def test_a_script_result_that_is_a_pickle_is_refused_by_the_coordinator(broker):
    ((_, task_id),) = submit(broker, {"kind": "script", "name": "job.py"}, [b"src", b"{}"])
    broker.dispatch(0.0)
    lease = broker.tasks[task_id].lease_id
    broker.handle(W, msg(Command.RESULT, {"task": task_id, "lease": lease, "status": "ok"},
                         [pickle.dumps({"x": 1})]), 0.1)
    task = broker.tasks[task_id]
    assert task.state is TaskState.FAILED and task.result_payload == []
    assert "not JSON or text" in task.result_header["diagnosis"]


class _Tripwire:
    fired = False

    def __reduce__(self):
        return (_fire, ())


def _fire():
    _Tripwire.fired = True
    return "unpickled"


def test_the_client_never_unpickles_a_scripts_result_whatever_the_header_says():
    payload = [pickle.dumps(_Tripwire())]
    for header in ({"status": "ok"}, {"status": "error", "error": {"message": "m"}}):
        with pytest.raises(TaskError):
            decode_result({**header, "task": "t"}, payload, script=True)
    assert not _Tripwire.fired
    assert decode_result({"status": "ok"}, payload) == "unpickled"  # a function's result is


# ----------------------------------------------------------------- 8. unbounded peers

def test_a_worker_cannot_claim_more_slots_than_its_machine_or_hold_more_than_them():
    b = new_broker(Store(":memory:"))
    b.handle(W, msg(Command.HELLO, worker_hello(slots=100_000)), 0.0)
    assert "w1" not in b.workers and "slots" in sent(b, Command.ERROR, W)[-1]["message"]
    b.handle(W, msg(Command.HELLO, worker_hello(slots=2, credit=10**9)), 0.0)
    for seq in range(1, 51):
        submit(b, {}, seq=seq)
    assert b.dispatch(0.0) == 2  # its two slots, not the credit it claimed
    b.handle(W, msg(Command.CREDIT, {"granted": 10**12}), 0.1)
    assert b.dispatch(0.1) == 0


def test_client_info_is_schema_checked_and_nothing_else_is_kept():
    b = new_broker(Store(":memory:"))
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1],
                                    "info": {**CLIENT_INFO, "junk": "x" * 900_000}}), 0.0)
    assert b.clients["c1"].info.to_dict() == {"pid": 0, "host": "lab", "user": "ana"}
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c2", "proto": [1, 1],
                                    "info": {"host": ["x"]}}), 0.0)
    assert "c2" not in b.clients


def test_a_client_over_its_byte_quota_is_told_busy_and_nothing_is_journaled():
    b = new_broker(Store(":memory:"), limits=Limits(max_queued_bytes=3000))
    assert submit(b, {}, [b"x" * 2500], seq=1) != []
    assert submit(b, {}, [b"y" * 2500], seq=2) == []
    rejected = sent(b, Command.ACCEPTED)[-1]["rejected"]
    assert rejected[0][1] == "busy" and "GPUMESH_MAX_QUEUED_GB" in rejected[0][2]
    assert len(list(b.store.load())) == 1
    b.handle(b"c2-routing", msg(Command.HELLO, {"role": "client", "id": "c2", "proto": [1, 1],
                                                "info": CLIENT_INFO}), 0.0)
    b.handle(b"c2-routing", msg(Command.SUBMIT, {"tasks": [{"seq": 1, "nf": 1, "kind": "fn"}]},
                                [b"z" * 2500]), 0.0)
    b.handle(b"c3-routing", msg(Command.HELLO, {"role": "client", "id": "c3", "proto": [1, 1],
                                                "info": CLIENT_INFO}), 0.0)
    b.handle(b"c3-routing", msg(Command.SUBMIT, {"tasks": [{"seq": 1, "nf": 1, "kind": "fn"}]},
                                [b"w" * 2500]), 0.0)  # its own quota is free; all together not
    refused = sent(b, Command.ACCEPTED, b"c3-routing")[-1]["rejected"][0]
    assert refused[1] == "busy" and "from all clients" in refused[2]


def test_a_reply_too_big_for_the_header_limit_is_paged_and_each_page_fits():
    limits = Limits(max_header_bytes=64 * 1024)
    b = new_broker(Store(":memory:"), limits=limits)
    big = {"python": "3.11", "cores": 4, "hostname": "h" * 200, "device_name": "d" * 200,
           "gpus": [{"name": "n" * 200, "vram": 1} for _ in range(4)]}
    for i in range(200):
        b.handle(b"w%d" % i, msg(Command.HELLO, {**worker_hello(f"w{i}"), "info": big}), 0.0)
    b.outbox.clear()
    seen: list = []
    page = 0
    while True:
        b.handle(C, msg(Command.QUERY, {"qid": 5, "what": "workers", "page": page}), 1.0)
        routing, frames = b.outbox[-1]
        assert len(frames[2]) <= limits.max_header_bytes
        reply = msgpack.unpackb(frames[2])
        seen += reply["data"]
        if "more" not in reply:
            break
        page = reply["more"]
    assert len(seen) == 200 and len({w["id"] for w in seen}) == 200


# ----------------------------------------------------------------- the loop survives our bugs

def test_a_bug_while_handling_one_message_is_answered_and_contained(broker, monkeypatch, caplog):
    def explode(*args):
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(broker.client_side, "query", explode)
    with caplog.at_level(logging.ERROR, "gpumesh.coordinator"):
        broker.handle(C, msg(Command.QUERY, {"qid": 9, "what": "workers"}), 0.0)
    error = sent(broker, Command.ERROR, C)[-1]
    assert error["qid"] == 9 and "could not handle this QUERY" in error["message"]
    assert "QUERY" in caplog.text
    assert submit(broker, {}) != []  # and the next message is served


def test_a_bug_while_dispatching_one_task_fails_that_task_and_the_rest_go_out(broker, monkeypatch):
    broker.handle(W, msg(Command.HELLO, worker_hello(slots=2, info={"cores": 4})), 0.0)
    (first,) = [t for _, t in submit(broker, {}, seq=1)]
    (second,) = [t for _, t in submit(broker, {"priority": -1}, seq=2)]
    real = scheduler.Placer.choose
    calls = []

    def choose_once_badly(placer, task, **options):
        calls.append(task.task_id)
        if len(calls) == 1:
            raise RuntimeError("a bug of ours")
        return real(placer, task, **options)

    monkeypatch.setattr(scheduler.Placer, "choose", choose_once_badly)
    assert broker.dispatch(0.0) == 1
    assert broker.tasks[first].state is TaskState.FAILED
    assert "could not schedule" in broker.tasks[first].result_header["diagnosis"]
    assert broker.tasks[second].state is TaskState.LEASED


def test_a_bug_in_one_timer_duty_leaves_the_others_running(broker, monkeypatch, caplog):
    ((_, task_id),) = submit(broker, {})
    broker.dispatch(0.0)

    def explode(now):
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(broker.retention, "sweep", explode)
    monkeypatch.setattr(broker, "_fail_unschedulable", explode)
    with caplog.at_level(logging.ERROR, "gpumesh.coordinator"):
        broker.tick(Timing().silence_limit + 60)
    assert broker.workers["w1"].state.value == "lost"  # expiry still ran
    assert broker.tasks[task_id].state is TaskState.PENDING
    assert "fail unschedulable tasks" in caplog.text and "sweep" in caplog.text


def test_big_frames_are_split_under_the_frame_limit_and_rebuilt_whole():
    data = bytes(range(256)) * 20_000  # 5 MB
    wire, layout = serialize.split_frames([b"head", data, memoryview(data)], 1 << 20)
    assert max(len(memoryview(f)) for f in wire) <= 1 << 20 and layout == [1, 5, 5]
    assert serialize.join_frames(wire, layout) == [b"head", data, data]
    with pytest.raises(ValueError):
        serialize.join_frames(wire, [1, 5, 4])


# ----------------------------------------------------------------- from the adversarial review

def _leased_script(b: Broker) -> tuple[str, int]:
    ((_, task_id),) = submit(b, {"kind": "script", "name": "job.py"}, [b"src", b"{}"])
    b.dispatch(0.0)
    return task_id, b.tasks[task_id].lease_id


def test_a_big_script_output_split_over_several_frames_is_one_result(broker):
    task_id, lease = _leased_script(broker)
    text = "é" * 700_000  # 1.4 MB of UTF-8, cut inside a character by the split
    wire, layout = serialize.split_frames([text.encode()], (1 << 20) - 4096)
    broker.handle(W, msg(Command.RESULT, {"task": task_id, "lease": lease, "status": "ok",
                                          "encoding": "text", "split": layout}, wire), 0.1)
    task = broker.tasks[task_id]
    assert task.state is TaskState.DONE and task.result_header["split"] == layout
    assert decode_result(task.result_header, task.result_payload, script=True) == text


def test_asking_again_and_again_for_one_result_queues_it_once(broker):
    ((_, task_id),) = submit(broker, {})
    broker.dispatch(0.0)
    lease = broker.tasks[task_id].lease_id
    broker.handle(W, msg(Command.RESULT, {"task": task_id, "lease": lease, "status": "ok"},
                         [b"r" * 1000]), 0.1)
    broker.outbox.clear()
    broker.handle(C, msg(Command.FETCH, {"qid": 0, "tasks": [task_id] * 5000}), 0.2)
    broker.handle(C, msg(Command.FETCH, {"qid": 0, "tasks": [task_id]}), 0.3)
    assert len(sent(broker, Command.RESULT, C)) == 0  # delivered at 0.1: not again within 1 s
    broker.handle(C, msg(Command.FETCH, {"qid": 0, "tasks": [task_id] * 5000}), 1.5)
    assert len(sent(broker, Command.RESULT, C)) == 1


def test_a_client_asking_faster_than_the_query_rate_is_told_busy(broker):
    for _ in range(40):
        broker.handle(C, msg(Command.QUERY, {"qid": 1, "what": "workers"}), 5.0)
    busy = [e for e in sent(broker, Command.ERROR, C) if e["code"] == "busy"]
    assert 15 <= len(busy) <= 25 and "requests a second" in busy[0]["message"]
    broker.outbox.clear()
    broker.handle(C, msg(Command.QUERY, {"qid": 2, "what": "workers"}), 6.0)  # refilled
    assert sent(broker, Command.REPLY, C)[-1]["qid"] == 2


def test_a_second_process_under_a_live_workers_id_takes_nothing_from_it(broker):
    ((_, task_id),) = submit(broker, {})
    broker.dispatch(0.0)
    lease = broker.tasks[task_id].lease_id
    broker.handle(W2, msg(Command.HELLO, worker_hello("w1", incarnation="other")), 0.5)
    assert sent(broker, Command.ERROR, W2)[-1]["code"] == "unexpected"
    broker.handle(W2, msg(Command.RESULT, {"task": task_id, "lease": lease, "status": "ok"},
                          [b"forged"]), 0.6)
    task = broker.tasks[task_id]
    assert task.state is TaskState.LEASED and task.attempts == 1
    assert broker.workers["w1"].routing == W


def test_worker_and_client_records_stay_bounded_under_churn(monkeypatch):
    from gpumesh.coordinator import clients, workers

    monkeypatch.setattr(workers, "MAX_WORKER_RECORDS", 50)
    monkeypatch.setattr(clients, "MAX_CLIENT_RECORDS", 50)
    b = new_broker(Store(":memory:"))
    for i in range(300):
        b.handle(W, msg(Command.HELLO, worker_hello(f"w{i}")), i * 0.01)
        b.handle(W, msg(Command.DISCONNECT, {"reason": "left"}), i * 0.01)
        b.handle(C, msg(Command.HELLO, {"role": "client", "id": f"c{i}", "proto": [1, 1]}),
                 i * 0.01)
        b.handle(C, msg(Command.DISCONNECT, {}), i * 0.01)
    assert len(b.workers) <= 50 and len(b.clients) <= 50
    assert "worker_joined" in {e.kind for e in b.ledger.events}
    assert all(len(msgpack.packb(e.data)) < 1024 for e in b.ledger.events)  # slim events


def test_a_result_whose_elapsed_time_went_backwards_still_counts(broker):
    ((_, task_id),) = submit(broker, {})
    broker.dispatch(0.0)
    broker.handle(W, msg(Command.RESULT, {"task": task_id, "lease": broker.tasks[task_id].lease_id,
                                          "status": "ok", "elapsed": -3.5}, [b"r"]), 0.1)
    assert broker.tasks[task_id].state is TaskState.DONE


def test_tasks_restored_after_a_restart_do_not_unbalance_their_owners_quota(tmp_path):
    store = Store(tmp_path / "j.db")
    b = new_broker(store)
    submit(b, {}, [b"x" * 5000], seq=1)
    store.commit()
    store.close()
    again = new_broker(Store(tmp_path / "j.db"), now=10.0)
    submit(again, {}, [b"y" * 3000], seq=2)
    client = again.clients["c1"]
    assert client.queued_bytes == 3000 and client.unfinished == 1
    restored = next(t for t in again.tasks.values() if t.seq == 1)
    assert again.ledger.cancel_task(restored, 11.0)  # it finishes: it was never counted here
    assert client.queued_bytes == 3000 and client.unfinished == 1
    again.store.close()


def test_a_timeout_of_zero_means_no_limit_as_the_client_documents_it(broker):
    ((_, task_id),) = submit(broker, {"timeout": 0})
    assert "timeout" not in broker.tasks[task_id].spec


def test_nobody_adds_tasks_to_another_owners_job_and_old_jobs_are_anybodys(broker):
    broker.handle(C, msg(Command.SUBMIT, {"job": "j1", "tasks": [{"seq": 1, "nf": 0,
                                                                  "kind": "fn"}]}), 0.0)
    bo = b"bo-routing"
    broker.handle(bo, msg(Command.HELLO, {"role": "client", "id": "bo", "proto": [1, 1],
                                          "info": {"user": "bo", "host": "desk"}}), 0.0)
    broker.handle(bo, msg(Command.SUBMIT, {"job": "j1", "tasks": [{"seq": 1, "nf": 0,
                                                                   "kind": "fn"}]}), 0.0)
    refused = sent(broker, Command.ACCEPTED, bo)[-1]["rejected"][0]
    assert refused[1] == "unexpected" and "ana@lab" in refused[2]
    broker.jobs["j1"].owner = "0123456789abcdef"  # a journal from before owners: a client id
    broker.handle(bo, msg(Command.CONTROL, {"qid": 3, "action": "cancel", "target": "j1"}), 0.1)
    assert sent(broker, Command.REPLY, bo)[-1]["data"]["cancelled"] == 1


def test_a_journal_row_that_does_not_decode_fails_its_task_and_the_restart_goes_on(tmp_path):
    store = Store(tmp_path / "j.db")
    b = new_broker(store)
    (good,) = [t for _, t in submit(b, {})]
    (bad,) = [t for _, t in submit(b, {}, seq=2)]
    store.commit()
    store._db.execute("UPDATE tasks SET spec = ? WHERE task_id = ?", (b"\xc1\xc1garbage", bad))
    store._db.commit()
    store.close()
    again = new_broker(Store(tmp_path / "j.db"), now=10.0)
    assert again.tasks[bad].state is TaskState.FAILED
    assert "does not decode" in again.tasks[bad].result_header["diagnosis"]
    assert again.tasks[good].state is TaskState.RESTORED
    again.store.close()


def test_events_are_paged_by_sequence_so_none_is_lost_between_pages():
    b = new_broker(Store(":memory:"), limits=Limits(max_header_bytes=16 * 1024))
    for i in range(300):
        b.handle(b"w%d" % i, msg(Command.HELLO, worker_hello(f"w{i}")), 0.0)
    seen: list[int] = []
    page, now = 0, 1.0
    while True:
        b.outbox.clear()
        b.handle(C, msg(Command.QUERY, {"qid": 4, "what": "events", "page": page}), now)
        reply = msgpack.unpackb(b.outbox[-1][1][2])
        seen += [e[0] for e in reply["data"]]
        b.handle(b"late%d" % now, msg(Command.HELLO, worker_hello(f"late{now}")), now)
        if "more" not in reply:
            break
        page, now = reply["more"], now + 1.0
    assert seen == sorted(set(seen)) and seen[0] == 1
    assert set(range(1, seen[-1] + 1)) <= set(seen)


def test_an_events_query_unpacks_one_page_of_the_log_not_all_of_it(monkeypatch):
    from gpumesh.coordinator import clients

    monkeypatch.setattr(clients, "EVENTS_PER_PAGE", 50)  # pages that fit the header easily
    b = new_broker(Store(":memory:"))
    for i in range(120):
        b.handle(b"w%d" % i, msg(Command.HELLO, worker_hello(f"w{i}")), 0.0)
    last = b.ledger.events.last_seq
    unpacked = []
    real_since = b.ledger.events.since

    def counting_since(seq):
        for event in real_since(seq):
            unpacked.append(event.seq)
            yield event

    monkeypatch.setattr(b.ledger.events, "since", counting_since)
    seen: list[int] = []
    page = 0
    while True:
        b.outbox.clear()
        unpacked.clear()
        b.handle(C, msg(Command.QUERY, {"qid": 4, "what": "events", "page": page}), 1.0)
        reply = msgpack.unpackb(b.outbox[-1][1][2])
        assert len(reply["data"]) <= 50 and len(unpacked) <= 51
        seen += [e[0] for e in reply["data"]]
        if "more" not in reply:
            break
        page = reply["more"]
    assert seen == list(range(1, last + 1))  # the pages still join up: none lost, none twice


@pytest.mark.parametrize("info", [{"hostname": "evil\x1b[2J"}, {"python": "3.11\n"},
                                  {"gpus": [{"name": "A100\x07"}]}])
def test_display_strings_with_terminal_escapes_are_refused(info):
    b = new_broker(Store(":memory:"))
    b.handle(W, msg(Command.HELLO, {**worker_hello(), "info": info}), 0.0)
    assert "w1" not in b.workers


def test_version_strings_other_users_see_lose_their_terminal_escapes():
    # `gpumesh doctor` printed them as they came: a worker could write into the terminal of
    # whoever looked at the mesh.
    escape = "\x1b]0;owned\x07\x1b[2J"
    b = new_broker(Store(":memory:"))
    info = {"python": "3.11", "gpumesh": "0.1" + escape, "torch": escape, "platform": escape,
            "python_full": escape, "cloudpickle": escape,
            "gpus": [{"name": "A100", "backend": "cuda" + escape[:5]}]}
    b.handle(W, msg(Command.HELLO, {**worker_hello(), "info": info}), 0.0)
    shown = b.workers["w1"].info
    texts = [shown.gpumesh, shown.torch, shown.platform, shown.python_full, shown.cloudpickle,
             shown.gpus[0].backend]
    assert all(text.isprintable() for text in texts), texts
    assert shown.gpumesh == "0.1?]0;owned??[2J"


def test_a_hostile_value_in_a_field_is_named_shortly_in_the_error(broker):
    # repr() of a 1,000-deep list raised RecursionError while the error message was made.
    deep: list = []
    for _ in range(1000):
        deep = [deep]
    broker.handle(b"x", msg(Command.HELLO, {"role": deep, "id": "x"}), 0.0)
    error = sent(broker, Command.ERROR)[-1]
    assert error["code"] == "malformed" and len(error["message"]) < 300
    assert "could not handle" not in error["message"]  # what a bug of ours is answered with


def test_a_heartbeat_proof_in_any_text_is_checked_without_failing(caplog):
    # compare_digest() takes ASCII text only: "é" raised TypeError, the heartbeat was lost.
    from gpumesh.sharedmem import SharedFolder

    folder = SharedFolder.create(secrets.token_hex(8), "")
    try:
        store = Store(":memory:")
        b = Broker(store, Timing(), Limits(), epoch=store.next_epoch(), now=0.0, shm=folder)
        b.handle(W, msg(Command.HELLO, worker_hello()), 0.0)
        b.outbox.clear()
        b.handle(W, msg(Command.HEARTBEAT, {"leases": [], "shm": "é" * 64}), 1.0)
        assert sent(b, Command.ERROR) == [] and "Traceback" not in caplog.text
        assert b.workers["w1"].last_seen == 1.0 and not b.workers["w1"].shm
    finally:
        folder.close()


def test_output_of_a_task_that_already_finished_is_not_forwarded(broker):
    ((_, task_id),) = submit(broker, {})
    broker.dispatch(0.0)
    lease = broker.tasks[task_id].lease_id
    broker.handle(W, msg(Command.RESULT, {"task": task_id, "lease": lease, "status": "ok"},
                         [b"r"]), 0.1)
    broker.outbox.clear()
    broker.handle(W, msg(Command.OUTPUT, {"task": task_id, "stream": "out"}, [b"late"]), 0.2)
    assert sent(broker, Command.OUTPUT, C) == []


def test_specs_that_differ_only_in_seq_share_one_parse_but_a_differently_typed_one_does_not(broker):
    good = {"kind": "fn", "nf": 1, "fnref": False, "max_attempts": 2, "priority": 3}
    odd = {**good, "max_attempts": 2.0}  # the same number as a float: refused on its own
    tasks = [{**good, "seq": 1}, {**good, "seq": 2}, {**odd, "seq": 3}, {**good, "seq": 4},
             {**good, "seq": 5, "req": {"gpu": True}}]
    broker.handle(C, msg(Command.SUBMIT, {"tasks": tasks}, [b"a", b"b", b"c", b"d", b"e"]), 0.0)
    answer = sent(broker, Command.ACCEPTED)[-1]
    assert [seq for seq, _ in answer["accepted"]] == [1, 2, 4, 5]
    assert [seq for seq, *_ in answer["rejected"]] == [3]
    by_seq = {seq: broker.ledger.tasks[task_id] for seq, task_id in answer["accepted"]}
    assert {seq: task.seq for seq, task in by_seq.items()} == {1: 1, 2: 2, 4: 4, 5: 5}
    assert by_seq[2].spec["max_attempts"] == 2 and by_seq[2].spec.get("priority") == 3
    assert by_seq[5].requirements.gpu is True and by_seq[1].requirements.gpu is not True


def test_copies_of_one_parsed_spec_give_their_own_seq_and_a_changed_field_its_own_spec():
    """A .map's tasks are copies of one parsed spec, and make their journaled spec from a dict
    the copies share: each gets its own seq in a dict of its own, and a copy that changes a
    field the spec shows gets a spec that shows the change."""
    from gpumesh.protocol.headers import TaskSpec
    from gpumesh.protocol.requirements import Requirements

    raw = {"kind": "fn", "nf": 1, "priority": 3, "fn": "ab" * 16, "req": {"gpu": True}}
    parsed = TaskSpec.from_mapping({**raw, "seq": 1})
    copies = [parsed.changed(seq=seq) for seq in (7, 8)]
    again = copies[1].changed(frames=2, by_reference=False)  # what a fnref task becomes
    for task, seq in ((copies[0], 7), (copies[1], 8), (again, 8)):
        assert task.to_spec() == TaskSpec.from_mapping({**raw, "seq": seq}).to_spec()
    first = copies[0].to_spec()
    first["priority"] = 99  # a dict of its own: the next copy's spec is not changed
    assert first is not copies[0].to_spec() and copies[1].to_spec()["priority"] == 3
    assert copies[0].changed(priority=5).to_spec()["priority"] == 5
    assert "req" not in copies[0].changed(requirements=Requirements()).to_spec()
    assert copies[0].changed(seq=9, max_attempts=4).to_spec() == TaskSpec.from_mapping(
        {**raw, "seq": 9, "max_attempts": 4}).to_spec()


def test_one_function_called_again_and_again_is_parsed_once_and_a_big_spec_every_time(
        broker, monkeypatch):
    from gpumesh.protocol.headers import TaskSpec

    parses = []
    real = TaskSpec.from_mapping.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(TaskSpec, "from_mapping",
                        classmethod(lambda cls, raw: parses.append(1) or real(cls, raw)))
    for seq in range(1, 6):  # five single calls, each its own SUBMIT
        assert [s for s, _ in submit(broker, {"priority": 2}, seq=seq)] == [seq]
    assert len(parses) == 1
    big_env = {f"VAR_{i}": "x" * 40 for i in range(40)}  # over MAX_TEMPLATE_BYTES
    for seq in range(6, 9):
        assert [s for s, _ in submit(broker, {"env": big_env}, seq=seq)] == [seq]
    assert len(parses) == 1 + 3


def test_kinds_of_tasks_no_longer_queued_are_forgotten_while_the_mesh_is_busy(broker):
    # Each distinct requirement set queued was kept until the mesh went idle, and judged
    # against every worker each second: a client cycling through new ones made that check cost
    # most of the loop's second on a mesh that is never idle. A backlog of live tasks keeps
    # the cancelled ones' queue entries (dispatch stops when credit runs out).
    from gpumesh.coordinator.broker import KINDS_REBUILD

    broker.handle(W2, msg(Command.HELLO, worker_hello(
        "w2", info={"python": "3.11", "cores": 4, "memory": 2**40})), 0.0)  # runs them all
    backlog = [{"seq": seq, "nf": 0, "kind": "script", "name": "a.py"} for seq in range(1, 51)]
    broker.handle(C, msg(Command.SUBMIT, {"job": "j1", "tasks": backlog}), 0.0)
    broker.dispatch(0.0)  # the workers' credit is used up: the rest stays queued
    specs = [{"seq": seq, "nf": 0, "kind": "script", "name": "a.py", "req": {"memory": seq}}
             for seq in range(100, 600)]
    broker.handle(C, msg(Command.SUBMIT, {"job": "j1", "tasks": specs}), 0.0)
    ids = [task for _, task in sent(broker, Command.ACCEPTED)[-1]["accepted"]]
    broker.handle(C, msg(Command.CANCEL, {"tasks": ids}), 0.0)
    broker.handle(C, msg(Command.RESULT_ACK, {"tasks": ids}), 0.0)
    broker.dispatch(0.0)
    assert len(broker.ledger.kinds) > 500 and len(broker.ledger.pending) > 500
    now = max(KINDS_REBUILD, Timing().pending_timeout) + 1.0
    for routing in (W, W2):
        broker.handle(routing, msg(Command.HEARTBEAT, {"leases": [
            lease for lease, _ in broker.workers["w1" if routing == W else "w2"]
            .leases.items()]}), now)
    broker._fail_unschedulable(now)
    assert len(broker.ledger.kinds) == 1  # the backlog's


def test_the_function_cache_is_bounded_in_bytes_as_well_as_in_count():
    # 1,024 distinct functions of 1 MiB each stayed in it, 1 GiB, after their tasks were gone.
    from gpumesh.coordinator.state import FunctionCache
    from gpumesh.protocol.serialize import function_digest

    cache = FunctionCache(size=1024, max_bytes=4 * 2**20)
    kept = []
    for n in range(10):
        data = bytes([n]) * 2**20
        kept.append(cache.intern(data, function_digest(data)))
    assert cache.nbytes <= 4 * 2**20 and len(cache._by_digest) == 4
    assert all(len(k) == 2**20 for k in kept)  # each task still got its function
    newest = bytes([9]) * 2**20
    assert cache.intern(newest, function_digest(newest)) is kept[-1]  # still shared


def test_a_peer_tripping_a_bug_again_and_again_leaves_a_bounded_number_of_tracebacks(
        broker, monkeypatch, caplog):
    from gpumesh.coordinator.broker import TRACEBACKS_PER_MINUTE

    def explode(*args):
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(broker.worker_side, "heartbeat", explode)
    with caplog.at_level(logging.DEBUG, "gpumesh.coordinator"):
        for n in range(100):
            broker.handle(W, msg(Command.HEARTBEAT, {"leases": []}), 1.0 + n / 100)
    assert caplog.text.count("Traceback") == TRACEBACKS_PER_MINUTE
    assert len(sent(broker, Command.ERROR)) == 100  # each one still answered
    caplog.clear()
    broker.handle(W, msg(Command.HEARTBEAT, {"leases": []}), 70.0)  # a minute on
    assert caplog.text.count("Traceback") == 1


def test_a_prefetch_beyond_what_the_protocol_allows_is_refused_at_hello():
    # docs/protocol.md says 0-256 (join's own bound); the coordinator took up to 1,000.
    b = new_broker(Store(":memory:"))
    b.handle(W, msg(Command.HELLO, worker_hello(prefetch=257)), 0.0)
    assert "w1" not in b.workers and sent(b, Command.ERROR)[-1]["code"] == "malformed"
    b.handle(W, msg(Command.HELLO, worker_hello(prefetch=256)), 0.0)
    assert "w1" in b.workers


def test_a_hello_naming_one_held_pair_twice_keeps_that_lease(tmp_path):
    # The second copy of the pair put the lease just claimed among the ones to abort: the
    # worker dropped a task the coordinator thought it ran, until the lease expired.
    store = Store(str(tmp_path / "j.db"))
    try:
        b = new_broker(store)
        ((_, task_id),) = submit(b, {})
        store.commit()
        restarted = new_broker(store, now=10.0)
        old = (1 << 40) | 3
        restarted.handle(W, msg(Command.HELLO, worker_hello(
            held=[[task_id, old], [task_id, old]])), 11.0)
        (welcome,) = sent(restarted, Command.WELCOME, W)
        assert welcome["abort"] == [] and restarted.workers["w1"].leases == {old: task_id}
    finally:
        store.close()


def test_a_worker_agent_never_announces_more_prefetch_than_a_hello_may_carry(tmp_path):
    # One made in Python with prefetch=1000 was refused at every HELLO, for good.
    from gpumesh.config import Settings, parse_url
    from gpumesh.protocol.headers import MAX_PREFETCH
    from gpumesh.worker.agent import WorkerAgent

    agent = WorkerAgent(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}),
                        parse_url("tcp://127.0.0.1:9"), "t" * 32, slots=1, info={},
                        local_control=False, prefetch=1000)
    try:
        assert agent.prefetch == MAX_PREFETCH
    finally:
        agent.link.close()
        agent._ctx.term()


def test_a_worker_s_depth_bounds_what_it_is_sent_and_a_bad_one_is_refused():
    b = new_broker(Store(":memory:"))
    b.handle(W, msg(Command.HELLO, {**worker_hello(slots=2, credit=2 + 64), "prefetch": 64}), 0.0)
    for seq in range(1, 101):
        submit(b, {}, seq=seq)
    assert b.dispatch(0.0) == 66  # its slots and the prefetch it granted
    worker = b.workers["w1"]
    # Its tasks turned long: it hands 64 back and says it holds nothing queued from now on.
    released = [lease for lease in worker.leases][2:]
    b.handle(W, msg(Command.CREDIT, {"granted": 66, "release": released, "depth": 0}), 0.1)
    assert len(worker.leases) == 2 and b.dispatch(0.1) == 0  # not sent straight back
    for bad in (-1, 257, "64", 2.5, True):
        b.handle(W, msg(Command.CREDIT, {"granted": 66, "depth": bad}), 0.2)
        assert "depth" in sent(b, Command.ERROR, W)[-1]["message"]
    assert worker.prefetch == 0
    # Short again: a depth above its HELLO's prefetch counts as that prefetch.
    b.handle(W, msg(Command.CREDIT, {"granted": 200, "depth": 256}), 0.3)
    assert worker.prefetch == 64 and b.dispatch(0.3) == 64
