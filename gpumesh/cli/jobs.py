"""``gpumesh submit|status|cancel|retry|kill|devices``: jobs and the pool, from any terminal."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from ..client import GPUMesh
from ..client.api import new_job_id
from ..client.tasks import TaskOptions
from ..errors import MeshError
from ..fileio import utf16_marked
from ..protocol.fields import for_terminal
from .board import Board
from .output import color_enabled, fail, json_text, ok

BAR_WIDTH = 20
WAIT_LISTING = 20  # --wait lists every task of a job up to this size, else only the failures


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _symbol(state: str) -> str:
    kind = "good" if state == "done" else "wait" if state in ("pending", "running") else "bad"
    mark = {"good": "✓", "wait": "…", "bad": "✗"}[kind]
    if not _can_print(mark):
        mark = {"good": "+", "wait": ".", "bad": "x"}[kind]
    if color_enabled():
        return click.style(mark, fg={"good": "green", "wait": "yellow", "bad": "red"}[kind])
    return mark


def _shown(result: Any) -> str:
    """A script's result on one line, for people: its text as printed ("héllo", not
    "h\\u00e9llo") where this terminal can show it."""
    if isinstance(result, str):
        return result
    text = json_text(result, indent=None, ascii_only=False)
    return text if _can_print(text) else json_text(result, indent=None)


def _outcome_lines(task: dict[str, Any], result: Any, job: str = "") -> list[str]:
    """A task's error, or its result, under its line in a listing; a result too big for the
    listing by its size, and where to read it (it was left out without a word)."""
    # Another user's task wrote these: nothing in them may act on this terminal.
    if "error" in task and task.get("state") != "done":
        return [f"    error: {for_terminal(str(task['error']))}"]
    if result is not None:
        return [f"    result: {for_terminal(_shown(result))}"]
    size = task.get("result_bytes")
    if type(size) is int and job:
        return [f"    result: {size:,} bytes, too big to list here: gpumesh results "
                f"{for_terminal(job)} reads it while the coordinator holds it"]
    return []


def _can_print(text: str) -> bool:
    encoding = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        text.encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def progress_line(status: dict[str, Any]) -> str:
    """``#################### 100%  6/6 done  (10s)``"""
    total = int(status.get("total", 0))
    counts = status.get("counts", {})
    finished = sum(n for state, n in counts.items() if state not in ("pending", "running"))
    done = int(counts.get("done", 0))
    fraction = finished / total if total else 1.0
    filled = int(round(fraction * BAR_WIDTH))
    bar = "#" * filled + "-" * (BAR_WIDTH - filled)
    line = f"  {bar} {int(fraction * 100):3d}%  {done}/{total} done"
    for state in ("failed", "cancelled"):
        if counts.get(state):
            line += f", {counts[state]} {state}"
    line += f"  ({float(status.get('elapsed', 0.0)):.0f}s)"
    if status.get("status") != "finished":
        workers, paused = int(status.get("workers") or 0), int(status.get("workers_paused") or 0)
        if not workers:
            line += "  waiting for a worker: none is connected"
        elif paused >= workers and counts.get("pending"):
            line += (f"  waiting: every worker is paused or draining ({workers}); "
                     "'gpumesh resume' on a worker's machine")
    return line


def waiting_line(status: dict[str, Any]) -> str | None:
    """Why a job's tasks wait that no connected worker could run, and when they fail (the
    coordinator says so a second after they queue), on a line of its own: it is long."""
    why = status.get("waiting")
    if not why or status.get("status") == "finished":
        return None
    try:
        seconds = float(status.get("fails_in") or 0.0)
    except (TypeError, ValueError):
        due = ""
    else:
        due = f"; it fails in {seconds:.0f}s unless such a worker joins"
    return f"  waiting: {for_terminal(str(why))}{due}"


def job_summary(status: dict[str, Any], results: dict[str, Any] | None = None, *,
                limit: int | None = None) -> str:
    """The spec's per-job block: status, counts, and a line (plus result or error) per task.

    With ``limit``, a bigger job lists only the tasks that did not succeed, up to ``limit``.
    """
    outcome = status.get("outcome")
    # "finished" alone read as a success under a full bar for a job whose every task failed.
    ended = for_terminal(str(status["status"])) + (
        f" ({for_terminal(str(outcome))})" if outcome and outcome != "succeeded" else "")
    lines = [f"  Status: {ended}", f"  Counts: {dict(sorted(status['counts'].items()))}", ""]
    tasks = status.get("tasks", [])
    if status.get("same_name"):
        lines.insert(0, f"  ({status['same_name']} jobs are named {status['name']!r}: this is the "
                        "newest; use the job id for another)")
    if limit is not None and len(tasks) > limit:
        shown = [t for t in tasks if t.get("state") != "done"][:limit]
        lines.append(f"  {len(tasks) - len(shown)} of {len(tasks)} tasks not listed "
                     f"('gpumesh status {status['job']}' lists them all; 'submit --wait "
                     "--json' prints every output whole)")
        tasks = shown
    for task in tasks:
        state = task.get("state", "unknown")
        worker = task.get("worker") or "-"
        lines.append(f"  {_symbol(state)} task {task['id']} [{state}]  "
                     f"cost={float(task.get('cost', 1.0)):.1f}  worker={worker}")
        result = task.get("result")
        if result is None and results is not None:
            result = results.get(task["id"])
        lines += _outcome_lines(task, result, str(status.get("job") or ""))
    if status.get("tasks_not_shown"):
        lines.append(f"  ... and {status['tasks_not_shown']} more task(s), counted above")
    return "\n".join(lines)


def print_job(status: dict[str, Any], results: dict[str, Any] | None = None) -> None:
    click.echo(f"Job: {for_terminal(str(status['name']))} ({for_terminal(str(status['job']))})"
               + _whose(status))
    click.echo("")
    click.echo(progress_line(status))
    waiting = waiting_line(status)
    if waiting:
        click.echo(waiting)
    click.echo("")
    click.echo(job_summary(status, results))


def follow(mesh: GPUMesh, job_id: str, board: Board | None = None) -> dict[str, Any]:
    """Wait for a job, redrawing its progress bar in a terminal (on ``board``, where its tasks'
    output lines go too); the final status."""
    board = board or Board()
    said: set[str] = set()

    def show(status: dict[str, Any]) -> None:
        waiting = waiting_line(status)
        why = str(status.get("waiting"))
        if waiting and why not in said:  # once for each reason: the bar's line is redrawn
            said.add(why)
            board.above(waiting)
        board.show(progress_line(status))

    try:
        return mesh.wait_job(job_id, progress=show)
    finally:
        board.end()


def submit(mesh: GPUMesh, script: str, payloads_file: str, name: str | None, wait: bool,
           as_json: bool, options: TaskOptions, board: Board | None = None) -> int:
    """``board``: where the bar and the scripts' stderr lines go (the one ``mesh`` relays
    its tasks' output to)."""
    payloads = _read_payloads(payloads_file)
    job_id = new_job_id()  # known before submitting: Ctrl+C may come while it is accepted
    try:
        mesh.submit_script(script=script, payloads=payloads, name=name or script,
                           options=options, job_id=job_id)
    except KeyboardInterrupt:
        sent = mesh.job_futures(job_id)
        accepted = bool(sent) and all(f.task_id for f in sent)
        return _stopped_waiting(job_id, accepted)
    futures = mesh.job_futures(job_id)  # accepted: submit_script waits for that
    if not wait:
        if as_json:
            click.echo(json.dumps({"job": job_id, "tasks": len(futures)}))
        else:
            ok(f"Submitted job {job_id} ({plural(len(futures), 'task')}): it runs on the mesh "
               "without this terminal")
            click.echo(f"Follow it with: gpumesh status {job_id}")
        return 0
    try:  # from the first line that says it was accepted: Ctrl+C stops the waiting only
        if not as_json:
            ok(f"Submitted job {job_id}")  # the spec's line: the progress bar counts tasks
            click.echo(f"Job: {name or script} ({job_id})")
            click.echo("")
        if as_json:
            try:
                status = mesh.wait_job(job_id)
            finally:
                if board is not None:
                    board.end()  # the scripts' last lines, that never ended with a newline
        else:
            status = follow(mesh, job_id, board)
    except KeyboardInterrupt:
        return _stopped_waiting(job_id, accepted=True)
    results = _results_of(futures)
    if as_json:
        for task in status.get("tasks", []):
            if "result" not in task and task["id"] in results:
                task["result"] = results[task["id"]]
        click.echo(json_text(status))
    else:
        click.echo("")
        click.echo(job_summary(status, results, limit=WAIT_LISTING))
    return 0 if status["counts"].get("done", 0) == status["total"] else 1


def _stopped_waiting(job_id: str, accepted: bool) -> int:
    """Ctrl+C stops the waiting, not the job: a detached job is the point of submit."""
    click.echo("", err=True)
    if accepted:
        click.echo(f"Stopped waiting; job {job_id} keeps running on the mesh. Follow it with: "
                   f"gpumesh status {job_id}  (stop it with: gpumesh cancel {job_id})", err=True)
    else:
        click.echo(f"Stopped before the coordinator confirmed job {job_id}: it may run or not. "
                   f"See with: gpumesh status {job_id}  (stop it with: gpumesh cancel "
                   f"{job_id})", err=True)
    return 130


def _results_of(futures: list[Any]) -> dict[str, Any]:
    """Results the submitter holds (larger than the coordinator's preview), by task id."""
    results = {}
    for future in futures:
        if future.done() and not future.cancelled() and future.exception() is None:
            results[future.task_id] = future.result()
    return results


def _read_payloads(path: str) -> list[Any]:
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        fail(f"cannot read the payloads file {path}: {exc.strerror}")
    try:
        text = raw.decode("utf-8-sig")  # a BOM, as Windows editors write, is no error
    except UnicodeDecodeError:
        utf16 = utf16_marked(raw)
        fail(f"{path} is not UTF-8 text" + (" (it is UTF-16, as PowerShell's > writes)"
                                             if utf16 else "")
             + ": save it as UTF-8 (in PowerShell: ... | Out-File -Encoding utf8 FILE)")
    try:
        payloads = json.loads(text)
    except RecursionError:
        fail(f"{path} nests lists or objects too deeply to read: a list of flat payload "
             "objects is what it must hold")
    except ValueError as exc:
        fail(f"{path} is not valid JSON ({exc}): it must hold a list of payload objects")
    if isinstance(payloads, list) and not all(isinstance(p, dict) for p in payloads):
        fail(f"{path}: every payload must be a JSON object (a dict the script reads), "
             f"e.g. [{{\"lr\": 0.1}}, {{\"lr\": 0.01}}]")
    if not isinstance(payloads, list) or not payloads:
        fail(f"{path} must hold a JSON list with at least one payload (one task per payload), "
             f"e.g. [{{\"lr\": 0.1}}, {{\"lr\": 0.01}}]")
    return payloads


def status(mesh: GPUMesh, job_id: str | None, as_json: bool) -> None:
    answer = mesh.status(job_id)
    if as_json:
        click.echo(json_text(answer))
    elif job_id:
        print_job(answer)
    else:
        click.echo(mesh_summary(answer))


def results(mesh: GPUMesh, job_id: str, as_json: bool) -> None:
    answer = mesh.job_results(job_id)
    if as_json:
        click.echo(json_text(answer))
        return
    click.echo(f"Job: {for_terminal(str(answer['name']))} ({for_terminal(str(answer['job']))})")
    click.echo("")
    for task in answer["tasks"]:
        state = for_terminal(str(task.get("state", "unknown")))
        click.echo(f"  {_symbol(state)} task {for_terminal(task['id'])} [{state}]")
        for line in _outcome_lines(task, task.get("result")):
            click.echo(line)
        if task.get("note"):
            click.echo(f"    ({for_terminal(str(task['note']))})")
    if answer.get("collected"):
        click.echo(f"  {answer['collected']} task(s) not listed: their submitter collected their "
                   "results, which the coordinator no longer holds")
    if not answer["tasks"] and not answer.get("collected"):
        click.echo("  (no tasks)")


def mesh_summary(answer: dict[str, Any]) -> str:
    counts = answer.get("counts", {})
    queue = ", ".join(f"{counts[s]} {s}" for s in ("pending", "running") if counts.get(s))
    paused = answer.get("workers_paused", 0)
    workers = f"{answer.get('workers', 0)} alive" + (f" ({paused} paused or draining)" if paused else "")
    lines = ["", f"  Workers: {workers}    Queue: {queue or 'empty'}", "",
             "  JOBS", "  " + "-" * 70]
    jobs = answer.get("jobs", [])
    if not jobs:
        lines.append("  (no jobs yet: 'gpumesh submit SCRIPT --payloads FILE' starts one)")
    for job in jobs:
        counts = job["counts"]
        tally = f"{counts.get('done', 0)}/{job['total']} done" + "".join(
            f", {counts[s]} {s}" for s in ("failed", "cancelled") if counts.get(s))
        lines.append(f"  {job['job']:<14}{_clip(for_terminal(str(job['name'])), 30):<32}{job['status']:<10}"
                     f"{tally}  {float(job['elapsed']):.0f}s" + _whose(job))
    return "\n".join(lines) + "\n"


def _whose(job: dict[str, Any]) -> str:
    """Another owner's job says whose it is (cancel and retry need --force for it); your own,
    as the coordinator tells, says nothing more."""
    owner = job.get("owner")
    if not owner or job.get("mine", True):
        return ""
    return f"  by {for_terminal(str(owner))[:80]}"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


def devices_table(pool: list[dict[str, Any]], workers: list[dict[str, Any]]) -> str:
    alive = [w for w in workers if w.get("alive")]
    gpus = sum(1 for d in pool if d["type"] == "GPU")
    total = sum(float(w.get("score", 0.0)) for w in alive)
    lines = ["", f"  DEVICES  {len(alive)} worker(s), {gpus} GPU(s), total score {total:.3f}",
             "  " + "-" * 70]
    if not pool:
        lines.append("  (no workers joined yet: run 'gpumesh join URL --token-file FILE' on a machine)")
    for d in pool:
        if d["type"] == "GPU":
            what = f"{d['name']} {int(d.get('vram', 0)) / 1e9:.1f}GB"
        else:
            what = f"{d['name'] or 'CPU'} ({d.get('cores', 0)} cores)"
        lines.append(f"  {d['type']:<5}{_clip(what, 40):<42}{d.get('hostname', ''):<16}"
                     f"worker={d['worker'][:12]}  score={float(d['score']):.3f}")
    return "\n".join(lines) + "\n"


def _why_nothing_to_retry(mesh: GPUMesh, target: str) -> str:
    """What the job's counts say of a retry that found nothing: still running, all done, or
    failures whose inputs the coordinator let go of."""
    try:
        counts = mesh.status(target, tasks=False).get("counts", {})
    except MeshError:
        counts = {}
    unfinished = int(counts.get("pending", 0)) + int(counts.get("running", 0))
    failed = int(counts.get("failed", 0)) + int(counts.get("cancelled", 0))
    if not failed and unfinished:
        return (f"none of its tasks has failed or been cancelled ({unfinished} still pending "
                "or running)")
    if not failed and counts:
        return "every task of it succeeded"
    return ("no failed or cancelled task whose input the coordinator still holds (results "
            "expire after GPUMESH_RESULT_TTL)")


def _stopping(count: int) -> str:
    verb, whose = ("is", "its") if count == 1 else ("are", "their")
    return (f"{plural(count, 'task')} cancelled while running {verb} still being stopped by "
            f"{whose} worker")


def control(mesh: GPUMesh, action: str, target: str, wait: bool = False,
            force: bool = False) -> int:
    try:
        if action == "cancel":
            answer = mesh.control_job("cancel", target, force=force)
            count = int(answer["cancelled"])
            ok(f"Cancelled {count} unfinished task(s) of job {target}" if count else
               f"Job {target} had no unfinished tasks: nothing to cancel")
            if answer["stopping"]:
                click.echo(f"  {_stopping(answer['stopping'])}: it shows as cancelled once "
                           "its worker confirms, or when its lease expires")
        elif action == "retry":
            answer = mesh.control_job("retry", target, force=force)
            count = int(answer["retried"])
            skipped = (f"; {_stopping(answer['stopping'])}, not retried: retry again once it "
                       "shows as cancelled") if answer["stopping"] else ""
            if not count:
                ok(f"Nothing to retry in job {target}: " + (
                    skipped[2:] if skipped else _why_nothing_to_retry(mesh, target)))
                return 0
            ok(f"Re-queued {plural(count, 'task')} of job {target}, each as it was submitted "
               "(the same script and payload: submit again to run an edited script)" + skipped)
            if wait:
                try:
                    final = follow(mesh, target)
                except KeyboardInterrupt:
                    return _stopped_waiting(target, accepted=True)  # the retry stands
                click.echo("")
                click.echo(job_summary(final, limit=WAIT_LISTING))
                return 0 if final["counts"].get("done", 0) == final["total"] else 1
        else:
            answer = mesh.kill_worker(target)
            host = f" ({answer['hostname']})" if answer.get("hostname") else ""
            ok(f"Removed worker {answer['worker']}{host}; {answer['handed_back']} running "
               "task(s) went back to the queue. Its owner sees who removed it, and can join "
               "it again")
    except MeshError as exc:
        fail(str(exc))
    return 0
