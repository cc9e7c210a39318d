"""The broker's policy with plain values: no sockets, an in-memory journal, ``now`` passed in."""

from __future__ import annotations

import pytest

from gpumesh.config import Limits, Timing
from gpumesh.coordinator.broker import Broker
from gpumesh.coordinator.state import TaskState
from gpumesh.protocol import Command, Message, decode, encode
from gpumesh.store import Store

W, C = b"worker-routing", b"client-routing"


def msg(command: Command, header: dict, payload: list | None = None) -> Message:
    return decode(encode(command, header, payload or []), Limits())


@pytest.fixture
def broker() -> Broker:
    b = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0)
    b.handle(W, msg(Command.HELLO, {"role": "worker", "id": "w1", "slots": 1, "credit": 1,
                                    "proto": [1, 1], "info": {"python": "3.11"}}), 0.0)
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    b.outbox.clear()
    return b


def sent(b: Broker, command: Command) -> list[dict]:
    out = [decode(frames, Limits()) for _, frames in b.outbox]
    return [m.header for m in out if m.command is command]


def submit(b: Broker, spec: dict, now: float = 0.0) -> str:
    b.handle(C, msg(Command.SUBMIT, {"tasks": [{"seq": 1, "nf": 1, "kind": "script", **spec}]},
                    [b"payload"]), now)
    accepted = sent(b, Command.ACCEPTED)[-1]["accepted"]
    return accepted[0][1]


def test_stale_result_of_a_requeued_task_wins_without_crashing(broker):
    task_id = submit(broker, {})
    broker.dispatch(0.0)
    lease = broker.tasks[task_id].lease_id
    broker.handle(W, msg(Command.HEARTBEAT, {"leases": []}), 99.0)  # alive, lease not renewed
    broker.tick(100.0)  # lease expired: back to the queue
    assert broker.tasks[task_id].state is TaskState.PENDING
    broker.handle(W, msg(Command.RESULT, {"task": task_id, "lease": lease, "status": "ok",
                                          "encoding": "text"}, [b"v"]), 100.1)
    assert broker.tasks[task_id].state is TaskState.DONE


def test_unknown_result_status_keeps_the_lease(broker):
    task_id = submit(broker, {})
    broker.dispatch(0.0)
    lease = broker.tasks[task_id].lease_id
    broker.handle(W, msg(Command.RESULT, {"task": task_id, "lease": lease, "status": "weird"}), 0.1)
    assert broker.workers["w1"].leases == {lease: task_id}
    assert sent(broker, Command.ERROR)[-1]["code"] == "malformed"


@pytest.mark.parametrize("bad", [{"cost": "heavy"}, {"max_attempts": 0}, {"priority": "high"},
                                 {"timeout": "soon"}, {"nf": -1}, {"req": "gpu"}])
def test_mistyped_specs_are_refused_before_journaling(broker, bad):
    spec = {"seq": 1, "nf": 1, "kind": "script", **bad}
    broker.handle(C, msg(Command.SUBMIT, {"tasks": [spec]}, [b"p"]), 0.0)
    assert broker.tasks == {}
    assert list(broker.store.load()) == []
    if "nf" in bad:  # its frames cannot be told from the next task's: the message goes whole
        assert sent(broker, Command.ERROR)[-1]["code"] == "malformed"
    else:  # only this task is refused, with the reason, to the future that sent it
        assert [r[:2] for r in sent(broker, Command.ACCEPTED)[-1]["rejected"]] == [[1, "malformed"]]


def test_duplicate_submit_gets_the_same_task(broker):
    first = submit(broker, {})
    second = submit(broker, {})
    assert first == second and len(broker.tasks) == 1


def test_safe_mode_rejects_functions():
    b = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0, safe_mode=True)
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    b.handle(C, msg(Command.SUBMIT, {"tasks": [{"seq": 1, "nf": 1, "kind": "fn"}]}, [b"f"]), 0.0)
    rejected = sent(b, Command.ACCEPTED)[-1]["rejected"]
    assert rejected[0][1] == "safe_mode" and "--safe-mode" in rejected[0][2]


def test_silent_worker_is_lost_and_its_task_requeued_with_exclusion(broker):
    task_id = submit(broker, {})
    broker.dispatch(0.0)
    broker.tick(Timing().silence_limit + 1)
    assert broker.workers["w1"].state.value == "lost"
    task = broker.tasks[task_id]
    assert task.state is TaskState.PENDING and "w1" in task.excluded


def test_poison_task_fails_after_max_attempts(broker):
    task_id = submit(broker, {"max_attempts": 2})
    for attempt in range(2):
        broker.dispatch(float(attempt))
        lease = broker.tasks[task_id].lease_id
        broker.handle(W, msg(Command.RESULT, {"task": task_id, "lease": lease, "status": "crashed",
                                              "diagnosis": "killed by SIGSEGV", "granted": 2 + attempt}),
                      float(attempt))
    task = broker.tasks[task_id]
    assert task.state is TaskState.FAILED
    assert task.result_header["diagnosis"].endswith(
        "gave up after 2 attempts: killed by SIGSEGV (2 times)")


def test_unschedulable_task_fails_after_the_pending_timeout_naming_the_requirement(broker):
    task_id = submit(broker, {"req": {"gpu": "A100"}})
    broker.dispatch(0.0)
    assert broker.tasks[task_id].state is TaskState.PENDING
    broker.handle(W, msg(Command.HEARTBEAT, {}), Timing().pending_timeout + 0.5)
    broker.tick(Timing().pending_timeout + 1)
    header = broker.tasks[task_id].result_header
    assert header["status"] == "unschedulable" and "A100" in header["diagnosis"]


def test_a_job_no_worker_could_run_says_why_it_waits_long_before_it_fails(broker):
    # Its status said "pending" for the whole minute before the timeout's error: nothing
    # told the user that no worker had an A100.
    task_id = submit(broker, {"req": {"gpu": "A100"}})
    job = broker.tasks[task_id].job_id
    assert "waiting" not in broker.status(job, 0.5)  # not looked at yet
    broker.tick(1.0)
    view = broker.status(job, 1.0)
    assert "A100" in view["waiting"] and "w1" in view["waiting"]
    assert view["fails_in"] == Timing().pending_timeout - 1.0
    assert view["counts"] == {"pending": 1}
    other = submit(broker, {"seq": 2})  # a kind this worker can run: nothing to say
    assert "waiting" not in broker.status(broker.tasks[other].job_id, 1.0)


def test_with_no_worker_connected_a_task_waits_and_the_clock_restarts_when_one_joins(broker):
    task_id = submit(broker, {"req": {"gpu": "A100"}})
    limit = Timing().pending_timeout
    broker.handle(W, msg(Command.DISCONNECT, {"reason": "left"}), 1.0)
    broker.tick(limit * 3)  # nobody to judge it against: laptops asleep, say
    assert broker.tasks[task_id].state is TaskState.PENDING
    broker.handle(W, msg(Command.HELLO, {"role": "worker", "id": "w1", "slots": 1, "proto": [1, 1]}),
                  limit * 3 + 1)
    broker.tick(limit * 3 + 2)
    assert broker.tasks[task_id].state is TaskState.PENDING  # the full timeout again, from now
    broker.handle(W, msg(Command.HEARTBEAT, {}), limit * 4 + 3)
    broker.tick(limit * 4 + 4)
    assert broker.tasks[task_id].result_header["status"] == "unschedulable"


def test_queued_tasks_of_one_function_share_its_frame_but_a_forged_digest_does_not():
    from gpumesh.protocol import serialize

    b = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0)
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    fn = serialize.dumps(len)[0] + b"padding"
    digest = serialize.function_digest(fn)
    specs = [{"seq": i, "nf": 2, "kind": "fn", "fn": digest} for i in range(3)]
    specs.append({"seq": 3, "nf": 2, "kind": "fn", "fn": digest})  # claims it, sends other bytes
    frames = [bytes(fn), b"a", bytes(fn), b"b", bytes(fn), b"c", b"not the function", b"d"]
    b.handle(C, msg(Command.SUBMIT, {"tasks": specs}, frames), 0.0)
    tasks = sorted(b.tasks.values(), key=lambda t: t.seq)
    assert tasks[0].payload[0] is tasks[1].payload[0] is tasks[2].payload[0]
    assert tasks[0].requirements is tasks[1].requirements
    # The forger is refused: a digest is what workers and the journal key a function by.
    assert len(tasks) == 3
    (answer,) = sent(b, Command.ACCEPTED)
    assert [r[0] for r in answer["rejected"]] == [3]
    assert "does not hash to its function digest" in answer["rejected"][0][2]


def test_clients_are_told_the_workers_pythons_when_they_change(broker):
    welcome = decode(encode(Command.HELLO, {"role": "client", "id": "c2", "proto": [1, 1]}), Limits())
    broker.handle(b"c2", welcome, 0.0)
    assert sent(broker, Command.WELCOME)[-1]["pythons"] == ["3.11"]
    broker.tick(0.05)  # the first push
    broker.outbox.clear()
    broker.tick(0.1)
    assert all("pythons" not in h for h in sent(broker, Command.HEARTBEAT))  # nothing changed
    broker.handle(b"w2", msg(Command.HELLO, {"role": "worker", "id": "w2", "slots": 1,
                                             "proto": [1, 1], "info": {"python": "3.12"}}), 0.2)
    broker.outbox.clear()
    broker.tick(0.3)
    told = [decode(f, Limits()).header for r, f in broker.outbox
            if decode(f, Limits()).command is Command.HEARTBEAT]
    assert told and all(h["pythons"] == ["3.11", "3.12"] for h in told)
    assert {r for r, f in broker.outbox} == {C, b"c2"}  # clients only


@pytest.mark.parametrize("reason, answer", [("left", "left"), ("drained", "drained"),
                                            ("kill", "other"), ("whatever", "other")])
def test_a_workers_goodbye_is_answered_after_its_leases_went_back(broker, reason, answer):
    task_id = submit(broker, {})
    broker.dispatch(0.0)
    broker.outbox.clear()
    broker.handle(W, msg(Command.DISCONNECT, {"reason": reason}), 1.0)
    # Its worker exits on the answer (and serve stops on that exit): by then the task is
    # queued again and the departure was logged.
    assert broker.tasks[task_id].state is TaskState.PENDING
    assert [(to, decode(frames, Limits()).header) for to, frames in broker.outbox
            if decode(frames, Limits()).command is Command.DISCONNECT] == [(W, {"reason": answer})]


def test_a_worker_is_told_its_goodbye_will_be_answered_and_a_client_is_not():
    b = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0)
    b.handle(W, msg(Command.HELLO, {"role": "worker", "id": "w1", "slots": 1, "proto": [1, 1]}), 0.0)
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    welcomes = {to: decode(frames, Limits()).header for to, frames in b.outbox
                if decode(frames, Limits()).command is Command.WELCOME}
    assert welcomes[W]["goodbye"] is True and "goodbye" not in welcomes[C]


def test_a_worker_taking_a_task_in_pieces_renews_its_lease_with_each_acknowledgement():
    b = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0)
    b.handle(W, msg(Command.HELLO, {"role": "worker", "id": "w1", "slots": 1, "credit": 1,
                                    "proto": [1, 1], "info": {"python": "3.11"},
                                    "pieces": True}), 0.0)
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    assert b.workers["w1"].pieces and b.ledger.reads_pieces(W) and not b.ledger.reads_pieces(C)
    b.outbox.clear()
    task_id = submit(b, {})
    b.dispatch(0.0)
    [(routing, frames)] = [(r, f) for r, f in b.outbox if f[1] == bytes([Command.TASK])]
    b.outflow.add(routing, [frames + [b"x" * Limits().chunk_bytes] * 9], 0.0)  # as the server does
    [first, *_] = [decode(f, Limits()) for f in b.outflow.take(routing)]
    task = b.tasks[task_id]
    expires = task.lease_expires
    b.handle(W, msg(Command.PIECE_ACK, {"x": first.header["x"], "got": 1000}), 5.0)
    assert task.lease_expires == 5.0 + Timing().lease_ttl > expires
    assert b.pieces_acked == {W}
    b.handle(W, msg(Command.PIECE_ACK, {"x": first.header["x"], "got": 1000}), 9.0)  # a repeat
    assert task.lease_expires == 5.0 + Timing().lease_ttl


@pytest.mark.parametrize("bad", [{}, {"x": "1", "got": 5}, {"x": 1, "got": 0},
                                 {"x": -1, "got": 5}, {"x": 1, "got": True}])
def test_a_malformed_piece_acknowledgement_is_answered_and_the_session_kept(broker, bad):
    broker.handle(W, msg(Command.PIECE_ACK, bad), 0.0)
    assert sent(broker, Command.ERROR)[-1]["code"] == "malformed"
    assert broker.workers["w1"].state.value == "alive"


def test_what_waited_behind_pieces_for_a_session_that_ended_is_still_sent(broker):
    frames = encode(Command.TASK, {}, [b"x" * Limits().chunk_bytes] * 40)  # past the window
    broker.outflow.add(W, [frames, encode(Command.DISCONNECT, {"reason": "kill"})], 0.0)
    broker.outflow.take(W)
    broker.ledger.peers.pop(W)  # the worker's session ended (kill, lost, left)
    broker.tick(1.0)
    assert not broker.outflow.busy(W)
    assert any(r == W and decode(f, Limits()).command is Command.DISCONNECT
               for r, f in broker.outbox)


def test_a_piece_from_a_worker_is_a_sign_of_life_and_renews_its_leases(broker):
    task_id = submit(broker, {})
    broker.dispatch(0.0)
    task = broker.tasks[task_id]
    assert broker.heard_piece(W, 7.0)
    assert task.lease_expires == 7.0 + Timing().lease_ttl
    assert broker.workers["w1"].last_seen == 7.0
    assert not broker.heard_piece(b"nobody", 7.0)  # no session: the server answers NO_SESSION


def test_a_capable_worker_away_for_seconds_fails_nothing_queued_for_it():
    """The pending timeout ran from submission: with another worker alive (the self-worker),
    the only one that could run a kind of task going quiet for a few seconds failed every task
    of that kind queued longer than the timeout, at once. Its clock now starts when the last
    capable worker goes, and a task fails only when none came back within the timeout."""
    limit = Timing().pending_timeout
    b = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0)
    W2 = b"big-routing"
    for routing, wid, cores in ((W, "small", 1), (W2, "big", 16)):
        b.handle(routing, msg(Command.HELLO, {
            "role": "worker", "id": wid, "slots": 1, "credit": 1, "proto": [1, 1],
            "info": {"python": "3.11", "cores": cores}}), 0.0)
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    first = submit(b, {"req": {"cores": 8}})
    b.handle(C, msg(Command.SUBMIT, {"tasks": [{"seq": 2, "nf": 1, "kind": "script",
                                                "req": {"cores": 8}}]}, [b"p"]), 0.0)
    second = sent(b, Command.ACCEPTED)[-1]["accepted"][0][1]
    b.dispatch(0.0)
    assert b.tasks[first].worker_id == "big" and b.tasks[second].state is TaskState.PENDING
    away = 2 * limit  # both queued or running for twice the timeout; then "big" goes quiet
    for t in range(1, int(away) + 1):
        b.handle(W, msg(Command.HEARTBEAT, {}), float(t))
        b.handle(W2, msg(Command.HEARTBEAT, {"leases": [b.tasks[first].lease_id]}), float(t))
        b.tick(float(t))
    silent = Timing().silence_limit + 2
    for t in range(int(away) + 1, int(away + silent)):
        b.handle(W, msg(Command.HEARTBEAT, {}), float(t))
        b.tick(float(t))
    assert b.workers["big"].state.value == "lost"
    assert b.tasks[first].state is TaskState.PENDING  # back in the queue
    assert b.tasks[second].state is TaskState.PENDING  # and neither failed for it
    end = away + silent + limit - 2
    t = away + silent
    while t < end:
        b.handle(W, msg(Command.HEARTBEAT, {}), t)
        b.tick(t)
        t += 1.0
    assert b.tasks[second].state is TaskState.PENDING  # the grace of a full timeout
    for t in (end + 3, end + 4):
        b.handle(W, msg(Command.HEARTBEAT, {}), t)
        b.tick(t)
    header = b.tasks[second].result_header
    assert header["status"] == "unschedulable", header  # none came back: it fails then


def _workers(b: Broker, *specs: tuple[bytes, str, int, int]) -> None:
    for routing, wid, cores, credit in specs:
        b.handle(routing, msg(Command.HELLO, {
            "role": "worker", "id": wid, "slots": 1, "credit": credit, "proto": [1, 1],
            "info": {"python": "3.11", "cores": cores}}), 0.0)


def test_a_heavy_task_only_a_straggler_can_run_goes_to_it_instead_of_waiting_forever():
    """Stragglers were filtered out of heavy tasks, while the pending timeout counted them as
    able: an A100 running only heavy tasks (the slowest per unit of cost) got none of them
    again, and they waited with no error. It is a preference: a faster capable worker, busy
    for now, is still waited for."""
    b = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0)
    _workers(b, (W, "small", 1, 1), (b"big-routing", "big", 16, 1))
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    b.worker_side.stragglers = {"big"}
    heavy = submit(b, {"req": {"cores": 8}, "cost": 4})
    b.dispatch(1.0)
    assert b.tasks[heavy].worker_id == "big"

    b = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0)
    _workers(b, (W, "small", 1, 1), (b"big-routing", "big", 16, 1), (b"big2", "big2", 16, 0))
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    b.worker_side.stragglers = {"big"}
    heavy = submit(b, {"req": {"cores": 8}, "cost": 4})
    b.dispatch(1.0)
    assert b.tasks[heavy].state is TaskState.PENDING  # big2 is capable and not slow: it waits


def test_a_worker_back_from_silence_keeps_the_task_it_still_runs(broker):
    """Silent past the limit (a Wi-Fi drop), its lease went back to the queue; back half a
    second later and naming the task in its HELLO, it was told to abort it, so the work done
    was thrown away and the task ran again from the start, an attempt spent."""
    task_id = submit(broker, {})
    broker.dispatch(0.0)
    lease = broker.tasks[task_id].lease_id
    gone = Timing().silence_limit + 1
    broker.tick(gone)
    task = broker.tasks[task_id]
    assert task.state is TaskState.PENDING and "w1" in task.excluded
    broker.outbox.clear()
    broker.handle(W, msg(Command.HELLO, {"role": "worker", "id": "w1", "slots": 1, "credit": 0,
                                         "proto": [1, 1], "held": [[task_id, lease]]}), gone + 0.5)
    welcome = sent(broker, Command.WELCOME)[-1]
    assert lease not in welcome.get("abort", [])
    assert task.state is TaskState.LEASED and task.lease_id == lease and task.attempts == 1
    assert "w1" not in task.excluded and broker.workers["w1"].leases == {lease: task_id}
    broker.dispatch(gone + 0.6)  # its old queue entry starts nothing
    assert sent(broker, Command.TASK) == []
    broker.handle(W, msg(Command.RESULT, {"task": task_id, "lease": lease, "status": "ok",
                                          "encoding": "text"}, [b"v"]), gone + 1)
    assert task.state is TaskState.DONE


def test_a_task_a_worker_crashed_waits_for_another_that_could_run_it_busy_or_not():
    """Only a worker with free credit counted as another: a machine whose runners die at once
    took back the task it had just crashed, at once, until its attempts were spent, while a
    healthy worker finished a longer task."""
    from gpumesh.coordinator.broker import EXCLUDED_WAIT

    b = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0)
    _workers(b, (W, "bad", 1, 1), (b"good-routing", "good", 1, 0))  # good: busy, no credit
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    first, second = submit(b, {"max_attempts": 3}), _submit_seq(b, 2)
    b.dispatch(0.0)
    task = b.tasks[first]
    assert task.worker_id == "bad"
    b.handle(W, msg(Command.RESULT, {"task": first, "lease": task.lease_id, "status": "crashed",
                                     "diagnosis": "killed by SIGKILL", "granted": 2}), 1.0)
    b.dispatch(1.5)
    assert task.state is TaskState.PENDING and task.attempts == 1  # waits for "good"
    assert b.tasks[second].worker_id == "bad"  # the queue behind it goes on
    b.handle(b"good-routing", msg(Command.CREDIT, {"granted": 1}), 2.0)
    b.dispatch(2.0)
    assert task.worker_id == "good"  # first in line still, for the worker that frees up

    # Nobody else frees up: after EXCLUDED_WAIT it may go back to the worker that failed it.
    b = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0)
    _workers(b, (W, "bad", 1, 1), (b"good-routing", "good", 1, 0))
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    only = submit(b, {"max_attempts": 3})
    b.dispatch(0.0)
    task = b.tasks[only]
    b.handle(W, msg(Command.RESULT, {"task": only, "lease": task.lease_id, "status": "crashed",
                                     "diagnosis": "killed by SIGKILL", "granted": 2}), 1.0)
    b.handle(b"good-routing", msg(Command.HEARTBEAT, {}), 1.0 + EXCLUDED_WAIT)
    b.handle(W, msg(Command.HEARTBEAT, {}), 1.0 + EXCLUDED_WAIT)
    b.dispatch(1.0 + EXCLUDED_WAIT)
    assert task.worker_id == "bad" and task.state is TaskState.LEASED


def _submit_seq(b: Broker, seq: int) -> str:
    b.handle(C, msg(Command.SUBMIT, {"tasks": [{"seq": seq, "nf": 1, "kind": "script"}]},
                    [b"payload"]), 0.0)
    return sent(b, Command.ACCEPTED)[-1]["accepted"][0][1]


def test_a_heavy_task_goes_to_a_straggler_when_the_faster_capable_workers_are_paused():
    b = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0)
    _workers(b, (W, "small", 1, 1), (b"big-routing", "big", 16, 1), (b"big2", "big2", 16, 0))
    b.handle(b"big2", msg(Command.CREDIT, {"granted": 0, "mode": "paused"}), 0.5)
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    b.worker_side.stragglers = {"big"}
    heavy = submit(b, {"req": {"cores": 8}, "cost": 4})
    b.dispatch(1.0)
    assert b.tasks[heavy].worker_id == "big"  # big2 is not there to take it: its owner paused it


def test_verbose_logs_say_who_connected_and_where_each_task_went(caplog):
    # `gpumesh -v serve` logged one handshake line through a whole job: nothing of clients,
    # submissions, dispatches or failures.
    import logging

    from gpumesh.cli.serve import log_event
    from gpumesh.coordinator import Event

    with caplog.at_level(logging.DEBUG, logger="gpumesh.coordinator"):
        b = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0)
        b.handle(W, msg(Command.HELLO, {"role": "worker", "id": "w1", "slots": 1, "credit": 1,
                                        "proto": [1, 1], "info": {"python": "3.11"}}), 0.0)
        b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
        task_id = submit(b, {})
        b.dispatch(0.0)
        log_event(Event(1, 0.0, "task_finished", {"task": task_id, "state": "failed",
                                                   "error": "ValueError: \x1b[31mbad"}))
    text = caplog.text
    assert "client c1" in text and "connected" in text
    assert f"task {task_id} of job" in text and "to worker" in text
    assert "task_finished" in text and "state=failed" in text and "\x1b" not in text
