"""The coordinator's records: tasks, workers and clients, and the lifecycles they move through.

Task:   PENDING -> LEASED -> DONE | FAILED | CANCELLED
        LEASED -> PENDING            (infrastructure failure, attempts left)
        PENDING -> DONE | FAILED     (a late result of an earlier attempt arrives first)
        RESTORED -> LEASED | PENDING (after a restart: re-claimed by its worker, or re-queued)
        FAILED | CANCELLED -> PENDING (`gpumesh retry`)
Worker: ALIVE -> LOST (silent past the liveness limit, or left) -> ALIVE (HELLO again)
"""

from __future__ import annotations

import enum
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from ..blobs import BlobRef
from ..fileio import SharedFd
from ..protocol import ClientInfo, ErrorCode, ProtocolError, Requirements, WorkerInfo, WorkerMode
from ..protocol.refs import refs_of, shared_bytes
from ..protocol.serialize import function_digest, payload_nbytes
from ..scheduler import DEFAULT_COST, TaskView, WorkerView, placement_class

MAX_GRANTS = 16  # leases remembered per task: late results of that many attempts still count
# What a task counts against its owner's byte quota at least: its record costs memory even
# without input, so a million empty tasks are not free.
MIN_TASK_BYTES = 1024
FUNCTION_CACHE_SIZE = 1024  # distinct pickled functions kept once for the queue
# And their bytes together: 1,024 functions of 1 MiB each held 1 GiB after their tasks were
# gone, outside any client's quota.
FUNCTION_CACHE_BYTES = 64 * 1024 * 1024
MAX_SHARED_FUNCTION = 1024 * 1024  # bigger ones are rare, and copied per task anyway
REDELIVER_AFTER = 1.0  # seconds before a result is sent again to the same connection


class TaskState(str, enum.Enum):
    PENDING = "pending"
    LEASED = "running"
    RESTORED = "restored"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    # Set on each member below: plain attributes, read several times per task (a property of
    # an enum member costs a descriptor call and the enum's own ``value`` lookup each time).
    terminal: bool
    public: str  # the state users see: a task restored after a restart is simply pending


_TERMINAL = {TaskState.DONE, TaskState.FAILED, TaskState.CANCELLED}
for _state in TaskState:
    _state.terminal = _state in _TERMINAL
    _state.public = "pending" if _state is TaskState.RESTORED else _state.value
del _state

# Allowed transitions; anything else is a bug and is refused loudly in Task.move.
TRANSITIONS: dict[TaskState, set[TaskState]] = {
    # An earlier attempt's result may arrive after its task was re-queued: it still wins.
    TaskState.PENDING: {TaskState.LEASED, TaskState.DONE, TaskState.FAILED, TaskState.CANCELLED},
    TaskState.LEASED: {TaskState.PENDING, TaskState.DONE, TaskState.FAILED, TaskState.CANCELLED},
    TaskState.RESTORED: {TaskState.LEASED, TaskState.PENDING, TaskState.DONE, TaskState.FAILED,
                         TaskState.CANCELLED},
    TaskState.DONE: set(),
    # Only `gpumesh retry` reopens a task, and only one that did not succeed.
    TaskState.FAILED: {TaskState.PENDING},
    TaskState.CANCELLED: {TaskState.PENDING},
}


class WorkerState(str, enum.Enum):
    ALIVE = "alive"
    LOST = "lost"


@dataclass(slots=True)
class Task:
    task_id: str
    client_id: str
    seq: int
    job_id: str
    spec: dict[str, Any]
    payload: list[Any]
    submitted_at: float
    requirements: Requirements = Requirements()
    state: TaskState = TaskState.PENDING
    attempts: int = 0
    lease_id: int = 0
    worker_id: str = ""
    lease_expires: float = 0.0
    # Workers that failed it, why it failed, its result, the leases it was granted: immutable
    # or absent until needed, so a queued task (100,000 may wait) costs no empty containers.
    excluded: frozenset[str] = frozenset()
    failures: tuple[str, ...] = ()  # the last three reasons, shown when it gives up
    failed_at: float = 0.0  # when a runner last crashed under it (or its lease expired there)
    result_header: dict[str, Any] | None = None
    result_payload: Sequence[Any] = ()
    finished_at: float = 0.0
    pending_since: float = 0.0  # when the pending timeout's clock started: submit, or retry
    lease_floor: int = 0  # results of leases below this belong to attempts before a retry
    cancel_requested: bool = False  # a cancel reached it while it ran on a worker
    collected: bool = False  # the owner has its (failed) result; kept only so it can be retried
    # Leases this coordinator run granted for the task, and to which worker: a RESULT counts
    # only under one of them, from that worker (an earlier attempt's late result still wins).
    granted: dict[int, str] | None = None
    charged: int = 0  # bytes counted against its owner's quota (0: not counted, e.g. restored)
    # Its input is in this machine's shared memory and too big for one message: only a worker
    # that maps that memory may take it (set when it is queued: Ledger.enqueue).
    local_only: bool = False
    # Its input frames (after its function) are in the journal's blob file and not in memory:
    # the coordinator reads them back only to send them (Ledger.input_frames).
    input_file: BlobRef | None = None
    result_file: BlobRef | None = None  # the same for its result, once journaled there
    # (routing, when) of the last RESULT sent, and its file while that RESULT still reads it a
    # piece at a time (a weak reference: dead once the message has gone or was dropped).
    delivered: tuple[bytes, float, weakref.ref[SharedFd] | None] | None = None
    # Told of every state change: its job keeps its counts without scanning its tasks.
    observer: Callable[[TaskState, TaskState], None] | None = field(
        default=None, repr=False, compare=False)

    def move(self, new: TaskState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise RuntimeError(f"task {self.task_id}: {self.state.value} -> {new.value} is not allowed")
        old, self.state = self.state, new
        if self.observer is not None:
            self.observer(old, new)

    def grant(self, lease_id: int, worker_id: str) -> None:
        if self.granted is None:
            self.granted = {}
        self.granted[lease_id] = worker_id
        if len(self.granted) > MAX_GRANTS:
            del self.granted[next(iter(self.granted))]  # the oldest attempt's

    def granted_to(self, lease_id: int, worker_id: str) -> bool:
        return self.granted is not None and self.granted.get(lease_id) == worker_id

    @property
    def kind(self) -> str:
        return str(self.spec.get("kind", "fn"))

    @property
    def is_script(self) -> bool:
        return self.spec.get("kind") == "script"

    @property
    def portable(self) -> bool:
        """A source form rides along: the function may run on another Python."""
        return "src" in self.spec

    @property
    def input_bytes(self) -> int:
        on_disk = 0 if self.input_file is None else self.input_file.nbytes
        return (payload_nbytes(self.payload) + on_disk
                + shared_bytes(refs_of(self.spec.get("shm"))))

    @property
    def has_input(self) -> bool:
        """Its input is still here (not dropped when it succeeded): it can run again."""
        return bool(self.payload) or self.input_file is not None

    @property
    def max_attempts(self) -> int:
        return int(self.spec.get("max_attempts", 3))

    @property
    def priority(self) -> int:
        return int(self.spec.get("priority", 0))

    @property
    def cost(self) -> float:
        return float(self.spec.get("cost", DEFAULT_COST))

    @property
    def result_bytes(self) -> int:
        elsewhere = shared_bytes(refs_of((self.result_header or {}).get("shm")))
        if self.result_file is not None:
            elsewhere += self.result_file.nbytes
        return elsewhere + payload_nbytes(self.result_payload)

    @property
    def kept_bytes(self) -> int:
        """What a finished task holds: its result, and its input while `gpumesh retry` may
        run it again (one that did not succeed), often in the shared-memory folder: RAM."""
        kept = self.result_bytes
        if self.state is not TaskState.DONE:
            kept += self.input_bytes
        return kept

    @property
    def placement(self) -> Any:
        """Its placement class (scheduler.placement_class)."""
        return placement_class(self.requirements, self.portable, self.cost, self.local_only)

    def view(self) -> TaskView:
        return TaskView(self.task_id, self.requirements, self.cost, self.excluded,
                        portable=self.portable, local_only=self.local_only)


@dataclass
class WorkerSession:
    worker_id: str
    routing: bytes
    incarnation: str
    info: WorkerInfo
    slots: int
    joined_at: float
    last_seen: float
    granted: int = 0
    sent: int = 0
    prefetch: int = 0  # tasks it may hold queued beyond its slots (now: CREDIT's depth)
    prefetch_max: int = 0  # ... at most (its HELLO's prefetch)
    leases: dict[int, str] = field(default_factory=dict)  # lease id -> task id
    state: WorkerState = WorkerState.ALIVE
    last_assigned: int = 0
    completed: int = 0
    busy_seconds: float = 0.0
    departed: str = ""  # "left" or "removed" when it went on purpose (shown instead of "lost")
    lost_reason: str = ""  # why it went: "drained", "left", "silent" ...
    mode: WorkerMode = WorkerMode.ACTIVE  # as the worker's owner set it
    seconds_per_cost: float = 0.0  # moving average of task time per unit of cost (stragglers)
    batch: bool = False  # it reads BATCH messages (its HELLO said so)
    pieces: bool = False  # it reads a big message in PIECEs (its HELLO said so)
    shm: bool = False  # it proved it shares this machine's memory folder (gpumesh.sharedmem)
    shmlock: bool = False  # it locks the shared files it maps (its HELLO said so)
    # It keeps functions sent with ``fnkeep`` for this session (its HELLO said ``fnref``): the
    # digests it holds, so later TASKs of one function name it instead of carrying it.
    fnref: bool = False
    functions: set[str] = field(default_factory=set)
    control: bool = False  # it takes CONTROL drain/pause/resume from clients (its HELLO said so)
    stats: dict[str, Any] | None = None  # its latest HEARTBEAT ``stats``, checked (telemetry.py)
    stats_at: float = 0.0
    # Bytes and messages between it and the coordinator, counted by the server loop where the
    # frames are handled anyway: up is worker -> coordinator.
    traffic: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # up, down bytes; msgs

    @property
    def maps_shared(self) -> bool:
        """It may be handed frames by name: it reads the folder, and locks what it maps (a
        gpumesh before protocol 1.7 does not, and gets the bytes: gpumesh/shmpool.py)."""
        return self.shm and self.shmlock

    @property
    def draining(self) -> bool:
        """Takes no new tasks: its owner paused or drains it."""
        return self.mode is not WorkerMode.ACTIVE

    @property
    def credit(self) -> int:
        """Tasks it may be sent now: what it granted, never more than its slots can hold."""
        if self.draining:
            return 0
        return max(min(self.granted - self.sent, self.slots + self.prefetch - len(self.leases)), 0)

    @property
    def short_id(self) -> str:
        return self.worker_id[:8]

    @property
    def label(self) -> str:
        return self.info.hostname or self.short_id

    def view(self, credit: int | None = None) -> WorkerView:
        """What the scheduler sees; ``credit`` when the caller has it already. (Made for every
        worker with credit on every dispatch: 1,000 idle workers cost a single call 4 ms.)"""
        info = self.info
        return WorkerView(
            self.worker_id,
            self.credit if credit is None else credit,
            len(self.leases),
            self.slots if self.slots > 1 else 1,
            info.score,
            info.cores,
            info.memory,
            tuple([g.as_gpu() for g in info.gpus]) if info.gpus else (),
            info.python,
            self.last_assigned,
            False,
            self.label,
            self.maps_shared,
        )

    def summary(self) -> dict[str, Any]:
        """The few fields events carry: a worker's full record can be tens of KiB."""
        return {"id": self.worker_id, "hostname": self.info.hostname, "device": self.info.device,
                "device_name": self.info.device_name, "score": self.info.score,
                "slots": self.slots}

    def describe(self) -> dict[str, Any]:
        info = self.info
        return {
            "id": self.worker_id,
            "device": info.device,
            "device_name": info.device_name,
            "hostname": info.hostname,
            "score": info.score,
            "alive": self.state is WorkerState.ALIVE,
            "state": (self.mode.value if self.draining else "alive")
            if self.state is WorkerState.ALIVE else (self.departed or self.state.value),
            "reason": self.lost_reason if self.state is not WorkerState.ALIVE else "",
            "slots": self.slots,
            "running": len(self.leases),
            "completed": self.completed,
            "python": info.python,
            "gpumesh": info.gpumesh,
            "cloudpickle": info.cloudpickle,
            "cores": info.cores,
            "memory": info.memory,
            "gpus": [g.to_dict() for g in info.gpus],
            "stats": self.stats,
            "stats_at": self.stats_at,
            "traffic": {"up_bytes": self.traffic[0], "down_bytes": self.traffic[1],
                        "up_msgs": self.traffic[2], "down_msgs": self.traffic[3]},
        }


@dataclass
class ClientSession:
    client_id: str
    routing: bytes | None
    last_seen: float
    info: ClientInfo = ClientInfo()
    # Tasks submitted and not yet terminal, and the bytes of their input: the per-client quota.
    unfinished: int = 0
    queued_bytes: int = 0
    batch: bool = False  # it reads BATCH messages (its HELLO said so)
    pieces: bool = False  # it reads a big message in PIECEs (its HELLO said so)
    shm: bool = False  # it proved it shares this machine's memory folder (gpumesh.sharedmem)
    shmlock: bool = False  # it locks the shared files it maps (its HELLO said so)
    hello_at: float = 0.0  # its session's HELLO: a client on this machine proves ``shm`` after
    # Results read back whole from their blob files and sent in this session, not acknowledged
    # yet (task id -> bytes), and those that wait for room among them (Ledger.deliver): a
    # FETCH of thousands of results on disk read them all in one turn. The line is a deque
    # (in order) and a set (what is in it); an id taken out of the set is skipped when reached.
    read_back: dict[str, int] = field(default_factory=dict)
    read_back_bytes: int = 0
    read_back_line: deque[str] = field(default_factory=deque)
    read_back_waiting: set[str] = field(default_factory=set)
    read_back_moved: float = 0.0  # when the window last had room made in it (or was opened)
    read_back_taken: bool = False  # it acknowledged one since the window was last started afresh

    def new_session(self, now: float) -> None:
        """What was sent in the last session is the client's to ask for again (FETCH)."""
        self.read_back.clear()
        self.read_back_bytes = 0
        self.read_back_line.clear()
        self.read_back_waiting.clear()
        self.read_back_moved = now
        self.read_back_taken = False

    def read_back_acknowledged(self, task_id: str, now: float) -> None:
        size = self.read_back.pop(task_id, None)
        if size is not None:
            self.read_back_bytes = max(self.read_back_bytes - size, 0)
            self.read_back_moved = now
            self.read_back_taken = True

    @property
    def owner(self) -> str:
        return self.info.owner(self.client_id)

    @property
    def maps_shared(self) -> bool:
        """As WorkerSession.maps_shared."""
        return self.shm and self.shmlock

    # Queries (QUERY, CONTROL) it may still make now: a bucket refilled at QUERY_RATE a second.
    query_allowance: float = 0.0
    query_checked: float = 0.0

    def queue(self, task: Task, charged: int | None = None) -> None:
        """Count ``task`` against the quota: ``charged`` bytes when the caller measured them
        (``max(task.input_bytes, MIN_TASK_BYTES)``, which is measured otherwise)."""
        task.charged = max(task.input_bytes, MIN_TASK_BYTES) if charged is None else charged
        self.unfinished += 1
        self.queued_bytes += task.charged

    def unqueue(self, task: Task) -> None:
        """Give back what ``queue`` counted; a task it never counted (restored after a restart,
        before this session) gives back nothing."""
        if not task.charged:
            return
        self.unfinished = max(self.unfinished - 1, 0)
        self.queued_bytes = max(self.queued_bytes - task.charged, 0)
        task.charged = 0

    def may_query(self, now: float, rate: float) -> bool:
        self.query_allowance = min(self.query_allowance + (now - self.query_checked) * rate, rate)
        self.query_checked = now
        if self.query_allowance < 1.0:
            return False
        self.query_allowance -= 1.0
        return True


class _Record(Protocol):
    last_seen: float


R = TypeVar("R", bound=_Record)


def make_room(records: dict[str, R], limit: int, evictable: Callable[[R], bool],
              refusal: str) -> None:
    """Bound a table of peer records before adding one: the least recently seen records that
    ``evictable`` allows go first; when none may go, the newcomer is refused (BUSY)."""
    if len(records) < limit:
        return
    candidates = sorted((r for r in records.values() if evictable(r)), key=lambda r: r.last_seen)
    doomed = {id(r) for r in candidates[:max(len(records) - limit + 1, 0)]}
    for key in [k for k, r in records.items() if id(r) in doomed]:
        del records[key]
    if len(records) >= limit:
        raise ProtocolError(ErrorCode.BUSY, refusal)


class FunctionCache:
    """The pickled functions of queued tasks, one bytes object per digest: a 100,000-task .map
    holds its function once, not once per task. A frame is shared only when its own digest is
    the one its spec names (a client cannot make another's task run its function), and the
    cache is bounded (an evicted function stays with the tasks that hold it)."""

    def __init__(self, size: int = FUNCTION_CACHE_SIZE,
                 max_bytes: int = FUNCTION_CACHE_BYTES) -> None:
        self._size = size
        self._max_bytes = max_bytes
        self.nbytes = 0
        self._by_digest: OrderedDict[str, bytes] = OrderedDict()

    def intern(self, frame: Any, digest: str) -> Any:
        """The one copy of this function, or ``frame`` itself when it is too big to share;
        None when its bytes do not hash to ``digest`` (a task must not name a function it
        does not carry: the digest is what workers and the journal key it by)."""
        data = frame if isinstance(frame, bytes) else getattr(frame, "bytes", None)
        if data is None:
            data = bytes(frame)  # a memoryview or bytearray
        known = self._by_digest.get(digest)
        if known is not None:
            if known == data:
                self._by_digest.move_to_end(digest)
                return known
            return None  # the same name for other bytes
        if function_digest(data) != digest:
            return None
        if len(data) > MAX_SHARED_FUNCTION:
            return frame
        self._by_digest[digest] = data
        self.nbytes += len(data)
        while len(self._by_digest) > self._size or (self.nbytes > self._max_bytes
                                                    and len(self._by_digest) > 1):
            self.nbytes -= len(self._by_digest.popitem(last=False)[1])
        return data
