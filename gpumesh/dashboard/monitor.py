"""The dashboard's view of the mesh: one thread polls the coordinator and keeps a snapshot.

One ``GPUMesh`` client, one thread asking about once a second (``workers``, ``status``,
``health``, ``events``: four of the coordinator's twenty requests a second per client), however
many browsers watch: each browser waits on ``wait_change`` for the next snapshot. Throughput
comes from the coordinator's count of finished tasks, latency from the ``task_finished`` events
(submit to finish), both kept for HISTORY_SECONDS.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from collections import deque
from typing import Any

from ..client import GPUMesh
from ..errors import MeshError

log = logging.getLogger("gpumesh.dashboard")

POLL_EVERY = 1.0  # seconds between rounds of queries
HISTORY_SECONDS = 600
RECENT_EVENTS = 100  # events the page lists
RECENT_FAILURES = 50
# Seconds a job's detail is reused, at least: many browsers cost one query. A big job's detail
# is a paged answer read from the journal, so it is reused a second more per 1,000 tasks.
JOB_CACHE = 1.0
MAX_JOB_CACHE = 10.0
MAX_TASKS_SHOWN = 2000  # tasks of one job the page lists (the counts cover them all)


class Monitor:
    def __init__(self, client: GPUMesh, interval: float = POLL_EVERY) -> None:
        self.client = client
        self.interval = interval
        self.version = 0
        self.snapshot: dict[str, Any] = {"workers": [], "jobs": [], "counts": {}, "health": None,
                                         "events": [], "failures": [], "error": "connecting..."}
        self.encoded = json.dumps(self.snapshot)  # the snapshot as every browser is sent it
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_SECONDS)
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._since = 0  # the last event seq seen
        self._events: deque[list[Any]] = deque(maxlen=RECENT_EVENTS)
        self._failures: deque[dict[str, Any]] = deque(maxlen=RECENT_FAILURES)
        self._finished: tuple[float, int] | None = None  # (when, finished_total) last round
        self._jobs: dict[str, tuple[float, dict[str, Any]]] = {}  # id -> (until, view)
        self._jobs_lock = threading.Lock()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpumesh-dashboard-poll",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(5)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def wait_change(self, seen: int, timeout: float) -> int:
        """Block until the snapshot is newer than ``seen`` (or ``timeout``, or stop)."""
        with self._changed:
            self._changed.wait_for(lambda: self.version != seen or self._stop.is_set(), timeout)
            return self.version

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.poll(time.time())
            except Exception as exc:  # a monitor's failure is shown, never fatal
                log.debug("dashboard poll failed", exc_info=True)
                self._publish({**self.snapshot, "error": _short(exc)})
            self._stop.wait(max(self.interval - (time.monotonic() - started), 0.05))

    def poll(self, now: float) -> None:
        """One round of queries; the new snapshot goes to every waiting browser."""
        client = self.client
        workers = client.workers()
        status = client.status(tasks=False)
        try:
            health: dict[str, Any] | None = client.health()
        except MeshError:
            health = None  # a coordinator older than protocol 1.5
        if health is not None and int(health.get("events") or 0) < self._since:
            self._since = 0  # the coordinator restarted: its events are numbered from 1 again
        events = client.events(self._since)
        latencies = []
        for seq, when, kind, data in events:
            self._since = max(self._since, int(seq))
            if kind != "task_finished" or data.get("state") != "done":
                # Successful tasks are in the throughput chart: kept here, a .map's thousand
                # would push every other event out.
                self._events.append([seq, when, kind, data])
            if kind == "task_finished":
                if isinstance(data.get("latency"), (int, float)):
                    latencies.append(float(data["latency"]))
                if data.get("state") == "failed":
                    self._failures.append({"time": when, **data})
        self._sample(now, health, latencies, events)
        self._publish({
            "time": now, "workers": workers, "jobs": status.get("jobs", []),
            "counts": status.get("counts", {}), "health": health,
            "events": list(self._events), "failures": list(self._failures),
            "point": self.history[-1] if self.history else None, "error": None,
        })

    def _sample(self, now: float, health: dict[str, Any] | None, latencies: list[float],
                events: list[Any]) -> None:
        if health is not None and isinstance(health.get("finished_total"), int):
            total = int(health["finished_total"])
        else:  # an older coordinator: count the events (a burst past 10,000 is undercounted)
            total = (self._finished[1] if self._finished else 0) + sum(
                1 for e in events if e[2] == "task_finished")
        last, self._finished = self._finished, (now, total)
        if last is None or now <= last[0]:
            return
        latencies.sort()
        point = {
            "t": now, "throughput": max(total - last[1], 0) / (now - last[0]),
            "p50": statistics.median(latencies) if latencies else None,
            "p95": latencies[min(int(len(latencies) * 0.95), len(latencies) - 1)]
            if latencies else None,
        }
        with self._changed:  # a browser may be copying the history just now
            self.history.append(point)

    def history_json(self) -> str:
        with self._changed:
            return json.dumps(list(self.history))

    def _publish(self, snapshot: dict[str, Any]) -> None:
        encoded = json.dumps(snapshot, default=str)  # once, however many browsers watch
        with self._changed:
            self.snapshot, self.encoded = snapshot, encoded
            self.version += 1
            self._changed.notify_all()

    # ----------------------------------------------------------------- on demand

    def job(self, job_id: str) -> dict[str, Any]:
        """A job with its tasks (at most MAX_TASKS_SHOWN), reused for a while (JOB_CACHE)."""
        now = time.monotonic()
        with self._jobs_lock:
            cached = self._jobs.get(job_id)
            if cached is not None and now < cached[0]:
                return cached[1]
        view = self.client.status(job_id)
        tasks = view.get("tasks") or []
        expires = now + min(JOB_CACHE + len(tasks) / 1000, MAX_JOB_CACHE)
        if len(tasks) > MAX_TASKS_SHOWN:
            view = {**view, "tasks": tasks[:MAX_TASKS_SHOWN],
                    "tasks_not_shown": len(tasks) - MAX_TASKS_SHOWN
                    + int(view.get("tasks_not_shown", 0))}
        with self._jobs_lock:
            if len(self._jobs) > 64:
                self._jobs.clear()
            self._jobs[job_id] = (expires, view)
        return view

    def task(self, task_id: str) -> dict[str, Any]:
        """One task with its whole error and traceback (no cache: asked on a click)."""
        return self.client.task_detail(task_id)

    def cancel(self, job_id: str, force: bool) -> dict[str, Any]:
        cancelled = self.client.cancel_job(job_id, force=force)
        self._forget(job_id)
        return {"cancelled": cancelled}

    def steer(self, worker: str, action: str) -> dict[str, Any]:
        return self.client.steer_worker(worker, action)

    def _forget(self, job_id: str) -> None:
        with self._jobs_lock:
            self._jobs.pop(job_id, None)


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
