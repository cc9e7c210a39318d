"""What the broker does for clients: submissions, results, queries, and job control.

A mixin of ``Broker`` (see broker.py for the shared state). Any client holding the token may
look at or control any job: the mesh is one trust domain, as the spec's security section says.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from .. import scheduler
from ..protocol import Command, ErrorCode, Message, ProtocolError, field_of
from .jobs import Job, find_job
from .state import ClientSession, Task, TaskState, WorkerState

if TYPE_CHECKING:
    from .broker import Broker

MAX_PENDING_PER_CLIENT = 1_000_000


class ClientSide:
    def _c_heartbeat(self: Broker, client: ClientSession, msg: Message, now: float) -> None:
        pass  # last_seen was refreshed by handle()

    def _c_submit(self: Broker, client: ClientSession, msg: Message, now: float) -> None:
        specs = field_of(msg.header, "tasks", list)
        job_id = field_of(msg.header, "job", str, "") or secrets.token_hex(6)
        name = field_of(msg.header, "name", str, "")[:200]
        if len(job_id) > 64:
            raise ProtocolError(ErrorCode.MALFORMED, "job id longer than 64 characters")
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
        job = self.jobs.get(job_id)
        if job is None:
            job = self.jobs[job_id] = Job(job_id, name or job_id, client.client_id, now)
            self.store.add_job(job_id, job.name, client.client_id, now)
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
            refusal = self._refusal(client, spec)
            if refusal is not None:
                rejected.append([seq, refusal[0].value, refusal[1]])
                continue
            try:
                requirements = scheduler.Requirements.from_mapping(field_of(spec, "req", dict, {}))
            except ValueError as exc:
                rejected.append([seq, ErrorCode.MALFORMED.value, str(exc)])
                continue
            spec = {k: v for k, v in spec.items() if k != "nf"}
            task_id = secrets.token_hex(6)
            task = Task(task_id, client.client_id, seq, job_id, spec, payload, now, requirements,
                        pending_since=now)
            self.tasks[task_id] = task
            self.by_seq[(client.client_id, seq)] = task_id
            self.store.add_task(task_id, client.client_id, seq, job_id, spec, payload, now)
            self._enqueue(task)
            job.add(task)
            job.finished_at = None
            job.last_activity = now
            accepted.append([seq, task_id])
            client.unfinished += 1
        if accepted:
            self.emit("submitted", now, job=job_id, count=len(accepted))
        self._send(client.routing, Command.ACCEPTED,
                   {"job": job_id, "accepted": accepted, "rejected": rejected})

    def _refusal(self: Broker, client: ClientSession, spec: dict[str, Any]
                 ) -> tuple[ErrorCode, str] | None:
        kind = field_of(spec, "kind", str)
        if kind not in ("fn", "script"):
            return ErrorCode.MALFORMED, f"unknown task kind {kind!r}"
        if self.safe_mode and kind == "fn":
            return ErrorCode.SAFE_MODE, (
                "this coordinator runs with --safe-mode and accepts scripts only: submit a script "
                "(mesh.submit(script=..., payloads=[...])) instead of a pickled function")
        if client.unfinished >= MAX_PENDING_PER_CLIENT:
            return ErrorCode.BUSY, (f"this client already has {MAX_PENDING_PER_CLIENT} unfinished "
                                    "tasks: wait for some to finish, then submit again")
        return None

    def _c_result_ack(self: Broker, client: ClientSession, msg: Message, now: float) -> None:
        for task_id in field_of(msg.header, "tasks", list):
            task = self.tasks.get(task_id)
            if task is None or not task.state.terminal or task.client_id != client.client_id:
                continue
            if task.state is TaskState.DONE:
                self._forget(task, now)
            else:
                # The owner has the failure; the task stays (input kept) so it can be retried.
                task.collected = True
                task.result_payload = []

    def _c_fetch(self: Broker, client: ClientSession, msg: Message, now: float) -> None:
        missing = []
        for task_id in field_of(msg.header, "tasks", list):
            task = self.tasks.get(task_id)
            if task is None or task.client_id != client.client_id:
                missing.append(task_id)
            elif task.state.terminal:
                self._deliver(task)
        self._send(client.routing, Command.REPLY,
                   {"qid": msg.header.get("qid", 0), "data": {"missing": missing}})

    def _c_cancel(self: Broker, client: ClientSession, msg: Message, now: float) -> None:
        for task_id in field_of(msg.header, "tasks", list):
            task = self.tasks.get(task_id)
            if task is not None and task.client_id == client.client_id:
                self.cancel_task(task, now)

    def _c_query(self: Broker, client: ClientSession, msg: Message, now: float) -> None:
        what = field_of(msg.header, "what", str)
        if what == "workers":
            stragglers = self.stragglers
            data: Any = [{**w.describe(), "straggler": w.worker_id in stragglers}
                         for w in self.workers.values()]
        elif what == "status":
            job = field_of(msg.header, "job", str, None)
            data = self.status(job, now, tasks=field_of(msg.header, "tasks", bool, True))
        elif what == "events":
            since = field_of(msg.header, "since", int, 0)
            data = [[e.seq, e.time, e.kind, e.data] for e in self.events if e.seq > since]
        else:
            data = None
        self._answer(client, msg, data, f"unknown query {what!r}")

    def _c_control(self: Broker, client: ClientSession, msg: Message, now: float) -> None:
        """``cancel``/``retry`` a job, ``kill`` a worker; the REPLY says what was done."""
        action = field_of(msg.header, "action", str)
        target = field_of(msg.header, "target", str)
        if action in ("cancel", "retry"):
            job = find_job(self.jobs, target, unique_name=True)
            if isinstance(job, str):
                data: dict[str, Any] = {"error": job}
            elif action == "cancel":
                data = {"job": job.job_id, "cancelled": self.cancel_job(job, now)}
            else:
                data = {"job": job.job_id, "retried": self.retry_job(job, now)}
        elif action == "kill":
            worker = self.find_worker(target)
            data = {"error": worker} if isinstance(worker, str) else self.kill_worker(worker, now)
        else:
            data = None
        self._answer(client, msg, data, f"unknown action {action!r}")

    def _answer(self: Broker, client: ClientSession, msg: Message, data: Any, unknown: str) -> None:
        """REPLY with ``data`` to the request's qid; None means the request was not understood."""
        qid = msg.header.get("qid", 0)
        if data is None:
            self._error(client.routing, ErrorCode.UNSUPPORTED, unknown, qid)
        else:
            self._send(client.routing, Command.REPLY, {"qid": qid, "data": data})

    def _c_disconnect(self: Broker, client: ClientSession, msg: Message, now: float) -> None:
        if client.routing is not None:
            self.peers.pop(client.routing, None)
        client.routing = None

    # ----------------------------------------------------------------- job control

    def cancel_task(self: Broker, task: Task, now: float) -> bool:
        """Pending tasks never start; a running one is stopped on its worker. False if finished."""
        if task.state.terminal:
            return False
        if task.state is TaskState.LEASED:
            task.cancel_requested = True
            worker = self.workers.get(task.worker_id)
            if worker is not None and worker.state is WorkerState.ALIVE:
                self._cancel_on_worker(task)
                return True
        self._finish(task, TaskState.CANCELLED, {"status": "cancelled", "attempts": task.attempts,
                                                 "diagnosis": "cancelled"}, [], now)
        return True

    def cancel_job(self: Broker, job: Job, now: float) -> int:
        return sum(self.cancel_task(task, now) for task in
                   [self.tasks[t] for t in job.task_ids if t in self.tasks])

    def retry_job(self: Broker, job: Job, now: float) -> int:
        """Re-queue the job's failed and cancelled tasks whose input the coordinator still has."""
        count = 0
        for task_id in job.task_ids:
            task = self.tasks.get(task_id)
            if task is None or task.state not in (TaskState.FAILED, TaskState.CANCELLED) \
                    or not task.payload:
                continue
            task.move(TaskState.PENDING)
            # A fresh start: a new pending clock, and the old attempts' results no longer count.
            task.pending_since = now
            task.lease_floor = (self.epoch << 40) | next(self._lease_counter)
            task.attempts, task.failures, task.excluded = 0, [], set()
            task.result_header, task.result_payload = None, []
            task.cancel_requested = task.collected = False
            task.worker_id = ""
            self.store.reopen_task(task_id)
            owner = self.clients.get(task.client_id)
            if owner is not None:
                owner.unfinished += 1
            job.summaries.pop(task_id, None)
            job.finished_at = None
            self._enqueue(task)
            count += 1
        if count:
            self.emit("retried", now, job=job.job_id, count=count)
        return count


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
