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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..scheduler import DEFAULT_COST, Gpu, Requirements, TaskView, WorkerView


class TaskState(str, enum.Enum):
    PENDING = "pending"
    LEASED = "running"
    RESTORED = "restored"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def public(self) -> str:
        """The state users see: a task restored after a restart is simply pending."""
        return "pending" if self is TaskState.RESTORED else self.value


_TERMINAL = {TaskState.DONE, TaskState.FAILED, TaskState.CANCELLED}

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


@dataclass
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
    excluded: set[str] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)
    result_header: dict[str, Any] | None = None
    result_payload: list[Any] = field(default_factory=list)
    finished_at: float = 0.0
    pending_since: float = 0.0  # when the pending timeout's clock started: submit, or retry
    lease_floor: int = 0  # results of leases below this belong to attempts before a retry
    cancel_requested: bool = False  # a cancel reached it while it ran on a worker
    collected: bool = False  # the owner has its (failed) result; kept only so it can be retried
    # Told of every state change: its job keeps its counts without scanning its tasks.
    observer: Callable[[TaskState, TaskState], None] | None = field(
        default=None, repr=False, compare=False)

    def move(self, new: TaskState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise RuntimeError(f"task {self.task_id}: {self.state.value} -> {new.value} is not allowed")
        old, self.state = self.state, new
        if self.observer is not None:
            self.observer(old, new)

    @property
    def kind(self) -> str:
        return str(self.spec.get("kind", "fn"))

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
        return sum(len(f) if isinstance(f, (bytes, bytearray)) else memoryview(f).nbytes
                   for f in self.result_payload)

    def view(self) -> TaskView:
        return TaskView(self.task_id, self.requirements, self.cost, frozenset(self.excluded),
                        portable="src" in self.spec)


@dataclass
class WorkerSession:
    worker_id: str
    routing: bytes
    incarnation: str
    info: dict[str, Any]
    slots: int
    joined_at: float
    last_seen: float
    granted: int = 0
    sent: int = 0
    leases: dict[int, str] = field(default_factory=dict)  # lease id -> task id
    state: WorkerState = WorkerState.ALIVE
    last_assigned: int = 0
    completed: int = 0
    busy_seconds: float = 0.0
    draining: bool = False  # takes no new tasks: its owner paused or drains it
    departed: str = ""  # "left" or "removed" when it went on purpose (shown instead of "lost")
    mode: str = "active"  # active | paused | draining, as the worker's owner set it
    seconds_per_cost: float = 0.0  # moving average of task time per unit of cost (stragglers)

    @property
    def credit(self) -> int:
        return 0 if self.draining else self.granted - self.sent

    @property
    def short_id(self) -> str:
        return self.worker_id[:8]

    @property
    def label(self) -> str:
        return str(self.info.get("hostname") or self.short_id)

    def view(self) -> WorkerView:
        info = self.info
        gpus = tuple(
            Gpu(str(g.get("name", "")), int(g.get("vram", 0)))
            for g in info.get("gpus", ()) if isinstance(g, dict)
        )
        return WorkerView(
            worker_id=self.worker_id,
            free=self.credit,
            load=len(self.leases),
            capacity=max(self.slots, 1),
            score=float(info.get("score", 0.0) or 0.0),
            cores=int(info.get("cores", 1) or 1),
            memory=int(info.get("memory", 0) or 0),
            gpus=gpus,
            python=str(info.get("python", "")),
            last_assigned=self.last_assigned,
            label=self.label,
        )

    def describe(self) -> dict[str, Any]:
        info = self.info
        return {
            "id": self.worker_id,
            "device": info.get("device", "CPU"),
            "device_name": info.get("device_name", ""),
            "hostname": info.get("hostname", ""),
            "score": info.get("score", 0.0),
            "alive": self.state is WorkerState.ALIVE,
            "state": (self.mode if self.mode != "active" else "alive")
            if self.state is WorkerState.ALIVE else (self.departed or self.state.value),
            "slots": self.slots,
            "running": len(self.leases),
            "completed": self.completed,
            "python": info.get("python", ""),
            "gpumesh": info.get("gpumesh", ""),
            "cloudpickle": info.get("cloudpickle", ""),
            "cores": info.get("cores", 0),
            "memory": info.get("memory", 0),
            "gpus": info.get("gpus", []),
        }


@dataclass
class ClientSession:
    client_id: str
    routing: bytes | None
    last_seen: float
    info: dict[str, Any] = field(default_factory=dict)
    unfinished: int = 0  # tasks submitted and not yet terminal: the per-client queue budget
