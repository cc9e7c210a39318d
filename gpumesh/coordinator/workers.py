"""What the coordinator does with workers: sessions, credit, results, and removing one (``kill``).

Every handler takes a header already parsed into its protocol type (``Hello``, ``Credit``,
``Result``...), so nothing here re-checks a field. What is checked here is the role: a worker
may report only on leases this coordinator granted to it, and hold no more tasks than its
slots (plus prefetch) allow.
"""

from __future__ import annotations

import codecs
import logging
from dataclasses import replace
from typing import Any, cast

from .. import scheduler
from ..protocol import (
    Command,
    Credit,
    Departure,
    ErrorCode,
    Heartbeat,
    Hello,
    Output,
    ProtocolError,
    Result,
    ResultEncoding,
    ResultStatus,
    WorkerInfo,
)
from ..protocol.refs import ref_names, refs_of
from .ledger import Ledger
from .state import Task, TaskState, WorkerSession, WorkerState, make_room

log = logging.getLogger("gpumesh.coordinator")

# What a client may ask of a worker through the mesh (CONTROL, since 1.5): only what gives the
# machine back or takes it less; the worker's owner keeps the last word (worker/owner.py).
REMOTE_ACTIONS = ("drain", "pause", "resume")
SPEED_SMOOTHING = 0.2  # weight of the newest task in a worker's moving average of task time
MIN_RESULTS_FOR_SPEED = 3  # results a worker needs before it can be called a straggler
LOST_WORKER_RETENTION = 600.0  # seconds a lost worker stays listed
MAX_WORKER_RECORDS = 10_000  # alive and lost together; the oldest lost ones make room
# Results that are the task's own outcome: one from before a restart is the claim on its task
# (a timeout only on a task nobody re-claimed: it must not stop an attempt still running).
_OWN_OUTCOMES = (ResultStatus.OK, ResultStatus.ERROR, ResultStatus.TIMEOUT)


class WorkerSide:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.stragglers: set[str] = set()  # worker ids kept from heavy tasks (refresh_stragglers)
        self._assign_counter = 0

    # ----------------------------------------------------------------- sessions

    def hello(self, routing: bytes, hello: Hello, now: float) -> list[int]:
        """Open or resume a worker's session; returns the held leases it must abort."""
        ledger = self.ledger
        info = cast(WorkerInfo, hello.info)  # Hello.from_header pairs the role with it
        worker_id = hello.peer_id
        worker = ledger.workers.get(worker_id)
        rejoined = worker is None or worker.state is WorkerState.LOST
        if worker is None:
            self._make_room()
            worker = WorkerSession(worker_id, routing, hello.incarnation, info, hello.slots, now,
                                   now)
            ledger.workers[worker_id] = worker
        else:
            if worker.state is WorkerState.ALIVE and worker.incarnation != hello.incarnation \
                    and now - worker.last_seen < ledger.timing.heartbeat * 2:
                # An agent keeps its id across restarts (gpumesh.worker.identity), and one that
                # was killed and started again says HELLO before its old session times out:
                # that old session is silent, and the new agent takes over. A second process
                # under an id whose agent is still talking (a copied state folder that escaped
                # the identity check) must not take its leases.
                raise ProtocolError(ErrorCode.UNEXPECTED, (
                    f"worker id {worker_id} is in use by a worker heard from "
                    f"{now - worker.last_seen:.1f}s ago; if that was this machine's previous "
                    "agent, this one takes over by itself once that one has been silent for "
                    f"{ledger.timing.heartbeat * 2:g}s (it retries)"))
            if worker.routing != routing:
                ledger.peers.pop(worker.routing, None)
            if worker.incarnation != hello.incarnation:
                # The agent restarted: whatever it held under the old incarnation is gone.
                ledger.release_leases(worker, now, f"worker {worker.label} restarted", infra=True)
                if not rejoined:
                    # Still alive to us: a monitor sees it go and come back, its tasks requeued
                    # in between, as it would for a lost worker.
                    ledger.emit("worker_lost", now, worker=worker.summary(), reason="restarted",
                                departed="")
                    rejoined = True
            worker.routing, worker.incarnation, worker.info = routing, hello.incarnation, info
            worker.slots, worker.last_seen, worker.state = hello.slots, now, WorkerState.ALIVE
            worker.departed = ""
        worker.granted, worker.sent, worker.prefetch = hello.credit, 0, hello.prefetch
        worker.prefetch_max = hello.prefetch
        worker.fnref, worker.functions = hello.fnref, set()  # a new session keeps none yet
        worker.control = hello.control
        worker.mode = hello.mode
        # Handed back while the link was down (the owner paused it): no attempt is charged.
        self._release(worker, hello.release, now)
        abort: list[int] = []
        claimed: dict[int, str] = {}
        for task_id, lease_id in hello.held:
            task = ledger.tasks.get(task_id)
            # At most what it can run and queue: a held task beyond that is a finished one
            # (its result comes right after WELCOME and is taken then, see `result`) or a
            # claim on work this worker never had.
            # One lease holds one task: a second task named under it would be in no lease
            # table, so it would never expire nor run again.
            if claimed.get(lease_id) == task_id:
                continue  # the same pair named twice: claimed once, and not aborted
            if task is not None and lease_id not in claimed \
                    and self._may_claim(task, lease_id, worker_id) \
                    and len(claimed) < worker.slots + worker.prefetch:
                self._claim(task, lease_id, worker_id, now)
                claimed[lease_id] = task_id
            else:
                abort.append(lease_id)
        # Leases the coordinator thinks this worker holds but it did not claim are lost.
        for lease_id, task_id in list(worker.leases.items()):
            if lease_id not in claimed:
                worker.leases.pop(lease_id)
                ledger.requeue(ledger.tasks.get(task_id), worker, now, "lost across a reconnect",
                               infra=True)
        worker.leases = claimed
        if rejoined:
            ledger.emit("worker_joined", now, worker=worker.summary())
        return abort

    def _make_room(self) -> None:
        """Bound the worker records: a peer that joins under ever new ids makes the oldest lost
        records go, and is refused once every record is a live worker."""
        make_room(self.ledger.workers, MAX_WORKER_RECORDS,
                  lambda w: w.state is WorkerState.LOST,
                  f"this coordinator already has {MAX_WORKER_RECORDS} workers connected")

    def _claim(self, task: Task, lease_id: int, worker_id: str, now: float) -> None:
        """The worker keeps the task under the lease it holds (restored, or queued again
        while it was away: granted it now, and no longer kept from it)."""
        if task.state is TaskState.PENDING:
            task.excluded = task.excluded - {worker_id}
        if task.state in (TaskState.RESTORED, TaskState.PENDING):
            task.move(TaskState.LEASED)
            task.attempts = max(task.attempts, 1)
            task.grant(lease_id, worker_id)
        task.lease_id, task.worker_id = lease_id, worker_id
        task.lease_expires = now + self.ledger.timing.lease_ttl

    def _may_claim(self, task: Task, lease_id: int, worker_id: str) -> bool:
        """A worker keeps a task across a reconnect only under the lease it was granted; after
        a coordinator restart (nothing granted yet) only under a lease of an earlier run."""
        if task.cancel_requested:
            return False
        if task.state is TaskState.LEASED:
            return task.lease_id == lease_id and task.worker_id == worker_id \
                and task.granted_to(lease_id, worker_id)
        if task.state is TaskState.PENDING:
            # Queued again while this worker was away (silent past the limit over a Wi-Fi
            # drop, or back after a restart's grace) and started by nobody since: it still
            # runs there. Aborting it threw away its work and spent an attempt on the rerun.
            # Not under a lease from before a `gpumesh retry` (lease_floor): its result would be
            # stale, dropped as a duplicate, and the task left leased in no worker's table.
            return lease_id >= task.lease_floor and (
                task.granted_to(lease_id, worker_id) or self._of_an_earlier_run(task, lease_id))
        return task.state is TaskState.RESTORED and self._of_an_earlier_run(task, lease_id)

    def _of_an_earlier_run(self, task: Task, lease_id: int) -> bool:
        """A lease a coordinator before this one could have granted (epochs start at 1), for
        an attempt since the task's last retry."""
        return 0 < lease_id >> 40 < self.ledger.epoch and lease_id >= task.lease_floor

    def _result_claims(self, task: Task, lease_id: int, worker_id: str) -> bool:
        """A result under a lease of an earlier run claims a task still restored (its HELLO
        claimed no more than its slots), or one another worker claimed under another attempt
        of an earlier run (two were running at the restart: the first to finish counts)."""
        if task.state is TaskState.RESTORED:
            return self._may_claim(task, lease_id, worker_id)
        return task.state is TaskState.LEASED and task.lease_id >> 40 < self.ledger.epoch \
            and lease_id != task.lease_id and self._of_an_earlier_run(task, lease_id) \
            and not task.cancel_requested

    def _release(self, worker: WorkerSession, leases: tuple[int, ...], now: float) -> None:
        """Tasks the worker hands back unstarted (its owner paused it): no attempt is spent."""
        for lease_id in leases:
            task_id = worker.leases.pop(lease_id, None)
            task = self.ledger.tasks.get(task_id) if task_id else None
            if task is not None and task.lease_id == lease_id:
                self.ledger.requeue(task, worker, now, f"handed back by {worker.label}",
                                    infra=False)

    # ----------------------------------------------------------------- worker messages

    def heartbeat(self, worker: WorkerSession, beat: Heartbeat, now: float) -> None:
        if beat.shm:
            worker.shm = self.ledger.shares_memory(beat.shm)
        if beat.stats is not None:
            worker.stats, worker.stats_at = beat.stats.to_dict(), now
        expires = now + self.ledger.timing.lease_ttl
        tasks = self.ledger.tasks
        for lease_id in beat.leases:
            task_id = worker.leases.get(lease_id)
            task = tasks.get(task_id) if task_id else None
            if task is not None and task.lease_id == lease_id:
                task.lease_expires = expires

    def credit(self, worker: WorkerSession, credit: Credit, now: float) -> None:
        worker.granted = max(worker.granted, credit.granted)
        if credit.depth is not None:
            # Its tasks turned long (or short again): what it may hold queued follows, so a
            # grant made while they were short does not keep sending it work it would queue.
            worker.prefetch = min(credit.depth, worker.prefetch_max)
        before, worker.mode = worker.mode, credit.mode
        self._release(worker, credit.release, now)
        if worker.mode is not before:
            self.ledger.emit("worker_mode", now, worker=worker.worker_id, mode=worker.mode.value)

    def output(self, worker: WorkerSession, out: Output, payload: list[Any], now: float) -> None:
        task = self.ledger.tasks.get(out.task)
        if task is None or task.worker_id != worker.worker_id or len(payload) != 1 \
                or task.state is not TaskState.LEASED:
            return
        client = self.ledger.clients.get(task.client_id)
        if client is not None and client.routing is not None:
            header = {"task": task.task_id, "stream": out.stream, "worker": worker.short_id}
            self.ledger.send(client.routing, Command.OUTPUT, header, payload)

    def result(self, worker: WorkerSession, res: Result, payload: list[Any], now: float) -> None:
        ledger = self.ledger
        if res.shared and not worker.shm:
            raise ProtocolError(ErrorCode.MALFORMED, "result frames in a shared-memory folder "
                                "this worker has not shown it can use: send the bytes instead")
        if res.granted is not None:
            worker.granted = max(worker.granted, res.granted)
        task = ledger.tasks.get(res.task)
        ack = {"task": res.task, "lease": res.lease}
        if task is not None and res.status in _OWN_OUTCOMES \
                and (res.status is not ResultStatus.TIMEOUT or task.state is TaskState.RESTORED) \
                and worker.leases.get(res.lease, task.task_id) == task.task_id \
                and self._result_claims(task, res.lease, worker.worker_id):
            # Finished before the restart and not claimed in the HELLO: its result is the
            # claim, so the work is not done twice. Only a result of the task's own (a value,
            # an error, running past its timeout): a crash or a cancellation decides nothing.
            if task.state is TaskState.RESTORED:
                self._claim(task, res.lease, worker.worker_id, now)
                worker.leases[res.lease] = task.task_id
            else:  # an attempt as good as the one another worker claimed (stopped below)
                task.grant(res.lease, worker.worker_id)
        if task is not None and not task.granted_to(res.lease, worker.worker_id):
            # Not a lease this coordinator run gave this worker: forged, or from before a
            # restart and never re-claimed. Either way it must not decide the task.
            ledger.send(worker.routing, Command.RESULT_ACK, {**ack, "disposition": "rejected"})
            self._drop_untaken(res, task)
            return
        if res.shared and ledger.shm is not None \
                and res.status in (ResultStatus.OK, ResultStatus.ERROR):
            gone = ledger.shm.missing(res.shared)
            if gone:
                # Removed before it came (its worker killed as it sent it again, a cleaned
                # /dev/shm): the task runs again, rather than its caller being told later
                # that its result is lost.
                res = replace(res, status=ResultStatus.CRASHED,
                              diagnosis=f"its result was gone when it arrived: {gone}")
        held = worker.leases.pop(res.lease, None)
        if held is not None:
            worker.completed += 1
            worker.busy_seconds += res.elapsed
            if task is not None and res.status in (ResultStatus.OK, ResultStatus.ERROR):
                self._record_speed(worker, res.elapsed / max(task.cost, 1e-3))
        stale = task is not None and (
            res.lease < task.lease_floor  # from an attempt before `gpumesh retry`
            # A cancellation is about that attempt only; another one may be running now.
            or (res.status is ResultStatus.CANCELLED and res.lease != task.lease_id))
        if task is None or task.state.terminal or stale:
            dup = {**ack, "disposition": "duplicate"}
            if task is not None and task.task_id in ledger.held_results:
                # The first copy is held, not journaled yet: this ack waits as its ack does
                # (a worker told to forget it, then a crash, and the task ran again).
                ledger.acknowledge_result(worker.routing, task, dup)
            else:
                ledger.send(worker.routing, Command.RESULT_ACK, dup)
            self._drop_untaken(res, task)
            return
        if res.status is ResultStatus.CRASHED:
            if held is not None and task.lease_id == res.lease:
                ledger.requeue(task, worker, now, res.diagnosis or "runner crashed", infra=True)
                # The worker is up and its runner died under the task: it waits a while for
                # another worker (Broker.dispatch). A worker lost and back is not held against.
                task.failed_at = now
            ledger.send(worker.routing, Command.RESULT_ACK, {**ack, "disposition": "accepted"})
            self._drop_untaken(res, task)  # files it names are nobody's now (RAM, in /dev/shm)
            return
        if task.lease_id != res.lease and task.state is TaskState.LEASED:
            # An earlier attempt finished first: its result is as good; stop the current one.
            ledger.cancel_on_worker(task)
        problem = _unreadable(task, res, payload)
        if problem:
            self._drop_untaken(res, task)  # its files, if any, are nobody's now
            ledger.fail(task, ResultStatus.ERROR, problem, now, worker.worker_id)
        else:
            self._finish(task, worker, res, payload, now)
        ledger.acknowledge_result(worker.routing, task, {**ack, "disposition": "accepted"})

    def _drop_untaken(self, res: Result, task: Task | None) -> None:
        """The files of a result not taken go, except those the task names: a worker that
        reconnects sends its unacknowledged result again, with the same files as the one
        taken, which its client may not have collected yet."""
        named: set[str] = set()
        if task is not None:
            for header in (task.spec, task.result_header):
                named.update(ref_names(refs_of((header or {}).get("shm"))))
        self.ledger.drop_files([name for name in ref_names(res.shared) if name not in named])

    def _finish(self, task: Task, worker: WorkerSession, res: Result, payload: list[Any],
                now: float) -> None:
        state = {ResultStatus.OK: TaskState.DONE,
                 ResultStatus.CANCELLED: TaskState.CANCELLED}.get(res.status, TaskState.FAILED)
        result: dict[str, Any] = {"status": res.status.value, "worker": worker.worker_id,
                                  "attempts": task.attempts, "elapsed": res.elapsed}
        if res.error is not None:
            result["error"] = res.error
        if res.diagnosis is not None:
            result["diagnosis"] = res.diagnosis
        if res.encoding is not ResultEncoding.PICKLE:
            result["encoding"] = res.encoding.value
        if task.is_script and res.status is not ResultStatus.OK:
            payload = []  # a failed script says it all in its error; no frames go on
        if res.split and payload:
            result["split"] = list(res.split)  # the submitter rebuilds the big frames
        if res.shared and payload:
            result["shm"] = [list(ref) for ref in res.shared]  # left in shared memory
        elif res.shared:
            self.ledger.drop_shared({"shm": [list(r) for r in res.shared]})
        self.ledger.finish(task, state, result, payload, now)

    def disconnect(self, worker: WorkerSession, reason: Departure, now: float) -> None:
        word = reason.value
        self.ledger.release_leases(worker, now, f"worker {worker.label} {word}", infra=False)
        departed = "left" if reason in (Departure.LEFT, Departure.DRAINED) else ""
        self.ledger.lose(worker, now, word, departed)
        # The answer: a worker waits for it before it exits, so whoever waits for that exit
        # (serve for its self-worker) knows the departure was handled, not merely sent.
        answer = reason if departed else Departure.OTHER
        self.ledger.send(worker.routing, Command.DISCONNECT, {"reason": answer.value})

    def expire(self, now: float) -> None:
        """Workers silent past the liveness limit are lost; leases past their time go back."""
        ledger = self.ledger
        silence = ledger.timing.silence_limit
        for worker in list(ledger.workers.values()):
            if worker.state is WorkerState.ALIVE and now - worker.last_seen > silence:
                why = f"silent for {now - worker.last_seen:.0f}s"
                ledger.release_leases(worker, now, f"worker {worker.label} {why}", infra=True)
                ledger.lose(worker, now, why)
            elif worker.state is WorkerState.LOST and now - worker.last_seen > LOST_WORKER_RETENTION:
                del ledger.workers[worker.worker_id]
                continue
            for lease_id, task_id in list(worker.leases.items()):
                task = ledger.tasks.get(task_id)
                if task is None or task.lease_id != lease_id:
                    worker.leases.pop(lease_id)
                elif now > task.lease_expires:
                    worker.leases.pop(lease_id)
                    ledger.requeue(task, worker, now,
                                   f"lease expired on {worker.label} (no heartbeat for "
                                   f"{ledger.timing.lease_ttl:.0f}s)", infra=True)
                    task.failed_at = now  # alive, but its agent stopped renewing the lease

    def assigned(self, worker: WorkerSession) -> None:
        """Remember the order of assignments: the scheduler breaks ties least recently used."""
        self._assign_counter += 1
        worker.last_assigned = self._assign_counter

    # ----------------------------------------------------------------- speed and stragglers

    def _record_speed(self, worker: WorkerSession, seconds_per_cost: float) -> None:
        if worker.completed <= 1 or worker.seconds_per_cost == 0.0:
            worker.seconds_per_cost = seconds_per_cost
        else:
            worker.seconds_per_cost += SPEED_SMOOTHING * (seconds_per_cost - worker.seconds_per_cost)

    def refresh_stragglers(self) -> set[str]:
        """Alive workers over twice the median task time per unit of cost (scheduler rule 4).

        Recomputed once a second by ``tick``, not on every dispatch: speeds move slowly.
        """
        speeds = {w.worker_id: w.seconds_per_cost for w in self.ledger.workers.values()
                  if w.state is WorkerState.ALIVE and w.completed >= MIN_RESULTS_FOR_SPEED}
        self.stragglers = scheduler.stragglers(speeds)
        return self.stragglers

    # ----------------------------------------------------------------- removing a worker

    def find(self, key: str) -> WorkerSession | str:
        """A worker by id, unique id prefix or hostname; an error message when none or many match."""
        workers = self.ledger.workers
        if key in workers:
            return workers[key]
        alive = [w for w in workers.values() if w.state is WorkerState.ALIVE]
        if len(key) < 4 and any(w.worker_id.startswith(key) for w in alive):
            return f"{key!r} is too short: give at least 4 characters of the worker id"
        matches = [w for w in alive if w.worker_id.startswith(key)] if len(key) >= 4 else []
        matches = matches or [w for w in alive if w.info.hostname == key]
        if len(matches) == 1:
            return matches[0]
        if matches:
            return f"{key!r} matches {len(matches)} workers: use the worker id ('gpumesh workers')"
        return f"no worker {key!r} is connected: 'gpumesh workers' lists them"

    def steer(self, worker: WorkerSession, action: str, now: float, by: str) -> dict[str, Any]:
        """Forward ``drain``/``pause``/``resume`` to the worker, which acts as if its owner had
        run ``gpumesh ACTION`` there; the new mode comes back in its CREDIT (``worker_mode``)."""
        if worker.state is not WorkerState.ALIVE:
            return {"error": f"worker {worker.label} is not connected"}
        if not worker.control:
            return {"error": f"worker {worker.label} runs a gpumesh that takes no {action} from "
                             f"the mesh: run 'gpumesh {action}' on its machine"}
        self.ledger.send(worker.routing, Command.CONTROL, {"action": action, "by": by})
        log.info("%s asked worker %s to %s", by, worker.label, action)
        self.ledger.emit("worker_control", now, worker=worker.worker_id, action=action, by=by)
        return {"worker": worker.worker_id, "hostname": worker.info.hostname, "action": action,
                "mode": worker.mode.value}

    def kill(self, worker: WorkerSession, now: float, by: str) -> dict[str, Any]:
        """Take a worker out of the pool: its tasks go back to the queue, and it is told to leave."""
        handed_back = len(worker.leases)
        self.ledger.release_leases(worker, now, f"worker {worker.label} was removed", infra=False)
        if worker.state is WorkerState.ALIVE:
            self.ledger.send(worker.routing, Command.DISCONNECT,
                             {"reason": Departure.KILL.value, "by": by})
        self.ledger.lose(worker, now, f"removed by 'gpumesh kill' from {by}", "removed")
        return {"worker": worker.worker_id, "hostname": worker.info.hostname,
                "handed_back": handed_back}


def _unreadable(task: Task, res: Result, payload: list[Any]) -> str:
    """Why a result's frames cannot be what its task produces; empty when they can.

    A script's result is JSON or text in one UTF-8 frame, and nobody ever unpickles it; a
    function's result is a pickle for its submitter alone."""
    if res.status is not ResultStatus.OK:
        return ""
    if task.is_script:
        # One frame of output, which may travel as several pieces (split) when it is big.
        if res.encoding is ResultEncoding.PICKLE or len(res.split or payload) != 1:
            return "the worker sent a script result that is not JSON or text; it was refused"
        decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            for frame in payload:
                decoder.decode(frame.buffer if hasattr(frame, "buffer") else frame)
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return "the worker sent a script result that is not UTF-8 text; it was refused"
    elif res.encoding is not ResultEncoding.PICKLE:
        return "the worker sent a function result as JSON or text; it was refused"
    return ""
