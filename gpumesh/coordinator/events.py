"""The coordinator's recent state changes, kept for monitors that ask for them (QUERY events).

They are kept packed (msgpack), a thousand to a buffer, rather than as objects: ten thousand
small objects made one by one during a burst of tasks end up spread over as many pymalloc arenas
as the burst used, and CPython returns an arena only once every object in it is gone. After
100,000 tasks drained, the last 10,000 task_finished events kept about 100 MiB of arenas that
way (RSS after the drain 193 -> 82-92 MiB once packed); packed, they are about 2 MiB in a dozen
buffers that glibc can give back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack

EVENT_HISTORY = 10_000  # events kept, at least (up to a segment more)
SEGMENT = 1_000  # events per buffer; the oldest buffer is dropped whole


@dataclass(frozen=True)
class Event:
    """One state change, for monitors (``gpumesh serve`` output, QUERY events, dashboards)."""

    seq: int
    time: float
    kind: str
    data: dict[str, Any]


@dataclass
class _Segment:
    last: int  # seq of its last event
    count: int
    packed: bytearray


class EventLog:
    """The last EVENT_HISTORY events or a little more, oldest first."""

    def __init__(self, history: int = EVENT_HISTORY, segment: int = SEGMENT) -> None:
        self._segment = segment
        self._segments: deque[_Segment] = deque(maxlen=max(history // segment, 1) + 1)
        self._last: Event | None = None

    def append(self, event: Event) -> None:
        packed = msgpack.packb([event.seq, event.time, event.kind, event.data],
                               use_bin_type=True)
        current = self._segments[-1] if self._segments else None
        if current is None or current.count >= self._segment:
            current = _Segment(event.seq, 0, bytearray())
            self._segments.append(current)  # the deque drops the oldest segment
        current.packed += packed
        current.last = event.seq
        current.count += 1
        self._last = event

    def since(self, seq: int) -> Iterator[Event]:
        """The events after ``seq``, oldest first."""
        for segment in list(self._segments):
            if segment.last <= seq:
                continue
            unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
            unpacker.feed(segment.packed)
            for item in unpacker:
                if item[0] > seq:
                    yield Event(*item)

    @property
    def last_seq(self) -> int:
        return self._last.seq if self._last is not None else 0

    def __iter__(self) -> Iterator[Event]:
        return self.since(0)

    def __len__(self) -> int:
        return sum(segment.count for segment in self._segments)

    def __getitem__(self, index: int) -> Event:
        """``log[-1]`` is the newest event as it was emitted; other indexes unpack the log."""
        if index == -1 and self._last is not None:
            return self._last
        return list(self)[index]
