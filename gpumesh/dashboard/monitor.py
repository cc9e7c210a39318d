"""The dashboard's view of the mesh: one thread polls the coordinator and keeps a snapshot.

One ``GPUMesh`` client, one thread asking about once a second (``workers``, ``status``,
``health``, ``events``: four of the coordinator's twenty requests a second per client), however
many browsers watch: each browser waits on ``wait_change`` for the next snapshot. Throughput
comes from the coordinator's count of finished tasks, latency from the ``task_finished`` events
(submit to finish), both kept for HISTORY_SECONDS.

When the mesh refuses (wrong token) or does not answer, the snapshot says so (``connected``
false, ``error``, ``down_since``), the terminal is told once, and the next round waits longer
each time (BACKOFF), so a wrong token does not mean a refused handshake a second forever.
Events: successful tasks are counted, never listed, and a burst of one kind of event for one
job (a cancel of 54 tasks) is one entry with a ``repeat`` count.
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
from ..errors import AuthenticationError, MeshError

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
# Longest wait between rounds while the mesh refuses this token / does not answer: each
# failed round doubles the wait from the poll interval up to this.
BACKOFF = {"token": 60.0, "unreachable": 10.0}
# Job and task details browsers may ask for, a second, all together (a burst of as many): the
# client's queries are the coordinator's to ration (20 a second), and the polls need theirs.
ON_DEMAND_RATE = 8.0
# health's time - uptime is the coordinator's start (both its wall clock): a restart moves it.
RESTART_SLACK = 1.0
BURST_LOOKBACK = 20  # recent events a task_finished may be folded into
BURST_SECONDS = 60.0
STEER_WAIT = 5.0  # seconds an action waits for the worker's new mode to show in a snapshot
EXPECTED_STATE = {"drain": ("draining", "left"), "pause": ("paused",), "resume": ("alive",)}


class TooManyRequests(Exception):
    """Browsers asked for more details than ON_DEMAND_RATE: the poll's queries come first."""


class Monitor:
    def __init__(self, client: GPUMesh, interval: float = POLL_EVERY) -> None:
        self.client = client
        self.interval = interval
        self.version = 0
        self.snapshot: dict[str, Any] = {"workers": [], "jobs": [], "counts": {}, "health": None,
                                         "events": [], "failures": [], "connected": False,
                                         "error": "connecting to the coordinator...",
                                         "down_kind": "connecting", "down_since": None}
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
        self._down: tuple[str, float] | None = None  # (kind, since) while the mesh is unusable
        self._failed_rounds = 0
        self._started: float | None = None  # when the coordinator started, by its health
        self._allowance = ON_DEMAND_RATE  # details browsers may still ask for (a token bucket)
        self._allowance_at = time.monotonic()
        self.steer_wait = STEER_WAIT

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpumesh-dashboard-poll",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        # Not yet started (a dashboard closed as it starts): it sees the stop when it does.
        if self._thread is not None and self._thread.ident is not None:
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
            delay = self.round(time.time())
            self._stop.wait(max(delay - (time.monotonic() - started), 0.05))

    def round(self, now: float) -> float:
        """One poll, its failure shown rather than raised; the seconds until the next one."""
        try:
            self.poll(now)
        except Exception as exc:  # a monitor's failure is shown, never fatal
            log.debug("dashboard poll failed", exc_info=True)
            kind = "token" if isinstance(exc, AuthenticationError) else "unreachable"
            self._failed(kind, now, exc)
            self._failed_rounds += 1
            # Capped before the power: 2.0 ** 1024 overflows, and an outage of a few hours
            # (a laptop coordinator closed overnight) would end this thread for good.
            return min(self.interval * 2 ** min(self._failed_rounds, 16), BACKOFF[kind])
        if self._down is not None:
            log.warning("dashboard: connected to the coordinator again")
        self._down, self._failed_rounds = None, 0
        return self.interval

    def _failed(self, kind: str, now: float, exc: BaseException) -> None:
        if kind == "token":
            reason = ("the token does not match this mesh's coordinator (give the mesh's "
                      "token: --token-file or GPUMESH_TOKEN)")
        else:
            reason = f"the coordinator is not answering ({_short(exc)})"
        if self._down is None or self._down[0] != kind:
            # Once per outage, not per retry: the page shows it live.
            log.warning("dashboard: cannot watch the mesh: %s; retrying less and less often",
                        reason)
            self._down = (kind, now)
        self._publish({**self.snapshot, "connected": False, "error": reason,
                       "down_kind": kind, "down_since": self._down[1]})

    def poll(self, now: float) -> None:
        """One round of queries; the new snapshot goes to every waiting browser."""
        client = self.client
        workers = client.workers()
        status = client.status(tasks=False)
        try:
            health: dict[str, Any] | None = client.health()
        except MeshError:
            health = None  # a coordinator older than protocol 1.5
        if health is not None and self._restarted(health):
            self._since = 0  # the coordinator restarted: its events are numbered from 1 again
        events = client.events(self._since)
        latencies = []
        for seq, when, kind, data in events:
            self._since = max(self._since, int(seq))
            if kind != "task_finished" or data.get("state") != "done":
                # Successful tasks are in the throughput chart: kept here, a .map's thousand
                # would push every other event out.
                self._note(seq, when, kind, data)
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
            "connected": True, "down_kind": None, "down_since": None,
        })

    def _restarted(self, health: dict[str, Any]) -> bool:
        """Whether the coordinator started again since the last poll: its start time moved (a
        restart whose journaled tasks made more events than this monitor had seen, while it
        waited to poll again, looks like no restart by the count), or its count went back."""
        started = None
        when, uptime = health.get("time"), health.get("uptime")
        if isinstance(when, (int, float)) and isinstance(uptime, (int, float)):
            started = float(when) - float(uptime)
        last, self._started = self._started, started
        if started is not None and last is not None and abs(started - last) > RESTART_SLACK:
            return True
        return int(health.get("events") or 0) < self._since

    def _note(self, seq: int, when: float, kind: str, data: dict[str, Any]) -> None:
        """Keep an event for the list. A task_finished of the same job and state as one of the
        last few kept, within BURST_SECONDS (a cancel's 54 tasks, a queue's and the running
        ones a moment apart), adds to that entry's ``repeat`` count, which moves to the end."""
        if kind == "task_finished" and data.get("job"):
            key = (data.get("job"), data.get("state"))
            for index in range(len(self._events) - 1, max(len(self._events) - BURST_LOOKBACK, 0) - 1, -1):
                old = self._events[index]
                if old[2] == kind and (old[3].get("job"), old[3].get("state")) == key \
                        and when - float(old[1]) <= BURST_SECONDS:
                    del self._events[index]
                    data = {**old[3], "repeat": int(old[3].get("repeat", 1)) + 1}
                    break
        self._events.append([seq, when, kind, data])

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
        self._take_allowance()
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
        self._take_allowance()
        return self.client.task_detail(task_id)

    def _take_allowance(self) -> None:
        """One on-demand query, or TooManyRequests: however many browsers ask, the poll keeps
        its share of the client's query rate."""
        with self._jobs_lock:
            now = time.monotonic()
            self._allowance = min(ON_DEMAND_RATE, self._allowance
                                  + (now - self._allowance_at) * ON_DEMAND_RATE)
            self._allowance_at = now
            if self._allowance < 1.0:
                raise TooManyRequests
            self._allowance -= 1.0

    def cancel(self, job_id: str, force: bool) -> dict[str, Any]:
        cancelled = self.client.cancel_job(job_id, force=force)
        self._forget(job_id)
        return {"cancelled": cancelled}

    def steer(self, worker: str, action: str, wait: float | None = None) -> dict[str, Any]:
        """Ask a worker to drain/pause/resume and say what it did: its state once a snapshot
        shows the one asked for, or, when none does within ``wait``, the state it kept and
        ``held`` (its owner chose that state on the machine, which the mesh never undoes)."""
        answer = dict(self.client.steer_worker(worker, action))
        wanted = EXPECTED_STATE.get(action, ())
        deadline = time.monotonic() + (self.steer_wait if wait is None else wait)
        seen = self.version
        state = self._state_of(worker)
        while state not in wanted and not self.stopped:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            seen = self.wait_change(seen, left)
            state = self._state_of(worker)
        answer["state"] = state
        answer["held"] = state not in wanted and state is not None
        return answer

    def _state_of(self, worker: str) -> str | None:
        with self._changed:
            workers = self.snapshot.get("workers") or []
        return next((str(w.get("state")) for w in workers if w.get("id") == worker), None)

    def _forget(self, job_id: str) -> None:
        with self._jobs_lock:
            self._jobs.pop(job_id, None)


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
