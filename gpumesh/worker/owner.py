"""The machine owner's controls on a worker agent: pause, resume, drain (``gpumesh pause|...``).

Requests arrive through the local control channel (control.py). Nothing is lost: queued tasks
are handed back unstarted (no attempt is charged), running ones finish, or with ``drain-now``
are handed back too. A client of the mesh may ask the same (CONTROL ``drain``/``pause``/``resume``
through the coordinator, ``by`` naming who): it acts alike, but never undoes what the machine's
owner chose here. ``OwnerControls`` acts on the agent through the few things ``AgentState``
names, so it needs nothing else of the agent and the agent imports it, never the reverse.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..protocol import WorkerMode
from .runners import Runner, RunningTask

ACK_WAIT_ON_DRAIN = 10.0  # seconds a draining worker waits for its last results to be acknowledged
DRAIN_OFFLINE_WAIT = 120.0  # seconds a drained worker waits for an unreachable coordinator


class AgentState(Protocol):
    """What the owner's controls read and change of a worker agent."""

    worker_id: str
    mode: WorkerMode
    granted: int
    received: int
    runners: list[Runner]
    queue: deque[Any]
    unacked: dict[int, Any]
    say: Callable[[str], None]

    @property
    def url(self) -> str: ...

    @property
    def welcomed(self) -> bool: ...

    def free_slots(self) -> int: ...

    def send_credit(self, release: Sequence[int] = ()) -> None: ...

    def stop(self) -> None: ...

    def drop_unsent(self, task: RunningTask) -> None: ...

    def read_finished(self, now: float) -> None: ...


class OwnerControls:
    def __init__(self, agent: AgentState) -> None:
        self.agent = agent
        self._drain_idle_since: float | None = None
        self._drain_offline_since: float | None = None  # since when draining waited offline
        self._owner_chose = False  # the mode was set here by the owner, not through the mesh

    def on_control(self, action: str, now: float, by: str | None = None) -> dict[str, Any]:
        """``by``: the ``user@host`` of a mesh client that asked; None for the owner."""
        agent = self.agent
        released: list[int] = []
        if by is not None:
            if self._owner_chose and agent.mode is not WorkerMode.ACTIVE:
                agent.say(f"[worker] {by} asked to {action} through the mesh; ignored: this "
                          f"machine's owner {agent.mode.value} it")
                return self.status()
            if action != "status" and (action != "resume" or agent.mode is not WorkerMode.ACTIVE):
                agent.say(f"[worker] {action} asked by {by} through the mesh")
        elif action != "status":
            self._owner_chose = action != "resume"
        if action == "pause" and agent.mode is WorkerMode.ACTIVE:
            agent.mode = WorkerMode.PAUSED
            released = self._hand_back_queued(now)
            agent.say("[worker] paused: running tasks finish, nothing new starts "
                      "('gpumesh resume' to continue)")
        elif action == "resume" and agent.mode is not WorkerMode.ACTIVE:
            agent.mode = WorkerMode.ACTIVE
            self._drain_idle_since = None
            # Credit is cumulative per session: grant what is free now on top of what was used.
            agent.granted = max(agent.granted, agent.received + agent.free_slots())
            agent.say("[worker] resumed: taking tasks again")
        elif action in ("drain", "drain-now"):
            agent.mode = WorkerMode.DRAINING
            released = self._hand_back_queued(now)
            if action == "drain-now":
                released += self._hand_back_running()
            agent.say("[worker] draining: " + (
                "handed back its tasks, leaving" if action == "drain-now"
                else "running tasks finish, then this worker leaves the mesh"))
        if action != "status":
            agent.send_credit(release=released)
        return self.status(released)

    def status(self, released: Sequence[int] = ()) -> dict[str, Any]:
        agent = self.agent
        return {"worker": agent.worker_id, "mode": agent.mode.value, "url": agent.url,
                "connected": agent.welcomed, "handed_back": len(released),
                "running": sum(1 for r in agent.runners if r.task is not None),
                "queued": len(agent.queue)}

    def _hand_back_queued(self, now: float) -> list[int]:
        """Every task not started: queued, or handed ahead to a busy runner (which then
        restarts once its current task ends, so the handed one never runs). Results the
        runners wrote are read first: a tiny task handed ahead may have run already, and
        handing it back would run it twice (its result thrown away here)."""
        self.agent.read_finished(now)
        released = [queued.task.lease_id for queued in self.agent.queue]
        self.agent.queue.clear()
        for runner in self.agent.runners:
            released += [queued.task.lease_id for queued in runner.drop_ahead()]
        return released

    def _hand_back_running(self) -> list[int]:
        released = []
        for runner in self.agent.runners:
            released += [queued.task.lease_id for queued in runner.take_back()]
            if runner.task is not None:
                task, runner.task = runner.task, None
                released.append(task.lease_id)
                runner.kill()
                self.agent.drop_unsent(task)  # what it wrote before the kill goes too
                runner.start()
        return released

    def finish_drain(self, now: float) -> None:
        """Leave once nothing runs and the last results are safe (or waited for long enough)."""
        agent = self.agent
        if any(r.task is not None for r in agent.runners) or agent.queue:
            self._drain_idle_since = None
            return
        if not agent.welcomed:
            # Its hand-backs go with the next HELLO and its results are re-sent after it:
            # leaving now lost both (every task run again, charged). The wait for
            # acknowledgements counts while connected; offline, it waits this long at most.
            self._drain_idle_since = None
            if self._drain_offline_since is None:
                self._drain_offline_since = now
            if now - self._drain_offline_since < DRAIN_OFFLINE_WAIT:
                return
            agent.say(f"[worker] drained, but the coordinator has not answered for "
                      f"{DRAIN_OFFLINE_WAIT:.0f}s: leaving; it runs again elsewhere what this "
                      f"worker had not handed over ({len(agent.unacked)} result(s))")
            agent.stop()
            return
        self._drain_offline_since = None
        if self._drain_idle_since is None:
            self._drain_idle_since = now
        if not agent.unacked or now - self._drain_idle_since > ACK_WAIT_ON_DRAIN:
            agent.say("[worker] drained: leaving the mesh")
            agent.stop()
