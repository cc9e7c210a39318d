"""The time the coordinator, worker and client loops run on: seconds since the epoch, like
``time.time()``, that never jump.

``time.time()`` steps when the system clock is set: NTP correcting a machine that booted with
the wrong time, a virtual machine restored from a snapshot, someone changing the date. A loop
that measured silences, leases and timers with it took a step forward for minutes of silence
(every worker lost at once, its leases released and charged) and a step back for a stall (no
heartbeats, no timers, until the wall clock caught up). This clock is the wall clock at start
plus ``time.monotonic()`` since, so durations are true and timestamps still read as dates; after
a step it differs from the wall clock by that step until the process restarts. (Like
``time.monotonic()``, it does not count a laptop's suspend: a coordinator that slept does not
wake to find every worker and lease timed out by the sleep.)
"""

from __future__ import annotations

import time

_OFFSET = time.time() - time.monotonic()


def now() -> float:
    """Seconds since the epoch, steady: what ``time.time()`` would say had nobody set it."""
    return _OFFSET + time.monotonic()
