"""Jobs, job control, worker modes, stragglers and retention in the broker, with plain values."""

from __future__ import annotations

import contextlib

import pytest

from gpumesh.config import Limits, Timing
from gpumesh.coordinator.broker import Broker
from gpumesh.coordinator.jobs import Job, find_job
from gpumesh.coordinator.ledger import RESULT_JOURNAL_DELAY
from gpumesh.coordinator.retention import MAX_RETAINED_RESULT_BYTES
from gpumesh.coordinator.state import TaskState
from gpumesh.protocol import Command, Message, decode, encode
from gpumesh.store import Store

W, W2, C, C2 = b"w1-routing", b"w2-routing", b"c1-routing", b"c2-routing"


def msg(command: Command, header: dict, payload: list | None = None) -> Message:
    return decode(encode(command, header, payload or []), Limits())


def hello_worker(b: Broker, routing: bytes, worker_id: str, slots: int = 1, now: float = 0.0,
                 **extra) -> None:
    b.handle(routing, msg(Command.HELLO, {"role": "worker", "id": worker_id, "slots": slots,
                                          "credit": slots, "proto": [1, 1],
                                          "info": {"hostname": worker_id + "-host"}, **extra}), now)


@pytest.fixture
def broker() -> Broker:
    b = Broker(Store(":memory:"), Timing(result_ttl=100.0), Limits(), epoch=1, now=0.0)
    hello_worker(b, W, "w1")
    # Two sessions of one person (a script and the CLI in another terminal): one owner.
    for routing, client in ((C, "c1"), (C2, "c2")):
        b.handle(routing, msg(Command.HELLO, {"role": "client", "id": client, "proto": [1, 1],
                                              "info": {"user": "ana", "host": "lab"}}), 0.0)
    b.outbox.clear()
    return b


def sent(b: Broker, command: Command, to: bytes | None = None) -> list[dict]:
    return [decode(frames, Limits()).header for routing, frames in b.outbox
            if decode(frames, Limits()).command is command and to in (None, routing)]


def submit(b: Broker, count: int, job: str = "job1", name: str = "grid", now: float = 0.0,
           first_seq: int = 1, **spec) -> list[str]:
    specs = [{"seq": first_seq + i, "nf": 1, "kind": "script", **spec} for i in range(count)]
    b.handle(C, msg(Command.SUBMIT, {"job": job, "name": name, "tasks": specs},
                    [b"p%d" % i for i in range(count)]), now)
    return [task_id for _, task_id in sent(b, Command.ACCEPTED)[-1]["accepted"]]


def control(b: Broker, action: str, target: str, routing: bytes = C2, now: float = 1.0,
            **extra) -> dict:
    b.handle(routing, msg(Command.CONTROL, {"qid": 7, "action": action, "target": target,
                                            **extra}), now)
    reply = sent(b, Command.REPLY, routing)[-1]
    assert reply["qid"] == 7
    return reply["data"]


def result(b: Broker, task_id: str, status: str = "ok", payload: bytes = b'{"v": 1}',
           routing: bytes = W, now: float = 1.0) -> None:
    task = b.tasks[task_id]
    header = {"task": task_id, "lease": task.lease_id, "status": status, "encoding": "json",
              "elapsed": 0.5}
    if status == "error":
        header["error"] = {"type": "X", "message": "boom", "traceback": ""}
    b.handle(routing, msg(Command.RESULT, header, [payload]), now)


def test_another_client_sees_a_job_by_id_prefix_or_name(broker):
    tasks = submit(broker, 3)
    broker.dispatch(0.0)
    result(broker, tasks[0])
    for key in ("job1", "job1"[:4], "grid"):
        broker.handle(C2, msg(Command.QUERY, {"qid": 3, "what": "status", "job": key}), 1.0)
        view = sent(broker, Command.REPLY, C2)[-1]["data"]
        assert view["job"] == "job1" and view["name"] == "grid"
        assert view["counts"] == {"done": 1, "pending": 2} and view["status"] == "running"
        assert view["tasks"][0]["result"] == {"v": 1}
        assert [t["id"] for t in view["tasks"]] == tasks
        assert [t["index"] for t in view["tasks"]] == [0, 1, 2]


def test_a_job_summary_survives_its_results_being_collected(broker):
    tasks = submit(broker, 1)
    broker.dispatch(0.0)
    result(broker, tasks[0])
    broker.handle(C, msg(Command.RESULT_ACK, {"tasks": tasks}), 2.0)
    assert tasks[0] not in broker.tasks
    view = broker.status("job1", 3.0)
    assert view["status"] == "finished" and view["counts"] == {"done": 1}
    assert view["tasks"][0]["worker"] == "w1"


def test_cancel_job_stops_running_tasks_and_never_starts_pending_ones(broker):
    running, pending = submit(broker, 2)
    broker.dispatch(0.0)
    lease = broker.tasks[running].lease_id
    broker.outbox.clear()
    # The running one is still being stopped: its worker has not confirmed (`cancel` said
    # "Cancelled 2" while status showed it running, and `retry` then skipped it unsaid).
    assert control(broker, "cancel", "job1") == {"job": "job1", "owner": "ana@lab", "cancelled": 2,
                                                 "stopping": 1}
    assert sent(broker, Command.CANCEL, W) == [{"leases": [lease]}]
    assert broker.tasks[pending].state is TaskState.CANCELLED
    assert control(broker, "retry", "job1") == {"job": "job1", "owner": "ana@lab", "retried": 1,
                                                "stopping": 1}
    assert broker.tasks[pending].state is TaskState.PENDING
    assert control(broker, "cancel", "job1")["stopping"] == 1
    # The worker dies before it reports the cancellation: the task must not run again.
    broker.unreachable(W, 2.0)
    assert broker.tasks[running].state is TaskState.CANCELLED
    hello_worker(broker, W2, "w2", slots=2, now=3.0)
    assert broker.dispatch(3.0) == 0


def test_retry_job_requeues_failed_tasks_even_after_the_owner_collected_them(broker):
    ok_task, bad_task = submit(broker, 2)
    broker.dispatch(0.0)
    result(broker, ok_task)
    hello_worker(broker, W2, "w2")
    broker.dispatch(1.0)
    result(broker, bad_task, status="error", routing=W2)
    broker.handle(C, msg(Command.RESULT_ACK, {"tasks": [ok_task, bad_task]}), 2.0)
    assert broker.tasks[bad_task].collected
    assert control(broker, "retry", "job1") == {"job": "job1", "owner": "ana@lab", "retried": 1,
                                                "stopping": 0}
    task = broker.tasks[bad_task]
    assert task.state is TaskState.PENDING and task.attempts == 0 and task.payload == [b"p1"]
    assert broker.status("job1", 3.0)["counts"] == {"done": 1, "pending": 1}
    assert control(broker, "retry", "job1") == {"job": "job1", "owner": "ana@lab", "retried": 0,
                                                "stopping": 0}


def test_unknown_job_and_unknown_action_are_clear_errors(broker):
    assert "no job 'nope'" in control(broker, "cancel", "nope")["error"]
    broker.handle(C2, msg(Command.CONTROL, {"qid": 9, "action": "explode", "target": "x"}), 1.0)
    error = sent(broker, Command.ERROR, C2)[-1]
    assert error["code"] == "unsupported" and error["qid"] == 9


def test_kill_hands_tasks_back_without_spending_attempts_and_tells_the_worker(broker):
    (task_id,) = submit(broker, 1)
    broker.dispatch(0.0)
    answer = control(broker, "kill", "w1-host")
    assert answer == {"worker": "w1", "hostname": "w1-host", "handed_back": 1}
    assert sent(broker, Command.DISCONNECT, W) == [{"reason": "kill", "by": "ana@lab"}]
    task = broker.tasks[task_id]
    assert task.state is TaskState.PENDING and task.attempts == 0
    assert broker.workers["w1"].describe()["alive"] is False
    assert broker.workers["w1"].describe()["state"] == "removed"  # not "lost": on purpose
    assert "no worker" in control(broker, "kill", "w1-host")["error"]


def test_a_paused_worker_gets_nothing_and_its_handed_back_tasks_cost_no_attempt(broker):
    hello_worker(broker, W2, "w2", slots=2)
    tasks = submit(broker, 2)
    broker.dispatch(0.0)
    on_w2 = [t for t in tasks if broker.tasks[t].worker_id == "w2"]
    leases = [broker.tasks[t].lease_id for t in on_w2]
    broker.handle(W2, msg(Command.CREDIT, {"granted": 2, "draining": True, "mode": "paused",
                                           "release": leases}), 1.0)
    assert broker.workers["w2"].describe()["state"] == "paused"
    for task_id in on_w2:
        assert broker.tasks[task_id].state is TaskState.PENDING
        assert broker.tasks[task_id].attempts == 0
    assert broker.dispatch(1.0) == 0 or all(broker.tasks[t].worker_id != "w2" for t in on_w2)
    broker.handle(W2, msg(Command.CREDIT, {"granted": 4, "draining": False, "mode": "active"}), 2.0)
    broker.dispatch(2.0)
    assert all(broker.tasks[t].state is TaskState.LEASED for t in tasks)


def test_a_worker_twice_the_median_time_gets_no_heavy_tasks(broker):
    for routing, wid in ((W2, "w2"), (b"w3-routing", "w3")):
        hello_worker(broker, routing, wid, slots=1)
    speeds = {"w1": 1.0, "w2": 1.1, "w3": 5.0}
    for worker in broker.workers.values():
        worker.completed = 5
        worker.seconds_per_cost = speeds[worker.worker_id]
    assert broker.refresh_stragglers() == {"w3"}
    broker.workers["w1"].granted = broker.workers["w2"].granted = 0  # only w3 has a free slot
    heavy = submit(broker, 1, job="heavy", cost=10.0)
    light = submit(broker, 1, job="light", first_seq=10)
    broker.dispatch(0.0)
    assert broker.tasks[heavy[0]].state is TaskState.PENDING
    assert broker.tasks[light[0]].worker_id == "w3"


def test_results_of_clients_gone_past_the_ttl_are_dropped_and_then_their_job(broker):
    (task_id,) = submit(broker, 1)
    broker.dispatch(0.0)
    result(broker, task_id)
    broker.handle(C, msg(Command.DISCONNECT, {}), 1.0)
    broker.sweep(50.0)
    assert task_id in broker.tasks  # within the TTL the client may come back for it
    broker.sweep(102.0)
    assert task_id not in broker.tasks
    (row,) = broker.store.load()
    assert row.state == "collected" and row.result_payload is None and row.payload == []
    assert broker.status("job1", 103.0)["counts"] == {"done": 1}  # the summary stays
    broker.sweep(203.0)
    assert "no job" in broker.status("job1", 204.0)["error"]
    assert list(broker.store.load()) == [] and broker.store.load_jobs() == []


def test_uncollected_results_beyond_the_byte_cap_go_oldest_first(broker, monkeypatch):
    monkeypatch.setattr("gpumesh.coordinator.retention.MAX_RETAINED_RESULT_BYTES", 150)
    tasks = submit(broker, 3)
    for i, task_id in enumerate(tasks):
        hello_worker(broker, W, "w1", now=float(i))
        broker.dispatch(float(i))
        result(broker, task_id, payload=b"x" * 100, now=float(i))
    broker.handle(C, msg(Command.DISCONNECT, {}), 5.0)
    broker.sweep(6.0)
    assert [t for t in tasks if t in broker.tasks] == tasks[2:]
    kept = sum(broker.tasks[t].result_bytes for t in tasks[2:])
    assert kept <= 150 < kept + 100  # under the cap, and only just: the oldest went first
    assert MAX_RETAINED_RESULT_BYTES > 150  # the real cap, untouched by the patch


def test_a_failure_a_connected_owner_collected_is_kept_for_a_retry_for_result_ttl(broker):
    # Kept for `gpumesh retry` as long as its owner stayed connected: a long-lived client
    # with a failure now and then held every such task, and its job record, without end.
    (bad_task,) = submit(broker, 1)
    broker.dispatch(0.0)
    result(broker, bad_task, status="error")
    broker.handle(C, msg(Command.RESULT_ACK, {"tasks": [bad_task]}), 2.0)
    broker.handle(C, msg(Command.HEARTBEAT, {}), 90.0)
    broker.sweep(90.0)
    assert broker.tasks[bad_task].collected  # within result_ttl (100 s) of its finish
    broker.handle(C, msg(Command.HEARTBEAT, {}), 102.0)
    broker.sweep(102.0)
    assert bad_task not in broker.tasks and broker.clients["c1"].routing is not None


def test_after_a_restart_results_wait_for_their_owner_to_reconnect(monkeypatch):
    # No owner is known right after a restart: its results were aged from their finish and
    # counted against the cap at the first sweep, before the owner's back-off brought it back.
    monkeypatch.setattr("gpumesh.coordinator.retention.MAX_RETAINED_RESULT_BYTES", 150)
    store, timing = Store(":memory:"), Timing(result_ttl=100.0)
    first = Broker(store, timing, Limits(), epoch=1, now=0.0)
    first.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    tasks = submit(first, 3)
    for i, task_id in enumerate(tasks):
        hello_worker(first, W, "w1", now=float(i))
        first.dispatch(float(i))
        result(first, task_id, payload=b"x" * 100, now=float(i))
    first.ledger.journal_held_results(3.0, everything=True)
    store.commit()  # and then it died, its client connected and about to acknowledge them
    second = Broker(store, timing, Limits(), epoch=2, now=1000.0)  # ttl long past their finish
    second.restore(1000.0)
    second.sweep(1010.0)
    assert all(t in second.tasks for t in tasks)  # kept: the owner may be on its way back
    second.sweep(1000.0 + 60.0)
    assert sum(t in second.tasks for t in tasks) == 1  # then the cap, as for any absent owner
    second.sweep(1000.0 + 101.0)
    assert not any(t in second.tasks for t in tasks)  # and the ttl, counted from the restart


def test_a_failure_its_owner_collected_is_not_held_for_it_again_after_a_restart():
    # The collection was not journaled: restored as uncollected, the failure was held for a
    # connected owner for good (never counted against the cap) and offered to it again.
    store, timing = Store(":memory:"), Timing(result_ttl=100.0)
    first = Broker(store, timing, Limits(), epoch=1, now=0.0)
    first.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    failed, done = submit(first, 2)
    hello_worker(first, W, "w1", slots=2)
    first.dispatch(1.0)
    result(first, failed, status="error", now=2.0)
    first.handle(C, msg(Command.RESULT_ACK, {"tasks": [failed]}), 3.0)
    store.commit()
    second = Broker(store, timing, Limits(), epoch=2, now=10.0)
    second.restore(10.0)
    assert second.tasks[failed].collected and second.tasks[failed].state is TaskState.FAILED
    assert not second.tasks[done].collected
    second.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 11.0)
    assert control(second, "retry", "job1", routing=C, now=11.0)["retried"] == 1  # still can


def test_find_job_refuses_ambiguous_and_too_short_prefixes():
    jobs = {"abcd01": Job("abcd01", "a", "c", 1.0), "abcd02": Job("abcd02", "a", "c", 2.0)}
    assert "matches 2 jobs" in find_job(jobs, "abcd")
    assert "too short: give at least 4 characters" in find_job(jobs, "ab")
    assert find_job(jobs, "a").job_id == "abcd02"  # by name: the newest
    assert find_job(jobs, "abcd01").job_id == "abcd01"
    assert "no job" in find_job(jobs, "zz")


def test_jobs_come_back_after_a_restart_with_their_names():
    store = Store(":memory:")
    first = Broker(store, Timing(), Limits(), epoch=1, now=0.0)
    first.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    submit(first, 2, name="nightly")
    store.commit()
    second = Broker(store, Timing(), Limits(), epoch=2, now=10.0)
    assert second.restore(10.0) == 2
    view = second.status("nightly", 11.0)
    assert view["total"] == 2 and view["counts"] == {"pending": 2}


def test_a_restart_keeps_collected_summaries_finish_times_and_counts_only_unfinished_work():
    store = Store(":memory:")
    first = Broker(store, Timing(), Limits(), epoch=1, now=0.0)
    hello_worker(first, W, "w1", slots=2)
    first.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    done, failed, waiting = submit(first, 3, name="nightly")
    first.dispatch(0.0)
    result(first, done, now=5.0)
    result(first, failed, status="error", now=6.0)
    first.handle(C, msg(Command.RESULT_ACK, {"tasks": [done, failed]}), 7.0)
    store.commit()
    second = Broker(store, Timing(), Limits(), epoch=2, now=500.0)
    assert second.restore(500.0) == 1  # only the unfinished one
    view = second.status("nightly", 501.0)
    assert view["counts"] == {"done": 1, "failed": 1, "pending": 1} and view["total"] == 3
    assert [t["id"] for t in view["tasks"]] == [done, failed, waiting]
    assert view["tasks"][0]["result"] == {"v": 1}
    second.tasks[waiting].move(TaskState.CANCELLED)  # finish it by hand, as a result would
    second.jobs[view["job"]].summaries[waiting] = {"id": waiting, "state": "cancelled",
                                                   "finished_at": 9.0}
    second.jobs[view["job"]].finished_at = 9.0
    assert second.status("nightly", 600.0)["elapsed"] == 9.0  # not the restart's clock


def test_retrying_an_unschedulable_task_restarts_its_clock_and_never_trips_the_coordinator(broker):
    limit = Timing().pending_timeout
    (task_id,) = submit(broker, 1, req={"gpu": True})  # the only worker has no GPU
    broker.handle(W, msg(Command.HEARTBEAT, {}), limit + 0.5)
    broker.tick(limit + 1)
    assert broker.tasks[task_id].result_header["status"] == "unschedulable"
    broker.handle(C2, msg(Command.HELLO, {"role": "client", "id": "c2", "proto": [1, 1],
                                          "info": {"user": "ana", "host": "lab"}}), limit + 2)
    assert control(broker, "retry", "job1", now=limit + 2)["retried"] == 1
    broker.handle(W, msg(Command.HEARTBEAT, {}), limit + 2.5)
    broker.tick(limit + 3)  # two heap entries for one task: must not finish it twice
    assert broker.tasks[task_id].state is TaskState.PENDING  # a fresh timeout from the retry
    broker.handle(W, msg(Command.HEARTBEAT, {}), 2 * limit + 2.5)
    broker.tick(2 * limit + 3)
    assert broker.tasks[task_id].state is TaskState.FAILED


def test_a_result_of_an_attempt_from_before_a_retry_is_a_duplicate(broker):
    (task_id,) = submit(broker, 1)
    broker.dispatch(0.0)
    old_lease = broker.tasks[task_id].lease_id
    control(broker, "cancel", "job1")
    broker.unreachable(W, 1.0)  # its cancelled RESULT is stuck on the worker
    assert broker.tasks[task_id].state is TaskState.CANCELLED
    control(broker, "retry", "job1", now=2.0)
    hello_worker(broker, W2, "w2", now=3.0)
    broker.dispatch(3.0)
    assert broker.tasks[task_id].worker_id == "w2"
    hello_worker(broker, W, "w1", now=4.0)
    broker.outbox.clear()
    broker.handle(W, msg(Command.RESULT, {"task": task_id, "lease": old_lease,
                                          "status": "cancelled"}), 4.5)
    assert sent(broker, Command.RESULT_ACK, W)[-1]["disposition"] == "duplicate"
    assert sent(broker, Command.CANCEL, W2) == []
    assert broker.tasks[task_id].state is TaskState.LEASED


def test_a_client_may_submit_a_seq_again_once_its_result_was_dropped(broker):
    (task_id,) = submit(broker, 1)
    broker.dispatch(0.0)
    result(broker, task_id)
    broker.handle(C, msg(Command.DISCONNECT, {}), 1.0)
    broker.sweep(102.0)  # gone past the TTL: the result is dropped, the summary kept
    broker.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1],
                                         "info": {"user": "ana", "host": "lab"}}), 103.0)
    (again,) = submit(broker, 1, now=103.0)  # FETCH said missing: the client resubmits seq 1
    assert again != task_id
    broker.store.commit()
    assert again in {row.task_id for row in broker.store.load()}  # durable, not just accepted


def test_a_malformed_held_list_moves_nothing(broker):
    store = broker.store
    (task_id,) = submit(broker, 1)
    store.commit()
    restarted = Broker(store, Timing(), Limits(), epoch=2, now=10.0)
    restarted.restore(10.0)
    restarted.handle(W, msg(Command.HELLO, {"role": "worker", "id": "w1", "slots": 1,
                                            "proto": [1, 1], "held": [[task_id, 5], "junk"]}), 11.0)
    assert restarted.tasks[task_id].state is TaskState.RESTORED
    assert sent(restarted, Command.ERROR)[-1]["code"] == "malformed"


def test_results_finished_before_a_restart_count_beyond_what_the_hello_may_claim(broker):
    # A worker that ran on while the coordinator was down holds more finished results than
    # its slots; its HELLO claims only as many, and each result it then sends is the claim.
    store = broker.store
    *tasks, other = submit(broker, 5)
    store.commit()
    restarted = Broker(store, Timing(restore_grace=5.0), Limits(), epoch=2, now=10.0)
    restarted.restore(10.0)
    leases = {task_id: (1 << 40) + i for i, task_id in enumerate(tasks)}
    hello_worker(restarted, W, "w1", now=11.0, held=[[t, lease] for t, lease in leases.items()])
    (welcome,) = sent(restarted, Command.WELCOME, W)
    assert 0 < len(welcome["abort"]) < len(tasks)  # the HELLO claimed its slots' worth

    def result_under(task_id: str, lease: int, now: float) -> str:
        restarted.handle(W, msg(Command.RESULT, {"task": task_id, "lease": lease,
                                                 "status": "ok", "encoding": "json",
                                                 "elapsed": 0.5}, [b'{"v": 1}']), now)
        restarted.tick(now)
        return sent(restarted, Command.RESULT_ACK, W)[-1]["disposition"]

    # A lease no earlier run could have granted decides nothing, nor does a crash.
    assert result_under(other, (2 << 40) + 1, 11.1) == "rejected"
    assert result_under(other, 7, 11.1) == "rejected"  # epoch 0: no coordinator ever ran one
    crashed = {"task": other, "lease": (1 << 40) + 9, "status": "crashed", "elapsed": 0.5}
    restarted.handle(W, msg(Command.RESULT, crashed), 11.1)
    assert sent(restarted, Command.RESULT_ACK, W)[-1]["disposition"] == "rejected"
    assert restarted.tasks[other].state is TaskState.RESTORED
    assert {result_under(t, lease, 11.2) for t, lease in leases.items()} == {"accepted"}
    assert restarted.workers["w1"].leases == {}  # nothing held that the results did not end
    restarted.tick(20.0)  # past the restore grace: only the task nobody held is queued again
    assert [restarted.tasks[t].state for t in tasks] == [TaskState.DONE] * len(tasks)
    assert restarted.tasks[other].state is TaskState.PENDING


def test_a_timeout_finished_before_a_restart_counts_beyond_what_the_hello_may_claim(broker):
    # A timeout is the task's own outcome, as an error is: rejecting it ran the task again,
    # for its whole timeout once more.
    restarted, tasks = _restarted_with(broker, 4)
    leases = {task_id: (1 << 40) + i for i, task_id in enumerate(tasks)}
    hello_worker(restarted, W, "w1", now=11.0, held=[[t, lease] for t, lease in leases.items()])
    (welcome,) = sent(restarted, Command.WELCOME, W)
    assert welcome["abort"]  # beyond its slots' worth
    for task_id, lease in leases.items():
        restarted.handle(W, msg(Command.RESULT, {
            "task": task_id, "lease": lease, "status": "timeout", "elapsed": 2.0,
            "error": {"type": "gpumesh.TaskTimeout", "message": "ran past 2s",
                      "traceback": ""}}), 11.2)
        assert sent(restarted, Command.RESULT_ACK, W)[-1]["disposition"] == "accepted"
    restarted.tick(20.0)  # past the restore grace: nothing is queued again
    assert [restarted.tasks[t].state for t in tasks] == [TaskState.FAILED] * len(tasks)


def test_finish_times_and_outcomes_survive_a_restart():
    store = Store(":memory:")
    first = Broker(store, Timing(), Limits(), epoch=1, now=0.0)
    hello_worker(first, W, "w1", slots=2)
    first.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    ok_task, bad_task = submit(first, 2, name="mixed")
    first.dispatch(0.0)
    result(first, ok_task, now=4.0)
    result(first, bad_task, status="error", now=6.0)  # neither collected by the client
    first.ledger.journal_held_results(6.0 + RESULT_JOURNAL_DELAY)  # the loop's next turn
    store.commit()
    second = Broker(store, Timing(), Limits(), epoch=2, now=900.0)
    second.restore(900.0)
    view = second.status("mixed", 901.0)
    assert [t["finished_at"] for t in view["tasks"]] == [4.0, 6.0]
    assert view["elapsed"] == 6.0 and view["outcome"] == "failed"


def test_cancel_and_retry_by_a_shared_name_refuse_to_guess(broker):
    submit(broker, 1, job="jobA", name="nightly")
    submit(broker, 1, job="jobB", name="nightly", first_seq=5, now=0.5)
    assert "2 jobs are named 'nightly'" in control(broker, "cancel", "nightly")["error"]
    view = broker.status("nightly", 1.0)
    assert view["job"] == "jobB" and view["same_name"] == 2 and view["outcome"] is None


def test_short_worker_prefixes_say_so(broker):
    assert "too short" in control(broker, "kill", "w1"[:1])["error"]


def test_another_owners_job_needs_force_and_the_refusal_names_the_owner(broker):
    submit(broker, 2)
    C3 = b"c3-routing"
    broker.handle(C3, msg(Command.HELLO, {"role": "client", "id": "c3", "proto": [1, 1],
                                          "info": {"user": "bo", "host": "desk"}}), 0.5)
    refused = control(broker, "cancel", "job1", routing=C3)
    assert refused["owner"] == "ana@lab" and "--force" in refused["error"]
    assert all(not t.state.terminal for t in broker.tasks.values())
    assert control(broker, "cancel", "job1", routing=C3, force=True)["cancelled"] == 2


def tasks_of_100_bytes_run(broker: Broker, statuses: list[str], result_payload: bytes
                           ) -> list[str]:
    """A job "big" of one task per status, each with 100 bytes of input, run one after the
    other (a second apart) and ended with that status."""
    specs = [{"seq": 1 + i, "nf": 1, "kind": "script"} for i in range(len(statuses))]
    broker.handle(C, msg(Command.SUBMIT, {"job": "big", "name": "big", "tasks": specs},
                         [b"i" * 100] * len(statuses)), 0.0)
    tasks = [task_id for _, task_id in sent(broker, Command.ACCEPTED)[-1]["accepted"]]
    for i, (task_id, status) in enumerate(zip(tasks, statuses, strict=True)):
        hello_worker(broker, W, "w1", now=float(i))
        broker.dispatch(float(i))
        result(broker, task_id, status=status, payload=result_payload, now=float(i))
    return tasks


def test_inputs_kept_for_retry_count_against_the_byte_cap(broker, monkeypatch):
    # A failed task keeps its input for `gpumesh retry` (in the shared-memory folder, RAM):
    # an absent client's failed tasks cannot hold more than the cap through their inputs.
    monkeypatch.setattr("gpumesh.coordinator.retention.MAX_RETAINED_RESULT_BYTES", 250)
    tasks = tasks_of_100_bytes_run(broker, ["error"] * 3, result_payload=b"")
    assert all(broker.tasks[t].kept_bytes >= 100 for t in tasks)  # the input, not the result
    broker.handle(C, msg(Command.DISCONNECT, {}), 5.0)
    broker.sweep(6.0)
    assert [t for t in tasks if t in broker.tasks] == tasks[1:]  # 3 x 100+ over 250: one went


def test_a_connected_clients_failures_kept_for_retry_count_against_the_byte_cap(broker,
                                                                              monkeypatch):
    # A client that stays connected (a notebook open for days) collects each failure, and the
    # failed task stays so it can be retried, its input with it: the sweep passed over every
    # connected owner, so those inputs grew without bound (a full disk stops the coordinator).
    # Its results not yet acknowledged are on their way to it, and stay.
    monkeypatch.setattr("gpumesh.coordinator.retention.MAX_RETAINED_RESULT_BYTES", 250)
    tasks = tasks_of_100_bytes_run(broker, ["error", "error", "error", "ok"],
                                   result_payload=b"r" * 100)
    broker.handle(C, msg(Command.RESULT_ACK, {"tasks": tasks[:3]}), 4.0)  # it has the failures
    assert all(broker.tasks[t].collected for t in tasks[:3])
    broker.sweep(6.0)
    assert [t for t in tasks if t in broker.tasks] == tasks[1:]  # the oldest failure went
    assert not broker.tasks[tasks[3]].collected  # the unacknowledged result stays
    assert control(broker, "retry", "big", routing=C)["retried"] == 2


def _restarted_with(broker: Broker, count: int) -> tuple[Broker, list[str]]:
    """``count`` tasks submitted and journaled, then the coordinator restarted (epoch 2) on
    the same journal: the new broker, and the task ids."""
    tasks = submit(broker, count)
    broker.store.commit()
    restarted = Broker(broker.store, Timing(restore_grace=5.0), Limits(), epoch=2, now=10.0)
    restarted.restore(10.0)
    return restarted, tasks


def test_of_two_attempts_running_at_a_restart_the_first_result_counts(broker):
    # Attempt 1 on w1 and attempt 2 (a re-queue) on w2 when the coordinator died: w2's HELLO
    # claims the task first, then w1 sends the result it had finished. It is as good: taken,
    # and w2 told to stop, as the coordinator before the restart would have done.
    restarted, (task_id,) = _restarted_with(broker, 1)
    first, second = (1 << 40) + 1, (1 << 40) + 2
    hello_worker(restarted, W2, "w2", now=11.0, held=[[task_id, second]])
    hello_worker(restarted, W, "w1", now=11.0, held=[[task_id, first]])
    assert sent(restarted, Command.WELCOME, W)[-1]["abort"] == [first]  # the task is w2's
    done = {"task": task_id, "lease": first, "status": "ok", "encoding": "json", "elapsed": 0.5}
    restarted.handle(W, msg(Command.RESULT, done, [b'{"v": 1}']), 11.1)
    assert restarted.tasks[task_id].state is TaskState.DONE
    assert sent(restarted, Command.CANCEL, W2)[-1]["leases"] == [second]
    # w2's answer to the CANCEL decides nothing more.
    restarted.handle(W2, msg(Command.RESULT, {"task": task_id, "lease": second,
                                              "status": "cancelled", "elapsed": 0.1}), 11.2)
    assert restarted.tasks[task_id].state is TaskState.DONE
    assert restarted.workers["w1"].leases == {} and restarted.workers["w2"].leases == {}


def test_a_result_from_before_a_retry_cannot_claim_the_task_after_a_restart():
    # The retry's lease floor is journaled: a worker that was still running the attempt from
    # before `gpumesh retry` when the coordinator restarted cannot claim the retried task.
    store = Store(":memory:")
    first = Broker(store, Timing(), Limits(), epoch=1, now=0.0)
    hello_worker(first, W, "w1")
    first.handle(C2, msg(Command.HELLO, {"role": "client", "id": "c2", "proto": [1, 1],
                                         "info": {"user": "ana", "host": "lab"}}), 0.0)
    first.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1],
                                        "info": {"user": "ana", "host": "lab"}}), 0.0)
    (task_id,) = submit(first, 1)
    first.dispatch(0.0)
    old_lease = first.tasks[task_id].lease_id
    first.unreachable(W, 1.0)  # w1 goes quiet, still running it
    control(first, "cancel", "job1", now=1.5)
    control(first, "retry", "job1", now=2.0)
    store.commit()
    second = Broker(store, Timing(), Limits(), epoch=2, now=10.0)
    assert second.restore(10.0) == 1
    hello_worker(second, W, "w1", now=11.0)
    second.outbox.clear()
    second.handle(W, msg(Command.RESULT, {"task": task_id, "lease": old_lease, "status": "ok",
                                          "encoding": "json"}, [b'"stale"']), 11.5)
    # Not a claim (before the fix it was: the floor came back as 0 and the old result won).
    assert sent(second, Command.RESULT_ACK, W)[-1]["disposition"] == "rejected"
    assert second.tasks[task_id].state is TaskState.RESTORED
    assert second.tasks[task_id].lease_floor == first.tasks[task_id].lease_floor > old_lease
    # Nor can a HELLO that lists the old lease among the tasks it holds.
    hello_worker(second, W2, "w2", now=11.6, held=[[task_id, old_lease]])
    assert second.tasks[task_id].state is TaskState.RESTORED
    assert sent(second, Command.WELCOME, W2)[-1]["abort"] == [old_lease]
    # A result of the retried attempt (a lease of the first run at or over the floor) claims it.
    retried_lease = first.ledger.new_lease_id()
    second.handle(W, msg(Command.RESULT, {"task": task_id, "lease": retried_lease,
                                          "status": "ok", "encoding": "json"}, [b'"fresh"']), 12.0)
    assert sent(second, Command.RESULT_ACK, W)[-1]["disposition"] == "accepted"
    assert second.tasks[task_id].state is TaskState.DONE


def test_the_restore_grace_waits_for_a_result_a_worker_is_sending_in_pieces(broker):
    # A big result finished before the restart claims its task only once whole: while the
    # worker's pieces keep coming, the restored tasks wait for it instead of running again.
    from gpumesh.coordinator.broker import MAX_GRACE_FOR_PIECES, PIECES_QUIET

    store = broker.store
    (task_id,) = submit(broker, 1)
    store.commit()

    def restarted_with_pieces(every: float, until: float) -> Broker:
        again = Broker(store, Timing(restore_grace=5.0), Limits(), epoch=2, now=10.0)
        again.restore(10.0)
        hello_worker(again, W, "w1", now=10.5)
        now = 11.0
        while now <= until:
            assert again.heard_piece(W, now)
            again.tick(now)
            now += every
        return again

    # Pieces every second up to 25 s after the start: still restored 1 s after the last one,
    # pending once they have been quiet for PIECES_QUIET.
    again = restarted_with_pieces(1.0, 35.0)
    assert again.tasks[task_id].state is TaskState.RESTORED
    again.tick(35.0 + PIECES_QUIET / 2)
    assert again.tasks[task_id].state is TaskState.RESTORED
    again.tick(35.0 + PIECES_QUIET)
    assert again.tasks[task_id].state is TaskState.PENDING
    # A worker that never stops sending holds the grace open no longer than the cap.
    end = 10.0 + 5.0 + MAX_GRACE_FOR_PIECES
    again = restarted_with_pieces(0.5, end - 0.5)
    assert again.tasks[task_id].state is TaskState.RESTORED
    again.heard_piece(W, end)
    again.tick(end)
    assert again.tasks[task_id].state is TaskState.PENDING
    # Without pieces the grace ends on time, and pieces after it change nothing.
    again = Broker(store, Timing(restore_grace=5.0), Limits(), epoch=2, now=10.0)
    again.restore(10.0)
    hello_worker(again, W, "w1", now=10.5)
    again.tick(15.0)
    assert again.tasks[task_id].state is TaskState.PENDING
    assert again.heard_piece(W, 15.5)
    again.tick(15.5)
    assert again.tasks[task_id].state is TaskState.PENDING
    assert again._worker_piece_at is None
    # (Last: it journals the result.) The result the pieces made up, whole at last, claims its task 25 s after the grace.
    again = restarted_with_pieces(1.0, 35.0)
    again.handle(W, msg(Command.RESULT, {"task": task_id, "lease": (1 << 40) + 1,
                                         "status": "ok", "encoding": "json", "elapsed": 9.0},
                        [b'{"v": 1}']), 35.5)
    assert sent(again, Command.RESULT_ACK, W)[-1]["disposition"] == "accepted"
    assert again.tasks[task_id].state is TaskState.DONE


def test_pieces_hold_the_restore_grace_only_while_a_task_is_left_to_claim(broker):
    store = broker.store
    first, second = submit(broker, 2)
    store.commit()
    again = Broker(store, Timing(restore_grace=5.0), Limits(), epoch=2, now=10.0)
    again.restore(10.0)
    hello_worker(again, W, "w1", slots=2, now=10.5,
                 held=[[first, (1 << 40) + 1], [second, (1 << 40) + 2]])
    assert {again.tasks[t].state for t in (first, second)} == {TaskState.LEASED}
    assert again.heard_piece(W, 14.9)  # a result of this run's lease, in pieces
    again.tick(15.0)
    assert again._restoring is False  # nothing restored is left: the grace ends on time


@pytest.mark.parametrize("output", [b"[" * 1500 + b"]" * 1500,  # RecursionError in json.loads
                                    b"265252859812191058636308480000000"])  # a 108-bit int
def test_a_script_output_the_summary_cannot_hold_as_a_value_is_shown_as_text(broker, output):
    # Deep JSON stopped finish() half done (no RESULT, no ack, the job never ended); a 2**64+
    # integer went into the job's summary, which msgpack could not pack for any status query.
    tasks = submit(broker, 2)
    broker.dispatch(0.0)
    result(broker, tasks[0], payload=output)
    assert broker.tasks[tasks[0]].state is TaskState.DONE
    assert sent(broker, Command.RESULT, C)[-1]["task"] == tasks[0]
    broker.handle(C2, msg(Command.QUERY, {"qid": 3, "what": "status", "job": "job1"}), 1.0)
    view = sent(broker, Command.REPLY, C2)[-1]["data"]
    assert view["tasks"][0]["result"] == output.decode()
    broker.handle(C, msg(Command.RESULT_ACK, {"tasks": [tasks[0]]}), 1.0)
    assert tasks[0] not in broker.tasks  # collected: the journal row was written


def test_an_id_named_twice_in_one_result_ack_collects_it_and_the_rest(broker):
    hello_worker(broker, W2, "w2")
    tasks = submit(broker, 2)
    broker.dispatch(0.0)
    for task_id in tasks:
        result(broker, task_id, routing=W if broker.tasks[task_id].worker_id == "w1" else W2)
    broker.handle(C, msg(Command.RESULT_ACK, {"tasks": [tasks[0], tasks[0], tasks[1]]}), 1.0)
    assert sent(broker, Command.ERROR) == []
    assert tasks[0] not in broker.tasks and tasks[1] not in broker.tasks


def test_one_lease_claims_one_restored_task_in_a_hello_or_by_a_result(broker):
    # A HELLO naming one lease for two restored tasks left the first leased in no lease
    # table: it never expired, never ran again. A result under a lease already holding
    # another task did the same.
    store = broker.store
    first, second, third = submit(broker, 3)
    store.commit()
    restarted = Broker(store, Timing(restore_grace=5.0), Limits(), epoch=2, now=10.0)
    restarted.restore(10.0)
    old = (1 << 40) | 7
    hello_worker(restarted, W, "w1", slots=2, now=11.0, held=[[first, old], [second, old]])
    (welcome,) = sent(restarted, Command.WELCOME, W)
    assert welcome["abort"] == [old] and restarted.workers["w1"].leases == {old: first}
    assert restarted.tasks[second].state is TaskState.RESTORED  # runs again, later
    restarted.handle(W, msg(Command.RESULT, {"task": third, "lease": old, "status": "ok",
                                             "encoding": "json"}, [b"1"]), 11.1)
    assert sent(restarted, Command.RESULT_ACK, W)[-1]["disposition"] == "rejected"
    assert restarted.workers["w1"].leases == {old: first}
    assert restarted.tasks[third].state is TaskState.RESTORED


def test_a_cancel_of_a_running_task_survives_a_restart_before_its_worker_answers():
    """The cancel of a running task lived in memory until the worker confirmed it: a restart
    in between restored the task, its worker re-claimed it and ran it on (the job then showed
    done, not cancelled), or it was queued and run again from the start."""
    store = Store(":memory:")
    first = Broker(store, Timing(), Limits(), epoch=1, now=0.0)
    first.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    hello_worker(first, W, "w1", slots=2)
    running, other = submit(first, 2)
    first.dispatch(1.0)
    lease = first.tasks[running].lease_id
    first.handle(C, msg(Command.CANCEL, {"tasks": [running]}), 2.0)
    assert first.tasks[running].state is TaskState.LEASED  # the worker has not answered yet
    store.commit()
    second = Broker(store, Timing(), Limits(), epoch=2, now=10.0)
    second.restore(10.0)
    assert second.tasks[running].state is TaskState.CANCELLED
    assert second.tasks[other].state is TaskState.RESTORED
    hello_worker(second, W, "w1", slots=2, now=11.0,
                 held=[[running, lease], [other, first.tasks[other].lease_id]])
    welcome = sent(second, Command.WELCOME, W)[-1]
    assert welcome["abort"] == [lease]  # it stops the cancelled one, keeps the other
    assert second.tasks[other].state is TaskState.LEASED


def test_the_event_stream_counts_new_tasks_and_shows_an_agent_restart(broker):
    """A re-sent SUBMIT counted its tasks as submitted again; an agent that restarted under
    its id had its tasks requeued with no event at all; a finished task's detail named the
    worker it last ran on, not the one whose result won."""
    events = broker.ledger.events
    first = submit(broker, 2)
    submit(broker, 2)  # the same seqs again: a re-send after a reconnect
    counts = [e.data["count"] for e in events.since(0) if e.kind == "submitted"]
    assert counts == [2]
    broker.dispatch(1.0)
    hello_worker(broker, W, "w1", now=10.0, incarnation="another-one")
    kinds = [e.kind for e in events.since(0)]
    assert kinds[-2:] == ["worker_lost", "worker_joined"]
    assert broker.tasks[first[0]].state is TaskState.PENDING
    task = broker.tasks[first[0]]
    broker.dispatch(11.0)
    task.result_header = {"status": "ok", "worker": "w-earlier"}
    task.move(TaskState.DONE)
    assert broker.retention.task_detail(task.task_id)["worker"] == "w-earlier"


def test_a_lease_from_before_a_retry_claims_nothing_and_an_ok_over_a_cancel_is_journaled():
    """A worker back from silence named the lease of an attempt before `gpumesh retry`: it was
    claimed, its result then dropped as stale, and the task left leased in no worker's table
    for good. And an OK that beat its cancel to the worker was held, so a crash brought the
    task back cancelled."""
    store = Store(":memory:")
    b = Broker(store, Timing(), Limits(), epoch=1, now=0.0)
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    hello_worker(b, W, "w1")
    task_id, = submit(b, 1)
    b.dispatch(1.0)
    old_lease = b.tasks[task_id].lease_id
    b.tick(Timing().silence_limit + 2)  # w1 silent: lost, the task queued again
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 19.0)
    b.handle(C, msg(Command.CANCEL, {"tasks": [task_id]}), 20.0)
    assert b.tasks[task_id].state is TaskState.CANCELLED
    assert control(b, "retry", "job1", routing=C, now=21.0)["retried"] == 1
    b.outbox.clear()
    hello_worker(b, W, "w1", now=22.0, held=[[task_id, old_lease]])
    assert sent(b, Command.WELCOME, W)[-1]["abort"] == [old_lease]
    task = b.tasks[task_id]
    b.dispatch(23.0)
    assert task.state is TaskState.LEASED and task.lease_id != old_lease  # runs again, afresh
    b.handle(C, msg(Command.CANCEL, {"tasks": [task_id]}), 24.0)  # cancel; the OK wins
    result(b, task_id, now=25.0)
    assert task.state is TaskState.DONE
    store.commit()
    restarted = Broker(store, Timing(), Limits(), epoch=2, now=30.0)
    restarted.restore(30.0)
    assert restarted.tasks[task_id].state is TaskState.DONE


def _journaled_states(path) -> list[str]:
    """What a restart would read: the journal's committed rows, from another connection."""
    import sqlite3
    with contextlib.closing(sqlite3.connect(path)) as db:
        return sorted(state for (state,) in db.execute("SELECT state FROM tasks"))


def test_a_cancel_is_in_the_journal_before_it_is_confirmed(tmp_path):
    # The REPLY "cancelled: N" (and a pending task's cancelled RESULT) went out before the
    # turn's commit: a kill -9 or a full disk then brought the tasks back, and they ran.
    path = tmp_path / "journal.db"
    b = Broker(Store(path), Timing(), Limits(), epoch=1, now=0.0)
    try:
        _cancel_and_look(b, path)
    finally:
        b.store.close()


def _cancel_and_look(b: Broker, path) -> None:
    for routing, client in ((C, "c1"), (C2, "c2")):
        b.handle(routing, msg(Command.HELLO, {"role": "client", "id": client, "proto": [1, 1],
                                              "info": {"user": "ana", "host": "lab"}}), 0.0)
    tasks = submit(b, 3)
    b.store.commit()  # the end of the turn that accepted them
    assert control(b, "cancel", "job1")["cancelled"] == 3
    assert _journaled_states(path) == ["cancelled"] * 3
    more = submit(b, 2, job="job2", first_seq=10)
    b.store.commit()
    b.handle(C, msg(Command.CANCEL, {"tasks": more}), 2.0)
    assert {h["status"] for h in sent(b, Command.RESULT, C) if h["task"] in more} == {"cancelled"}
    assert _journaled_states(path) == ["cancelled"] * 5
    assert len(tasks) == 3


def test_a_timeout_from_before_a_restart_never_stops_an_attempt_another_worker_re_claimed(broker):
    # Restored, then re-claimed by w2 in its HELLO (it still runs it): w1's timeout from an
    # earlier run's attempt decided the task and stopped w2's attempt, which could succeed.
    restarted, (task_id,) = _restarted_with(broker, 1)
    hello_worker(restarted, W2, "w2", now=11.0, held=[[task_id, (1 << 40) + 2]])
    assert restarted.tasks[task_id].state is TaskState.LEASED
    hello_worker(restarted, W, "w1", now=11.0)
    restarted.outbox.clear()
    restarted.handle(W, msg(Command.RESULT, {
        "task": task_id, "lease": (1 << 40) + 1, "status": "timeout", "elapsed": 2.0,
        "error": {"type": "gpumesh.TaskTimeout", "message": "ran past 2s", "traceback": ""}}),
        11.2)
    assert sent(restarted, Command.RESULT_ACK, W)[-1]["disposition"] == "rejected"
    assert restarted.tasks[task_id].state is TaskState.LEASED and not sent(
        restarted, Command.CANCEL, W2)


def test_status_says_whose_each_job_is_as_its_asker_sees_it(broker):
    # README: jobs belong to user@host, "shown by status"; only --json showed the owner.
    from gpumesh.cli.jobs import mesh_summary, print_job

    submit(broker, 1)  # ana@lab's
    broker.handle(b"bob-routing", msg(Command.HELLO, {"role": "client", "id": "c3",
                                                      "proto": [1, 1],
                                                      "info": {"user": "bob", "host": "desk"}}),
                  1.0)
    for routing, mine in ((b"bob-routing", False), (C2, True)):
        broker.handle(routing, msg(Command.QUERY, {"qid": 3, "what": "status"}), 1.0)
        listing = sent(broker, Command.REPLY, routing)[-1]["data"]
        assert [j["mine"] for j in listing["jobs"]] == [mine]
        broker.handle(routing, msg(Command.QUERY, {"qid": 4, "what": "status", "job": "job1"}),
                      1.0)
        one = sent(broker, Command.REPLY, routing)[-1]["data"]
        assert one["mine"] is mine
        assert ("by ana@lab" in mesh_summary(listing)) is not mine
    import click.testing

    shown = click.testing.CliRunner().invoke(click.command()(lambda: print_job(one)))
    assert shown.output.splitlines()[0] == "Job: grid (job1)"  # your own: as the spec shows
