"""The words of the protocol that are not commands: task kinds, result outcomes, worker modes,
departure reasons. One enum each, so no handler compares against a string literal of its own.

Every value here travels on the wire or sits in the journal as its string; the enums are
``str`` subclasses so they pack with msgpack and compare equal to what a peer sent.
"""

from __future__ import annotations

import enum

# Functions a worker keeps per session (TASK ``fnkeep``): the coordinator says ``fnreset`` before
# it would tell the worker to keep one more, and a worker that is told to anyway starts afresh.
KEPT_FUNCTIONS = 64


class TaskKind(str, enum.Enum):
    FUNCTION = "fn"  # a pickled (or source-form) Python function with its arguments
    SCRIPT = "script"  # a Python script run with a JSON payload


class ResultStatus(str, enum.Enum):
    """What a worker (or the coordinator, for the last two) says a task came to."""

    OK = "ok"
    ERROR = "error"  # the user's code raised, or a script exited non-zero
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    CRASHED = "crashed"  # the runner died: an infrastructure failure, retried
    UNSCHEDULABLE = "unschedulable"  # coordinator only: no connected worker could ever run it

    @property
    def from_worker(self) -> bool:
        return self is not ResultStatus.UNSCHEDULABLE


class ResultEncoding(str, enum.Enum):
    """How a result's frames are to be read. Script results are never pickles."""

    PICKLE = "pickle"  # function results: only the submitter, who sent the function, unpickles
    JSON = "json"
    TEXT = "text"


class WorkerMode(str, enum.Enum):
    """What the machine's owner chose (``gpumesh pause/resume/drain``)."""

    ACTIVE = "active"
    PAUSED = "paused"
    DRAINING = "draining"


class Departure(str, enum.Enum):
    """Why a peer's session ended, as DISCONNECT ``reason`` says or the coordinator decided."""

    LEFT = "left"  # a worker or client stopped cleanly
    DRAINED = "drained"  # a worker left after ``gpumesh drain``
    CLOSED = "closed"  # a client closed its session
    KILL = "kill"  # coordinator -> worker: ``gpumesh kill`` removed it
    VERSION = "version"  # coordinator -> peer: protocol versions do not overlap
    OTHER = "other"  # anything else a peer said: kept only as a word in the log

    @classmethod
    def parse(cls, value: object) -> Departure:
        try:
            return cls(value)
        except ValueError:
            return cls.OTHER

