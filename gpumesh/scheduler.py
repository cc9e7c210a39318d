"""Placement: which worker runs which task. Pure: values in, choices out; no sockets, no clock.

Rules, in order:
1. Requirements are filters, never preferences: ``gpu`` (model substring, or True for any GPU),
   ``cores``, ``memory`` (RAM bytes), ``vram`` (bytes, on one GPU) and, for pickled functions,
   the submitter's Python major.minor. A function that also travels as source (``portable``)
   may run on another Python, but a worker on the submitter's Python is preferred.
2. A worker that already failed the task is avoided while another eligible worker exists.
3. Heavy tasks (``cost`` above the default 1.0) go to the strongest eligible worker by score;
   other tasks go to the least-loaded worker, the least recently used one on a tie.
4. Stragglers (flagged by the caller) only get tasks of default cost or less.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .protocol.requirements import Gpu, Requirements, gpu_satisfies, parse_size

DEFAULT_COST = 1.0

__all__ = [  # Requirements, Gpu and sizes live in the protocol; they are used here by name
    "DEFAULT_COST", "Gpu", "Placer", "Requirements", "TaskView", "WorkerView", "choose",
    "could_ever_run",
    "eligible", "explain_unschedulable", "parse_size", "placement_class", "stragglers", "unmet",
]


@dataclass(slots=True)
class WorkerView:
    """What the scheduler may know of a worker."""

    worker_id: str
    free: int
    load: int = 0
    capacity: int = 1
    score: float = 0.0
    cores: int = 1
    memory: int = 0
    gpus: tuple[Gpu, ...] = ()
    python: str = ""
    last_assigned: int = 0
    straggler: bool = False
    label: str = field(default="", compare=False)
    shares_memory: bool = False  # it maps the coordinator's shared-memory folder (same machine)


@dataclass
class TaskView:
    task_id: str
    requirements: Requirements = Requirements()
    cost: float = DEFAULT_COST
    excluded: frozenset[str] = frozenset()
    portable: bool = False  # a source form rides along: the Python version is a preference
    # Its input sits in the coordinator's shared memory and is too big for one message: only a
    # worker that maps that memory (on the coordinator's machine) can be handed it.
    local_only: bool = False


def unmet(worker: WorkerView, req: Requirements, *, portable: bool = False,
          local_only: bool = False) -> list[str]:
    """The requirements ``worker`` misses, in words; empty when it qualifies."""
    missing = []
    if local_only and not worker.shares_memory:
        missing.append("is not on the coordinator's machine, and the task's input is too big "
                       "for one message")
    model = req.gpu if isinstance(req.gpu, str) else None
    no_gpu_said = False  # "has no GPU" once, whether gpu= or vram= (or both) asked for one
    if req.gpu is True and not worker.gpus:
        missing.append("has no GPU")
        no_gpu_said = True
    elif model and not any(gpu_satisfies(g, model, None) for g in worker.gpus):
        missing.append(f"has no {model} GPU")
        no_gpu_said = not worker.gpus
    if req.vram and not worker.gpus:
        if not no_gpu_said:
            missing.append("has no GPU")
    elif req.vram and not any(gpu_satisfies(g, None, req.vram) for g in worker.gpus):
        missing.append("has too little VRAM")
    elif model and req.vram and not missing \
            and not any(gpu_satisfies(g, model, req.vram) for g in worker.gpus):
        # One GPU must have both: a task runs on one (its slot's), not on a model and the
        # VRAM of another.
        missing.append(f"has no {model} GPU with that much VRAM")
    if req.cores and worker.cores < req.cores:
        missing.append(f"has {worker.cores} cores")
    if req.memory and worker.memory < req.memory:
        missing.append(f"has {worker.memory / 1e9:.1f}GB RAM")
    if req.python and worker.python != req.python and not portable:
        missing.append(f"runs Python {worker.python or '?'}")
    return missing


def eligible(worker: WorkerView, task: TaskView, *, stragglers_too: bool = False) -> bool:
    if task.cost > DEFAULT_COST and worker.straggler and not stragglers_too:
        return False
    return not unmet(worker, task.requirements, portable=task.portable,
                     local_only=task.local_only)


def placement_class(requirements: Requirements, portable: bool, cost: float,
                    local_only: bool = False) -> Hashable:
    """What decides whether ``choose`` finds a worker for a task at all: given the same workers,
    it finds one for every task of a class or for none (the rest of a task, its priority, exact
    cost and excluded workers, only ranks the candidates). The dispatcher relies on it to pass
    over a whole class at once."""
    return (requirements, portable, cost > DEFAULT_COST, local_only)


def choose(task: TaskView, workers: Iterable[WorkerView], *, stragglers_too: bool = False
           ) -> WorkerView | None:
    """The worker to run ``task`` now, among those with a free slot; None if none fits.
    ``stragglers_too``: a heavy task may go to a straggler (no other worker could ever run
    it: lighter work for the slow is a preference, never a reason to wait forever)."""
    best: WorkerView | None = None
    best_key: tuple[Any, ...] = ()
    for worker in workers:
        if worker.free <= 0 or not eligible(worker, task, stragglers_too=stragglers_too):
            continue
        key = (worker.worker_id in task.excluded, *_rank(task, worker))  # failed it: last
        if best is None or key < best_key:
            best, best_key = worker, key
    return best


def _rank(task: TaskView, worker: WorkerView) -> tuple[Any, ...]:
    """The order among eligible workers, the one that failed the task aside: on the
    submitter's Python first, then the strongest (heavy tasks), the least loaded, the least
    recently used."""
    foreign = bool(task.requirements.python) and worker.python != task.requirements.python
    ratio = worker.load / max(worker.capacity, 1)
    if task.cost > DEFAULT_COST:
        return (foreign, -worker.score, ratio, worker.last_assigned)
    return (foreign, ratio, worker.last_assigned)


class Placer:
    """``choose`` for the many tasks of one dispatch pass, without a scan of every worker per
    task (1,000 workers and 4,000 free slots took 2.4 s in choose alone: one blocking turn).

    Per placement class, a heap of the eligible workers that had room when the class was first
    asked for, ranked as ``choose`` ranks them. The caller records each placement in the
    chosen ``WorkerView`` (``free``, ``load``, ``last_assigned``), which only ever raises a
    worker's rank: an entry whose rank went up is pushed back with its rank of now when it
    surfaces, one with no room left is dropped. A task some worker failed before ranks that
    worker last: it is placed by ``choose`` itself, as are those few."""

    def __init__(self, workers: Iterable[WorkerView]) -> None:
        self.workers = list(workers)
        self._heaps: dict[Hashable, list[tuple[tuple[Any, ...], int, WorkerView]]] = {}
        self._order = itertools.count()

    def choose(self, task: TaskView, *, stragglers_too: bool = False) -> WorkerView | None:
        if task.excluded:
            return choose(task, self.workers, stragglers_too=stragglers_too)
        key = (placement_class(task.requirements, task.portable, task.cost, task.local_only),
               stragglers_too)
        heap = self._heaps.get(key)
        if heap is None:
            heap = [(_rank(task, w), next(self._order), w) for w in self.workers
                    if w.free > 0 and eligible(w, task, stragglers_too=stragglers_too)]
            heapq.heapify(heap)
            self._heaps[key] = heap
        while heap:
            rank, _, worker = heap[0]
            if worker.free <= 0:
                heapq.heappop(heap)
                continue
            now = _rank(task, worker)
            if now != rank:
                heapq.heapreplace(heap, (now, next(self._order), worker))
                continue
            return worker
        return None


def could_ever_run(task: TaskView, workers: Sequence[WorkerView]) -> bool:
    """Whether any connected worker qualifies, busy or not (else the task waits to time out)."""
    return any(not unmet(w, task.requirements, portable=task.portable,
                         local_only=task.local_only) for w in workers)


def explain_unschedulable(req: Requirements, workers: Sequence[WorkerView], *,
                          portable: bool = False, local_only: bool = False) -> str:
    """A message naming the requirement and the closest connected workers."""
    needs = req.describe()
    if local_only:  # what it needs before anything else: a worker on this machine
        needs = "a worker on the coordinator's machine (its input is too big for one " \
                "message)" + ("" if needs == "nothing" else f", {needs}")
    if not workers:
        return f"no worker is connected to run a task that needs {needs}"

    def misses(w: WorkerView) -> list[str]:
        return unmet(w, req, portable=portable, local_only=local_only)

    ranked = sorted(workers, key=lambda w: (len(misses(w)), -w.score))[:3]
    closest = "; ".join(f"{_name(w)} {', '.join(misses(w))}" for w in ranked)
    return f"no connected worker satisfies {needs} (closest: {closest})"


def _name(worker: WorkerView) -> str:
    """Hostname and short id: several workers often share one machine's name."""
    return f"{worker.label} [{worker.worker_id[:8]}]" if worker.label else worker.worker_id


def stragglers(speeds: Mapping[str, float]) -> set[str]:
    """Workers whose mean task time is over twice the median of their peers'."""
    if len(speeds) < 3:
        return set()
    ordered = sorted(speeds.values())
    median = ordered[len(ordered) // 2]
    return {wid for wid, seconds in speeds.items() if median > 0 and seconds > 2 * median}
