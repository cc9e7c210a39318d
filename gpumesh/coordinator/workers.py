"""What the broker does with workers: sessions, credit, results, and removing one (``kill``).

A mixin of ``Broker`` (see broker.py for the shared state); split out so each file has one job.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import scheduler
from ..protocol import Command, ErrorCode, Message, ProtocolError, field_of
from .state import TaskState, WorkerSession, WorkerState

if TYPE_CHECKING:
    from .broker import Broker

WORKER_MODES = ("active", "paused", "draining")
SPEED_SMOOTHING = 0.2  # weight of the newest task in a worker's moving average of task time
MIN_RESULTS_FOR_SPEED = 3  # results a worker needs before it can be called a straggler


class WorkerSide:
    def _hello_worker(self: Broker, routing: bytes, worker_id: str, h: dict[str, Any], now: float
                      ) -> list[int]:
        info = field_of(h, "info", dict, {})
        slots = field_of(h, "slots", int)
        credit = field_of(h, "credit", int, slots)
        held = _held_leases(field_of(h, "held", list, []))  # checked whole before anything moves
        release = [lease for lease in field_of(h, "release", list, []) if isinstance(lease, int)]
        incarnation = field_of(h, "incarnation", str, "")
        if not 0 <= credit <= 100_000 or not 0 < slots <= 100_000:
            raise ProtocolError(ErrorCode.MALFORMED, "slots and credit must be 0-100000")
        draining, mode = _mode_of(h)
        worker = self.workers.get(worker_id)
        rejoined = worker is not None and worker.state is WorkerState.LOST
        if worker is None:
            worker = WorkerSession(worker_id, routing, incarnation, info, slots, now, now)
            self.workers[worker_id] = worker
            rejoined = True
        else:
            if worker.routing != routing:
                self.peers.pop(worker.routing, None)
            if worker.incarnation != incarnation:
                # The agent restarted: whatever it held under the old incarnation is gone.
                self._release_leases(worker, now, f"worker {worker.label} restarted", infra=True)
            worker.routing, worker.incarnation, worker.info = routing, incarnation, info
            worker.slots, worker.last_seen, worker.state = slots, now, WorkerState.ALIVE
            worker.departed = ""
        worker.granted, worker.sent = credit, 0
        worker.draining, worker.mode = draining, mode
        # Handed back while the link was down (the owner paused it): no attempt is charged.
        self._release(worker, release, now)
        abort: list[int] = []
        claimed: dict[int, str] = {}
        for task_id, lease_id in held:
            task = self.tasks.get(task_id)
            if task is not None and not task.cancel_requested and (
                (task.state is TaskState.LEASED and task.lease_id == lease_id
                 and task.worker_id == worker_id)
                or task.state is TaskState.RESTORED
            ):
                if task.state is TaskState.RESTORED:
                    task.move(TaskState.LEASED)
                    task.attempts = max(task.attempts, 1)
                task.lease_id, task.worker_id = lease_id, worker_id
                task.lease_expires = now + self.timing.lease_ttl
                claimed[lease_id] = task_id
            else:
                abort.append(lease_id)
        # Leases the coordinator thinks this worker holds but it did not claim are lost.
        for lease_id, task_id in list(worker.leases.items()):
            if lease_id not in claimed:
                worker.leases.pop(lease_id)
                self._requeue(self.tasks.get(task_id), worker, now, "lost across a reconnect",
                              infra=True)
        worker.leases = claimed
        if rejoined:
            self.emit("worker_joined", now, worker=worker.describe())
        return abort

    def _release(self: Broker, worker: WorkerSession, leases: list[int], now: float) -> None:
        """Tasks the worker hands back unstarted (its owner paused it): no attempt is spent."""
        for lease_id in leases:
            task_id = worker.leases.pop(lease_id, None)
            task = self.tasks.get(task_id) if task_id else None
            if task is not None and task.lease_id == lease_id:
                self._requeue(task, worker, now, f"handed back by {worker.label}", infra=False)

    # ----------------------------------------------------------------- worker messages

    def _w_heartbeat(self: Broker, worker: WorkerSession, msg: Message, now: float) -> None:
        leases = field_of(msg.header, "leases", list, [])
        expires = now + self.timing.lease_ttl
        for lease_id in leases:
            task_id = worker.leases.get(lease_id)
            task = self.tasks.get(task_id) if task_id else None
            if task is not None and task.lease_id == lease_id:
                task.lease_expires = expires

    def _w_credit(self: Broker, worker: WorkerSession, msg: Message, now: float) -> None:
        h = msg.header
        worker.granted = max(worker.granted, field_of(h, "granted", int))
        before = worker.mode
        worker.draining, worker.mode = _mode_of(h, worker.draining)
        self._release(worker, [lease for lease in field_of(h, "release", list, [])
                               if isinstance(lease, int)], now)
        if worker.mode != before:
            self.emit("worker_mode", now, worker=worker.worker_id, mode=worker.mode)

    def _w_output(self: Broker, worker: WorkerSession, msg: Message, now: float) -> None:
        task = self.tasks.get(field_of(msg.header, "task", str))
        if task is None or task.worker_id != worker.worker_id or len(msg.payload) != 1:
            return
        client = self.clients.get(task.client_id)
        if client is not None and client.routing is not None:
            header = {"task": task.task_id, "stream": msg.header.get("stream", "out"),
                      "worker": worker.short_id}
            self._send(client.routing, Command.OUTPUT, header, msg.payload)

    def _w_result(self: Broker, worker: WorkerSession, msg: Message, now: float) -> None:
        h = msg.header
        task_id = field_of(h, "task", str)
        lease_id = field_of(h, "lease", int)
        status = field_of(h, "status", str)
        if status not in ("ok", "error", "timeout", "cancelled", "crashed"):
            raise ProtocolError(ErrorCode.MALFORMED, f"unknown result status {status!r}")
        if "granted" in h:
            worker.granted = max(worker.granted, field_of(h, "granted", int))
        held = worker.leases.pop(lease_id, None)
        elapsed = field_of(h, "elapsed", (int, float), 0.0)
        task = self.tasks.get(task_id)
        if held is not None:
            worker.completed += 1
            worker.busy_seconds += elapsed
            if task is not None and status in ("ok", "error"):
                self._record_speed(worker, elapsed / max(task.cost, 1e-3))
        ack = {"task": task_id, "lease": lease_id}
        stale = task is not None and (
            lease_id < task.lease_floor  # from an attempt before `gpumesh retry`
            # A cancellation is about that attempt only; another one may be running now.
            or (status == "cancelled" and lease_id != task.lease_id))
        if task is None or task.state.terminal or stale:
            self._send(worker.routing, Command.RESULT_ACK, {**ack, "disposition": "duplicate"})
            return
        if status == "crashed":
            if held is not None and task.lease_id == lease_id:
                self._requeue(task, worker, now, str(h.get("diagnosis", "runner crashed")),
                              infra=True)
            self._send(worker.routing, Command.RESULT_ACK, {**ack, "disposition": "accepted"})
            return
        if task.lease_id != lease_id and task.state is TaskState.LEASED:
            # An earlier attempt finished first: its result is as good; stop the current one.
            self._cancel_on_worker(task)
        state = {"ok": TaskState.DONE, "cancelled": TaskState.CANCELLED}.get(status, TaskState.FAILED)
        result = {"status": status, "worker": worker.worker_id, "attempts": task.attempts,
                  "elapsed": elapsed}
        for key in ("error", "diagnosis", "encoding"):
            if key in h:
                result[key] = h[key]
        self._finish(task, state, result, msg.payload, now)
        self._send(worker.routing, Command.RESULT_ACK, {**ack, "disposition": "accepted"})

    def _w_disconnect(self: Broker, worker: WorkerSession, msg: Message, now: float) -> None:
        reason = str(msg.header.get("reason", "left"))
        self._release_leases(worker, now, f"worker {worker.label} {reason}", infra=False)
        self._lose(worker, now, reason)

    # ----------------------------------------------------------------- speed and stragglers

    def _record_speed(self: Broker, worker: WorkerSession, seconds_per_cost: float) -> None:
        if worker.completed <= 1 or worker.seconds_per_cost == 0.0:
            worker.seconds_per_cost = seconds_per_cost
        else:
            worker.seconds_per_cost += SPEED_SMOOTHING * (seconds_per_cost - worker.seconds_per_cost)

    def refresh_stragglers(self: Broker) -> set[str]:
        """Alive workers over twice the median task time per unit of cost (scheduler rule 4).

        Recomputed once a second by ``tick``, not on every dispatch: speeds move slowly.
        """
        speeds = {w.worker_id: w.seconds_per_cost for w in self.workers.values()
                  if w.state is WorkerState.ALIVE and w.completed >= MIN_RESULTS_FOR_SPEED}
        self.stragglers = scheduler.stragglers(speeds)
        return self.stragglers

    # ----------------------------------------------------------------- removing a worker

    def find_worker(self: Broker, key: str) -> WorkerSession | str:
        """A worker by id, unique id prefix or hostname; an error message when none or many match."""
        if key in self.workers:
            return self.workers[key]
        alive = [w for w in self.workers.values() if w.state is WorkerState.ALIVE]
        if len(key) < 4 and any(w.worker_id.startswith(key) for w in alive):
            return f"{key!r} is too short: give at least 4 characters of the worker id"
        matches = [w for w in alive if w.worker_id.startswith(key)] if len(key) >= 4 else []
        matches = matches or [w for w in alive if w.info.get("hostname") == key]
        if len(matches) == 1:
            return matches[0]
        if matches:
            return f"{key!r} matches {len(matches)} workers: use the worker id ('gpumesh workers')"
        return f"no worker {key!r} is connected: 'gpumesh workers' lists them"

    def kill_worker(self: Broker, worker: WorkerSession, now: float) -> dict[str, Any]:
        """Take a worker out of the pool: its tasks go back to the queue, and it is told to leave."""
        handed_back = len(worker.leases)
        self._release_leases(worker, now, f"worker {worker.label} was removed", infra=False)
        if worker.state is WorkerState.ALIVE:
            self._send(worker.routing, Command.DISCONNECT, {"reason": "kill"})
        self._lose(worker, now, "removed by 'gpumesh kill'")
        return {"worker": worker.worker_id, "hostname": worker.info.get("hostname", ""),
                "handed_back": handed_back}


def _held_leases(items: list[Any]) -> list[tuple[str, int]]:
    pairs = []
    for item in items:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], int) and not isinstance(item[1], bool)):
            raise ProtocolError(ErrorCode.MALFORMED, "held leases must be [task, lease] pairs")
        pairs.append((item[0], item[1]))
    return pairs


def _mode_of(h: dict[str, Any], draining: bool = False) -> tuple[bool, str]:
    """(draining, mode) from a HELLO or CREDIT: a paused or draining worker takes no new tasks."""
    draining = field_of(h, "draining", bool, draining)
    mode = field_of(h, "mode", str, "draining" if draining else "active")
    if mode not in WORKER_MODES:
        raise ProtocolError(ErrorCode.MALFORMED, f"unknown worker mode {mode!r}")
    return draining or mode != "active", mode
