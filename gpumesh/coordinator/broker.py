"""The coordinator's policy: messages in, messages out. Routes each message to the part that owns
it, runs the timers, and hands out work.

The broker owns no socket and reads no clock: the server loop hands it decoded messages with
``now`` and sends whatever the ledger left in ``outbox``: the acknowledgements once the journal
has committed, the rest before.

Every header is parsed into its protocol type (gpumesh.protocol.headers) before anything acts on
it, and an exception while handling one message, one timer or one task is contained: logged with
the message kind and peer, answered with ERROR where there is a peer, and the loop goes on.

- ``ledger.py``: the shared state and the task lifecycle;
- ``workers.py`` / ``clients.py``: what each kind of peer may ask for;
- ``retention.py``: what is kept for how long, and the status views;
- ``jobs.py``: per-job records.
"""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Callable
from typing import Any

from .. import scheduler
from .._version import __version__
from ..config import Limits, Timing
from ..protocol import (
    MAJOR,
    Command,
    Control,
    Credit,
    ErrorCode,
    Heartbeat,
    Hello,
    Message,
    Output,
    PieceAck,
    ProtocolError,
    Query,
    Result,
    ResultStatus,
    Role,
    Submit,
    TaskIds,
    TaskKind,
    TaskSpec,
    check_proto,
    departure_of,
    qid_of,
    unbundle,
)
from ..protocol.pieces import Outflow
from ..sharedmem import ORPHAN_AGE, SharedFolder
from ..store import COLLECTED, CORRUPT, Store, StoredTask
from .clients import ClientSide
from .jobs import Job, summarize
from .ledger import Event, InputUnreadable, Ledger, ReadLater
from .memory import trim_heap
from .retention import RETENTION_SWEEP, Retention
from .state import ClientSession, Task, TaskState, WorkerSession, WorkerState
from .workers import WorkerSide

PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
log = logging.getLogger("gpumesh.coordinator")

# Seconds between looks for shared frames whose writers are gone (sharedmem.ORPHAN_GRACE).
ORPHAN_SWEEP = 60.0

__all__ = ["Broker", "Event"]

# Placement classes (distinct requirements) one dispatch pass may find unplaceable before it
# stops: each costs a look at every worker with credit, every turn.
MAX_PASSED_OVER = 1000
# A task whose runner crashed under it (or whose lease expired on a live worker) waits this long
# after that for another worker that could run it, busy or not, before it may go back to the
# one that failed it: a machine whose runners die at once (too little RAM, a broken driver) took
# every attempt of each task in seconds while a healthy worker finished a longer task.
EXCLUDED_WAIT = 60.0
KINDS_REBUILD_OVER = 64  # kinds of queued task beyond which they are counted again ...
KINDS_REBUILD = 30.0  # ... at most this often (seconds): it costs a pass over the queue
TRACEBACKS_PER_MINUTE = 10  # of failures handle() contained; the rest are logged at debug
# Input bytes let go of or read back from blob files after which the C heap is trimmed, at
# most once a second: glibc keeps big freed buffers for reuse once it has raised its mmap
# threshold past their size (a queue of 8 MiB inputs let go of stayed resident without it).
LOOSE_TRIM_BYTES = 1 << 20
# Idle, memory is given back once this many tasks finished or left since the last time...
MEMORY_AFTER = 1000
MEMORY_INTERVAL = 5.0  # ... and at most once in this many seconds (it costs O(tasks))
# After a restart the restore grace stays open while workers send big messages in pieces (a
# result that may claim a restored task): until their pieces have been quiet this long...
PIECES_QUIET = 2.0
MAX_GRACE_FOR_PIECES = 60.0  # ... or this long past restore_grace, whichever comes first


class Broker:
    def __init__(
        self, store: Store, timing: Timing, limits: Limits, *, epoch: int, now: float,
        safe_mode: bool = False, shm: SharedFolder | None = None,
    ) -> None:
        self.ledger = Ledger(store, timing, limits, epoch=epoch, now=now, safe_mode=safe_mode)
        self.ledger.shm = shm
        self.worker_side = WorkerSide(self.ledger)
        self.retention = Retention(self.ledger)
        self._last_heartbeat = now
        self._last_pending_check = now
        self._finished_seen = 0  # ledger.finished_total at the last idle check
        self._last_sweep = now
        self._last_orphan_sweep = now
        self._no_workers_at = now  # last time no worker was alive (pending timeouts start after)
        # For the pending timeout of a kind of task no alive worker can run: when a worker last
        # left (its clock cannot have started before), the workers alive at the last look,
        # and since when each such kind has had no worker.
        self._worker_left_at = now
        self._alive_at_last_look: frozenset[str] = frozenset()
        self._restoring = True
        # When a worker last sent a piece of a big message (a RESULT that may claim a restored
        # task) while the restore grace was open: it stays open for that result to arrive.
        self._worker_piece_at: float | None = None
        self._pythons_told: list[str] = []  # the worker Pythons last pushed to clients
        self._memory_given_at = now
        self._trimmed_at = now  # when spill_inputs last trimmed the C heap
        # Big messages going out in pieces (the server sends what it gives), and the peers
        # whose acknowledgements let more go since the server last asked.
        self.outflow = Outflow(limits)
        self.client_side = ClientSide(self.ledger, self.worker_side, self.retention,
                                      sending_to=self.outflow.busy)
        self.pieces_acked: set[bytes] = set()
        self._tracebacks: list[float] = []
        self._kinds_rebuilt = now  # when _fail_unschedulable last counted the queued kinds  # when handle() last logged one, for the bound

    # The ledger's state, by the names the server loop, monitors and tests use.
    @property
    def store(self) -> Store:
        return self.ledger.store

    @property
    def tasks(self) -> dict[str, Task]:
        return self.ledger.tasks

    @property
    def workers(self) -> dict[str, WorkerSession]:
        return self.ledger.workers

    @property
    def clients(self) -> dict[str, ClientSession]:
        return self.ledger.clients

    @property
    def jobs(self) -> dict[str, Job]:
        return self.ledger.jobs

    @property
    def outbox(self) -> list[tuple[bytes, list[Any]]]:
        return self.ledger.outbox

    @outbox.setter
    def outbox(self, value: list[tuple[bytes, list[Any]]]) -> None:
        self.ledger.outbox = value

    @property
    def listeners(self) -> list[Callable[[Event], None]]:
        return self.ledger.listeners

    def status(self, job_id: str | None, now: float, *, tasks: bool = True) -> dict[str, Any]:
        return self.retention.status(job_id, now, tasks=tasks)

    def sweep(self, now: float) -> None:
        self.retention.sweep(now)

    def refresh_stragglers(self) -> set[str]:
        return self.worker_side.refresh_stragglers()

    def count_malformed(self, routing: bytes) -> None:
        self.ledger.count_malformed(routing)

    def count_traffic(self, routing: bytes, nbytes: int, up: bool) -> None:
        """One message between a worker and the coordinator (``up``: from the worker); a
        message of any other peer is not counted."""
        peer = self.ledger.peers.get(routing)
        if peer is None or peer[0] is not Role.WORKER:
            return
        worker = self.ledger.workers.get(peer[1])
        if worker is not None:
            traffic = worker.traffic
            traffic[0 if up else 1] += nbytes
            traffic[2 if up else 3] += 1

    # ----------------------------------------------------------------- restore

    def restore(self, now: float) -> int:
        """Load the journal after a start. Unfinished tasks wait for their workers to re-claim.

        A row that no longer parses (written by a bug, or edited by hand) fails its task with
        a clear error instead of stopping the restart. Returns how many unfinished tasks came
        back."""
        ledger = self.ledger
        for job_id, name, owner, created in ledger.store.load_jobs():
            ledger.jobs[job_id] = Job(job_id, name, owner, created)
        count = 0
        for row in ledger.store.load():
            try:
                count += self._restore_row(row, now)
            except Exception as exc:
                log.warning("journal entry for task %s no longer parses (%s): failing it",
                            row.task_id, exc)
                self._restore_broken(row, exc, now)
        for job in ledger.jobs.values():
            if job.all_finished:
                job.finished_at = job.last_finish()
        if ledger.shm is not None:
            # Shared frames no journaled task refers to: from a client that never got its
            # ACCEPTED, or a result acknowledged just before a crash.
            swept = ledger.shm.sweep(ledger.shared_files)  # aged by the wall clock, as above
            if swept:
                log.info("removed %d shared-memory file(s) nothing refers to", swept)
        return count

    def _restore_row(self, row: StoredTask, now: float) -> int:
        ledger = self.ledger
        if row.state == COLLECTED:  # only its summary is left, for its job's record
            job = self._restored_job(row.job_id, row.submitted_at)
            job.add_collected(row.result_header or {"id": row.task_id})
            return 0
        if CORRUPT in row.spec:
            raise ValueError(f"its row does not decode: {row.spec[CORRUPT]}")
        payload, payload_file = row.payload, row.payload_file
        if payload_file is not None and ("shm" in row.spec or row.spec.get("kind") == TaskKind.SCRIPT.value):
            # As when it was accepted, these stay in memory (inputs.py): a script's frames (its
            # job's summary previews them) and a task in shared memory and 64 KiB beyond it (its
            # frames count against the message room with the shared ones, Ledger.enqueue).
            payload, payload_file = [*payload, *ledger.store.read_blob(payload_file)], None
        on_disk = 0 if payload_file is None else len(payload_file.lengths)
        stored = {**row.spec, "nf": len(payload) + on_disk}
        if not payload and payload_file is None:
            # A finished task's input is gone, and its layout and shared frames with it.
            stored.pop("split", None)
            stored.pop("shm", None)
        spec = TaskSpec.from_mapping(stored)
        task = Task(
            task_id=row.task_id, client_id=row.client_id, seq=row.seq, job_id=row.job_id,
            spec=spec.to_spec(), payload=payload, submitted_at=row.submitted_at,
            attempts=row.attempts, requirements=spec.requirements, input_file=payload_file,
            lease_floor=row.lease_floor,
        )
        if row.result_header is not None:
            task.state = TaskState(row.state)
            task.result_header = row.result_header
            task.result_payload = row.result_payload or []
            task.result_file = row.result_file
            task.finished_at = float(row.result_header.get("finished_at", 0.0) or now)
            # A failure its owner had collected before the restart: not held for it again.
            task.collected = row.result_header.get("collected") is True
        else:
            task.state = TaskState.RESTORED
            task.pending_since = now
        job = self._restored_job(task.job_id, task.submitted_at)
        if task.result_header is not None:
            job.summaries[task.task_id] = summarize(task)
        job.add(task)
        ledger.tasks[task.task_id] = task
        ledger.by_seq[(task.client_id, task.seq)] = task.task_id
        return 0 if task.state.terminal else 1

    def _restore_broken(self, row: StoredTask, exc: Exception, now: float) -> None:
        """Keep a task whose journal row does not parse as failed, so its owner learns why."""
        task = Task(task_id=row.task_id, client_id=row.client_id, seq=row.seq, job_id=row.job_id,
                    spec={"kind": "fn"}, payload=[], submitted_at=row.submitted_at,
                    attempts=row.attempts, state=TaskState.PENDING)
        self.ledger.tasks[task.task_id] = task
        self.ledger.by_seq[(task.client_id, task.seq)] = task.task_id
        self._restored_job(task.job_id, task.submitted_at).add(task)
        # Its input stays in the journal: the cause may pass (a blob folder that gave EIO at
        # start), and a restart then restores the task failed with it, for `gpumesh retry`.
        self.ledger.fail(task, ResultStatus.ERROR,
                         f"the coordinator's journal entry for this task no longer parses "
                         f"({_short(exc)}); submit it again (or, once the cause is fixed, "
                         f"restart the coordinator and 'gpumesh retry' it: what the journal "
                         f"holds of its input is kept, an input in shared memory is not)",
                         now, keep_journaled_input=True)

    def _restored_job(self, job_id: str, created: float) -> Job:
        job = self.ledger.jobs.get(job_id)
        if job is None:  # a journal from before job records: name it by its id
            job = self.ledger.jobs[job_id] = Job(job_id, job_id, "", created)
        return job

    # ----------------------------------------------------------------- messages

    def handle(self, routing: bytes, msg: Message, now: float) -> None:
        """Apply one decoded message. Bad content becomes an ERROR reply, never an exception."""
        ledger = self.ledger
        try:
            if msg.command is Command.HELLO:
                self._on_hello(routing, msg, now)
                return
            if msg.command is Command.BATCH:
                self._on_batch(routing, msg, now)
                return
            peer = ledger.peers.get(routing)
            if peer is None:
                # Unknown routing id: a coordinator restart, or a reconnect under a new socket.
                if msg.command is not Command.DISCONNECT:
                    ledger.error(routing, ErrorCode.NO_SESSION, "no session: send HELLO")
                return
            role, peer_id = peer
            if role is Role.WORKER:
                handler = _WORKER_HANDLERS.get(msg.command)
                session: Any = ledger.workers[peer_id]
            else:
                handler = _CLIENT_HANDLERS.get(msg.command)
                session = ledger.clients[peer_id]
            if handler is None:
                ledger.error(routing, ErrorCode.UNEXPECTED,
                             f"{msg.command.name} is not valid from a {role.value}")
                return
            session.last_seen = now
            handler(self, session, msg, now)
        except ProtocolError as exc:
            ledger.count_malformed(routing)
            ledger.error(routing, exc.code, f"bad {msg.command.name}: {exc.detail}",
                         qid_of(msg.header))
        except Exception as exc:  # a bug of ours: contained to this one message
            if self._may_log_traceback(now):
                log.exception("failed to handle %s from peer %s", msg.command.name,
                              routing.hex())
            else:  # a peer repeating what trips it would fill the log with tracebacks
                log.debug("failed to handle %s from peer %s: %r", msg.command.name,
                          routing.hex(), exc)
            ledger.count_malformed(routing)
            ledger.error(routing, ErrorCode.MALFORMED,
                         f"the coordinator could not handle this {msg.command.name} "
                         f"({type(exc).__name__}); it was dropped", qid_of(msg.header))

    def _may_log_traceback(self, now: float) -> bool:
        """At most TRACEBACKS_PER_MINUTE tracebacks of contained failures a minute."""
        recent = [t for t in self._tracebacks if now - t < 60.0]
        self._tracebacks = recent
        if len(recent) >= TRACEBACKS_PER_MINUTE:
            return False
        recent.append(now)
        return True

    def _on_batch(self, routing: bytes, batch: Message, now: float) -> None:
        """Each message of a BATCH as if it came alone: one bad message is answered alone."""
        for item in unbundle(batch, self.ledger.limits):
            if isinstance(item, ProtocolError):
                self.ledger.count_malformed(routing)
                self.ledger.error(routing, item.code, item.detail)
            else:
                self.handle(routing, item, now)

    def _on_hello(self, routing: bytes, msg: Message, now: float) -> None:
        ledger = self.ledger
        if not check_proto(msg.header, MAJOR):
            proto = msg.header.get("proto")
            # ``gpumesh`` names what the peer should install: a number, not "the same version".
            ledger.send(routing, Command.ERROR, {
                "code": ErrorCode.VERSION.value, "gpumesh": __version__,
                "message": f"this coordinator runs gpumesh {__version__} and speaks protocol "
                           f"v{MAJOR}, the peer {proto!r}"})
            ledger.send(routing, Command.DISCONNECT, {"reason": "version"})
            return
        hello = Hello.from_header(msg.header)  # checked whole before anything moves
        # A peer saying HELLO has forgotten what was coming to it in pieces (its new session
        # gets what matters again): going on would only wait for acknowledgements.
        self.outflow.drop(routing)
        old = ledger.peers.get(routing)
        if old is not None and old != (hello.role, hello.peer_id):
            ledger.error(routing, ErrorCode.UNEXPECTED, "a second HELLO under another identity")
            return
        welcome: dict[str, Any] = {
            "session": ledger.session_id, "epoch": ledger.epoch,
            "heartbeat": ledger.timing.heartbeat, "liveness": ledger.timing.liveness,
            "lease_ttl": ledger.timing.lease_ttl,
            "max_frame_bytes": ledger.limits.max_frame_bytes,
            "max_message_bytes": ledger.limits.max_message_bytes,
            "max_frames": ledger.limits.max_frames, "safe_mode": ledger.safe_mode,
            "batch": True, "fnref": True, "pieces": True,
            # What peers compare with their own at join time (a worker on another Python
            # cannot load functions pickled where the coordinator runs, usually a client too).
            "python": PYTHON, "gpumesh": __version__,
        }
        if ledger.shm is not None:
            welcome["shm"] = ledger.shm.offer()
        if hello.role is Role.CLIENT:
            welcome["pythons"] = ledger.worker_pythons()
        if hello.role is Role.WORKER:
            welcome["abort"] = self.worker_side.hello(routing, hello, now)
            welcome["goodbye"] = True  # a worker's DISCONNECT is answered (since 1.6)
        else:
            self.client_side.hello(routing, hello, now)
        ledger.peers[routing] = (hello.role, hello.peer_id)
        session = (ledger.workers if hello.role is Role.WORKER else ledger.clients).get(hello.peer_id)
        if session is not None:
            session.batch = hello.batch
            session.pieces = hello.pieces
            session.shmlock = hello.shmlock
            session.shm = False  # until this session's HEARTBEAT proves it reads the folder
            if isinstance(session, ClientSession):
                session.hello_at = now
                session.new_session(now)
        ledger.send(routing, Command.WELCOME, welcome)

    def _worker_result(self, worker: WorkerSession, msg: Message, now: float) -> None:
        result = Result.from_header(msg.header)
        result.check_frames(len(msg.payload))
        self.worker_side.result(worker, result, msg.payload, now)

    def _piece_ack(self, session: WorkerSession | ClientSession, msg: Message, now: float) -> None:
        ack = PieceAck.from_header(msg.header)
        routing = session.routing
        if routing is None or not self.outflow.acked(routing, ack.transfer, ack.got, now):
            return
        self.pieces_acked.add(routing)
        if isinstance(session, WorkerSession):
            # A worker still receiving a task in pieces cannot list its lease in a heartbeat
            # yet: each acknowledgement renews its leases, so a long transfer never expires one.
            self._renew_leases(session, now)

    def heard_piece(self, routing: bytes, now: float) -> bool:
        """A PIECE of a big message came from this peer (the server puts it together). False
        when the peer has no session. A piece is a sign of life, and a worker's renews its
        leases: its heartbeats wait behind the result it is sending."""
        session = self.ledger.session_at(routing)
        if session is None:
            return False
        session.last_seen = now
        if isinstance(session, WorkerSession):
            self._renew_leases(session, now)
            if self._restoring:
                self._worker_piece_at = now
        return True

    def _renew_leases(self, worker: WorkerSession, now: float) -> None:
        expires = now + self.ledger.timing.lease_ttl
        tasks = self.ledger.tasks
        for lease_id, task_id in worker.leases.items():
            task = tasks.get(task_id)
            if task is not None and task.lease_id == lease_id:
                task.lease_expires = max(task.lease_expires, expires)

    def _client_submit(self, client: ClientSession, msg: Message, now: float) -> None:
        self.client_side.submit(client, Submit.from_header(msg.header), msg.payload, now)

    def unreachable(self, routing: bytes, now: float) -> None:
        """A send failed: the peer's connection is gone (or its queue is full). Drop the session;
        a live peer will notice the silence and HELLO again."""
        ledger = self.ledger
        peer = ledger.peers.get(routing)
        if peer is None:
            return
        role, peer_id = peer
        if role is Role.WORKER:
            worker = ledger.workers[peer_id]
            ledger.release_leases(worker, now, f"worker {worker.label} unreachable", infra=True)
            ledger.lose(worker, now, "unreachable")
        else:
            ledger.peers.pop(routing, None)
            ledger.clients[peer_id].routing = None

    # ----------------------------------------------------------------- dispatch

    def work_waits_for_idle_workers(self) -> bool:
        """Pending tasks and a worker with credit: a dispatch now would start something."""
        ledger = self.ledger
        return bool(ledger.pending) and any(
            w.credit > 0 and w.state is WorkerState.ALIVE for w in ledger.workers.values())

    def dispatch(self, now: float) -> int:
        """Hand pending tasks to workers with credit. Returns how many were sent."""
        ledger = self.ledger
        if not ledger.pending:
            return 0
        views: dict[str, scheduler.WorkerView] = {}
        alive = WorkerState.ALIVE
        for w in ledger.workers.values():
            if w.state is alive:
                credit = w.credit
                if credit > 0:
                    views[w.worker_id] = w.view(credit)
        if not views:
            return 0
        slow = self.worker_side.stragglers & views.keys()
        for worker_id in slow:
            views[worker_id].straggler = True
        placer = scheduler.Placer(views.values())
        # Per placement class: whether a heavy task of it must go to a straggler, because no
        # other alive worker could ever run it (the A100 that runs only heavy tasks is the
        # slowest per unit of cost there is): computed only when a straggler has room.
        only_stragglers: dict[Any, bool] = {}
        sent = 0
        free = sum(v.free for v in views.values())
        # Class by class: a class whose best task fits no worker now is passed over whole.
        walk = ledger.pending.walk()
        passed_over = 0
        # Kept for a worker that did not fail them: queued again after, where they were.
        held: list[tuple[Task, int]] = []
        # Whether a held task's class has another worker for it, per (class, workers that
        # failed it): asked once a pass, not once per held task (a scan of every worker).
        another: dict[Any, bool] = {}
        holding: set[Any] = set()  # (class, failed-by) whose best free worker failed them
        try:
            while free > 0 and passed_over < MAX_PASSED_OVER:
                entry = walk.peek()
                if entry is None:
                    break
                task = ledger.tasks.get(entry[2])
                if task is None or task.state is not TaskState.PENDING:
                    walk.take()  # stale entry: cancelled, or already handed out
                    continue
                taken = False
                try:
                    view = task.view()
                    kind: Any = None
                    if view.excluded and now - task.failed_at < EXCLUDED_WAIT:
                        kind = (task.placement, view.excluded)
                        if kind in holding:  # as the one before it: the same choice, the same wait
                            walk.take()
                            held.append((task, entry[1]))
                            continue
                    choice = placer.choose(view)
                    if choice is None and slow and view.cost > scheduler.DEFAULT_COST \
                            and self._only_stragglers_fit(task, only_stragglers):
                        choice = placer.choose(view, stragglers_too=True)
                    if choice is None:
                        walk.pass_over()
                        passed_over += 1
                        continue
                    walk.take()
                    taken = True
                    if choice.worker_id in view.excluded \
                            and self._waits_for_another(task, now, another):
                        held.append((task, entry[1]))
                        if kind is not None:
                            holding.add(kind)
                        continue
                    worker = ledger.workers[choice.worker_id]
                    ledger.lease(task, worker, now)
                except InputUnreadable as exc:  # removed or cut short by hand
                    log.warning("task %s cannot run: %s", task.task_id, exc)
                    if not taken:
                        walk.take()
                    ledger.drop_input(task)  # a retry could only fail the same way
                    ledger.fail(task, ResultStatus.ERROR,
                                f"the coordinator could not read this task's input back ({exc}); "
                                f"submit it again", now)
                    continue
                except ReadLater as exc:  # it stays queued, and this pass ends (the next reads may
                    # fail alike); the next turn tries again
                    ledger.warn_read_later(f"task {task.task_id}'s input", exc, now)
                    ledger.enqueue(task)
                    break
                except Exception as exc:  # a bug of ours: this task fails, the others go on
                    log.exception("failed to dispatch task %s", task.task_id)
                    if not taken:
                        walk.take()
                    if not task.state.terminal:
                        ledger.fail(task, ResultStatus.ERROR,
                                    f"the coordinator could not schedule this task ({_short(exc)})",
                                    now)
                    continue
                self.worker_side.assigned(worker)
                choice.free -= 1
                choice.load += 1
                choice.last_assigned = worker.last_assigned
                free -= 1
                sent += 1
        finally:  # whatever ended the pass: a held task out of the queue would wait for good
            for task, order in held:
                ledger.enqueue(task, order)
        return sent

    def _waits_for_another(self, task: Task, now: float, known: dict[Any, bool]) -> bool:
        """Whether ``task``, whose best free worker failed it before, should wait for another
        that could run it, busy now or not (one its owner paused or drains is not waited for),
        rather than go back: for EXCLUDED_WAIT after its last failure."""
        if now - task.failed_at >= EXCLUDED_WAIT:
            return False
        key = (task.placement, task.excluded)
        if key not in known:
            known[key] = any(
                w.worker_id not in task.excluded and not w.draining
                and not scheduler.unmet(w.view(0), task.requirements, portable=task.portable,
                                        local_only=task.local_only)
                for w in self.ledger.workers.values() if w.state is WorkerState.ALIVE)
        return known[key]

    def _only_stragglers_fit(self, task: Task, known: dict[Any, bool]) -> bool:
        """Whether every alive worker that could run ``task`` is a straggler (so it takes
        one, rather than wait for a faster one that is not there)."""
        key = task.placement
        if key not in known:
            stragglers = self.worker_side.stragglers
            known[key] = not any(
                w.worker_id not in stragglers and not w.draining  # paused: not here to take it
                and not scheduler.unmet(w.view(), task.requirements, portable=task.portable,
                                        local_only=task.local_only)
                for w in self.ledger.workers.values() if w.state is WorkerState.ALIVE)
        return known[key]

    # ----------------------------------------------------------------- timers

    def tick(self, now: float) -> None:
        """Heartbeats out, silent peers and expired leases in. Call a few times a second.

        Each duty runs on its own: one that fails (a bug) is logged and the others still run."""
        ledger = self.ledger
        pythons = ledger.worker_pythons()
        if pythons != self._pythons_told:
            # Clients learn at once when a worker of another Python joins or the last leaves.
            self._pythons_told = pythons
            for client in ledger.clients.values():
                if client.routing is not None:
                    ledger.send(client.routing, Command.HEARTBEAT, {"pythons": pythons})
        if now - self._last_heartbeat >= ledger.timing.heartbeat:
            self._last_heartbeat = now
            for routing in ledger.peers:
                ledger.send(routing, Command.HEARTBEAT, {})
        _guarded("expire workers and leases", self.worker_side.expire, now)
        _guarded("drop pieces nobody takes", self._drop_stalled_pieces, now)
        _guarded("deliver results held for a proof of shared memory", ledger.deliver_deferred,
                 now)
        _guarded("send results waiting for an acknowledgement that does not come",
                 ledger.expire_read_backs, now)
        silence = ledger.timing.silence_limit
        for client in ledger.clients.values():
            if client.routing is not None and now - client.last_seen > silence:
                ledger.peers.pop(client.routing, None)
                client.routing = None
        if self._restoring and self._grace_over(now):
            # Restored leases nobody re-claimed in the grace window go back to the queue.
            self._restoring = False
            for task in ledger.tasks.values():
                if task.state is TaskState.RESTORED:
                    task.move(TaskState.PENDING)
                    ledger.enqueue(task)
        if now - self._last_pending_check >= 1.0:
            self._last_pending_check = now
            _guarded("fail unschedulable tasks", self._fail_unschedulable, now)
            _guarded("find stragglers", lambda _now: self.worker_side.refresh_stragglers(), now)
            # Idle for the whole second since the last look, not only at this instant: between
            # the single calls of a busy client the queue is empty most of the time, and the
            # checkpoint, vacuum and full collection below cost that client's call milliseconds.
            quiet = ledger.finished_total == self._finished_seen
            self._finished_seen = ledger.finished_total
            if quiet and not ledger.pending and not any(w.leases for w in ledger.workers.values()):
                # Idle: give the journal's freed pages and WAL back (once 256 rows were freed).
                _guarded("give back journal space",
                         lambda _now: ledger.store.idle_maintenance(), now)
                _guarded("give back memory", self._give_back_memory, now)
        if now - self._last_sweep >= RETENTION_SWEEP:
            self._last_sweep = now
            _guarded("sweep retained results", self.retention.sweep, now)
        if self.ledger.shm is not None and now - self._last_orphan_sweep >= ORPHAN_SWEEP:
            self._last_orphan_sweep = now
            _guarded("sweep orphaned shared files", self._sweep_orphans, now)

    def _sweep_orphans(self, now: float) -> None:
        """Remove the shared frames of producers that are gone which no task names: a client
        killed before its SUBMIT was accepted, a worker killed before it sent its result. Of
        unknown producers only those written before this run began, and ORPHAN_AGE old (the
        coordinator's own copies of a remote client's inputs, left by a restart: the journal
        holds their bytes): one written since may belong to a SUBMIT parked for minutes."""
        shm = self.ledger.shm
        if shm is not None:
            before_this_run = max(ORPHAN_AGE, now - self.ledger.started_at)
            # Files carry wall-clock times: their ages are the wall clock's (sweep's default),
            # not this loop's steady clock, which differs by any step since the start.
            swept = shm.sweep(self.ledger.shared_files, unknown_after=before_this_run)
            if swept:
                log.info("removed %d shared-memory file(s) whose writers are gone", swept)

    def _grace_over(self, now: float) -> bool:
        """``restore_grace`` after the start, or later while a worker is sending a big message
        in pieces: a result finished before the restart claims its task only once it is whole
        (a 1 GiB result takes nine seconds on a gigabit LAN), and a task run again for want of
        it is work done twice. Pieces quiet for ``PIECES_QUIET``, or ``MAX_GRACE_FOR_PIECES``
        after the start, end the wait however busy the workers are."""
        grace = self.ledger.timing.restore_grace
        since_start = now - self.ledger.started_at
        if since_start < grace:
            return False
        piece_at = self._worker_piece_at
        if (piece_at is None or now - piece_at >= PIECES_QUIET
                or since_start >= grace + MAX_GRACE_FOR_PIECES):
            return True
        # Pieces are coming: worth waiting for only while a task is left to claim (a scan, but
        # only in this window after a restart, a tick at a time).
        return not any(task.state is TaskState.RESTORED for task in self.ledger.tasks.values())

    def _drop_stalled_pieces(self, now: float) -> None:
        """What was going in pieces to a session that ended goes; a peer that acknowledged
        nothing for a minute is treated as unreachable (it says HELLO again, and re-claims)."""
        outflow, ledger = self.outflow, self.ledger
        for routing in outflow.routings():
            if routing not in ledger.peers:
                # Sent as they are, the rest of what waited: a DISCONNECT among them included.
                ledger.outbox.extend((routing, frames) for frames in outflow.drop(routing))
        for routing in outflow.stalled(now):
            log.warning("a peer acknowledged no piece of a big message for a minute: "
                        "dropping its session")
            self.unreachable(routing, now)
            ledger.outbox.extend((routing, frames) for frames in outflow.drop(routing))

    def spill_inputs(self, now: float) -> None:
        """After the turn's dispatch: queued inputs the turn journaled into blob files leave
        memory (Ledger.spill_inputs), and the C heap gives them back to the system, as it does
        the buffers inputs were read back into to be sent."""
        ledger = self.ledger
        ledger.spill_inputs()
        # Every turn runs this (ticks included): the last of a burst is trimmed a second later.
        if ledger.loose_bytes >= LOOSE_TRIM_BYTES and now - self._trimmed_at >= 1.0:
            ledger.loose_bytes = 0
            self._trimmed_at = now
            trim_heap()

    def _give_back_memory(self, now: float) -> None:
        """Once enough tasks have left since the last time, and not more than once every
        MEMORY_INTERVAL seconds: right-size the tables, collect cycles, trim the C heap."""
        ledger = self.ledger
        if ledger.released < MEMORY_AFTER or now - self._memory_given_at < MEMORY_INTERVAL:
            return
        self._memory_given_at = now
        ledger.released = 0
        ledger.compact()
        gc.collect()
        trim_heap()

    def _fail_unschedulable(self, now: float) -> None:
        ledger = self.ledger
        limit = ledger.timing.pending_timeout
        alive = [w for w in ledger.workers.values() if w.state is WorkerState.ALIVE]
        alive_ids = frozenset(w.worker_id for w in alive)
        if self._alive_at_last_look - alive_ids:
            self._worker_left_at = now
        self._alive_at_last_look = alive_ids
        views = [w.view() for w in alive]
        if not views:
            # Nobody to judge the task against (laptops asleep, workers not joined yet): it waits,
            # and the clock restarts once a worker is back.
            self._no_workers_at = now
            self.ledger.unrunnable.clear()
            self.ledger.waiting_for = {}
            return
        cutoff = now - limit
        if len(ledger.kinds) > KINDS_REBUILD_OVER and now - self._kinds_rebuilt >= KINDS_REBUILD:
            # Kinds are added as tasks queue and forgotten only here or when the mesh is idle:
            # a mesh never idle kept every kind it ever queued (200,000 cancelled ones took
            # 0.95 s of this second's check), though most have nothing queued any more. The
            # queue's length cannot tell: it counts the entries of cancelled tasks too.
            self._kinds_rebuilt = now
            ledger.kinds = {(task.requirements, task.portable, task.local_only)
                            for task in (ledger.tasks.get(entry[2]) for entry in ledger.pending)
                            if task is not None and task.state is TaskState.PENDING}
        runnable = {kind: scheduler.could_ever_run(
            scheduler.TaskView("", kind[0], portable=kind[1], local_only=kind[2]), views)
            for kind in ledger.kinds}
        self._note_unrunnable(runnable)
        if all(runnable.values()):
            self.ledger.unrunnable.clear()  # what it held is runnable again, or no longer queued
            self.ledger.waiting_for = {}
            return  # every kind of task queued has a worker that could run it: nothing is due
        # Failing waits for a worker back less than the timeout ago; saying why a job waits
        # (its first task no worker could run, for `status`) does not.
        may_fail = self._no_workers_at <= cutoff
        doomed: dict[str, Task] = {}  # a task may have several heap entries (retry)
        waiting_for: dict[str, str] = {}
        ledger.kinds = set()
        for _, _, task_id in ledger.pending:
            task = ledger.tasks.get(task_id)
            if task is None or task.state is not TaskState.PENDING:
                continue
            kind = (task.requirements, task.portable, task.local_only)
            ledger.kinds.add(kind)
            if kind not in runnable:
                runnable[kind] = scheduler.could_ever_run(task.view(), views)
                self._note_unrunnable({kind: runnable[kind]})
            if runnable[kind]:
                continue
            waiting_for.setdefault(task.job_id, task.task_id)
            if may_fail and task.pending_since <= cutoff and self.ledger.unrunnable[kind] <= cutoff:
                doomed[task.task_id] = task
        ledger.waiting_for = waiting_for
        ledger.unrunnable = {kind: since for kind, since in ledger.unrunnable.items()
                             if kind in ledger.kinds}
        for task in doomed.values():
            message = scheduler.explain_unschedulable(task.requirements, views,
                                                      portable=task.portable,
                                                      local_only=task.local_only)
            ledger.fail(task, ResultStatus.UNSCHEDULABLE,
                        f"{message}; gave up after {limit:.0f}s pending", now)


    def _note_unrunnable(self, runnable: dict[Any, bool]) -> None:
        """Since when each kind has had no alive worker that could run it. A kind no worker
        ran since the last departure counts from that departure, not from this look: the timeout
        runs from when its last capable worker went (a laptop's Wi-Fi drop, back seconds later,
        costs the queue nothing), or from the task's own submission if none ever could."""
        for kind, can in runnable.items():
            if can:
                self.ledger.unrunnable.pop(kind, None)
            else:
                # Nor before the last time no worker was alive (the same for when it fails,
                # which waits for that too; a job's status says when).
                self.ledger.unrunnable.setdefault(
                    kind, max(self._worker_left_at, self._no_workers_at))


def _guarded(duty: str, action: Callable[[float], Any], now: float) -> None:
    try:
        action(now)
    except Exception:
        log.exception("the coordinator failed to %s; it goes on", duty)


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 200 else text[:197] + "..."


# Each handler parses the header into its protocol type, then hands it to the owning part.
_WORKER_HANDLERS: dict[Command, Callable[[Broker, Any, Message, float], None]] = {
    Command.HEARTBEAT: lambda b, w, m, now: b.worker_side.heartbeat(
        w, Heartbeat.from_header(m.header), now),
    Command.CREDIT: lambda b, w, m, now: b.worker_side.credit(
        w, Credit.from_header(m.header, w.mode), now),
    Command.OUTPUT: lambda b, w, m, now: b.worker_side.output(
        w, Output.from_header(m.header), m.payload, now),
    Command.RESULT: Broker._worker_result,
    Command.PIECE_ACK: Broker._piece_ack,
    Command.DISCONNECT: lambda b, w, m, now: b.worker_side.disconnect(
        w, departure_of(m.header), now),
}
_CLIENT_HANDLERS: dict[Command, Callable[[Broker, Any, Message, float], None]] = {
    Command.HEARTBEAT: lambda b, c, m, now: b.client_side.heartbeat(
        c, Heartbeat.from_header(m.header)),  # last_seen was refreshed by handle()
    Command.SUBMIT: Broker._client_submit,
    Command.RESULT_ACK: lambda b, c, m, now: b.client_side.result_ack(
        c, TaskIds.from_header(m.header), now),
    Command.FETCH: lambda b, c, m, now: b.client_side.fetch(c, TaskIds.from_header(m.header), now),
    Command.CANCEL: lambda b, c, m, now: b.client_side.cancel(
        c, TaskIds.from_header(m.header), now),
    Command.QUERY: lambda b, c, m, now: b.client_side.query(c, Query.from_header(m.header), now),
    Command.CONTROL: lambda b, c, m, now: b.client_side.control(
        c, Control.from_header(m.header), now),
    Command.DISCONNECT: lambda b, c, m, now: b.client_side.disconnect(c, now),
    Command.PIECE_ACK: Broker._piece_ack,
}
