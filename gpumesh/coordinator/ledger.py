"""The coordinator's shared state and the task lifecycle: the one object every part changes.

It owns the tasks, the queue, the sessions and the jobs, and the moves a task makes (queue,
lease, finish, requeue, cancel, reopen), each journaled through the store and announced on the
event stream. It owns no socket and reads no clock: messages it wants sent wait in ``outbox``,
and the server loop sends the acknowledgements among them (ACCEPTED, RESULT_ACK) only after it
has committed the journal, so nothing is acknowledged before it is durable. ``workers.py``, ``clients.py`` and ``retention.py`` act on it; ``broker.py`` routes
messages to them.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import secrets
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..blobs import BlobRef
from ..config import Limits, Timing, sizes_over_room
from ..fileio import FileSpan, SharedFd
from ..protocol import (
    Command,
    ErrorCode,
    Requirements,
    ResultStatus,
    Role,
    TaskKind,
    encode,
    serialize,
)
from ..protocol.pieces import STREAM_BYTES
from ..protocol.refs import ref_names, refs_of, shared_bytes
from ..protocol.vocabulary import KEPT_FUNCTIONS
from ..sharedmem import SharedFolder, SharedFrameBusy, materialize
from ..store import Store
from .events import Event, EventLog
from .inputs import JournaledInputs
from .jobs import Job, error_line, summarize
from .pending import PendingQueue
from .state import (
    REDELIVER_AFTER,
    ClientSession,
    FunctionCache,
    Task,
    TaskState,
    WorkerSession,
    WorkerState,
)

log = logging.getLogger("gpumesh.coordinator")

EVENT_ERROR_CHARS = 300  # of a failed task's "Type: message" in its task_finished event
# A successful result handed to its connected client is journaled only if the client has not
# acknowledged it within this long: most are collected first, and then the journal never holds
# the result at all (only the collection is written, not the result and then the collection;
# no result bytes in SQLite). Until one or the other is committed, the worker's RESULT_ACK
# waits, so the worker keeps the result and sends it again if the coordinator dies meanwhile.
RESULT_JOURNAL_DELAY = 0.05
# A client on this machine proves it maps the shared-memory folder right after WELCOME: a result
# too big to send any other way waits this long after its HELLO for that proof.
SHM_PROOF_GRACE = 2.0
# A blob file that exists but cannot be read now (too many open files, no memory): the input or
# result is read again after this long, instead of being declared lost.
READ_AGAIN_AFTER = 1.0
READ_WARNING_INTERVAL = 10.0  # at most one warning this often while files cannot be read

MAX_PEER_COUNTERS = 10_000
# A function task's input from a socket is moved into the shared-memory folder for a worker on
# this machine from this size (_share_input).
MOVE_INTO_FOLDER_BYTES = 1024 * 1024
# Journaled inputs and results held open to be sent a piece at a time (protocol/pieces.py): one
# descriptor each until sent, however long it waits behind another; beyond this many, one is
# read back whole as before, so the coordinator never runs short of descriptors for its sockets.
MAX_SPAN_FILES = 64
# Results read back whole from their blob files (64 KiB-8 MiB, or bigger for a client that does
# not read pieces) go to one client this many bytes at a time: the rest wait until it
# acknowledges those. A FETCH of 10,000 such results read them all in one turn (1 GiB of 100 KB
# results at once, into the outbox). Those sent and not acknowledged count no more after
# READ_BACK_EXPIRY seconds without any acknowledgement while others wait, from a client that
# acknowledged others since (expire_read_backs).
READ_BACK_WINDOW = 64 << 20
READ_BACK_EXPIRY = 30.0
FUNCTIONS_PER_WORKER = KEPT_FUNCTIONS  # functions a worker keeps per session (then afresh)
MAX_DISTINCT_REQUIREMENTS = 10_000  # shared Requirements objects kept (then started afresh)


class InputUnreadable(ValueError):
    """A task's input, let go of once journaled, cannot be read back from its blob file (it was
    removed or cut short by hand, or the disk fails): the task cannot run."""


class ReadLater(Exception):
    """A blob file that is there could not be read now (too many open files, no memory, an
    I/O error): the input or result waits and is read again, never declared lost."""


class TooBigToSend(ValueError):
    """Frames in this machine's shared memory that a peer elsewhere could only get in a message
    over the limits: sent, it would be dropped unanswered."""


@dataclass
class HeldResult:
    """A finished task whose result is not journaled yet (RESULT_JOURNAL_DELAY), and the
    RESULT_ACKs that wait for it to be journaled or collected."""

    task: Task
    state: TaskState
    result: dict[str, Any]
    payload: list[Any]
    since: float
    acks: list[tuple[bytes, dict[str, Any]]]



class Ledger:
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
        self.peers: dict[bytes, tuple[Role, str]] = {}
        self.pending = PendingQueue()  # entries (-priority, order, task id), by placement class
        # Kinds (requirements, portable) of the tasks queued: the unschedulable check scans the
        # queue only when some kind has no worker that could ever run it.
        self.kinds: set[tuple[Requirements, bool, bool]] = set()  # requirements, portable, local
        # The kinds no alive worker could run, with since when (the broker's once-a-second
        # check): such tasks fail after the pending timeout, and a job's status says why it waits.
        self.unrunnable: dict[tuple[Requirements, bool, bool], float] = {}
        # Per job with such a task queued, its first (the same check): what `status` explains.
        self.waiting_for: dict[str, str] = {}
        self.outbox: list[tuple[bytes, list[Any]]] = []
        self.events = EventLog()
        self.listeners: list[Callable[[Event], None]] = []
        self.malformed: dict[bytes, int] = {}
        # One copy in memory of each pickled function, however many queued tasks call it.
        self.functions = FunctionCache()
        self._requirements: dict[Requirements, Requirements] = {}
        # This machine's shared-memory folder, where same-machine peers leave big frames
        # (gpumesh.sharedmem); None where there is none. Set by the server.
        self.shm: SharedFolder | None = None
        self.unneeded_files: list[str] = []  # removed after the next commit
        self._order = itertools.count()
        self.released = 0  # tasks finished or forgotten since memory was last given back
        self.finished_total = 0  # tasks finished in this run: monitors derive throughput from it
        self.leased_total = 0  # tasks handed to workers in this run (the loop's busy polling)
        self._lease_counter = itertools.count(1)
        self._event_seq = itertools.count(1)
        # Results delivered and not journaled yet, oldest first (task id -> HeldResult).
        self.held_results: dict[str, HeldResult] = {}
        self.deferred_deliveries: dict[str, float] = {}  # task id -> when to deliver it again
        self.read_back_clients: set[str] = set()  # clients with results waiting in line
        # The inputs that are in blob files and also in memory, within a budget (inputs.py).
        self.inputs = JournaledInputs(limits.queue_memory_bytes)
        # Bytes of inputs and results let go of, or read back from blob files (and sent), since
        # the broker last gave the C heap's free pages back: what those big buffers leave.
        self.loose_bytes = 0
        self._read_warned_at = -READ_WARNING_INTERVAL  # last warning of a ReadLater

    # ----------------------------------------------------------------- plumbing

    def send(self, routing: bytes | None, command: Command, header: dict[str, Any],
             payload: Sequence[Any] = ()) -> None:
        if routing is not None:
            self.outbox.append((routing, encode(command, header, payload)))

    def worker_pythons(self) -> list[str]:
        """The Python versions of the alive workers: what clients need to pick a function's
        form (a pickle loads only on its own Python), pushed to them when it changes."""
        return sorted({w.info.python for w in self.workers.values()
                       if w.state is WorkerState.ALIVE and w.info.python})

    def shares_memory(self, proof: str) -> bool:
        """Whether a peer's HEARTBEAT ``shm`` proves it reads this machine's memory folder."""
        return self.shm is not None and self.shm.verifies(proof)

    def reads_batches(self, routing: bytes) -> bool:
        session = self.session_at(routing)
        return session is not None and session.batch

    def reads_pieces(self, routing: bytes) -> bool:
        session = self.session_at(routing)
        return session is not None and session.pieces

    def session_at(self, routing: bytes) -> WorkerSession | ClientSession | None:
        peer = self.peers.get(routing)
        if peer is None:
            return None
        return (self.workers if peer[0] is Role.WORKER else self.clients).get(peer[1])

    def error(self, routing: bytes | None, code: ErrorCode, text: str, qid: int = 0) -> None:
        header: dict[str, Any] = {"code": code.value, "message": text}
        if qid:
            header["qid"] = qid  # so the client can fail the one call that caused it
        self.send(routing, Command.ERROR, header)

    def emit(self, kind: str, now: float, **data: Any) -> None:
        event = Event(next(self._event_seq), now, kind, data)
        self.events.append(event)
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # a monitor's bug must never stop the broker
                log.exception("event listener failed")

    def count_malformed(self, routing: bytes) -> None:
        if len(self.malformed) > MAX_PEER_COUNTERS:
            self.malformed.clear()  # bounded: a counter per peer is a diagnostic, not a ledger
        self.malformed[routing] = self.malformed.get(routing, 0) + 1

    def compact(self) -> None:
        """Copy the tables that held a burst of tasks into right-sized ones: a Python dict
        keeps the size of its largest moment after its entries are gone. O(tasks); call it
        when the queue is empty, not per turn."""
        self.tasks = dict(self.tasks)
        self.by_seq = dict(self.by_seq)
        if not self.pending:
            self.pending = PendingQueue()
            self.kinds = set()
        for job in self.jobs.values():
            job.compact()
        self.inputs.compact()
        self.store.compact()

    def new_lease_id(self) -> int:
        """Lease ids rise monotonically and carry the coordinator run (epoch) in their top bits."""
        return (self.epoch << 40) | next(self._lease_counter)

    # ----------------------------------------------------------------- task lifecycle

    def shared_requirements(self, requirements: Requirements) -> Requirements:
        """One object per distinct set of requirements (they are frozen): a queue of 100,000
        tasks of one .map holds one, not 100,000."""
        if len(self._requirements) > MAX_DISTINCT_REQUIREMENTS:
            self._requirements.clear()
        return self._requirements.setdefault(requirements, requirements)

    def enqueue(self, task: Task, order: int | None = None) -> None:
        """Queue ``task`` behind those of its priority; with ``order`` (its entry's, taken out
        a moment ago) where it was."""
        if "shm" in task.spec:  # only frames in shared memory can make it too big to send
            task.local_only = self.too_big_to_send(task.spec, task.payload)
        self.pending.push(task.placement, (-task.priority, next(self._order) if order is None else order,
                           task.task_id))
        self.kinds.add((task.requirements, task.portable, task.local_only))

    def too_big_to_send(self, header: dict[str, Any], payload: Sequence[Any]) -> bool:
        """Whether ``payload``, its shared frames read back in, would be over one message's room
        (as a client counts it) for a peer that does not map this machine's shared memory."""
        nbytes, frames = serialize.wire_cost(serialize.join_frames(payload, header.get("split")),
                                             self.limits.chunk_bytes, refs_of(header.get("shm")))
        room_bytes, room_frames = self.limits.message_room
        return nbytes > room_bytes or frames > room_frames

    def journaled_input(self, task: Task, blob: BlobRef) -> None:
        """``task``'s input (after its function) was written to ``blob`` as it was journaled."""
        if task.kind == TaskKind.FUNCTION.value and "shm" not in task.spec:
            # A script's frames stay: its job's summary previews them. A task naming frames in
            # shared memory is counted against the message room from its frames (enqueue).
            self.inputs.arrived(task, blob)

    def spill_inputs(self) -> None:
        """Call after the turn's dispatch, so a task handed out at once was sent from the
        frames that came in: the inputs this turn journaled stay in memory within the budget,
        the rest wait on disk (page cache) and are read back when sent (``input_frames``)."""
        self.loose_bytes += self.inputs.end_turn()

    def input_frames(self, task: Task) -> list[Any]:
        """``task``'s input frames, read back from its blob file if it was let go of.
        Raises InputUnreadable (the file is gone) or ReadLater."""
        if task.input_file is None:
            return task.payload
        frames = self._read_back(task.input_file, InputUnreadable)
        return [*task.payload, *frames]

    def _file_spans(self, blob: BlobRef, gone: type[ValueError]) -> list[FileSpan]:
        """A big input or result on disk, for a peer that reads a message in pieces: its
        frames as spans of its file, read a piece at a time as they are sent
        (protocol/pieces.py) instead of whole now. Raises ``gone`` (the file is gone) or
        ReadLater."""
        try:
            fd = SharedFd(self.store.open_blob(blob))
        except ValueError as exc:
            raise gone(str(exc)) from None
        except OSError as exc:
            raise ReadLater(exc.strerror or str(exc)) from None
        spans, offset = [], 0
        for length in blob.lengths:
            spans.append(fd.span(offset, length))
            offset += length
        return spans

    def _read_back(self, blob: BlobRef, gone: type[ValueError]) -> list[memoryview]:
        try:
            frames = self.store.read_blob(blob)
        except ValueError as exc:
            raise gone(str(exc)) from None
        except OSError as exc:
            raise ReadLater(exc.strerror or str(exc)) from None
        self.loose_bytes += blob.nbytes
        return frames

    def warn_read_later(self, what: str, exc: ReadLater, now: float) -> None:
        """Say that ``what`` waits for its file to be readable, at most every 10 s."""
        if now - self._read_warned_at >= READ_WARNING_INTERVAL:
            self._read_warned_at = now
            log.warning("cannot read %s back from its file now (%s): it waits", what, exc)

    def lease(self, task: Task, worker: WorkerSession, now: float) -> None:
        # Raises InputUnreadable (and the task fails, saying why) when its blob file is gone.
        if worker.pieces and not worker.maps_shared and task.input_file is not None \
                and _spans_pay(task.input_file):
            frames = [*task.payload, *self._file_spans(task.input_file, InputUnreadable)]
        else:
            frames = self.input_frames(task)
        if worker.maps_shared and self.shm is not None and "shm" not in task.spec:
            frames = self._share_input(task, frames, self.shm)
        header = {k: v for k, v in task.spec.items() if k not in ("req", "seq")}
        refs = refs_of(header.get("shm"))
        if refs and self.shm is not None:
            gone = self.shm.missing(refs)
            if gone:
                # For a worker on this machine too: it crashed on the missing file, and the
                # task was retried on every worker (a reboot emptied /dev/shm) to the same end.
                raise InputUnreadable(f"its input in this machine's shared memory is gone "
                                      f"({gone}): the machine restarted, or /dev/shm was emptied")
        # Raises (and the task fails, saying why) when its shared input is gone.
        payload = self.outgoing(header, frames, worker.maps_shared)
        task.move(TaskState.LEASED)
        task.attempts += 1
        task.lease_id = self.new_lease_id()
        task.grant(task.lease_id, worker.worker_id)
        task.worker_id = worker.worker_id
        task.lease_expires = now + self.timing.lease_ttl
        worker.leases[task.lease_id] = task.task_id
        worker.sent += 1
        need = {k: v for k, v in (("gpu", task.requirements.gpu), ("vram", task.requirements.vram))
                if v is not None}
        if need:
            header["need"] = need  # the worker picks the slot whose own GPU satisfies it
        header.update(task=task.task_id, lease=task.lease_id, attempt=task.attempts)
        if worker.fnref and "shm" not in task.spec and "split" not in task.spec:
            # Only a task whose function frame was checked against its digest at SUBMIT (one in
            # shared memory or in slices was not) may be kept and named by that digest.
            payload = self._by_reference(header, payload, worker)
        self.send(worker.routing, Command.TASK, header, payload)
        self.leased_total += 1
        if log.isEnabledFor(logging.DEBUG):  # -v: each task's way, without its cost otherwise
            log.debug("task %s of job %s (attempt %d) to worker %s", task.task_id, task.job_id,
                      task.attempts, worker.label)

    def _share_input(self, task: Task, payload: list[Any], folder: SharedFolder) -> list[Any]:
        """Before a function task goes to a worker that maps this machine's shared memory, its
        big input frames that came over a socket (from a client on another machine, or one
        that does not share memory) move into the folder: one memory copy here instead of
        encrypting them again for that worker, and decrypting them there. The task then names
        them as a client on this machine would have (``shm``), and they go when it ends. The
        journal keeps the bytes it wrote at SUBMIT: a restarted coordinator takes them from
        there, and removes an unnamed file left here once it is 10 minutes old.

        Only from 1 MiB (MIN_SHARED_BYTES is 64 KiB): under it, a copy into the folder against
        an encryption on loopback has not been measured, and a function's frame there would
        keep it from going to the worker by reference (fnref) once per session.

        Returns the frames to send: ``payload``, or the task's new ones."""
        if task.spec.get("kind") != TaskKind.FUNCTION.value \
                or serialize.payload_nbytes(payload) < MOVE_INTO_FOLDER_BYTES:
            return payload  # a script's frames are its own: only a function's runner maps them
        layout = task.spec.get("split")
        counts = layout if isinstance(layout, list) else [1] * len(payload)
        if sum(counts) != len(payload):
            return payload  # checked at SUBMIT; never here
        frames: list[Any] = []
        refs: list[list[Any]] = []
        start = 0
        for index, count in enumerate(counts):
            pieces = payload[start:start + count]
            start += count
            size = serialize.payload_nbytes(pieces)
            name = None
            if size >= MOVE_INTO_FOLDER_BYTES:
                try:
                    name = folder.write(pieces)
                except OSError as exc:  # never the task's fault: its bytes go as they came
                    log.warning("cannot write a task's input into shared memory: %s", exc)
            if name is not None:
                frames.append(b"")
                refs.append([index, name, size])
            elif size >= MOVE_INTO_FOLDER_BYTES:  # the folder is full: the bytes go as they came
                self.drop_files([ref[1] for ref in refs])
                return payload
            else:  # a copy: a view would keep the whole buffer it came in (a blob read) alive
                frames.append(bytes(serialize.join_frames(pieces, [count])[0]))
        if refs:
            spec = {k: v for k, v in task.spec.items() if k != "split"}
            spec["shm"] = refs
            task.spec = spec
            task.payload = frames
            task.input_file = None  # the journal keeps its blob; this run reads the folder
            self.inputs.release(task)
        return task.payload if refs else payload

    @staticmethod
    def _by_reference(header: dict[str, Any], payload: list[Any],
                      worker: WorkerSession) -> list[Any]:
        """A function the worker already keeps is named, not sent: ``fnref`` and the frames
        without it. Sent, it is marked ``fnkeep`` (keep it for this session), after
        ``fnreset`` (forget the others) when the worker holds FUNCTIONS_PER_WORKER already:
        the worker does exactly what it is told, so the two never disagree."""
        digest = header.get("fn")
        if (header.get("kind") != TaskKind.FUNCTION.value or not digest or not payload
                or "split" in header or "shm" in header):
            return payload
        if digest in worker.functions:
            header["fnref"] = True
            return payload[1:]
        if len(worker.functions) >= FUNCTIONS_PER_WORKER:
            worker.functions.clear()
            header["fnreset"] = True
        worker.functions.add(digest)
        header["fnkeep"] = True
        return payload

    def outgoing(self, header: dict[str, Any], payload: list[Any], shares: bool) -> list[Any]:
        """The frames to send a peer: as they are for one that shares this machine's memory
        folder; with the shared frames read back in (and ``shm`` dropped) for one that does not.
        Raises ValueError when a shared frame is gone."""
        refs = refs_of(header.get("shm"))
        if not refs or shares:
            return payload
        if self.too_big_to_send(header, payload):
            shown, most = sizes_over_room(serialize.payload_nbytes(payload) + shared_bytes(refs),
                                          self.limits.message_room[0])
            raise TooBigToSend(f"it is {shown} in this machine's shared memory, and one message "
                               f"to a peer on another machine carries at most {most}")
        frames = serialize.join_frames(payload, header.get("split"))
        try:
            frames = materialize(frames, refs, self.shm)
        except SharedFrameBusy as exc:  # short of descriptors or memory: not lost
            raise ReadLater(str(exc)) from None
        wire, layout = serialize.split_frames(frames, self.limits.chunk_bytes)
        header.pop("shm")
        header.pop("split", None)
        if layout is not None:
            header["split"] = layout
        return wire

    def shared_files(self) -> set[str]:
        """The names of every shared-memory file a task's input or result refers to, and of
        those dropped this turn (the journal names them until its commit): what an orphan
        sweep (sharedmem.SharedFolder.sweep) must leave."""
        named = {name for task in self.tasks.values()
                 for header in (task.spec, task.result_header or {}) if "shm" in header
                 for name in ref_names(refs_of(header["shm"]))}
        named.update(self.unneeded_files)
        return named

    def drop_shared(self, header: dict[str, Any] | None) -> None:
        """Remove the shared-memory files a spec or result refers to once this turn's journal
        writes are committed (``remove_unneeded_files``): nobody needs them after that."""
        if header and "shm" in header:
            self.drop_files(ref_names(refs_of(header["shm"])))

    def drop_files(self, names: list[str]) -> None:
        """``drop_shared`` for names already known."""
        if self.shm is not None:
            self.unneeded_files.extend(names)

    def remove_unneeded_files(self) -> None:
        """After a commit: remove the files dropped before it, off the loop's thread. Never
        before the commit, since a coordinator that crashes in between restarts from a journal
        that may still name them (a task finished but not journaled runs again)."""
        if self.unneeded_files and self.shm is not None:
            self.shm.retire_soon(self.unneeded_files)
        self.unneeded_files = []

    def finish(self, task: Task, state: TaskState, result: dict[str, Any], payload: list[Any],
               now: float, *, keep_journaled_input: bool = False) -> None:
        """``keep_journaled_input``: the task's input stays in the journal though it is not in
        memory (a row that did not parse at a restart, maybe for a passing cause)."""
        task.move(state)
        owner = self.clients.get(task.client_id)
        if owner is not None:
            owner.unqueue(task)
        result = {**result, "finished_at": now}  # journaled: a restart keeps the job's timings
        task.result_header = result
        task.result_payload = payload
        task.finished_at = now
        if task.worker_id:
            worker = self.workers.get(task.worker_id)
            if worker is not None:
                worker.leases.pop(task.lease_id, None)
        self.released += 1
        self.finished_total += 1
        # `gpumesh retry` needs the input again (unless it is gone: drop_input)
        retryable = state is not TaskState.DONE and task.has_input
        client = owner if owner is not None and owner.routing is not None else None
        journaled = None
        # A cancel of it, journaled as cancelled when asked (cancel_task), is overwritten now,
        # not after the hold: a crash in between must not bring back cancelled what finished.
        if retryable or client is None or task.collected or task.cancel_requested:
            journaled = self.store.finish_task(task.task_id, state.value, task.attempts, result,
                                               payload, keep_input=retryable or keep_journaled_input)
        else:  # on its way to a connected client, which will most likely collect it first
            self.held_results[task.task_id] = HeldResult(task, state, result, payload, now, [])
        job = self.jobs.get(task.job_id)
        if job is not None:
            job.summaries[task.task_id] = summarize(task)
        if retryable:
            self.loose_bytes += self.inputs.spill(task)  # on disk until a retry, if ever
        else:
            self.drop_input(task)
            if task.task_id not in self.held_results:
                # A held result's input stays until the result is journaled or collected:
                # until then the journal says the task is to run.
                self.drop_shared(task.spec)
        if job is not None and job.all_finished:  # only its tasks
            job.finished_at = now
        # Latency (submit to finish) and run time let a monitor chart them without a query;
        # a failure says what failed, so a list of recent failures needs no query either.
        extra: dict[str, Any] = {}
        if state is TaskState.FAILED:
            error = result.get("error")
            if isinstance(error, dict):
                extra["error"] = error_line(error)[:EVENT_ERROR_CHARS]
            elif result.get("diagnosis"):
                extra["error"] = str(result["diagnosis"])[:EVENT_ERROR_CHARS]
        self.emit("task_finished", now, task=task.task_id, job=task.job_id, state=state.value,
                  worker=result.get("worker", ""), latency=round(now - task.submitted_at, 6),
                  elapsed=result.get("elapsed", 0.0), **extra)
        self.deliver(task, now)
        if journaled is not None:
            self._result_on_disk(task, journaled)

    def _result_on_disk(self, task: Task, blob: BlobRef) -> None:
        """A result just journaled into ``blob`` (and sent, if its client is here) leaves
        memory: it waits there for a FETCH, maybe hours (a laptop closed), and is read back
        to be sent (``result_frames``)."""
        if task.result_file is None and task.result_payload \
                and len(task.result_payload) == len(blob.lengths):
            task.result_payload = []
            task.result_file = blob
            self.loose_bytes += blob.nbytes

    def drop_input(self, task: Task) -> None:
        """``task``'s input is not needed any more (it succeeded) or is gone (its file was
        removed): it cannot run again, so nothing may offer a retry (``finish`` then journals
        it without an input)."""
        task.payload = []
        task.input_file = None
        self.inputs.release(task)

    def result_frames(self, task: Task, in_pieces: bool = False) -> list[Any]:
        """``task``'s result frames, read back from its blob file if it left memory (a big
        one for a peer that reads pieces: as spans of the file, read as they are sent).
        Raises ValueError (the file is gone: the result is lost) or ReadLater."""
        if task.result_file is None:
            return list(task.result_payload)  # the frames' references, not their bytes
        if in_pieces and _spans_pay(task.result_file):
            return self._file_spans(task.result_file, ValueError)
        return self._read_back(task.result_file, ValueError)

    def acknowledge_result(self, routing: bytes | None, task: Task, header: dict[str, Any]
                           ) -> None:
        """RESULT_ACK to the worker that sent ``task``'s result: now, or once the result is
        journaled or collected if it is held (the ack tells the worker to forget it)."""
        held = self.held_results.get(task.task_id)
        if held is not None and routing is not None:
            held.acks.append((routing, header))
        else:
            self.send(routing, Command.RESULT_ACK, header)

    def journal_held_results(self, now: float, everything: bool = False) -> None:
        """Journal the held results that waited RESULT_JOURNAL_DELAY (all of them with
        ``everything``, as the coordinator stops) and release their workers' RESULT_ACKs,
        which go after the commit that holds them."""
        held = self.held_results
        while held:
            entry = next(iter(held.values()))
            if not everything and now - entry.since < RESULT_JOURNAL_DELAY:
                break  # oldest first: the rest are younger
            self._journal_held(entry)

    def journal_held_result(self, task: Task) -> None:
        """Journal ``task``'s held result now, if it is held: a failure its owner collects is
        journaled as collected, over its finish."""
        entry = self.held_results.get(task.task_id)
        if entry is not None:
            self._journal_held(entry)

    def _journal_held(self, entry: HeldResult) -> None:
        task = entry.task
        del self.held_results[task.task_id]
        journaled = self.store.finish_task(task.task_id, entry.state.value, task.attempts,
                                           entry.result, entry.payload)
        if journaled is not None and task.result_payload is entry.payload:
            self._result_on_disk(task, journaled)
        self.drop_shared(task.spec)
        self._release_acks(entry)

    def result_collected(self, task: Task) -> None:
        """The client acknowledged ``task``'s result: if it was never journaled it never will
        be (the caller journals the task as collected), and its worker may forget it."""
        entry = self.held_results.pop(task.task_id, None)
        if entry is not None:
            self._release_acks(entry)

    def next_held_result_due(self) -> float | None:
        """When the oldest held result is to be journaled; None when none is held."""
        for entry in self.held_results.values():
            return entry.since + RESULT_JOURNAL_DELAY
        return None

    def _release_acks(self, entry: HeldResult) -> None:
        for routing, header in entry.acks:
            self.send(routing, Command.RESULT_ACK, header)

    def fail(self, task: Task, status: ResultStatus, diagnosis: str, now: float,
             worker: str = "", *, keep_journaled_input: bool = False) -> None:
        """Finish ``task`` as failed by the coordinator's own decision, saying why."""
        result: dict[str, Any] = {"status": status.value, "attempts": task.attempts,
                                  "diagnosis": diagnosis}
        if worker:
            result["worker"] = worker
        self.finish(task, TaskState.FAILED, result, [], now,
                    keep_journaled_input=keep_journaled_input)

    def deliver(self, task: Task, now: float) -> None:
        client = self.clients.get(task.client_id)
        if client is None or client.routing is None or task.result_header is None \
                or task.collected:
            return  # kept until the client comes back and FETCHes it
        header = {**task.result_header, "task": task.task_id, "seq": task.seq}
        reading: weakref.ref[Any] | None = None
        # From its file a piece at a time only where the frames go as they are, in pieces:
        # outgoing() joins and reads back shared frames (a header with shm), and a client
        # on this machine gets the result whole, as before (as a worker's input, `lease`).
        in_pieces = client.pieces and not client.maps_shared and "shm" not in header
        whole = task.result_file if task.result_file is not None and not (
            in_pieces and _spans_pay(task.result_file)) else None
        if whole is not None and not self._room_to_read_back(client, task, whole):
            return  # sent as the client acknowledges what went before it (or on its way)
        if client.read_back_waiting:  # (a set's look-up skipped for every other delivery)
            client.read_back_waiting.discard(task.task_id)  # it goes now, however it goes
        try:
            read_back = "shm" in header and not client.maps_shared
            frames = self.result_frames(task, in_pieces)
            payload = self.outgoing(header, frames, client.maps_shared)
            if frames and isinstance(frames[0], FileSpan):
                reading = weakref.ref(frames[0].fd)
            elif read_back:  # mapped (a descriptor) or copied until sent: one at a time
                reading = _buffer_of(payload)
        except ReadLater as exc:
            self.warn_read_later(f"the result of task {task.task_id}", exc, now)
            self.deferred_deliveries[task.task_id] = now + READ_AGAIN_AFTER
            return
        except TooBigToSend as exc:
            if client.shmlock and not client.shm and now - client.hello_at < SHM_PROOF_GRACE:
                # Maybe a client on this machine whose proof is on its way (it just reconnected):
                # sent now, the error would be final (its acknowledgement drops the result).
                self.deferred_deliveries[task.task_id] = client.hello_at + SHM_PROOF_GRACE
                return
            header = {"status": ResultStatus.ERROR.value, "task": task.task_id, "seq": task.seq,
                      "worker": header.get("worker", ""), "attempts": task.attempts,
                      "error": {"type": "gpumesh.ResultTooLarge", "traceback": "",
                                "message": f"the task finished, but its result is dropped: {exc}. "
                                           "Return less, or write it to a file every machine "
                                           "can read and return the path"}}
            payload = []
        except ValueError as exc:
            log.warning("the result of task %s is lost: %s", task.task_id, exc)
            header = {"status": ResultStatus.ERROR.value, "task": task.task_id, "seq": task.seq,
                      "worker": header.get("worker", ""), "attempts": task.attempts,
                      "error": {"type": "gpumesh.ResultLost", "traceback": "",
                                "message": f"the task finished, but its result is lost: {exc}"}}
            payload = []
        task.delivered = (client.routing, now, reading)
        if whole is not None and payload:
            if not client.read_back:
                client.read_back_moved = now  # the wait for an acknowledgement starts now
            client.read_back[task.task_id] = whole.nbytes
            client.read_back_bytes += whole.nbytes
        self.send(client.routing, Command.RESULT, header, payload)

    def _room_to_read_back(self, client: ClientSession, task: Task, blob: BlobRef) -> bool:
        """Whether ``task``'s result, to be read back whole from ``blob``, may go to ``client``
        now: within READ_BACK_WINDOW bytes of such results sent to it and not acknowledged
        (always the first one). Otherwise it waits in line (``deliver_read_backs``). One sent
        in this session and not acknowledged is on its way: asked for again, it is not read
        and sent again (a client asking every second and reading nothing would otherwise
        grow the outbox by the window each time)."""
        if task.task_id in client.read_back:
            return False
        if client.read_back_bytes and client.read_back_bytes + blob.nbytes > READ_BACK_WINDOW:
            if task.task_id not in client.read_back_waiting:
                client.read_back_waiting.add(task.task_id)
                client.read_back_line.append(task.task_id)
                self.read_back_clients.add(client.client_id)
            return False
        return True

    def deliver_read_backs(self, client: ClientSession, now: float) -> None:
        """Send the results that wait for room in ``client``'s read-back window, in order, as
        far as it has room (the first that has none stays first in line)."""
        line, waiting = client.read_back_line, client.read_back_waiting
        while line and client.routing is not None:
            task_id = line[0]
            if task_id not in waiting:
                line.popleft()  # sent or dropped meanwhile
                continue
            task = self.tasks.get(task_id)
            if task is None or task.collected or task.result_file is None \
                    or task.result_header is None or task.client_id != client.client_id:
                waiting.discard(task_id)
                continue
            self.deliver(task, now)
            if task_id in waiting:
                return  # still no room: the rest wait behind it
        if not waiting:
            line.clear()
            self.read_back_clients.discard(client.client_id)

    def expire_read_backs(self, now: float) -> None:
        """A client whose window has had no room made in it for READ_BACK_EXPIRY seconds, and
        that acknowledged some since it was last started afresh (it reads, but left some
        unacknowledged: ones it dropped), gets a fresh window: the results waiting in line go
        on. One that acknowledges nothing reads nothing: it gets no more until it does, or
        until its next session. A slow link keeps acknowledging, so it never gets here while
        results still move."""
        for client_id in list(self.read_back_clients):
            client = self.clients.get(client_id)
            if client is None or not client.read_back_waiting:
                self.read_back_clients.discard(client_id)
                if client is not None:
                    client.read_back_line.clear()
                continue
            if client.routing is not None and client.read_back_taken \
                    and now - client.read_back_moved >= READ_BACK_EXPIRY:
                client.read_back.clear()
                client.read_back_bytes = 0
                client.read_back_moved = now
                client.read_back_taken = False
                self.deliver_read_backs(client, now)

    def deliver_deferred(self, now: float) -> None:
        """Deliver the results ``deliver`` held back for a proof of shared memory, once due."""
        if not self.deferred_deliveries:
            return
        due = [task_id for task_id, when in self.deferred_deliveries.items() if when <= now]
        for task_id in due:
            del self.deferred_deliveries[task_id]
            task = self.tasks.get(task_id)
            if task is not None:
                self.deliver(task, now)

    def redeliver(self, task: Task, now: float) -> None:
        """Send a finished task's result again (FETCH, a re-sent SUBMIT), at most once a second
        to one connection, and not while it still goes there from its file or shared memory (a
        second copy would hold another of the MAX_SPAN_FILES descriptors, another mapping or
        copy): asking again and again must not multiply what we queue for it."""
        client = self.clients.get(task.client_id)
        last = task.delivered
        if client is None or last is None or last[0] != client.routing \
                or now - last[1] >= REDELIVER_AFTER and (last[2] is None or last[2]() is None):
            self.deliver(task, now)

    def requeue(self, task: Task | None, worker: WorkerSession | None, now: float, why: str,
                *, infra: bool) -> None:
        """Take a task back from a worker. Infrastructure failures count against max_attempts."""
        if task is None or task.state.terminal:
            return
        if task.cancel_requested:
            # Cancelled while its worker was unreachable: it must not start again anywhere.
            self.finish(task, TaskState.CANCELLED, _cancelled_result(task), [], now)
            return
        if infra:
            task.failures = (*task.failures, why)[-3:]  # only the last three are ever shown
            if worker is not None:
                task.excluded = task.excluded | {worker.worker_id}
            if task.attempts >= task.max_attempts:
                self.fail(task, ResultStatus.CRASHED,
                          f"gave up after {task.attempts} attempts: {_causes(task.failures)}",
                          now, worker.worker_id if worker else "")
                return
        else:
            task.attempts = max(task.attempts - 1, 0)  # a polite hand-back costs no attempt
        task.move(TaskState.PENDING)
        task.worker_id = ""
        self.store.set_attempts(task.task_id, task.attempts)
        self.enqueue(task)

    def release_leases(self, worker: WorkerSession, now: float, why: str, *, infra: bool) -> None:
        leases, worker.leases = worker.leases, {}
        for lease_id, task_id in leases.items():
            task = self.tasks.get(task_id)
            if task is not None and task.lease_id == lease_id:
                try:
                    self.requeue(task, worker, now, why, infra=infra)
                except Exception:  # a bug of ours stops this task, not the worker's later ones
                    log.exception("could not put task %s back in the queue", task_id)

    def cancel_on_worker(self, task: Task) -> None:
        worker = self.workers.get(task.worker_id)
        if worker is not None and worker.state is WorkerState.ALIVE:
            self.send(worker.routing, Command.CANCEL, {"leases": [task.lease_id]})

    def cancel_task(self, task: Task, now: float) -> bool:
        """Pending tasks never start; a running one is stopped on its worker. False if finished."""
        if task.state.terminal:
            return False
        if task.state is TaskState.LEASED:
            task.cancel_requested = True
            worker = self.workers.get(task.worker_id)
            if worker is not None and worker.state is WorkerState.ALIVE:
                # Journaled as cancelled now, while its worker is told to stop: a restart
                # before the worker answers must not bring it back restored, to be claimed
                # and run on (or queued and run again) as if nobody had cancelled it. The
                # worker's answer finishes it in memory, and journals it again.
                self.store.finish_task(task.task_id, TaskState.CANCELLED.value, task.attempts,
                                       {**_cancelled_result(task), "finished_at": now}, [],
                                       keep_input=task.has_input)
                self.cancel_on_worker(task)
                return True
        self.finish(task, TaskState.CANCELLED, _cancelled_result(task), [], now)
        return True

    def reopen(self, task: Task, now: float) -> bool:
        """``gpumesh retry``: a failed or cancelled task whose input is still here runs again."""
        if task.state not in (TaskState.FAILED, TaskState.CANCELLED) or not task.has_input:
            return False
        task.move(TaskState.PENDING)
        # A fresh start: a new pending clock, and the old attempts' results no longer count.
        task.pending_since = now
        task.lease_floor = self.new_lease_id()
        task.attempts, task.failures, task.excluded = 0, (), frozenset()
        self.drop_shared(task.result_header)
        task.result_header, task.result_payload, task.result_file = None, [], None
        task.cancel_requested = task.collected = False
        task.worker_id = ""
        self.store.reopen_task(task.task_id, task.lease_floor)
        owner = self.clients.get(task.client_id)
        if owner is not None:
            owner.queue(task)
        job = self.jobs.get(task.job_id)
        if job is not None:
            job.summaries.pop(task.task_id, None)
            job.finished_at = None
        self.enqueue(task)
        return True

    def lose(self, worker: WorkerSession, now: float, reason: str, departed: str = "") -> None:
        """Mark a worker gone; ``departed`` ("left", "removed") when it went on purpose."""
        if worker.state is WorkerState.LOST:
            return
        worker.state = WorkerState.LOST
        worker.departed = departed
        worker.lost_reason = reason
        self.peers.pop(worker.routing, None)
        # ``departed``: it went on purpose (drained, left, removed), which a monitor shows as a
        # normal departure, not as a failure.
        self.emit("worker_lost", now, worker=worker.summary(), reason=reason, departed=departed)


def _cancelled_result(task: Task) -> dict[str, Any]:
    return {"status": ResultStatus.CANCELLED.value, "attempts": task.attempts,
            "diagnosis": "cancelled"}


def _spans_pay(blob: BlobRef) -> bool:
    """A file big enough to send a piece at a time from disk, and a descriptor to spare."""
    return blob.nbytes >= STREAM_BYTES and SharedFd.opened < MAX_SPAN_FILES


def _buffer_of(frames: list[Any]) -> weakref.ref[Any] | None:
    """A weak reference to the mapping (or anonymous copy) behind the first frame read back
    from shared memory: it dies once ZeroMQ has sent every frame over it."""
    for frame in frames:
        owner = getattr(frame, "obj", None)
        if isinstance(owner, mmap.mmap):
            return weakref.ref(owner)
    return None


def _causes(failures: Sequence[str]) -> str:
    """The last failures, each said once, how often it came in brackets ("the runner process
    exited with code 3 (3 times)", not the same sentence three times over)."""
    counts: dict[str, int] = {}
    for why in failures:
        counts[why] = counts.get(why, 0) + 1
    return "; ".join(why if n == 1 else f"{why} ({n} times)" for why, n in counts.items())
