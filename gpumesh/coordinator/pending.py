"""The queue of tasks waiting for a worker: one priority heap per placement class.

A dispatch pass walks the classes' best tasks in priority order. When no worker can take a
class's best task now, no worker can take any task of that class in this pass either
(``scheduler.placement_class``), so the whole class is passed over at the cost of one look.
Tasks that can run are never stuck behind thousands that cannot (a batch waiting for a busy
GPU, say), and a pass costs about one heap step per task placed and per class, not per task
skipped. (The dispatcher still stops after passing over so many classes in one pass: tasks
queued behind that many distinct unplaceable requirement sets wait.)

An entry is ``(-priority, order, task_id)``: lower is first. A task may have stale entries
(cancelled, or handed out after a retry queued it again); the dispatcher drops those as it
meets them.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator

Entry = tuple[int, int, str]


class PendingQueue:
    def __init__(self) -> None:
        self.classes: dict[Hashable, list[Entry]] = {}
        self._size = 0

    def push(self, placement: Hashable, entry: Entry) -> None:
        heap = self.classes.get(placement)
        if heap is None:
            heap = self.classes[placement] = []
        heapq.heappush(heap, entry)
        self._size += 1

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Entry]:
        """Every entry, in no particular order."""
        for heap in self.classes.values():
            yield from heap

    def walk(self) -> DispatchPass:
        """One dispatch pass over the queue as it is now."""
        return DispatchPass(self)


class DispatchPass:
    """The best entry of the classes not passed over yet: ``peek`` it, then ``take`` it (it was
    placed, or is stale) or ``pass_over`` its class for the rest of this pass."""

    def __init__(self, queue: PendingQueue) -> None:
        self._queue = queue
        # (best entry, class): entries are unique (by order), so classes are never compared.
        self._heads = [(heap[0], placement) for placement, heap in queue.classes.items()]
        heapq.heapify(self._heads)

    def peek(self) -> Entry | None:
        return self._heads[0][0] if self._heads else None

    def take(self) -> None:
        """Remove the best entry from the queue; its class's next one takes its place."""
        entry, placement = self._heads[0]
        queue = self._queue
        heap = queue.classes[placement]
        if heap[0] is entry:
            heapq.heappop(heap)
        else:  # pushed to during the pass, ahead of it: remove this very entry
            heap.remove(entry)
            heapq.heapify(heap)
        queue._size -= 1
        if heap:
            heapq.heapreplace(self._heads, (heap[0], placement))
        else:
            del queue.classes[placement]
            heapq.heappop(self._heads)

    def pass_over(self) -> None:
        """Leave the best entry's class queued, untouched, for later passes."""
        heapq.heappop(self._heads)
