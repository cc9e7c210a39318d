"""Writing many buffers to a file descriptor at once: the journal's blob files, the runner
pipe's memfd and the shared-memory folder all write frames straight from their buffers."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence

try:
    IOV_MAX = min(int(os.sysconf("SC_IOV_MAX")), 1024)
except (AttributeError, ValueError, OSError):
    IOV_MAX = 16


def write_all(fd: int, views: Sequence[memoryview]) -> None:
    """Write every byte of ``views``, in order, with as few system calls as writev allows
    (a short write goes on from where it stopped; no buffer is copied or joined)."""
    pending = deque(v for v in views if v.nbytes)
    while pending:
        written = os.writev(fd, [pending[i] for i in range(min(len(pending), IOV_MAX))])
        while written:
            head = pending[0]
            if written >= head.nbytes:
                written -= head.nbytes
                pending.popleft()
            else:
                pending[0] = head[written:]
                written = 0
