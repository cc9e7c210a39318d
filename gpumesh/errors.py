"""The exception tree every gpumesh failure is raised as.

    MeshError
    ├── ConfigError            bad settings, URL or token; nothing was started
    ├── ConnectionFailed       the coordinator could not be reached in time
    ├── AuthenticationError    the token does not match this coordinator
    ├── ProtocolMismatch       the peer speaks another major version of the wire protocol
    ├── SubmitRejected         the coordinator refused a submission (safe mode, too large, busy)
    ├── TaskError              a task ended without a value
    │   ├── RemoteError        user code raised; carries the remote traceback
    │   ├── RunnerCrashed      the process running the task died (signal, exit code, stderr tail)
    │   ├── TaskTimeout        the task ran past its timeout and was stopped
    │   └── Unschedulable      no connected worker can satisfy the task's requirements
    └── MeshTimeout            a call's own deadline passed before every result arrived

Messages say what happened and what to do next. None of them ever contains the token.
"""

from __future__ import annotations

import concurrent.futures


class MeshError(Exception):
    """Root of every error gpumesh raises."""


class ConfigError(MeshError):
    """A setting, URL or token is unusable; the message names it and the fix."""


class ConnectionFailed(MeshError):
    """The coordinator could not be reached within the connect timeout."""


class AuthenticationError(MeshError):
    """The CURVE handshake failed: the token differs from the coordinator's."""


class ProtocolMismatch(MeshError):
    """The peer speaks an incompatible major version of the gpumesh wire protocol."""


class SubmitRejected(MeshError):
    """The coordinator refused a submission; the message says why."""


class MeshTimeout(MeshError, TimeoutError):
    """A call's deadline passed before all of its results arrived."""


class TaskError(MeshError):
    """A task ended without a value. ``task_id`` and ``worker`` say which and where."""

    def __init__(self, message: str, *, task_id: str = "", worker: str = "") -> None:
        super().__init__(message)
        self.task_id = task_id
        self.worker = worker


class RemoteError(TaskError):
    """User code raised on a worker and the exception could not be rebuilt locally.

    When the original exception type unpickles on the caller, that type is raised instead,
    with this text attached as a note (``__notes__``) and as ``remote_traceback``.
    """

    def __init__(
        self, message: str, *, remote_type: str, remote_traceback: str, task_id: str = "",
        worker: str = "",
    ) -> None:
        super().__init__(message, task_id=task_id, worker=worker)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        if not self.remote_traceback:  # an error the worker itself reported: no user code ran
            return f"{self.remote_type}: {self.args[0]}"
        return f"{self.remote_type}: {self.args[0]}\n\nRemote traceback:\n{self.remote_traceback}"


class RunnerCrashed(TaskError):
    """The runner process died while running the task, on every attempt allowed."""


class TaskTimeout(TaskError, TimeoutError):
    """The task ran past its ``timeout`` and its runner was stopped."""


class Unschedulable(TaskError):
    """No connected worker satisfied the task's requirements before the pending timeout."""


class TaskCancelled(TaskError, concurrent.futures.CancelledError):
    """The task was cancelled on the mesh (``gpumesh cancel``, the dashboard, another client's
    ``cancel_job``), not by this future's own ``cancel()``. A ``concurrent.futures.
    CancelledError`` still, for ``except`` clauses; but a subclass, so ``await`` raises it as
    an error of the task, not as a cancellation of the awaiting coroutine (which asyncio, and a
    TaskGroup, would take for its own and swallow)."""


__all__ = [
    "AuthenticationError",
    "ConfigError",
    "ConnectionFailed",
    "MeshError",
    "MeshTimeout",
    "ProtocolMismatch",
    "RemoteError",
    "RunnerCrashed",
    "SubmitRejected",
    "TaskCancelled",
    "TaskError",
    "TaskTimeout",
    "Unschedulable",
]
