"""The machine owner's controls on a worker agent: pause, resume, drain (``gpumesh pause|...``).

A mixin of ``WorkerAgent`` (see agent.py for the shared state). Requests arrive through the local
control channel (control.py). Nothing is lost: queued tasks are handed back unstarted (no
attempt is charged), running ones finish, or with ``drain-now`` are handed back too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..protocol import Command, encode

if TYPE_CHECKING:
    from .agent import WorkerAgent

ACK_WAIT_ON_DRAIN = 10.0  # seconds a draining worker waits for its last results to be acknowledged


class OwnerControls:
    def _on_control(self: WorkerAgent, action: str, now: float) -> dict[str, Any]:
        released: list[int] = []
        if action == "pause" and self.mode == "active":
            self.mode = "paused"
            released = self._hand_back_queued()
            self.say("[worker] paused: running tasks finish, nothing new starts "
                     "('gpumesh resume' to continue)")
        elif action == "resume" and self.mode != "active":
            self.mode = "active"
            self._drain_idle_since = None
            # Credit is cumulative per session: grant what is free now on top of what was used.
            self.granted = max(self.granted, self.received + self._free_slots())
            self.say("[worker] resumed: taking tasks again")
        elif action in ("drain", "drain-now"):
            self.mode = "draining"
            released = self._hand_back_queued()
            if action == "drain-now":
                released += self._hand_back_running(now)
            self.say("[worker] draining: " + ("handed back its tasks, leaving" if action == "drain-now"
                     else "running tasks finish, then this worker leaves the mesh"))
        if action != "status":
            self._send_credit(release=released)
        return self._control_status(released)

    def _control_status(self: WorkerAgent, released: list[int]) -> dict[str, Any]:
        return {"worker": self.worker_id, "mode": self.mode, "url": self.endpoint.zmq,
                "connected": self.welcomed, "handed_back": len(released),
                "running": sum(1 for r in self.runners if r.task is not None),
                "queued": len(self.queue)}

    def _hand_back_queued(self) -> list[int]:
        released = [queued.task.lease_id for queued in self.queue]
        self.queue.clear()
        return released

    def _hand_back_running(self: WorkerAgent, now: float) -> list[int]:
        released = []
        for runner in self.runners:
            if runner.task is not None:
                released.append(runner.task.lease_id)
                runner.task = None
                runner.kill()
                runner.start()
        return released

    def _send_credit(self: WorkerAgent, release: Sequence[int] = ()) -> None:
        if not self.welcomed:
            # The next HELLO carries the mode and these leases: nothing is charged for them.
            self._pending_release.extend(release)
            return
        header: dict[str, Any] = {"granted": self.granted, "draining": self.draining,
                                  "mode": self.mode}
        if release:
            header["release"] = list(release)
        self.link.send(encode(Command.CREDIT, header))

    def _finish_drain(self: WorkerAgent, now: float) -> None:
        """Leave once nothing runs and the last results are safe (or waited for long enough)."""
        if any(r.task is not None for r in self.runners) or self.queue:
            self._drain_idle_since = None
            return
        if self._drain_idle_since is None:
            self._drain_idle_since = now
        if not self.unacked or now - self._drain_idle_since > ACK_WAIT_ON_DRAIN:
            self.say("[worker] drained: leaving the mesh")
            self.stop()
