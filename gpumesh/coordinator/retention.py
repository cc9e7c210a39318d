"""What the coordinator keeps and for how long: finished results, job records, client records.

It acts on the ``Ledger`` (the shared state). The rules are in docs/protocol.md, "Retention";
``sweep`` runs every RETENTION_SWEEP seconds from ``Broker.tick``.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from typing import Any

import msgpack

from .. import scheduler
from .._version import __version__
from ..protocol import ResultEncoding
from .jobs import DETAIL_CHARS, LIST_JOBS, MAX_JOBS, error_line, find_job
from .ledger import Ledger, ReadLater
from .state import Task, TaskState, WorkerState

RETENTION_SWEEP = 10.0  # seconds between sweeps for results nobody will collect
# What finished tasks hold, all together: absent clients' uncollected results, and the inputs
# of those that did not succeed (kept for `gpumesh retry`), whoever owns them. One cap for all:
# one user's failing job can push out another's oldest retry inputs.
MAX_RETAINED_RESULT_BYTES = 2 * 1024**3
# `gpumesh results`: the scripts' results sent back whole, this many bytes a page at most (one
# bigger result goes alone), results over RESULT_READ_MAX named with their size only.
RESULTS_PAGE_BYTES = 32 * 1024**2
RESULTS_PER_PAGE = 2000  # tasks a page lists (about 100 bytes of header each)
RESULTS_PAGE_FRAMES = 1024  # pieces of outputs a page carries (a message holds 4,096 frames)
RESULTS_FILES_READ = 16  # outputs a page reads back from the journal's files, at most
RESULT_READ_MAX = 256 * 1024**2
MIN_JOB_AGE = 60.0  # seconds a finished job is kept even over MAX_JOBS (a .map sends batches)


class Retention:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def forget(self, task: Task, now: float) -> None:
        """Drop a finished task and its result: only its summary stays, in memory and in the
        journal, until its job is forgotten."""
        del self.ledger.tasks[task.task_id]
        self.ledger.inputs.release(task)
        self.ledger.result_collected(task)
        self.ledger.released += 1
        self.ledger.drop_shared(task.spec)
        self.ledger.drop_shared(task.result_header)
        self.ledger.by_seq.pop((task.client_id, task.seq), None)
        job = self.ledger.jobs.get(task.job_id)
        summary = job.collect(task.task_id) if job is not None else None
        if job is not None:
            job.last_activity = max(job.last_activity, now)
        if summary is None:
            self.ledger.store.delete_task(task.task_id)
        else:
            self.ledger.store.collect_task(task.task_id, summary)

    def sweep(self, now: float) -> None:
        """Bound memory: results of clients gone for ``result_ttl`` are dropped, and the oldest
        of those and of the failures kept for a retry (a connected owner's too) go first when
        they exceed MAX_RETAINED_RESULT_BYTES; finished jobs beyond MAX_JOBS are forgotten,
        oldest first."""
        ttl = self.ledger.timing.result_ttl
        # After a restart no owner of a restored result is known until it reconnects (its
        # back-off reaches backoff_max, and a try takes a while): until then such results are
        # neither expired nor evicted for the cap, and an owner not seen in this run counts
        # as seen when the run began.
        started = self.ledger.started_at
        settling = now - started < 1.5 * self.ledger.timing.backoff_max + 10.0
        absent: list[Task] = []
        for task in list(self.ledger.tasks.values()):
            if not task.state.terminal:
                continue
            owner = self.ledger.clients.get(task.client_id)
            if owner is not None and owner.routing is not None:
                if task.collected:
                    # A failure its connected owner has: kept only for `gpumesh retry`, for
                    # result_ttl after it finished (a long-lived client's failures were kept
                    # for good, and their jobs' records), and counted in the cap meanwhile
                    # (a session of failing tasks kept every input).
                    if now - task.finished_at > ttl:
                        self.forget(task, now)
                    else:
                        absent.append(task)
                continue
            if owner is None and settling:
                continue
            last_seen = owner.last_seen if owner is not None else started
            if now - max(last_seen, task.finished_at) > ttl:
                self.forget(task, now)
            else:
                absent.append(task)
        retained = sum(t.kept_bytes for t in absent)
        if retained > MAX_RETAINED_RESULT_BYTES:  # sorted only then
            for task in sorted(absent, key=lambda t: t.finished_at):  # never expire by age
                if retained <= MAX_RETAINED_RESULT_BYTES:
                    break
                retained -= task.kept_bytes
                self.forget(task, now)
        finished = sorted((j for j in self.ledger.jobs.values() if j.finished_at is not None),
                          key=lambda j: max(j.finished_at or 0.0, j.last_activity))
        excess = len(self.ledger.jobs) - MAX_JOBS
        for job in finished:
            idle = now - max(job.finished_at or now, job.last_activity)
            if idle <= MIN_JOB_AGE or (excess <= 0 and idle <= ttl):
                break  # the rest are newer; a job that just finished may get more batches yet
            if not any(t in self.ledger.tasks for t in job.task_ids):
                del self.ledger.jobs[job.job_id]
                self.ledger.store.delete_job(job.job_id)  # with its tasks' summaries
                excess -= 1
        for client_id, client in list(self.ledger.clients.items()):
            if client.routing is None and now - client.last_seen > ttl and not client.unfinished:
                del self.ledger.clients[client_id]

    # ----------------------------------------------------------------- views

    def status(self, job_id: str | None, now: float, *, tasks: bool = True) -> dict[str, Any]:
        """One job (``job_id``: id, unique prefix or name; its tasks listed unless ``tasks`` is
        false), or the queue and the recent jobs. Costs O(jobs), plus O(tasks) when listed."""
        alive = sum(1 for w in self.ledger.workers.values() if w.state is WorkerState.ALIVE)
        paused = sum(1 for w in self.ledger.workers.values() if w.state is WorkerState.ALIVE and w.draining)
        if job_id:
            job = find_job(self.ledger.jobs, job_id)
            if isinstance(job, str):
                return {"error": job, "workers": alive}
            journal = functools.partial(self.ledger.store.job_tasks, job.job_id)
            view = {**job.describe(self.ledger.tasks, now, tasks=tasks, journal=journal),
                    "workers": alive,
                    "workers_paused": paused}
            waiting = self._why_waiting(job.job_id, now)
            if waiting is not None:
                view["waiting"], view["fails_in"] = waiting
            if job_id == job.name != job.job_id:  # found by name: was it the only one?
                same_name = sum(1 for j in self.ledger.jobs.values() if j.name == job.name)
                if same_name > 1:
                    view["same_name"] = same_name  # the newest was picked
            return view
        counts = {state: sum(j.tally[state] for j in self.ledger.jobs.values())
                  for state in ("pending", "running")}
        counts = {state: n for state, n in counts.items() if n}
        recent = sorted(self.ledger.jobs.values(), key=lambda j: j.created, reverse=True)[:LIST_JOBS]
        return {"job": None, "counts": counts, "workers": alive, "workers_paused": paused,
                "jobs_known": len(self.ledger.jobs),
                "jobs": [j.describe(self.ledger.tasks, now, tasks=False) for j in recent]}

    def _why_waiting(self, job_id: str, now: float) -> tuple[str, float] | None:
        """Why the job's first pending task that no alive worker could run waits, and in how
        many seconds it fails: the status said only "pending" until the timeout's error. Read
        from the broker's once-a-second check, not found here: `status` is polled, and a
        walk of a 200,000-task job took 130 ms of the loop each time."""
        ledger = self.ledger
        task = ledger.tasks.get(ledger.waiting_for.get(job_id, ""))
        if task is None or task.state is not TaskState.PENDING:
            return None
        since = ledger.unrunnable.get((task.requirements, task.portable, task.local_only))
        if since is None:
            return None
        views = [w.view() for w in ledger.workers.values() if w.state is WorkerState.ALIVE]
        why = scheduler.explain_unschedulable(task.requirements, views, portable=task.portable,
                                              local_only=task.local_only)
        # ``since`` is no earlier than the last time no worker was alive (_note_unrunnable).
        due = max(since, task.pending_since) + ledger.timing.pending_timeout - now
        return why, round(max(due, 0.0), 1)

    def results(self, job_id: str, page: int, header_room: int
                ) -> tuple[dict[str, Any], list[Any], int | None]:
        """A page of a job's script results, whole (``status`` shows only what fits
        PREVIEW_BYTES): ``(data, frames, next page or None)``. Each of the job's tasks still
        held here is listed from position ``page`` on, with ``frame`` (the index in ``frames``
        of its output's first piece) and ``pieces`` where its output is here to read: a
        detached ``submit``'s, kept for GPUMESH_RESULT_TTL, which nothing else could read back.
        Tasks whose results their submitter collected are counted (``collected``), not listed:
        they are gone from here. A page stays within ``header_room`` bytes of header,
        RESULTS_PAGE_BYTES of outputs (one bigger output alone), RESULTS_PAGE_FRAMES pieces
        and RESULTS_FILES_READ outputs read back from disk: the loop's time and memory."""
        job = find_job(self.ledger.jobs, job_id)
        if isinstance(job, str):
            return {"error": job}, [], None
        entries: list[dict[str, Any]] = []
        frames: list[Any] = []
        used = files = 0
        header_used = len(_packed({"job": job.job_id, "name": job.name,
                                   "collected": job.collected}))
        position = page
        ids = itertools.islice(job.task_ids, page, None)
        for task_id in ids:
            task = self.ledger.tasks.get(task_id)
            if task is None:
                position += 1
                continue
            entry = _result_entry(task)
            pieces = _output_pieces(task)
            size = task.result_bytes if pieces else 0
            readable = pieces > 0 and size <= RESULT_READ_MAX
            if pieces:
                entry["bytes"] = size
            if pieces and not readable:
                entry["note"] = (f"its output is {size:,} bytes, more than `gpumesh results` "
                                 f"reads back ({RESULT_READ_MAX:,}): write big outputs to a "
                                 "file every machine can read, and print its path")
            entry_bytes = len(_packed(entry)) + 32  # and its frame, pieces and encoding
            on_disk = readable and task.result_file is not None
            if entries and (header_used + entry_bytes > header_room
                            or len(entries) >= RESULTS_PER_PAGE
                            or (readable and (used + size > RESULTS_PAGE_BYTES
                                              or len(frames) + pieces > RESULTS_PAGE_FRAMES
                                              or (on_disk and files >= RESULTS_FILES_READ)))):
                break  # the next page starts with it
            if readable:
                try:
                    read = self.ledger.result_frames(task)
                except (ValueError, ReadLater) as exc:
                    entry["note"] = f"its output could not be read back: {exc}"
                else:
                    entry.update(encoding=(task.result_header or {}).get("encoding"),
                                 frame=len(frames), pieces=len(read))
                    frames.extend(read)
                    used += size
                    files += on_disk
            header_used += entry_bytes
            entries.append(entry)
            position += 1
        data = {"job": job.job_id, "name": job.name, "collected": job.collected,
                "tasks": entries}
        return data, frames, (position if position < len(job.task_ids) else None)

    def task_detail(self, task_id: str) -> dict[str, Any]:
        """One task as the coordinator holds it, its whole error and traceback included (a
        job's status keeps the last DETAIL_CHARS of it); an ``error`` once it is forgotten."""
        task = self.ledger.tasks.get(task_id)
        if task is None:
            return {"error": f"the coordinator no longer holds task {task_id} (its result was "
                             "collected): its job's status keeps a summary"}
        header = task.result_header or {}
        return {"id": task.task_id, "job": task.job_id, "state": task.state.public,
                # A finished task's is the worker whose result won (an earlier attempt's may
                # win over the one it was running on); a running one's is where it runs.
                "worker": (header.get("worker") or task.worker_id) if task.state.terminal
                else task.worker_id, "attempts": task.attempts,
                "submitted_at": task.submitted_at, "finished_at": task.finished_at or None,
                "elapsed": header.get("elapsed"), "error": header.get("error"),
                "diagnosis": header.get("diagnosis"), "failures": list(task.failures)}

    def health(self, now: float) -> dict[str, Any]:
        """The coordinator's own state, for monitors: O(jobs + workers + clients), no task scan."""
        ledger = self.ledger
        queue: Counter[str] = Counter()
        for job in ledger.jobs.values():
            queue.update(job.tally)
        workers = Counter(w.state.value for w in ledger.workers.values())
        return {
            "version": __version__,
            "uptime": now - ledger.started_at,
            "queue": {state: queue[state] for state in ("pending", "running") if queue[state]},
            "time": now,
            "finished_total": ledger.finished_total,
            "journal_bytes": ledger.store.size_bytes(),
            "clients": sum(1 for c in ledger.clients.values() if c.routing is not None),
            "workers": dict(workers),
            "jobs": len(ledger.jobs),
            "events": ledger.events.last_seq,
            "malformed": sum(ledger.malformed.values()),
        }


def _result_entry(task: Task) -> dict[str, Any]:
    """A task's line in a ``results`` page, before its output: id, state, and why it failed
    (cut as a job's status cuts it: the whole error is the ``task`` query's)."""
    entry: dict[str, Any] = {"id": task.task_id, "state": task.state.public}
    header = task.result_header or {}
    error = header.get("error")
    why = error_line(error) if isinstance(error, dict) else header.get("diagnosis")
    if why:
        entry["error"] = str(why)[:DETAIL_CHARS]
    if task.state.terminal and not task.is_script:
        entry["note"] = "a function's result goes to the process that submitted it"
    return entry


def _output_pieces(task: Task) -> int:
    """How many frames hold a finished script task's output (its JSON or text) here: one, or
    the pieces a big one travelled in (``split``, one frame's worth); 0 when there is none to
    read (a function's, a failure's, one collected or kept in another form)."""
    header = task.result_header
    if not (task.state is TaskState.DONE and task.is_script and header is not None
            and header.get("encoding") in (ResultEncoding.JSON.value, ResultEncoding.TEXT.value)
            and not task.collected):
        return 0
    count = (len(task.result_file.lengths) if task.result_file is not None
             else len(task.result_payload))
    split = header.get("split")
    if split is None:
        return count if count == 1 else 0
    return count if split == [count] else 0


def _packed(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)
