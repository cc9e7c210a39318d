"""The coordinator's policy: sessions, the queue, leases, results. Messages in, messages out.

The broker owns no socket and reads no clock: the server loop hands it decoded messages with
``now`` and sends whatever it left in ``outbox`` once the journal has committed, so nothing is
acknowledged before it is durable.

This file holds the shared state and the task lifecycle; ``workers.py`` and ``clients.py`` hold
what each kind of peer can ask for, ``jobs.py`` the per-job records, ``retention.py`` what is
kept for how long, and the status views.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import scheduler
from ..config import Limits, Timing
from ..protocol import MAJOR, Command, ErrorCode, Message, ProtocolError, Role, encode, field_of
from ..store import COLLECTED, Store
from .clients import ClientSide
from .jobs import Job, summarize
from .retention import RETENTION_SWEEP, Retention
from .state import ClientSession, Task, TaskState, WorkerSession, WorkerState
from .workers import WorkerSide

log = logging.getLogger("gpumesh.coordinator")

LOST_WORKER_RETENTION = 600.0
EVENT_HISTORY = 10_000


@dataclass(frozen=True)
class Event:
    """One state change, for monitors (``gpumesh serve`` output, QUERY events, dashboards)."""

    seq: int
    time: float
    kind: str
    data: dict[str, Any]


class Broker(WorkerSide, ClientSide, Retention):
    def __init__(
        self, store: Store, timing: Timing, limits: Limits, *, epoch: int, now: float,
        safe_mode: bool = False,
    ) -> None:
        self.store = store
        self.timing = timing
        self.limits = limits
        self.epoch = epoch
        self.safe_mode = safe_mode
        self.started_at = now
        self.session_id = secrets.token_hex(6)
        self.tasks: dict[str, Task] = {}
        self.by_seq: dict[tuple[str, int], str] = {}
        self.workers: dict[str, WorkerSession] = {}
        self.clients: dict[str, ClientSession] = {}
        self.jobs: dict[str, Job] = {}
        self.stragglers: set[str] = set()  # worker ids kept from heavy tasks (refresh_stragglers)
        self.peers: dict[bytes, tuple[Role, str]] = {}
        self._pending: list[tuple[int, int, str]] = []
        self._order = itertools.count()
        self._lease_counter = itertools.count(1)
        self._assign_counter = itertools.count(1)
        self.outbox: list[tuple[bytes, list[Any]]] = []
        self.events: deque[Event] = deque(maxlen=EVENT_HISTORY)
        self._event_seq = itertools.count(1)
        self.listeners: list[Callable[[Event], None]] = []
        self.malformed: dict[bytes, int] = {}
        self._last_heartbeat = now
        self._last_pending_check = now
        self._last_sweep = now
        self._no_workers_at = now  # last time no worker was alive (pending timeouts start after)
        # Kinds (requirements, portable) of the tasks queued: the unschedulable check scans the
        # queue only when some kind has no worker that could ever run it.
        self._kinds: set[tuple[scheduler.Requirements, bool]] = set()
        self._restoring = True

    # ----------------------------------------------------------------- plumbing

    def _send(self, routing: bytes | None, command: Command, header: dict[str, Any],
              payload: list[Any] | tuple[Any, ...] = ()) -> None:
        if routing is not None:
            self.outbox.append((routing, encode(command, header, payload)))

    def _error(self, routing: bytes | None, code: ErrorCode, text: str, qid: Any = None) -> None:
        header: dict[str, Any] = {"code": code.value, "message": text}
        if isinstance(qid, int) and qid:
            header["qid"] = qid  # so the client can fail the one call that caused it
        self._send(routing, Command.ERROR, header)

    def emit(self, kind: str, now: float, **data: Any) -> None:
        event = Event(next(self._event_seq), now, kind, data)
        self.events.append(event)
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # a monitor's bug must never stop the broker
                log.exception("event listener failed")

    def restore(self, now: float) -> int:
        """Load the journal after a start. Unfinished tasks wait for their workers to re-claim.

        Returns how many unfinished tasks came back.
        """
        for job_id, name, client_id, created in self.store.load_jobs():
            self.jobs[job_id] = Job(job_id, name, client_id, created)
        count = 0
        for row in self.store.load():
            if row.state == COLLECTED:  # only its summary is left, for its job's record
                job = self._restored_job(row.job_id, row.client_id, row.submitted_at)
                job.add_collected(row.task_id, row.result_header or {"id": row.task_id})
                continue
            task = Task(
                task_id=row.task_id, client_id=row.client_id, seq=row.seq, job_id=row.job_id,
                spec=row.spec, payload=row.payload, submitted_at=row.submitted_at,
                attempts=row.attempts,
                requirements=scheduler.Requirements.from_mapping(row.spec.get("req", {})),
            )
            job = self._restored_job(task.job_id, task.client_id, task.submitted_at)
            if row.result_header is not None:
                task.state = TaskState(row.state)
                task.result_header = row.result_header
                task.result_payload = row.result_payload or []
                task.finished_at = float(row.result_header.get("finished_at", 0.0) or now)
                job.summaries[task.task_id] = summarize(task)
            else:
                task.state = TaskState.RESTORED
                task.pending_since = now
                count += 1
            job.add(task)
            self.tasks[task.task_id] = task
            self.by_seq[(task.client_id, task.seq)] = task.task_id
        for job in self.jobs.values():
            if len(job.summaries) >= len(job.task_ids):
                job.finished_at = max((float(s.get("finished_at", 0.0) or 0.0)
                                       for s in job.summaries.values()), default=job.created)
        return count

    def _restored_job(self, job_id: str, client_id: str, created: float) -> Job:
        job = self.jobs.get(job_id)
        if job is None:  # a journal from before job records: name it by its id
            job = self.jobs[job_id] = Job(job_id, job_id, client_id, created)
        return job

    # ----------------------------------------------------------------- dispatch of messages

    def handle(self, routing: bytes, msg: Message, now: float) -> None:
        """Apply one decoded message. Bad content becomes ERROR replies, never an exception."""
        try:
            if msg.command is Command.HELLO:
                self._on_hello(routing, msg, now)
                return
            peer = self.peers.get(routing)
            if peer is None:
                # Unknown routing id: a coordinator restart, or a reconnect under a new socket.
                if msg.command is not Command.DISCONNECT:
                    self._error(routing, ErrorCode.NO_SESSION, "no session: send HELLO")
                return
            role, peer_id = peer
            handler = (_WORKER_HANDLERS if role is Role.WORKER else _CLIENT_HANDLERS).get(msg.command)
            if handler is None:
                self._error(routing, ErrorCode.UNEXPECTED,
                            f"{msg.command.name} is not valid from a {role.value}")
                return
            if role is Role.WORKER:
                worker = self.workers[peer_id]
                worker.last_seen = now
                handler(self, worker, msg, now)
            else:
                client = self.clients[peer_id]
                client.last_seen = now
                handler(self, client, msg, now)
        except ProtocolError as exc:
            self.count_malformed(routing)
            self._error(routing, exc.code, exc.detail, msg.header.get("qid"))
        except (ValueError, TypeError, KeyError) as exc:
            self.count_malformed(routing)
            self._error(routing, ErrorCode.MALFORMED, f"bad {msg.command.name}: {exc}",
                        msg.header.get("qid"))

    def count_malformed(self, routing: bytes) -> None:
        if len(self.malformed) > 10_000:
            self.malformed.clear()  # bounded: a counter per peer is a diagnostic, not a ledger
        self.malformed[routing] = self.malformed.get(routing, 0) + 1

    def _on_hello(self, routing: bytes, msg: Message, now: float) -> None:
        h = msg.header
        proto = field_of(h, "proto", list, [MAJOR, MAJOR])
        if len(proto) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in proto):
            raise ProtocolError(ErrorCode.MALFORMED, "proto must be [lowest, highest] major versions")
        if not proto[0] <= MAJOR <= proto[1]:
            self._error(routing, ErrorCode.VERSION,
                        f"this coordinator speaks protocol v{MAJOR}, the peer v{proto[0]}-v{proto[1]}")
            self._send(routing, Command.DISCONNECT, {"reason": "version"})
            return
        role = Role(field_of(h, "role", str))
        peer_id = field_of(h, "id", str)
        if not 0 < len(peer_id) <= 64:
            raise ProtocolError(ErrorCode.MALFORMED, "peer id must be 1-64 characters")
        old = self.peers.get(routing)
        if old is not None and old != (role, peer_id):
            self._error(routing, ErrorCode.UNEXPECTED, "a second HELLO under another identity")
            return
        welcome: dict[str, Any] = {
            "session": self.session_id, "epoch": self.epoch,
            "heartbeat": self.timing.heartbeat, "liveness": self.timing.liveness,
            "lease_ttl": self.timing.lease_ttl, "max_frame_bytes": self.limits.max_frame_bytes,
            "max_message_bytes": self.limits.max_message_bytes, "max_frames": self.limits.max_frames,
            "safe_mode": self.safe_mode,
        }
        if role is Role.WORKER:
            welcome["abort"] = self._hello_worker(routing, peer_id, h, now)
        else:
            client = self.clients.get(peer_id)
            if client is None:
                client = self.clients[peer_id] = ClientSession(peer_id, routing, now)
            elif client.routing not in (None, routing):
                self.peers.pop(client.routing, None)
            client.routing, client.last_seen = routing, now
            client.info = field_of(h, "info", dict, {})
        self.peers[routing] = (role, peer_id)
        self._send(routing, Command.WELCOME, welcome)

    # ----------------------------------------------------------------- task lifecycle

    def _enqueue(self, task: Task) -> None:
        heapq.heappush(self._pending, (-task.priority, next(self._order), task.task_id))
        self._kinds.add((task.requirements, "src" in task.spec))

    def _finish(self, task: Task, state: TaskState, result: dict[str, Any], payload: list[Any],
                now: float) -> None:
        task.move(state)
        owner = self.clients.get(task.client_id)
        if owner is not None:
            owner.unfinished = max(owner.unfinished - 1, 0)
        result = {**result, "finished_at": now}  # journaled: a restart keeps the job's timings
        task.result_header = result
        task.result_payload = payload
        task.finished_at = now
        if task.worker_id and task.state is not TaskState.PENDING:
            worker = self.workers.get(task.worker_id)
            if worker is not None:
                worker.leases.pop(task.lease_id, None)
        retryable = state is not TaskState.DONE  # `gpumesh retry` needs the input again
        self.store.finish_task(task.task_id, state.value, task.attempts, result, payload,
                               keep_input=retryable)
        job = self.jobs.get(task.job_id)
        if job is not None:
            job.summaries[task.task_id] = summarize(task)
        if not retryable:
            task.payload = []
        if job is not None and len(job.summaries) >= len(job.task_ids):  # only its tasks
            job.finished_at = now
        self.emit("task_finished", now, task=task.task_id, job=task.job_id, state=state.value,
                  worker=result.get("worker", ""))
        self._deliver(task)

    def _deliver(self, task: Task) -> None:
        client = self.clients.get(task.client_id)
        if client is None or client.routing is None or task.result_header is None \
                or task.collected:
            return  # kept until the client comes back and FETCHes it
        header = {**task.result_header, "task": task.task_id, "seq": task.seq}
        self._send(client.routing, Command.RESULT, header, task.result_payload)

    def _requeue(self, task: Task | None, worker: WorkerSession | None, now: float, why: str,
                 *, infra: bool) -> None:
        """Take a task back from a worker. Infrastructure failures count against max_attempts."""
        if task is None or task.state.terminal:
            return
        if task.cancel_requested:
            # Cancelled while its worker was unreachable: it must not start again anywhere.
            self._finish(task, TaskState.CANCELLED, {"status": "cancelled", "attempts": task.attempts,
                                                     "diagnosis": "cancelled"}, [], now)
            return
        if infra:
            task.failures.append(why)
            if worker is not None:
                task.excluded.add(worker.worker_id)
            if task.attempts >= task.max_attempts:
                diagnosis = "; ".join(task.failures[-3:])
                self._finish(task, TaskState.FAILED, {
                    "status": "crashed", "attempts": task.attempts,
                    "worker": worker.worker_id if worker else "",
                    "diagnosis": f"gave up after {task.attempts} attempts: {diagnosis}",
                }, [], now)
                return
        else:
            task.attempts = max(task.attempts - 1, 0)  # a polite hand-back costs no attempt
        task.move(TaskState.PENDING)
        task.worker_id = ""
        self.store.set_attempts(task.task_id, task.attempts)
        self._enqueue(task)

    def _release_leases(self, worker: WorkerSession, now: float, why: str, *, infra: bool) -> None:
        leases, worker.leases = worker.leases, {}
        for lease_id, task_id in leases.items():
            task = self.tasks.get(task_id)
            if task is not None and task.lease_id == lease_id:
                self._requeue(task, worker, now, why, infra=infra)

    def _cancel_on_worker(self, task: Task) -> None:
        worker = self.workers.get(task.worker_id)
        if worker is not None and worker.state is WorkerState.ALIVE:
            self._send(worker.routing, Command.CANCEL, {"leases": [task.lease_id]})

    def _lose(self, worker: WorkerSession, now: float, reason: str) -> None:
        if worker.state is WorkerState.LOST:
            return
        worker.state = WorkerState.LOST
        worker.departed = {"left": "left", "drained": "left"}.get(reason, "")
        if reason.startswith("removed"):
            worker.departed = "removed"
        self.peers.pop(worker.routing, None)
        self.emit("worker_lost", now, worker=worker.describe(), reason=reason)

    def unreachable(self, routing: bytes, now: float) -> None:
        """A send failed: the peer's connection is gone (or its queue is full). Drop the session;
        a live peer will notice the silence and HELLO again."""
        peer = self.peers.get(routing)
        if peer is None:
            return
        role, peer_id = peer
        if role is Role.WORKER:
            worker = self.workers[peer_id]
            self._release_leases(worker, now, f"worker {worker.label} unreachable", infra=True)
            self._lose(worker, now, "unreachable")
        else:
            self.peers.pop(routing, None)
            self.clients[peer_id].routing = None

    def dispatch(self, now: float) -> int:
        """Hand pending tasks to workers with credit. Returns how many were sent."""
        if not self._pending:
            return 0
        candidates = [w for w in self.workers.values()
                      if w.state is WorkerState.ALIVE and w.credit > 0]
        if not candidates:
            return 0
        views = {w.worker_id: w.view() for w in candidates}
        for worker_id in self.stragglers & views.keys():
            views[worker_id].straggler = True
        skipped: list[tuple[int, int, str]] = []
        sent = 0
        free = sum(v.free for v in views.values())
        while self._pending and free > 0 and len(skipped) < 1000:
            entry = heapq.heappop(self._pending)
            task = self.tasks.get(entry[2])
            if task is None or task.state is not TaskState.PENDING:
                continue  # stale entry: cancelled, or already handed out
            choice = scheduler.choose(task.view(), views.values())
            if choice is None:
                skipped.append(entry)
                continue
            self._lease(task, self.workers[choice.worker_id], now)
            choice.free -= 1
            choice.load += 1
            choice.last_assigned = self.workers[choice.worker_id].last_assigned
            free -= 1
            sent += 1
        for entry in skipped:
            heapq.heappush(self._pending, entry)
        return sent

    def _lease(self, task: Task, worker: WorkerSession, now: float) -> None:
        task.move(TaskState.LEASED)
        task.attempts += 1
        task.lease_id = (self.epoch << 40) | next(self._lease_counter)
        task.worker_id = worker.worker_id
        task.lease_expires = now + self.timing.lease_ttl
        worker.leases[task.lease_id] = task.task_id
        worker.sent += 1
        worker.last_assigned = next(self._assign_counter)
        header = {k: v for k, v in task.spec.items() if k not in ("req", "seq")}
        need = {k: v for k, v in (("gpu", task.requirements.gpu), ("vram", task.requirements.vram))
                if v is not None}
        if need:
            header["need"] = need  # the worker picks the slot whose own GPU satisfies it
        header.update(task=task.task_id, lease=task.lease_id, attempt=task.attempts)
        self._send(worker.routing, Command.TASK, header, task.payload)

    # ----------------------------------------------------------------- timers

    def tick(self, now: float) -> None:
        """Heartbeats out, silent peers and expired leases in. Call a few times a second."""
        silence = self.timing.silence_limit
        if now - self._last_heartbeat >= self.timing.heartbeat:
            self._last_heartbeat = now
            for routing in self.peers:
                self._send(routing, Command.HEARTBEAT, {})
        for worker in list(self.workers.values()):
            if worker.state is WorkerState.ALIVE and now - worker.last_seen > silence:
                why = f"silent for {now - worker.last_seen:.0f}s"
                self._release_leases(worker, now, f"worker {worker.label} {why}", infra=True)
                self._lose(worker, now, why)
            elif worker.state is WorkerState.LOST and now - worker.last_seen > LOST_WORKER_RETENTION:
                del self.workers[worker.worker_id]
                continue
            for lease_id, task_id in list(worker.leases.items()):
                task = self.tasks.get(task_id)
                if task is None or task.lease_id != lease_id:
                    worker.leases.pop(lease_id)
                elif now > task.lease_expires:
                    worker.leases.pop(lease_id)
                    self._requeue(task, worker, now,
                                  f"lease expired on {worker.label} (no heartbeat for "
                                  f"{self.timing.lease_ttl:.0f}s)", infra=True)
        for client in self.clients.values():
            if client.routing is not None and now - client.last_seen > silence:
                self.peers.pop(client.routing, None)
                client.routing = None
        if self._restoring and now - self.started_at >= self.timing.restore_grace:
            # Restored leases nobody re-claimed in the grace window go back to the queue.
            self._restoring = False
            for task in self.tasks.values():
                if task.state is TaskState.RESTORED:
                    task.move(TaskState.PENDING)
                    self._enqueue(task)
        if now - self._last_pending_check >= 1.0:
            self._last_pending_check = now
            self._fail_unschedulable(now)
            self.refresh_stragglers()
        if now - self._last_sweep >= RETENTION_SWEEP:
            self._last_sweep = now
            self.sweep(now)

    def _fail_unschedulable(self, now: float) -> None:
        limit = self.timing.pending_timeout
        views = [w.view() for w in self.workers.values() if w.state is WorkerState.ALIVE]
        if not views:
            # Nobody to judge the task against (laptops asleep, workers not joined yet): it waits,
            # and the clock restarts once a worker is back.
            self._no_workers_at = now
            return
        cutoff = now - limit
        if self._no_workers_at > cutoff:
            return  # a worker came back less than the timeout ago: nothing can be due yet
        runnable = {kind: scheduler.could_ever_run(scheduler.TaskView("", kind[0], portable=kind[1]),
                                                   views) for kind in self._kinds}
        if all(runnable.values()):
            return  # every kind of task queued has a worker that could run it: nothing is due
        doomed: dict[str, Task] = {}  # a task may have several heap entries (retry)
        self._kinds = set()
        tasks = self.tasks
        for _, _, task_id in self._pending:
            task = tasks.get(task_id)
            if task is None or task.state is not TaskState.PENDING:
                continue
            kind = (task.requirements, "src" in task.spec)
            self._kinds.add(kind)
            if task.pending_since > cutoff:
                continue
            if kind not in runnable:
                runnable[kind] = scheduler.could_ever_run(task.view(), views)
            if not runnable[kind]:
                doomed[task.task_id] = task
        for task in doomed.values():
            message = scheduler.explain_unschedulable(task.requirements, views,
                                                      portable="src" in task.spec)
            self._finish(task, TaskState.FAILED, {
                "status": "unschedulable", "attempts": task.attempts,
                "diagnosis": f"{message}; gave up after {limit:.0f}s pending",
            }, [], now)

_WORKER_HANDLERS: dict[Command, Callable[[Broker, Any, Message, float], None]] = {
    Command.HEARTBEAT: Broker._w_heartbeat,
    Command.CREDIT: Broker._w_credit,
    Command.OUTPUT: Broker._w_output,
    Command.RESULT: Broker._w_result,
    Command.DISCONNECT: Broker._w_disconnect,
}
_CLIENT_HANDLERS: dict[Command, Callable[[Broker, Any, Message, float], None]] = {
    Command.HEARTBEAT: Broker._c_heartbeat,
    Command.SUBMIT: Broker._c_submit,
    Command.RESULT_ACK: Broker._c_result_ack,
    Command.FETCH: Broker._c_fetch,
    Command.CANCEL: Broker._c_cancel,
    Command.QUERY: Broker._c_query,
    Command.CONTROL: Broker._c_control,
    Command.DISCONNECT: Broker._c_disconnect,
}
