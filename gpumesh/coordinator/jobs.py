"""Jobs: the tasks of one submission, seen together by any client (``gpumesh status JOB``).

A job outlives its tasks' results: once the submitter has collected a result the task leaves
the queue, but the journal keeps a one-line summary of it (state, worker, cost, a preview of a
small JSON or text result) so that another terminal can still show what happened. In memory the
job keeps only counts of its collected tasks: a drained 100,000-task job holds no per-task
record, and ``status JOB`` with its task list reads the summaries back from the journal.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ..protocol import ResultEncoding
from .state import Task, TaskState

MAX_JOBS = 1000  # finished jobs beyond this are forgotten, oldest first
PREVIEW_BYTES = 4096  # a script result up to this size is shown by `status`; larger ones are not
DETAIL_CHARS = 1000  # the end of a failed task's traceback or stderr, kept in its summary
LIST_JOBS = 20  # jobs listed by a status query without a job id
MAX_TASKS_SHOWN = 10_000  # tasks listed one by one in a job's status; the counts cover them all


@dataclass
class Job:
    job_id: str
    name: str
    owner: str  # ``user@host`` of the client that submitted it (clients.py: who may control it)
    created: float
    # Its tasks still in the coordinator's table, in submission order (a dict: O(1) removal).
    task_ids: dict[str, None] = field(default_factory=dict)
    # Summaries of those of them that finished; a collected task's is in the journal only.
    summaries: dict[str, dict[str, Any]] = field(default_factory=dict)
    collected: int = 0  # tasks collected and forgotten: counted in ``tally``, listed from the journal
    collected_finished_at: float = 0.0  # the latest finish among them
    finished_at: float | None = None
    # Last time one of its results was delivered for good or dropped: the record is kept for
    # the result TTL after that, so `status` still answers after the results are gone.
    last_activity: float = 0.0
    # Tasks per state users see, kept up to date by each task's observer: O(1) per change,
    # so status queries cost nothing per task.
    tally: Counter[str] = field(default_factory=Counter)

    @property
    def owned(self) -> bool:
        """Whether the owner is known: journals from before owners filed jobs under a client
        id, which no client can prove to be; such jobs are anybody's to control."""
        return "@" in self.owner

    def add(self, task: Task) -> None:
        """Count a task in (new, or restored from the journal) and follow its state changes."""
        self.task_ids[task.task_id] = None
        self.tally[task.state.public] += 1
        task.observer = self._moved

    def add_collected(self, summary: dict[str, Any]) -> None:
        """Count in a task restored as collected (only its journaled summary is left)."""
        self.collected += 1
        self.tally[str(summary.get("state", "unknown"))] += 1
        self._note_finish(summary)

    def collect(self, task_id: str) -> dict[str, Any] | None:
        """The task leaves memory (its result was collected): returns its summary, for the
        journal, which from now on is the only place that keeps it."""
        self.task_ids.pop(task_id, None)
        summary = self.summaries.pop(task_id, None)
        if summary is not None:
            self.collected += 1
            self._note_finish(summary)
        if not self.task_ids:  # dicts keep their size when emptied: give it back
            self.task_ids, self.summaries = {}, {}
        return summary

    def _note_finish(self, summary: dict[str, Any]) -> None:
        finished = summary.get("finished_at", 0.0)
        if isinstance(finished, (int, float)):
            self.collected_finished_at = max(self.collected_finished_at, float(finished))

    @property
    def total(self) -> int:
        return len(self.task_ids) + self.collected

    @property
    def all_finished(self) -> bool:
        return len(self.summaries) >= len(self.task_ids)

    def last_finish(self) -> float:
        """When its last task finished, as journaled (a restart keeps the job's timings)."""
        return max([self.collected_finished_at, *(float(s.get("finished_at", 0.0) or 0.0)
                                                   for s in self.summaries.values())],
                   default=0.0) or self.created

    def compact(self) -> None:
        """Copy its tables into right-sized ones (Python dicts never shrink by themselves)."""
        self.task_ids, self.summaries = dict(self.task_ids), dict(self.summaries)

    def _moved(self, old: TaskState, new: TaskState) -> None:
        self.tally[old.public] -= 1
        self.tally[new.public] += 1

    def counts(self) -> dict[str, int]:
        return {state: n for state, n in sorted(self.tally.items()) if n > 0}

    def status_word(self) -> str:
        counts = self.counts()
        if not counts.keys() & {"pending", "running"}:
            return "finished"
        return "queued" if counts.keys() == {"pending"} else "running"

    def outcome(self) -> str | None:
        """Once finished: ``succeeded`` (all done), ``failed`` (some failed), else ``cancelled``."""
        counts = self.counts()
        if self.status_word() != "finished":
            return None
        if counts.get("failed"):
            return "failed"
        return "cancelled" if counts.get("cancelled") else "succeeded"

    def describe(self, live: dict[str, Task], now: float, *, tasks: bool,
                 journal: Callable[[int], list[tuple[str, dict[str, Any] | None]]] | None = None,
                 ) -> dict[str, Any]:
        """Its status. ``journal(limit)`` lists the job's tasks in submission order as
        (task id, summary of a collected task or None); without it only the tasks still in
        memory are listed."""
        counts = self.counts()
        end = self.finished_at if self.finished_at is not None else now
        view: dict[str, Any] = {
            "job": self.job_id, "name": self.name, "owner": self.owner,
            "status": self.status_word(),
            "outcome": self.outcome(),
            "counts": counts, "total": self.total, "created": self.created,
            "elapsed": round(max(end - self.created, 0.0), 3),
        }
        if tasks:
            listed = self._listed(journal)
            view["tasks"] = [{**(summary or self.task_view(task_id, live)), "index": index}
                             for index, (task_id, summary) in enumerate(listed)]
            if self.total > len(listed):
                view["tasks_not_shown"] = self.total - len(listed)
        return view

    def _listed(self, journal: Callable[[int], list[tuple[str, dict[str, Any] | None]]] | None,
                ) -> list[tuple[str, dict[str, Any] | None]]:
        if journal is None or not self.collected:
            return [(t, None) for t in itertools.islice(self.task_ids, MAX_TASKS_SHOWN)]
        rows = journal(MAX_TASKS_SHOWN)
        if len(rows) < MAX_TASKS_SHOWN:  # one the journal refused (a bug) is still listed
            seen = {task_id for task_id, _ in rows}
            rows += [(t, None) for t in self.task_ids if t not in seen]
        return [(t, s if t not in self.task_ids else None) for t, s in rows[:MAX_TASKS_SHOWN]]

    def task_view(self, task_id: str, live: dict[str, Task]) -> dict[str, Any]:
        task = live.get(task_id)
        if task is not None and not task.state.terminal:
            return {"id": task_id, "state": task.state.public, "worker": task.worker_id,
                    "attempts": task.attempts, "cost": task.cost}
        return self.summaries.get(task_id, {"id": task_id, "state": "unknown"})


def short_type(name: Any) -> str:
    """An exception's type as a traceback's last line names it: ``builtins.`` dropped."""
    text = str(name)[:200]
    return text.removeprefix("builtins.")


def error_line(error: dict[str, Any]) -> str:
    """``Type: message`` of a task's error record."""
    kind, message = error.get("type"), str(error.get("message", ""))
    return f"{short_type(kind)}: {message}" if kind else message


def summarize(task: Task) -> dict[str, Any]:
    """The one-line record of a finished task that its job keeps."""
    header = task.result_header or {}
    summary: dict[str, Any] = {
        "id": task.task_id, "state": task.state.value, "worker": header.get("worker", ""),
        "attempts": task.attempts, "cost": task.cost, "elapsed": header.get("elapsed", 0.0),
    }
    error = header.get("error")
    if task.state is TaskState.CANCELLED:
        pass  # the state says it all
    elif isinstance(error, dict):
        summary["error"] = str(error.get("message", ""))
        if error.get("type"):  # "ValueError: task 3 is unhappy", not only the message
            summary["error_type"] = short_type(error["type"])
        trace = str(error.get("traceback", "")).strip()
        if trace:
            summary["detail"] = trace[-DETAIL_CHARS:]
    elif header.get("diagnosis"):
        summary["error"] = str(header["diagnosis"])
    if task.is_script and len(task.payload) > 1 and "split" not in task.spec:
        payload = _preview(ResultEncoding.JSON.value, task.payload[1:2])
        if payload is not None:
            summary["payload"] = payload
    if task.finished_at:
        summary["finished_at"] = task.finished_at
    preview = None if "split" in header else _preview(header.get("encoding"), task.result_payload)
    if preview is not None:
        summary["result"] = preview
    elif header.get("encoding") in (ResultEncoding.JSON.value, ResultEncoding.TEXT.value):
        # Too big to show: its size says that there is one, and `results` reads it whole.
        summary["result_bytes"] = (  # in its blob file when restored from the journal
            task.result_file.nbytes if task.result_file is not None and not task.result_payload
            else sum(len(frame.bytes if hasattr(frame, "bytes") else frame)
                     for frame in task.result_payload))
    return summary


def _preview(encoding: Any, payload: Sequence[Any]) -> Any:
    """A script's JSON or text output, when small: pickled values stay opaque to the coordinator."""
    if encoding not in (ResultEncoding.JSON.value, ResultEncoding.TEXT.value) or len(payload) != 1:
        return None
    frame = payload[0]
    data = frame.bytes if hasattr(frame, "bytes") else bytes(frame)
    if len(data) > PREVIEW_BYTES:
        return None
    text = data.decode("utf-8", "replace")
    if encoding == ResultEncoding.TEXT.value:
        return text
    # A task's output is anyone's: deep nesting (RecursionError) or an integer past 64 bits
    # (msgpack cannot pack it, and the summary goes into every status answer and the journal)
    # is shown as the text it is.
    try:
        value = json.loads(text)
        msgpack.packb(value, use_bin_type=True)
    except (ValueError, TypeError, OverflowError, RecursionError):
        return text
    return value


def find_job(jobs: dict[str, Job], key: str, *, unique_name: bool = False) -> Job | str:
    """A job by id, unique id prefix (4+ characters) or name (the newest of that name, or, with
    ``unique_name``, only when one job has it: cancel and retry must not guess).

    Returns an error message instead when nothing, or more than one job, matches.
    """
    if key in jobs:
        return jobs[key]
    named = [job for job in jobs.values() if job.name == key]
    if len(named) > 1 and unique_name:
        return (f"{len(named)} jobs are named {key!r}: use the job id ('gpumesh status' lists "
                "them)")
    if named:
        return max(named, key=lambda job: job.created)
    matches = [job for job_id, job in jobs.items() if job_id.startswith(key)]
    if len(key) < 4 and matches:
        return f"{key!r} is too short: give at least 4 characters of the job id"
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        return f"{key!r} matches {len(matches)} jobs: give more of the job id"
    return (f"no job {key!r} on this coordinator (it may have been forgotten after a restart or "
            "once finished long ago): 'gpumesh status' lists the jobs it knows")
