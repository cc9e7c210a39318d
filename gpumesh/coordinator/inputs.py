"""Which journaled task inputs the coordinator keeps in memory, and which wait on disk.

A function task's input of 64 KiB or more is written to a blob file as it is journaled
(blobs.py). Keeping a second copy in memory makes sending it free; letting go of it makes the
coordinator's size independent of its queue: a client elsewhere may queue gigabytes. So the
inputs stay in memory up to ``budget`` bytes, and those beyond it go back to disk, the newest
first (they are sent last), to be read back when they are sent (``Ledger.input_frames``). An
input that is only kept for ``gpumesh retry`` (its task failed or was cancelled) goes to disk at
once. Owned by the ledger; it reads no clock and no socket.
"""

from __future__ import annotations

from ..blobs import BlobRef
from .state import Task


class JournaledInputs:
    def __init__(self, budget: int) -> None:
        self.budget = budget  # Limits.queue_memory_bytes (GPUMESH_QUEUE_MEMORY_MB)
        self._arrived: list[tuple[Task, BlobRef]] = []  # this turn's, in order of arrival
        self._resident: dict[str, BlobRef] = {}  # task id -> its blob, input still in memory
        self.resident_bytes = 0

    def arrived(self, task: Task, blob: BlobRef) -> None:
        """``task``'s input (after its function, when journaled apart) is also in ``blob``."""
        self._arrived.append((task, blob))

    def end_turn(self) -> int:
        """After the turn's dispatch: this turn's inputs join the resident ones, and the newest
        go to disk until the resident ones fit the budget. Returns the bytes let go of."""
        if not self._arrived:
            return 0  # most turns: tiny tasks' inputs are in their database rows
        arrived, self._arrived = self._arrived, []
        freed = 0
        queued: list[Task] = []
        for task, blob in arrived:
            if not _spillable(task, blob):
                continue  # it succeeded already, or its input moved into shared memory
            self._resident[task.task_id] = blob
            self.resident_bytes += blob.nbytes
            if task.state.terminal:
                freed += self.spill(task)  # failed or cancelled: kept only for a retry
            else:
                queued.append(task)
        while self.resident_bytes > self.budget and queued:
            freed += self.spill(queued.pop())
        return freed

    def spill(self, task: Task) -> int:
        """Let go of ``task``'s input frames: from now on they are read from its blob file.
        Returns the bytes let go of."""
        blob = self._resident.pop(task.task_id, None)
        if blob is None:
            return 0
        self.resident_bytes -= blob.nbytes
        if not _spillable(task, blob):
            return 0
        task.payload = task.payload[:len(task.payload) - len(blob.lengths)]
        task.input_file = blob
        return blob.nbytes

    def release(self, task: Task) -> None:
        """``task``'s input frames left memory another way (it succeeded, or they moved into the
        shared-memory folder, or the task was forgotten): stop counting them."""
        blob = self._resident.pop(task.task_id, None)
        if blob is not None:
            self.resident_bytes -= blob.nbytes

    def compact(self) -> None:
        self._resident = dict(self._resident)  # dicts keep their peak size when emptied


def _spillable(task: Task, blob: BlobRef) -> bool:
    kept = len(task.payload) - len(blob.lengths)  # its function, when journaled apart
    return task.input_file is None and kept in (0, 1) and "shm" not in task.spec
