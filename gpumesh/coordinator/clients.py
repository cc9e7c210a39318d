"""What the coordinator does for clients: submissions, results, queries, and job control.

Who may do what (docs/protocol.md, "Roles and ownership"): any client holding the token may
look at every job and worker. A client acts on its own tasks (CANCEL, FETCH, RESULT_ACK
ignore other clients' task ids), and on its owner's jobs (CONTROL ``cancel``/``retry``); another
owner's job needs ``force``, so nobody stops a friend's work by a mistyped id. Removing a worker
(``kill``) or asking it to ``drain``/``pause``/``resume`` is open to every client, and the worker,
the log and the event stream are told who did it.
Owners are ``user@host`` as the client says: this guards against mistakes, not against a token
holder who lies, who can run code on every worker anyway.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any, cast

import msgpack

from ..protocol import (
    ClientInfo,
    Command,
    Control,
    ErrorCode,
    Heartbeat,
    Hello,
    ProtocolError,
    Query,
    Submit,
    TaskIds,
    TaskKind,
    TaskSpec,
)
from ..protocol import fields as f
from ..protocol.ids import HexIds
from ..protocol.refs import shared_bytes
from ..protocol.serialize import function_digest, payload_nbytes
from .jobs import Job, find_job
from .ledger import Ledger
from .retention import Retention
from .state import MIN_TASK_BYTES, ClientSession, Task, TaskState, make_room
from .workers import REMOTE_ACTIONS, WorkerSide

log = logging.getLogger("gpumesh.coordinator")
_task_id = HexIds(12)  # 48 random bits a task, drawn 256 at a time
_job_id = HexIds(12)  # for a SUBMIT that names no job

REPLY_MARGIN = 4096  # bytes of a REPLY header kept for everything but its data
EVENTS_PER_PAGE = 2000  # events one REPLY to an events query holds at most
# What a task counts against the byte quotas at least: its record costs the coordinator memory
# even without input, so a million empty tasks are not free.
MAX_CLIENT_RECORDS = 10_000  # connected and gone together (results wait for gone ones)
QUERY_RATE = 20.0  # queries (QUERY, CONTROL) a client may make per second, in a burst of as many


class ClientSide:
    def __init__(self, ledger: Ledger, workers: WorkerSide, retention: Retention,
                 sending_to: Callable[[bytes], bool] = lambda routing: False) -> None:
        self.ledger = ledger
        self.workers = workers
        self.retention = retention
        # Whether a message to this peer still goes in pieces (the broker's Outflow.busy).
        self.sending_to = sending_to
        # Parsed specs by their bytes without seq (_parse_spec): a .map's SUBMITs, and a
        # client's single calls of one function, repeat one spec.
        self._parsed: dict[bytes, TaskSpec | tuple[ErrorCode, str]] = {}

    def hello(self, routing: bytes, hello: Hello, now: float) -> None:
        clients = self.ledger.clients
        client = clients.get(hello.peer_id)
        if client is None:
            self._make_room()
            client = clients[hello.peer_id] = ClientSession(hello.peer_id, routing, now)
        elif client.routing not in (None, routing):
            self.ledger.peers.pop(client.routing, None)
        client.routing, client.last_seen = routing, now
        client.info = cast(ClientInfo, hello.info)  # Hello.from_header pairs the role with it
        log.debug("client %s (%s) connected", client.client_id[:12], f.for_terminal(client.owner))

    def _make_room(self) -> None:
        """Bound the client records (kept for the result TTL after a client leaves): the oldest
        gone clients with nothing unfinished make room; past that, a new client is refused."""
        make_room(self.ledger.clients, MAX_CLIENT_RECORDS,
                  lambda c: c.routing is None and not c.unfinished,
                  f"this coordinator already serves {MAX_CLIENT_RECORDS} clients")

    def heartbeat(self, client: ClientSession, beat: Heartbeat) -> None:
        if beat.shm:
            client.shm = self.ledger.shares_memory(beat.shm)

    def disconnect(self, client: ClientSession, now: float) -> None:
        if client.routing is not None:
            self.ledger.peers.pop(client.routing, None)
            log.debug("client %s (%s) left", client.client_id[:12], f.for_terminal(client.owner))
        client.routing = None

    # ----------------------------------------------------------------- submissions

    def submit(self, client: ClientSession, sub: Submit, frames: list[Any], now: float) -> None:
        """Journal and queue each task that parses; one bad spec rejects only its own task.

        The frame count is checked first, over every spec, so a message whose frames do not add
        up is refused whole and nothing of it is journaled. A spec whose ``(client, seq)`` is
        already known is a re-send: only its seq and frame count are read."""
        ledger = self.ledger
        table = _function_table(sub.functions, frames)
        frames = frames[len(sub.functions):]
        entries: list[tuple[int, int, TaskSpec | str | tuple[ErrorCode, str]]] = []
        needed = 0
        seen: set[int] = set()
        for raw in sub.specs:
            seq, nf = _seq_and_frames(raw)
            needed += nf
            if seq in seen:  # two tasks would share one journal row: the second is refused
                entries.append((seq, nf, (ErrorCode.MALFORMED, f"seq {seq} is used twice in "
                                          "one SUBMIT: each task needs a seq of its own")))
                continue
            seen.add(seq)
            existing = ledger.by_seq.get((client.client_id, seq))
            if existing is not None:
                entries.append((seq, nf, existing))
                continue
            entries.append((seq, nf, _parse_spec(raw, seq, self._parsed)))
        if needed != len(frames):
            raise ProtocolError(ErrorCode.MALFORMED,
                                f"specs announce {needed} payload frames, {len(frames)} arrived")
        job_id = sub.job or _job_id()
        job = ledger.jobs.get(job_id)
        if job is not None and job.owned and job.owner != client.owner:
            refusal = (ErrorCode.UNEXPECTED, f"job {job_id} belongs to {job.owner}: submit "
                       "under another job id")
            entries = [(seq, nf, e if isinstance(e, str) else refusal) for seq, nf, e in entries]
        # Every client's queued input together may hold twice one client's quota: a token
        # holder who opens many connections cannot make the coordinator hold more than that.
        queued_total = sum(c.queued_bytes for c in ledger.clients.values())
        accepted: list[list[Any]] = []
        rejected: list[list[Any]] = []
        redeliver: dict[str, Task] = {}
        new = 0  # accepted by this SUBMIT, not re-sent ones: what the event stream counts
        offset = 0
        for seq, nf, entry in entries:
            payload, offset = frames[offset:offset + nf], offset + nf
            if isinstance(entry, str):  # a re-send of a task already accepted
                accepted.append([seq, entry])
                task = ledger.tasks.get(entry)
                if task is not None and task.state.terminal:
                    redeliver[task.task_id] = task
                continue
            if isinstance(entry, tuple):
                rejected.append([seq, entry[0].value, entry[1]])
                continue
            if entry.by_reference:
                function = table.get(entry.function)
                if function is None:
                    rejected.append([seq, ErrorCode.MALFORMED.value, (
                        "its function (fnref) is not in this SUBMIT's function table, or its "
                        "frame does not match its digest: send the function with the task")])
                    continue
                # From here on the task is what it would be had its function come with it.
                payload = [function, *payload]
                entry = entry.changed(frames=entry.frames + 1, by_reference=False)
            if _carries_function(entry, payload):
                function = ledger.functions.intern(payload[0], entry.function)
                if function is None:
                    rejected.append([seq, ErrorCode.MALFORMED.value, (
                        "its first frame does not hash to its function digest (fn): send the "
                        "pickled function and its digest together")])
                    continue
                payload = [function, *payload[1:]]
            size = max(payload_nbytes(payload) + shared_bytes(entry.shared), MIN_TASK_BYTES)
            over = self._refusal(client, entry, size, queued_total)
            if over is not None:
                rejected.append([seq, over[0].value, over[1]])
                continue
            if job is None:
                job = ledger.jobs[job_id] = Job(job_id, sub.name or job_id, client.owner, now)
                ledger.store.add_job(job_id, job.name, job.owner, now)
            task = self._accept(client, job, entry, payload, size, now)
            accepted.append([seq, task.task_id])
            new += 1
            queued_total += task.charged  # what _accept counted against the client's quota
        for task in redeliver.values():
            ledger.redeliver(task, now)
        if new:
            ledger.emit("submitted", now, job=job_id, count=new)
        ledger.send(client.routing, Command.ACCEPTED,
                    {"job": job_id, "accepted": accepted, "rejected": rejected})

    def _accept(self, client: ClientSession, job: Job, entry: TaskSpec, payload: list[Any],
                size: int, now: float) -> Task:
        ledger = self.ledger
        task_id = _task_id()
        while task_id in ledger.tasks:  # 48 random bits: a clash is rare, never silent
            task_id = _task_id()
        spec = entry.to_spec()
        # Its pickled function (checked against its digest in submit()) is journaled once,
        # however many tasks of a .map carry it.
        by_digest = _carries_function(entry, payload)
        task = Task(task_id, client.client_id, entry.seq, job.job_id, spec, payload, now,
                    ledger.shared_requirements(entry.requirements), pending_since=now)
        ledger.tasks[task_id] = task
        ledger.by_seq[(client.client_id, entry.seq)] = task_id
        blob = ledger.store.add_task(task_id, client.client_id, entry.seq, job.job_id, spec,
                                     payload, now, function=entry.function if by_digest else None)
        ledger.enqueue(task)
        if blob is not None:
            ledger.journaled_input(task, blob)
        job.add(task)
        job.finished_at = None
        job.last_activity = now
        client.queue(task, size)
        return task

    def _refusal(self, client: ClientSession, spec: TaskSpec, size: int,
                 queued_total: int) -> tuple[ErrorCode, str] | None:
        """Why the task of ``size`` bytes (its input, at least MIN_TASK_BYTES) is refused."""
        limits = self.ledger.limits
        if spec.shared and not client.shm:
            return ErrorCode.MALFORMED, (
                "its frames are in a shared-memory folder this client has not shown it can "
                "read: send the bytes instead")
        if self.ledger.safe_mode and spec.kind is TaskKind.FUNCTION:
            return ErrorCode.SAFE_MODE, (
                "this coordinator runs with --safe-mode and accepts scripts only: submit a script "
                "(mesh.submit(script=..., payloads=[...])) instead of a pickled function")
        if size > limits.max_queued_bytes:
            # Never accepted, however long it waits: refused now, not parked as busy.
            return ErrorCode.TOO_LARGE, (
                f"its input is {_mib(size)}, more than all of a client's unfinished tasks may "
                f"hold ({_mib(limits.max_queued_bytes)}, GPUMESH_MAX_QUEUED_GB on the "
                "coordinator): raise that, or pass a path to the data instead")
        if client.unfinished >= limits.max_queued_tasks:
            return ErrorCode.BUSY, (f"this client already has {client.unfinished} unfinished "
                                    f"tasks (the limit is {limits.max_queued_tasks}): wait for "
                                    "some to finish, then submit again")
        if client.queued_bytes + size > limits.max_queued_bytes:
            return ErrorCode.BUSY, (
                f"this client's unfinished tasks already hold {_mib(client.queued_bytes)} of "
                f"input and this one {_mib(size)} more, over the coordinator's limit of "
                f"{_mib(limits.max_queued_bytes)} (GPUMESH_MAX_QUEUED_GB): it is sent again "
                "as earlier tasks finish")
        if queued_total + size > 2 * limits.max_queued_bytes:
            return ErrorCode.BUSY, (
                f"the coordinator already holds {_mib(queued_total)} of queued input from all "
                f"clients, its limit is {_mib(2 * limits.max_queued_bytes)} (twice "
                "GPUMESH_MAX_QUEUED_GB): it is sent again as earlier tasks finish")
        return None

    # ----------------------------------------------------------------- results

    def result_ack(self, client: ClientSession, ids: TaskIds, now: float) -> None:
        reading = bool(client.read_back)  # results read back from disk on their way to it
        for task in self._own(client, ids):
            if reading:
                client.read_back_acknowledged(task.task_id, now)
            if not task.state.terminal:
                continue
            if task.state is TaskState.DONE:
                self.retention.forget(task, now)
            elif not task.collected:  # an acknowledgement sent again changes nothing more
                # The owner has the failure; the task stays (input kept) so it can be retried.
                self.ledger.journal_held_result(task)  # its finish first, if not yet written
                task.collected = True
                task.result_payload, task.result_file = [], None
                self.ledger.drop_shared(task.result_header)
                if task.result_header is not None:  # and a restart knows it (journaled)
                    self.ledger.store.collect_failure(task.task_id, task.result_header)
        if client.read_back_waiting:
            self.ledger.deliver_read_backs(client, now)

    def fetch(self, client: ClientSession, ids: TaskIds, now: float) -> None:
        missing = []
        for task_id in dict.fromkeys(ids.tasks):  # each task once, however often it is named
            task = self.ledger.tasks.get(task_id)
            if task is None or task.client_id != client.client_id:
                missing.append(task_id)
            elif task.state.terminal:
                self.ledger.redeliver(task, now)
        self.ledger.send(client.routing, Command.REPLY, {"qid": ids.qid,
                                                         "data": {"missing": missing}})

    def cancel(self, client: ClientSession, ids: TaskIds, now: float) -> None:
        if sum(self.ledger.cancel_task(task, now) for task in self._own(client, ids)):
            # A pending task's cancelled RESULT (and a worker's CANCEL) go out before the
            # turn's commit: a crash in between brought the task back, and it ran.
            self.ledger.store.commit()

    def _own(self, client: ClientSession, ids: TaskIds) -> list[Task]:
        """The listed tasks that this client submitted, each once: others' ids are ignored (a
        RESULT_ACK naming one twice forgot it twice, and the second time failed)."""
        tasks = self.ledger.tasks
        return [task for task in (tasks.get(t) for t in dict.fromkeys(ids.tasks))
                if task is not None and task.client_id == client.client_id]

    # ----------------------------------------------------------------- queries and control

    def query(self, client: ClientSession, q: Query, now: float) -> None:
        ledger = self.ledger
        if not self._may_ask(client, q.qid, now):
            return
        data: Any
        if q.what == "workers":
            stragglers = self.workers.stragglers
            data = [{**w.describe(), "straggler": w.worker_id in stragglers}
                    for w in ledger.workers.values()]
        elif q.what == "status":
            data = self.retention.status(q.job, now, tasks=q.tasks)
            # Whose each job is, as the asker sees it: `gpumesh status` names another owner.
            for job in (data, *data.get("jobs", ())):
                if "owner" in job:
                    # A job from a journal before owners were kept names a client id: anyone's.
                    job["mine"] = "@" not in job["owner"] or job["owner"] == client.owner
        elif q.what == "health":
            data = self.retention.health(now)
        elif q.what == "task" and q.task is not None:
            data = self.retention.task_detail(q.task)
        elif q.what == "results" and q.job:
            if client.routing is not None and self.sending_to(client.routing):
                # A page (or another big message) to it still goes in pieces: one at a time,
                # so a client that asks and does not read holds one page here, not hundreds.
                ledger.error(client.routing, ErrorCode.BUSY, "the last page of results is "
                             "still on its way: ask again once it is in", q.qid)
                return
            # Outputs travel as frames, not in the header: one may be megabytes.
            data, frames, more = self.retention.results(
                q.job, q.page, ledger.limits.max_header_bytes - REPLY_MARGIN)
            header: dict[str, Any] = {"qid": q.qid, "data": data}
            if more is not None:
                header["more"] = more
            ledger.send(client.routing, Command.REPLY, header, frames)
            return
        elif q.what == "events":
            # Paged by sequence number, not by position: events arrive (and the oldest go)
            # between pages.
            since = max(q.since, q.page)
            # At most a page's worth unpacked: the log holds up to 11,000, and a monitor
            # asking from 0 must not cost the loop all of them each time.
            events = list(itertools.islice(ledger.events.since(since), EVENTS_PER_PAGE + 1))
            data = [[e.seq, e.time, e.kind, e.data] for e in events[:EVENTS_PER_PAGE]]
            self._answer(client, q.qid, data, 0, resume=lambda chunk: int(chunk[-1][0]),
                         more_after=len(events) > EVENTS_PER_PAGE)
            return
        else:
            ledger.error(client.routing, ErrorCode.UNSUPPORTED, f"unknown query {q.what!r}", q.qid)
            return
        self._answer(client, q.qid, data, q.page)

    def _may_ask(self, client: ClientSession, qid: int, now: float) -> bool:
        if client.may_query(now, QUERY_RATE):
            return True
        self.ledger.error(client.routing, ErrorCode.BUSY,
                          f"more than {QUERY_RATE:.0f} requests a second: ask again later", qid)
        return False

    def control(self, client: ClientSession, c: Control, now: float) -> None:
        """``cancel``/``retry`` a job, ``kill``/``drain``/``pause``/``resume`` a worker; the REPLY
        says what was done."""
        if not self._may_ask(client, c.qid, now):
            return
        data: dict[str, Any]
        if c.action in ("cancel", "retry"):
            job = find_job(self.ledger.jobs, c.target, unique_name=True)
            if isinstance(job, str):
                data = {"error": job}
            elif job.owned and job.owner != client.owner and not c.force:
                data = {"error": f"job {job.job_id} ({job.name}) was submitted by {job.owner}, "
                                 f"not by {client.owner}: pass --force to {c.action} it anyway",
                        "owner": job.owner}
            elif c.action == "cancel":
                cancelled = self.cancel_job(job, now)
                # Who cancelled, as for a drain: the job's owner may be someone else.
                log.info("%s cancelled job %s (%s): %d task(s)", client.owner, job.job_id,
                         job.name, cancelled)
                self.ledger.emit("job_cancelled", now, job=job.job_id, count=cancelled,
                                 by=client.owner)
                data = {"job": job.job_id, "owner": job.owner, "cancelled": cancelled,
                        "stopping": self._stopping(job)}
            else:
                data = {"job": job.job_id, "owner": job.owner, "retried": self.retry_job(job, now),
                        "stopping": self._stopping(job)}
            # The REPLY goes out before the turn's commit: what it confirms is journaled first
            # (a crash in between undid a cancel the user was told of, and the tasks ran).
            self.ledger.store.commit()
        elif c.action == "kill":
            worker = self.workers.find(c.target)
            data = {"error": worker} if isinstance(worker, str) else \
                self.workers.kill(worker, now, by=client.owner)
        elif c.action in REMOTE_ACTIONS:
            worker = self.workers.find(c.target)
            data = {"error": worker} if isinstance(worker, str) else \
                self.workers.steer(worker, c.action, now, by=client.owner)
        else:
            self.ledger.error(client.routing, ErrorCode.UNSUPPORTED,
                              f"unknown action {c.action!r}", c.qid)
            return
        self._answer(client, c.qid, data, 0)

    def _stopping(self, job: Job) -> int:
        """The job's tasks cancelled while running, whose worker has not confirmed the stop
        (one stopped or cut off answers when it is back, or its lease expires): neither
        cancelled yet nor retried."""
        tasks = self.ledger.tasks
        return sum(1 for t in job.task_ids if t in tasks and tasks[t].cancel_requested
                   and tasks[t].state is TaskState.LEASED)

    def cancel_job(self, job: Job, now: float) -> int:
        tasks = self.ledger.tasks
        return sum(self.ledger.cancel_task(tasks[t], now) for t in job.task_ids if t in tasks)

    def retry_job(self, job: Job, now: float) -> int:
        """Re-queue the job's failed and cancelled tasks whose input the coordinator still has."""
        tasks = self.ledger.tasks
        count = sum(self.ledger.reopen(tasks[t], now) for t in job.task_ids if t in tasks)
        if count:
            self.ledger.emit("retried", now, job=job.job_id, count=count)
        return count

    def _answer(self, client: ClientSession, qid: int, data: Any, page: int,
                resume: Callable[[list[Any]], int] | None = None, more_after: bool = False
                ) -> None:
        """REPLY with ``data``, paged so that no REPLY passes the header limit: a list (or a
        status's ``tasks``) is sent from item ``page`` on, as many items as fit, and ``more``
        says where the next page starts (``resume`` of the items sent, when given), also
        after the last item of ``data`` when ``more_after`` (``data`` is one page of more).

        Items are sized one by one, and only as many as fit: a query costs the size of one
        page, however big the whole answer is."""
        budget = self.ledger.limits.max_header_bytes - REPLY_MARGIN
        if isinstance(data, list):
            items, rest = data, None
        elif isinstance(data, dict) and isinstance(data.get("tasks"), list):
            items, rest = data["tasks"], {k: v for k, v in data.items() if k != "tasks"}
        else:
            if len(_packed(data)) > budget:
                self.ledger.error(client.routing, ErrorCode.TOO_LARGE, "the answer is too large",
                                  qid)
            else:
                self.ledger.send(client.routing, Command.REPLY, {"qid": qid, "data": data})
            return
        used = len(_packed(rest)) if rest is not None else 16
        end = page
        while end < len(items):
            used += len(_packed(items[end]))
            if used > budget and end > page:
                break
            end += 1
        chunk = items[page:end]
        header: dict[str, Any] = {"qid": qid,
                                  "data": chunk if rest is None else {**rest, "tasks": chunk}}
        if end < len(items) or (more_after and chunk):
            header["more"] = resume(chunk) if resume is not None else end
        self.ledger.send(client.routing, Command.REPLY, header)


def _packed(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _mib(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB"


def _parse_spec(raw: dict[str, Any], seq: int,
                parsed: dict[bytes, TaskSpec | tuple[ErrorCode, str]]
                ) -> TaskSpec | tuple[ErrorCode, str]:
    """One task's spec, checked; or why it is refused. The specs of a .map differ in ``seq``
    alone (checked already, by _seq_and_frames): a spec equal to one parsed before in every
    other key, value and value type gets that one's outcome, with its seq."""
    key = _template_key(raw)
    outcome = parsed.get(key) if key is not None else None
    if outcome is None:
        try:
            outcome = TaskSpec.from_mapping(raw)
        except ProtocolError as exc:
            outcome = (exc.code, exc.detail)
        if key is not None and len(key) <= MAX_TEMPLATE_BYTES:
            if len(parsed) >= MAX_TEMPLATES:
                parsed.clear()  # a client sending ever new specs only costs itself parses
            parsed[key] = outcome
    return outcome if isinstance(outcome, tuple) else outcome.changed(seq=seq)


MAX_TEMPLATES = 256  # distinct specs remembered
MAX_TEMPLATE_BYTES = 1024  # a spec bigger than this (a big env) is parsed every time


def _template_key(raw: dict[str, Any]) -> bytes | None:
    """Every key and value of a spec but ``seq``, as msgpack writes them: equal bytes mean
    equal values of equal types (2 and 2.0, 1 and true differ). Another key order only misses
    the cache; None for what msgpack cannot write (it came from msgpack: never, in practice)."""
    try:
        return msgpack.packb({k: v for k, v in raw.items() if k != "seq"}, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return None


def _seq_and_frames(raw: Any) -> tuple[int, int]:
    """A spec's ``seq`` and ``nf``, read before anything else: without them its frames cannot be
    told apart from the next task's, and the whole message is refused."""
    if not isinstance(raw, dict):
        raise ProtocolError(ErrorCode.MALFORMED, "each task spec must be a map")
    return (f.integer(raw, "seq", low=0, high=f.INT64), f.integer(raw, "nf", low=0, high=4096))


def _function_table(digests: tuple[str, ...], frames: list[Any]) -> dict[str, Any]:
    """A SUBMIT's function table: the first frames, one per digest in ``fns``. A frame that
    does not hash to its digest is left out, so the tasks naming it are refused (one frame
    per function, never split: bigger functions travel with their tasks)."""
    if len(digests) > len(frames):
        raise ProtocolError(ErrorCode.MALFORMED,
                            f"fns names {len(digests)} functions, {len(frames)} frames arrived")
    table = {}
    for digest, frame in zip(digests, frames, strict=False):
        data = frame.bytes if hasattr(frame, "bytes") else bytes(frame)
        if function_digest(data) == digest:
            table[digest] = data
    return table


def _carries_function(entry: TaskSpec, payload: list[Any]) -> bool:
    """Whether the task's first frame is its pickled function, whole and on hand (not split
    into slices, not left in shared memory): then it is checked against ``fn`` and kept once."""
    return (entry.kind is TaskKind.FUNCTION and bool(entry.function) and bool(payload)
            and not entry.split and all(ref[0] != 0 for ref in entry.shared))
