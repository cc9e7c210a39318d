"""``gpumesh pause|resume|drain``: the owner of a worker machine takes it back, politely.

These talk to the workers running on this machine (found in GPUMESH_HOME/workers), not to the
coordinator, so they need no token: being the user who runs the worker is the permission.
"""

from __future__ import annotations

import time
from typing import Any

import click

from ..config import Settings
from ..worker import control as local
from .output import fail, ok

DRAIN_POLL = 0.2
DRAIN_REPORT = 30.0  # seconds between progress lines while drained workers finish


def steer(settings: Settings, action: str, worker: str | None, wait: bool) -> int:
    entries = local.local_workers(settings.home)
    if worker:
        entries = [e for e in entries if str(e["worker"]).startswith(worker)]
    if not entries:
        which = f"no worker {worker!r}" if worker else "no worker"
        fail(f"{which} runs on this machine under GPUMESH_HOME={settings.home}: "
             "start one with 'gpumesh join URL --token-file FILE' (or set GPUMESH_HOME to the one it uses)")
    failures = 0
    for entry in entries:
        answer = local.send(entry, action)
        if "error" in answer:
            click.echo(f"error: worker {entry['worker']}: {answer['error']}", err=True)
            failures += 1
            continue
        ok(_describe(action, answer))
    if wait and action.startswith("drain"):
        try:
            _wait_gone(settings, entries)
        except KeyboardInterrupt:
            click.echo("", err=True)
            click.echo("Stopped waiting; the drain goes on: each worker leaves once its running "
                       "tasks end ('gpumesh drain --now' hands them back now)", err=True)
            return 130
    return 1 if failures else 0


def _describe(action: str, answer: dict[str, Any]) -> str:
    wid, running, back = answer["worker"], answer["running"], answer["handed_back"]
    gave = f"{back} queued task(s) handed back" if back else "no queued tasks"
    if action == "pause":
        return (f"worker {wid} paused: {running} running task(s) will finish, {gave}; "
                "nothing new starts until 'gpumesh resume'")
    if action == "resume":
        return f"worker {wid} resumed: taking tasks again"
    if action == "drain-now":
        return f"worker {wid} handed back {back} task(s) and is leaving the mesh"
    return (f"worker {wid} draining: {running} running task(s) will finish, {gave}; "
            "then it leaves the mesh")


def _wait_gone(settings: Settings, entries: list[dict[str, Any]]) -> None:
    """Wait until the drained workers have left (their entry gone, or their process)."""
    waiting = {str(e["worker"]): e for e in entries}
    started = last_report = time.time()
    while waiting:
        for worker, entry in list(waiting.items()):
            if not local.is_registered(settings.home, worker) or not local.is_alive(int(entry["pid"])):
                del waiting[worker]
                ok(f"worker {worker} has left the mesh ({time.time() - started:.0f}s)")
        if waiting and time.time() - last_report >= DRAIN_REPORT:
            last_report = time.time()
            for worker, entry in waiting.items():  # a long task: say what it waits for
                answer = local.send(entry, "status", timeout=2.0)
                running = answer.get("running", "?")
                click.echo(f"   worker {worker} still finishing {running} task(s) "
                           f"({time.time() - started:.0f}s; Ctrl+C stops waiting, not the drain; "
                           "'gpumesh drain --now' hands them back)")
        if waiting:
            time.sleep(DRAIN_POLL)
