"""The coordinator's policy: sessions, the queue, leases, results. Messages in, messages out.

The broker owns no socket and reads no clock: the server loop hands it decoded messages with
``now`` and sends whatever it left in ``outbox`` once the journal has committed, so nothing is
acknowledged before it is durable.
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
from ..store import Store
from .state import ClientSession, Task, TaskState, WorkerSession, WorkerState

log = logging.getLogger("gpumesh.coordinator")

LOST_WORKER_RETENTION = 600.0
MAX_PENDING_PER_CLIENT = 1_000_000
EVENT_HISTORY = 10_000


@dataclass(frozen=True)
class Event:
    """One state change, for monitors (``gpumesh serve`` output, QUERY events, dashboards)."""

    seq: int
    time: float
    kind: str
    data: dict[str, Any]


class Broker:
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
        self._restoring = True

    # ----------------------------------------------------------------- plumbing

    def _send(self, routing: bytes | None, command: Command, header: dict[str, Any],
              payload: list[Any] | tuple[Any, ...] = ()) -> None:
        if routing is not None:
            self.outbox.append((routing, encode(command, header, payload)))

    def _error(self, routing: bytes, code: ErrorCode, text: str) -> None:
        self._send(routing, Command.ERROR, {"code": code.value, "message": text})

    def emit(self, kind: str, now: float, **data: Any) -> None:
        event = Event(next(self._event_seq), now, kind, data)
        self.events.append(event)
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # a monitor's bug must never stop the broker
                log.exception("event listener failed")

    def restore(self, now: float) -> int:
        """Load the journal after a start. Unfinished tasks wait for their workers to re-claim."""
        count = 0
        for row in self.store.load():
            task = Task(
                task_id=row.task_id, client_id=row.client_id, seq=row.seq, job_id=row.job_id,
                spec=row.spec, payload=row.payload, submitted_at=row.submitted_at,
                attempts=row.attempts,
                requirements=scheduler.Requirements.from_mapping(row.spec.get("req", {})),
            )
            if row.result_header is not None:
                task.state = TaskState(row.state)
                task.result_header = row.result_header
                task.result_payload = row.result_payload or []
            else:
                task.state = TaskState.RESTORED
            self.tasks[task.task_id] = task
            self.by_seq[(task.client_id, task.seq)] = task.task_id
            count += 1
        return count

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
            self._error(routing, exc.code, exc.detail)
        except (ValueError, TypeError, KeyError) as exc:
            self.count_malformed(routing)
            self._error(routing, ErrorCode.MALFORMED, f"bad {msg.command.name}: {exc}")

    def count_malformed(self, routing: bytes) -> None:
        if len(self.malformed) > 10_000:
            self.malformed.clear()  # bounded: a counter per peer is a diagnostic, not a ledger
        self.malformed[routing] = self.malformed.get(routing, 0) + 1

    def _on_hello(self, routing: bytes, msg: Message, now: float) -> None:
        h = msg.header
        proto = field_of(h, "proto", list, [MAJOR, MAJOR])
        if len(proto) != 2 or not proto[0] <= MAJOR <= proto[1]:
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

    def _hello_worker(self, routing: bytes, worker_id: str, h: dict[str, Any], now: float) -> list[int]:
        info = field_of(h, "info", dict, {})
        slots = field_of(h, "slots", int)
        credit = field_of(h, "credit", int, slots)
        held = field_of(h, "held", list, [])
        incarnation = field_of(h, "incarnation", str, "")
        if not 0 <= credit <= 100_000 or not 0 < slots <= 100_000:
            raise ProtocolError(ErrorCode.MALFORMED, "slots and credit must be 0-100000")
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
        worker.granted, worker.sent = credit, 0
        worker.draining = bool(h.get("draining", False))
        abort: list[int] = []
        claimed: dict[int, str] = {}
        for item in held:
            if not (isinstance(item, list) and len(item) == 2):
                raise ProtocolError(ErrorCode.MALFORMED, "held leases must be [task, lease] pairs")
            task_id, lease_id = str(item[0]), int(item[1])
            task = self.tasks.get(task_id)
            if task is not None and (
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
                self._requeue(self.tasks.get(task_id), worker, now, "lost across a reconnect", infra=True)
        worker.leases = claimed
        if rejoined:
            self.emit("worker_joined", now, worker=worker.describe())
        return abort

    # ----------------------------------------------------------------- worker messages

    def _w_heartbeat(self, worker: WorkerSession, msg: Message, now: float) -> None:
        leases = field_of(msg.header, "leases", list, [])
        expires = now + self.timing.lease_ttl
        for lease_id in leases:
            task_id = worker.leases.get(lease_id)
            task = self.tasks.get(task_id) if task_id else None
            if task is not None and task.lease_id == lease_id:
                task.lease_expires = expires

    def _w_credit(self, worker: WorkerSession, msg: Message, now: float) -> None:
        worker.granted = max(worker.granted, field_of(msg.header, "granted", int))
        worker.draining = bool(msg.header.get("draining", worker.draining))

    def _w_output(self, worker: WorkerSession, msg: Message, now: float) -> None:
        task = self.tasks.get(field_of(msg.header, "task", str))
        if task is None or task.worker_id != worker.worker_id or len(msg.payload) != 1:
            return
        client = self.clients.get(task.client_id)
        if client is not None and client.routing is not None:
            header = {"task": task.task_id, "stream": msg.header.get("stream", "out"),
                      "worker": worker.short_id}
            self._send(client.routing, Command.OUTPUT, header, msg.payload)

    def _w_result(self, worker: WorkerSession, msg: Message, now: float) -> None:
        h = msg.header
        task_id = field_of(h, "task", str)
        lease_id = field_of(h, "lease", int)
        status = field_of(h, "status", str)
        if status not in ("ok", "error", "timeout", "cancelled", "crashed"):
            raise ProtocolError(ErrorCode.MALFORMED, f"unknown result status {status!r}")
        if "granted" in h:
            worker.granted = max(worker.granted, field_of(h, "granted", int))
        held = worker.leases.pop(lease_id, None)
        if held is not None:
            worker.completed += 1
            worker.busy_seconds += float(h.get("elapsed", 0.0) or 0.0)
        task = self.tasks.get(task_id)
        ack = {"task": task_id, "lease": lease_id}
        if task is None or task.state.terminal:
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
                  "elapsed": h.get("elapsed", 0.0)}
        for key in ("error", "diagnosis", "encoding"):
            if key in h:
                result[key] = h[key]
        self._finish(task, state, result, msg.payload, now)
        self._send(worker.routing, Command.RESULT_ACK, {**ack, "disposition": "accepted"})

    def _w_disconnect(self, worker: WorkerSession, msg: Message, now: float) -> None:
        reason = str(msg.header.get("reason", "left"))
        self._release_leases(worker, now, f"worker {worker.label} {reason}", infra=False)
        self._lose(worker, now, reason)

    # ----------------------------------------------------------------- client messages

    def _c_heartbeat(self, client: ClientSession, msg: Message, now: float) -> None:
        pass  # last_seen was refreshed by handle()

    def _c_submit(self, client: ClientSession, msg: Message, now: float) -> None:
        specs = field_of(msg.header, "tasks", list)
        job_id = field_of(msg.header, "job", str, "") or secrets.token_hex(6)
        frames = msg.payload
        needed = 0
        for spec in specs:
            if not isinstance(spec, dict):
                raise ProtocolError(ErrorCode.MALFORMED, "each task spec must be a map")
            _check_spec(spec)
            needed += spec["nf"]
        if needed != len(frames):
            raise ProtocolError(ErrorCode.MALFORMED,
                                f"specs announce {needed} payload frames, {len(frames)} arrived")
        accepted: list[list[Any]] = []
        rejected: list[list[Any]] = []
        offset = 0
        for spec in specs:
            count = spec["nf"]
            payload, offset = list(frames[offset:offset + count]), offset + count
            seq = field_of(spec, "seq", int)
            existing = self.by_seq.get((client.client_id, seq))
            if existing is not None:
                accepted.append([seq, existing])
                task = self.tasks.get(existing)
                if task is not None and task.state.terminal:
                    self._deliver(task)
                continue
            kind = field_of(spec, "kind", str)
            if kind not in ("fn", "script"):
                rejected.append([seq, ErrorCode.MALFORMED.value, f"unknown task kind {kind!r}"])
                continue
            if self.safe_mode and kind == "fn":
                rejected.append([seq, ErrorCode.SAFE_MODE.value,
                                 "this coordinator runs with --safe-mode and accepts scripts only: "
                                 "submit a script (mesh.submit(script=..., payloads=[...])) instead "
                                 "of a pickled function"])
                continue
            if client.unfinished >= MAX_PENDING_PER_CLIENT:
                rejected.append([seq, ErrorCode.BUSY.value,
                                 f"this client already has {MAX_PENDING_PER_CLIENT} unfinished tasks: "
                                 "wait for some to finish, then submit again"])
                continue
            try:
                requirements = scheduler.Requirements.from_mapping(field_of(spec, "req", dict, {}))
            except ValueError as exc:
                rejected.append([seq, ErrorCode.MALFORMED.value, str(exc)])
                continue
            spec = {k: v for k, v in spec.items() if k != "nf"}
            task_id = secrets.token_hex(6)
            task = Task(task_id, client.client_id, seq, job_id, spec, payload, now, requirements)
            self.tasks[task_id] = task
            self.by_seq[(client.client_id, seq)] = task_id
            self.store.add_task(task_id, client.client_id, seq, job_id, spec, payload, now)
            self._enqueue(task)
            accepted.append([seq, task_id])
            client.unfinished += 1
        if accepted:
            self.emit("submitted", now, job=job_id, count=len(accepted))
        self._send(client.routing, Command.ACCEPTED,
                   {"job": job_id, "accepted": accepted, "rejected": rejected})

    def _c_result_ack(self, client: ClientSession, msg: Message, now: float) -> None:
        for task_id in field_of(msg.header, "tasks", list):
            task = self.tasks.get(task_id)
            if task is not None and task.state.terminal and task.client_id == client.client_id:
                del self.tasks[task_id]
                self.by_seq.pop((task.client_id, task.seq), None)
                self.store.delete_task(task_id)

    def _c_fetch(self, client: ClientSession, msg: Message, now: float) -> None:
        missing = []
        for task_id in field_of(msg.header, "tasks", list):
            task = self.tasks.get(task_id)
            if task is None or task.client_id != client.client_id:
                missing.append(task_id)
            elif task.state.terminal:
                self._deliver(task)
        self._send(client.routing, Command.REPLY,
                   {"qid": msg.header.get("qid", 0), "data": {"missing": missing}})

    def _c_cancel(self, client: ClientSession, msg: Message, now: float) -> None:
        for task_id in field_of(msg.header, "tasks", list):
            task = self.tasks.get(task_id)
            if task is None or task.client_id != client.client_id or task.state.terminal:
                continue
            if task.state is TaskState.LEASED:
                self._cancel_on_worker(task)
            else:
                self._finish(task, TaskState.CANCELLED, {"status": "cancelled"}, [], now)

    def _c_query(self, client: ClientSession, msg: Message, now: float) -> None:
        what = field_of(msg.header, "what", str)
        if what == "workers":
            data: Any = [w.describe() for w in self.workers.values()]
        elif what == "status":
            data = self.status(msg.header.get("job"))
        elif what == "events":
            since = field_of(msg.header, "since", int, 0)
            data = [[e.seq, e.time, e.kind, e.data] for e in self.events if e.seq > since]
        else:
            self._error(client.routing, ErrorCode.UNSUPPORTED, f"unknown query {what!r}")
            return
        self._send(client.routing, Command.REPLY, {"qid": msg.header.get("qid", 0), "data": data})

    def _c_disconnect(self, client: ClientSession, msg: Message, now: float) -> None:
        if client.routing is not None:
            self.peers.pop(client.routing, None)
        client.routing = None

    # ----------------------------------------------------------------- task lifecycle

    def _enqueue(self, task: Task) -> None:
        heapq.heappush(self._pending, (-task.priority, next(self._order), task.task_id))

    def _finish(self, task: Task, state: TaskState, result: dict[str, Any], payload: list[Any],
                now: float) -> None:
        task.move(state)
        owner = self.clients.get(task.client_id)
        if owner is not None:
            owner.unfinished = max(owner.unfinished - 1, 0)
        task.result_header = result
        task.result_payload = payload
        if task.worker_id and task.state is not TaskState.PENDING:
            worker = self.workers.get(task.worker_id)
            if worker is not None:
                worker.leases.pop(task.lease_id, None)
        self.store.finish_task(task.task_id, state.value, task.attempts, result, payload)
        task.payload = []
        self.emit("task_finished", now, task=task.task_id, job=task.job_id, state=state.value,
                  worker=result.get("worker", ""))
        self._deliver(task)

    def _deliver(self, task: Task) -> None:
        client = self.clients.get(task.client_id)
        if client is None or client.routing is None or task.result_header is None:
            return  # kept until the client comes back and FETCHes it
        header = {**task.result_header, "task": task.task_id, "seq": task.seq}
        self._send(client.routing, Command.RESULT, header, task.result_payload)

    def _requeue(self, task: Task | None, worker: WorkerSession | None, now: float, why: str,
                 *, infra: bool) -> None:
        """Take a task back from a worker. Infrastructure failures count against max_attempts."""
        if task is None or task.state.terminal:
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

    def _fail_unschedulable(self, now: float) -> None:
        limit = self.timing.pending_timeout
        views = [w.view() for w in self.workers.values() if w.state is WorkerState.ALIVE]
        for _, _, task_id in list(self._pending):
            task = self.tasks.get(task_id)
            if task is None or task.state is not TaskState.PENDING or now - task.submitted_at < limit:
                continue
            if not scheduler.could_ever_run(task.view(), views):
                message = scheduler.explain_unschedulable(task.requirements, views)
                self._finish(task, TaskState.FAILED, {
                    "status": "unschedulable", "attempts": task.attempts,
                    "diagnosis": f"{message}; gave up after {limit:.0f}s pending",
                }, [], now)

    # ----------------------------------------------------------------- views

    def status(self, job_id: str | None) -> dict[str, Any]:
        counts: dict[str, int] = {}
        tasks = []
        for task in self.tasks.values():
            if job_id and task.job_id != job_id:
                continue
            counts[task.state.value] = counts.get(task.state.value, 0) + 1
            if job_id:
                tasks.append({"id": task.task_id, "state": task.state.value,
                              "worker": task.worker_id, "attempts": task.attempts})
        return {"job": job_id, "counts": counts, "tasks": tasks,
                "workers": sum(1 for w in self.workers.values() if w.state is WorkerState.ALIVE)}


def _check_spec(spec: dict[str, Any]) -> None:
    """Refuse a SUBMIT whose specs carry mistyped values, before any of it is journaled."""
    field_of(spec, "seq", int)
    if not 0 <= field_of(spec, "nf", int) <= 4096:
        raise ProtocolError(ErrorCode.MALFORMED, "nf must be 0-4096")
    if not 1 <= field_of(spec, "max_attempts", int, 3) <= 100:
        raise ProtocolError(ErrorCode.MALFORMED, "max_attempts must be 1-100")
    field_of(spec, "priority", int, 0)
    cost = field_of(spec, "cost", (int, float), 1.0)
    timeout = field_of(spec, "timeout", (int, float), None)
    if not 0 <= cost < 1e12 or (timeout is not None and not 0 < timeout < 1e9):
        raise ProtocolError(ErrorCode.MALFORMED, "cost must be >= 0 and timeout > 0")
    field_of(spec, "req", dict, {})


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
    Command.DISCONNECT: Broker._c_disconnect,
}
