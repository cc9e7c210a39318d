"""The dashboard's poller with a stub mesh: throughput, latency, failures, an older coordinator."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from gpumesh.dashboard.monitor import Monitor
from gpumesh.errors import AuthenticationError, ConnectionFailed, MeshError


class Stub:
    def __init__(self, health: bool = True) -> None:
        self.has_health = health
        self.finished = 0
        self.pending_events: list[list[Any]] = []
        self.asked_since: list[int] = []
        self.last_seq = 0

    def workers(self) -> list[dict[str, Any]]:
        return [{"id": "w1", "hostname": "<b>box</b>"}]

    def status(self, job: str | None = None, *, tasks: bool = True) -> dict[str, Any]:
        if job:
            return {"job": job, "tasks": [{"id": str(i)} for i in range(2500)]}
        return {"jobs": [{"job": "j1"}], "counts": {"pending": 3}}

    def health(self) -> dict[str, Any]:
        if not self.has_health:
            raise MeshError("the coordinator refused the request: unknown query 'health'")
        return {"finished_total": self.finished, "events": self.last_seq}

    def events(self, since: int = 0) -> list[list[Any]]:
        self.asked_since.append(since)
        events, self.pending_events = self.pending_events, []
        self.last_seq = max([self.last_seq, *(e[0] for e in events)])
        return events


def finished(seq: int, latency: float, state: str = "done") -> list[Any]:
    return [seq, 100.0 + seq, "task_finished",
            {"task": f"t{seq}", "job": "j1", "state": state, "latency": latency}]


def test_throughput_latency_and_failures_from_two_rounds():
    stub = Stub()
    monitor = Monitor(stub)  # type: ignore[arg-type]
    monitor.poll(10.0)
    stub.finished = 30
    stub.pending_events = [finished(1, 0.5), finished(2, 1.5, "failed"), finished(3, 1.0)]
    monitor.poll(12.0)
    point = monitor.history[-1]
    assert point["throughput"] == 15.0 and point["p50"] == 1.0 and point["p95"] == 1.5
    assert [f["task"] for f in monitor.snapshot["failures"]] == ["t2"]
    assert [e[0] for e in monitor.snapshot["events"]] == [2]  # done tasks are only counted
    assert stub.asked_since == [0, 0] and monitor._since == 3
    monitor.poll(13.0)
    assert stub.asked_since[-1] == 3  # only what is new
    stub.last_seq = 0  # the coordinator restarted: numbering starts again
    monitor.poll(14.0)
    assert stub.asked_since[-1] == 0
    assert json.loads(monitor.encoded)["workers"][0]["hostname"] == "<b>box</b>"  # as data


def test_an_older_coordinator_without_health_counts_events():
    stub = Stub(health=False)
    monitor = Monitor(stub)  # type: ignore[arg-type]
    monitor.poll(10.0)
    stub.pending_events = [finished(1, 0.2), finished(2, 0.2)]
    monitor.poll(11.0)
    assert monitor.snapshot["health"] is None and monitor.history[-1]["throughput"] == 2.0


def test_a_big_jobs_detail_is_cut_and_reused():
    stub = Stub()
    monitor = Monitor(stub)  # type: ignore[arg-type]
    view = monitor.job("j1")
    assert len(view["tasks"]) == 2000 and view["tasks_not_shown"] == 500
    stub.status = None  # type: ignore[assignment]  # a second ask would fail: it is cached
    assert monitor.job("j1") is view


def test_the_dashboard_is_a_layer_above_the_client_only():
    code = ("import sys, gpumesh.dashboard; print(sorted(m for m in sys.modules if m.startswith("
            "('gpumesh.coordinator', 'gpumesh.worker', 'gpumesh.cli.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


class Refusing(Stub):
    """A mesh that refuses this token, or does not answer, until told otherwise."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error: Exception | None = error
        self.rounds = 0

    def workers(self) -> list[dict[str, Any]]:
        self.rounds += 1
        if self.error is not None:
            raise self.error
        return super().workers()


def test_a_wrong_token_is_said_once_shown_as_such_and_retried_less_and_less(caplog):
    stub = Refusing(AuthenticationError("authentication failed: the token does not match"))
    monitor = Monitor(stub, interval=1.0)  # type: ignore[arg-type]
    with caplog.at_level("WARNING", logger="gpumesh.dashboard"):
        delays = [monitor.round(100.0 + i) for i in range(8)]
    assert delays == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    snapshot = json.loads(monitor.encoded)
    assert snapshot["connected"] is False and snapshot["down_kind"] == "token"
    assert "token does not match this mesh" in snapshot["error"]
    assert snapshot["down_since"] == 100.0
    assert len([r for r in caplog.records if "cannot watch" in r.message]) == 1
    stub.error = None
    with caplog.at_level("WARNING", logger="gpumesh.dashboard"):
        assert monitor.round(200.0) == 1.0
    assert json.loads(monitor.encoded)["connected"] is True
    assert "connected to the coordinator again" in caplog.text


def test_hours_of_outage_keep_the_poller_polling():
    stub = Refusing(ConnectionFailed("cannot reach a coordinator at tcp://127.0.0.1:9"))
    monitor = Monitor(stub, interval=1.0)  # type: ignore[arg-type]
    delays = [monitor.round(10.0 + i) for i in range(1100)]  # 2.0 ** 1024 would overflow
    assert set(delays[5:]) == {10.0}
    stub.error = None
    assert monitor.round(5000.0) == 1.0 and json.loads(monitor.encoded)["connected"] is True


def test_a_restart_that_made_more_events_than_were_seen_is_still_a_restart():
    class Restarting(Stub):
        started = 1000.0

        def health(self) -> dict[str, Any]:
            return {**super().health(), "time": self.started + 50.0, "uptime": 50.0}

    stub = Restarting()
    monitor = Monitor(stub)  # type: ignore[arg-type]
    stub.pending_events = [finished(seq, 0.1, "failed") for seq in range(1, 6)]
    monitor.poll(10.0)
    monitor.poll(11.0)
    assert stub.asked_since[-1] == 5
    # It restarted while the page waited, and its journaled tasks ran again: 700 events.
    stub.started, stub.last_seq = 2000.0, 700
    stub.pending_events = [finished(seq, 0.1, "failed") for seq in range(1, 701)]
    monitor.poll(12.0)
    assert stub.asked_since[-1] == 0  # from its first event, not from the old run's 5th
    monitor.poll(13.0)
    assert stub.asked_since[-1] == 700  # and no restart seen again while its start holds
    assert len(monitor.snapshot["failures"]) == 50  # the new run's, the list's length


def test_an_unreachable_coordinator_is_shown_since_when_and_its_figures_kept():
    stub = Refusing(ConnectionFailed("cannot reach a coordinator at tcp://127.0.0.1:9"))
    stub.error = None
    monitor = Monitor(stub, interval=1.0)  # type: ignore[arg-type]
    monitor.round(10.0)
    stub.error = ConnectionFailed("cannot reach a coordinator at tcp://127.0.0.1:9")
    delays = [monitor.round(11.0 + i) for i in range(6)]
    assert delays[-1] == 10.0  # the cap for a silent coordinator: it comes back by itself
    snapshot = json.loads(monitor.encoded)
    assert snapshot["connected"] is False and snapshot["down_kind"] == "unreachable"
    assert snapshot["down_since"] == 11.0 and "not answering" in snapshot["error"]
    assert snapshot["workers"]  # the last figures stay, the page greys them


def test_successful_tasks_never_displace_events_and_a_burst_is_one_line():
    stub = Stub()
    monitor = Monitor(stub)  # type: ignore[arg-type]
    joined = [1, 90.0, "worker_joined", {"worker": {"id": "w1", "hostname": "vm"}}]
    done = [finished(2 + i, 0.1) for i in range(300)]
    cancelled = [[400 + i, 200.0 + i, "task_finished",
                  {"task": f"c{i}", "job": "jx", "state": "cancelled"}] for i in range(54)]
    asked = [350, 215.0, "job_cancelled", {"job": "jx", "count": 54, "by": "ann@lap"}]
    # The queued tasks are cancelled at once, the running ones when their workers stop them.
    stub.pending_events = [joined, *done, *cancelled[:20], asked]
    monitor.poll(10.0)
    stub.pending_events = cancelled[20:]
    monitor.poll(11.0)
    events = monitor.snapshot["events"]
    assert [e[2] for e in events] == ["worker_joined", "job_cancelled", "task_finished"]
    assert events[2][3]["repeat"] == 54 and events[2][3]["job"] == "jx"


class Steered(Stub):
    def __init__(self, obeys: bool) -> None:
        super().__init__()
        self.obeys = obeys
        self.state = "paused"

    def workers(self) -> list[dict[str, Any]]:
        return [{"id": "w1", "hostname": "vm", "state": self.state}]

    def steer_worker(self, worker: str, action: str) -> dict[str, Any]:
        if self.obeys:
            self.state = "alive"
        return {"worker": worker, "action": action, "mode": "paused"}


def test_an_action_reports_the_workers_state_after_it_and_when_its_owner_holds_it():
    for obeys in (True, False):
        stub = Steered(obeys)
        monitor = Monitor(stub, interval=0.05)  # type: ignore[arg-type]
        monitor.poll(1.0)
        monitor.start()
        try:
            answer = monitor.steer("w1", "resume", wait=1.0)
        finally:
            monitor.stop()
        assert answer["state"] == ("alive" if obeys else "paused")
        assert answer["held"] is (not obeys)


def test_browsers_asking_for_details_cannot_take_the_polls_share_of_queries():
    from gpumesh.dashboard.monitor import ON_DEMAND_RATE, TooManyRequests

    class Counting(Stub):
        asked = 0

        def task_detail(self, task_id: str) -> dict[str, Any]:
            self.asked += 1
            return {"id": task_id}

    stub = Counting()
    monitor = Monitor(stub)  # type: ignore[arg-type]
    refused = 0
    for i in range(200):  # a page (or a script with its cookie) asking in a loop
        try:
            monitor.task(f"t{i}") if i % 2 else monitor.job(f"job{i}")
        except TooManyRequests:
            refused += 1
    answered = 200 - refused
    assert ON_DEMAND_RATE <= answered <= ON_DEMAND_RATE + 2  # the burst (and what refilled)
    assert stub.asked <= answered
    monitor.poll(10.0)  # the poll's own queries are not rationed here
    assert monitor.snapshot["connected"] is True
