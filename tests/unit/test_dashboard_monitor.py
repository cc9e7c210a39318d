"""The dashboard's poller with a stub mesh: throughput, latency, failures, an older coordinator."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from gpumesh.dashboard.monitor import Monitor
from gpumesh.errors import MeshError


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
