"""References to payload frames kept in a shared-memory folder (gpumesh.sharedmem) instead of
on the wire: the ``shm`` field of a task spec, a TASK and a RESULT. Parsing only; no files."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

# [frame index, file name, size]: the frame at that index is an empty placeholder on the wire.
Ref = tuple[int, str, int]
NAME_PATTERN = re.compile(r"[0-9a-f]{32}")
MAX_SHARED_BYTES = 2**40


def parse_refs(value: Any, frame_count: int) -> tuple[Ref, ...]:
    """A peer's ``shm`` field: [[index, name, size], ...], each index a distinct frame of the
    message's ``frame_count``. Raises ValueError otherwise. The frame at an index is a
    placeholder (empty, from gpumesh): it is replaced by the file, whatever it holds."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > frame_count:
        raise ValueError("shm must be a list of [index, name, size], one per shared frame")
    refs: list[Ref] = []
    seen: set[int] = set()
    for item in value:
        if not (isinstance(item, list) and len(item) == 3):
            raise ValueError("shm entries are [index, name, size]")
        index, name, size = item
        if not (_plain_int(index) and 0 <= index < frame_count and index not in seen):
            raise ValueError("an shm index names no frame, or one twice")
        if not (isinstance(name, str) and NAME_PATTERN.fullmatch(name)):
            raise ValueError("an shm name is not 32 hex characters")
        if not (_plain_int(size) and 0 <= size <= MAX_SHARED_BYTES):
            raise ValueError("an shm size is not a byte count")
        seen.add(index)
        refs.append((index, name, size))
    return tuple(refs)


def ref_names(refs: Iterable[Ref]) -> list[str]:
    return [name for _, name, _ in refs]


def _plain_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def shared_bytes(refs: Iterable[Ref]) -> int:
    return sum(size for _, _, size in refs)


def refs_of(value: Any) -> tuple[Ref, ...]:
    """The references a journaled spec or result header holds (already checked when they
    arrived); nothing for anything else."""
    try:
        return parse_refs(value, 4096)
    except ValueError:
        return ()
