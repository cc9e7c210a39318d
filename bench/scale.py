"""``--scale``: the coordinator alone under load it would meet on a big mesh.

1. 1,000 simulated workers (``bench.simworkers``, 4 processes) heartbeating for 20 s: the
   coordinator's CPU (% of one core) and RSS.
2. 100,000 queued no-op tasks and no worker: the coordinator's RSS per queued task.
3. Two real workers drain them: dispatch rate, RSS after the drain, journal size (db + WAL).
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .procs import cpu_seconds, python_exe, rss_bytes, spawn, stop_group, wait_for
from .systems.gpumesh_system import Mesh, wait_for_workers
from .tasks import noop

MIB = 1024 * 1024


@dataclass(frozen=True)
class ScaleParams:
    sim_processes: int = 4
    sim_per_process: int = 250
    sim_seconds: float = 20.0
    queued_tasks: int = 100_000

    @classmethod
    def quick(cls) -> ScaleParams:
        return cls(sim_seconds=10.0, queued_tasks=20_000)


def run_scale(*, quick: bool, log: Callable[[str], None]) -> dict[str, Any]:
    params = ScaleParams.quick() if quick else ScaleParams()
    mesh = Mesh.fresh()
    rows: list[tuple[str, str]] = []
    try:
        mesh.start_coordinator()
        mesh.wait_listening()
        pid = mesh.coordinator.pid
        rows += simulated_workers(mesh, pid, params, log)
        rows += queued_and_drained(mesh, pid, params, log)
    except Exception as exc:
        log(f"scale: FAILED: {type(exc).__name__}: {exc}\n{mesh.tail_log()}")
        rows.append(("failed", f"{type(exc).__name__}: {exc}"))
    finally:
        mesh.stop()
    return {"params": params.__dict__, "rows": rows}


def simulated_workers(mesh: Mesh, pid: int, params: ScaleParams,
                      log: Callable[[str], None]) -> list[tuple[str, str]]:
    total = params.sim_processes * params.sim_per_process
    log(f"scale: {total} simulated workers joining")
    idle_rss = rss_bytes(pid) or 0
    started = time.perf_counter()
    sims = [spawn([python_exe(), "-m", "bench.simworkers", mesh.url, str(params.sim_per_process),
                   f"sim{n}"], env=mesh.env(), log=None, stdout_pipe=True)
            for n in range(params.sim_processes)]
    try:
        for sim in sims:
            _wait_line(sim, b"welcomed", 120)
        joined = time.perf_counter() - started
        log(f"scale: {total} welcomed in {joined:.1f}s; measuring {params.sim_seconds:g}s")
        cpu_before = cpu_seconds(pid) or 0.0
        time.sleep(params.sim_seconds)  # the measurement is of a steady state over this window
        cpu_share = ((cpu_seconds(pid) or 0.0) - cpu_before) / params.sim_seconds
        rss = rss_bytes(pid) or 0
    finally:
        for sim in sims:
            stop_group(sim)
    return [(f"{total} simulated workers: all welcomed after", f"{joined:.1f} s"),
            ("coordinator CPU, heartbeats only", f"{cpu_share * 100:.1f} % of a core"),
            ("coordinator RSS, idle before they joined", f"{idle_rss / MIB:.1f} MiB"),
            (f"coordinator RSS with {total} workers", f"{rss / MIB:.1f} MiB"),
            ("RSS per simulated worker", f"{(rss - idle_rss) / total / 1024:.1f} KiB")]


def _wait_line(proc: Any, prefix: bytes, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        readable, _, _ = select.select([proc.stdout], [], [], 0.5)
        if readable:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("a simulated-worker process exited early")
            if line.startswith(prefix):
                return
    raise TimeoutError(f"no {prefix.decode()!r} within {timeout:g}s")


def queued_and_drained(mesh: Mesh, pid: int, params: ScaleParams,
                       log: Callable[[str], None]) -> list[tuple[str, str]]:
    count = params.queued_tasks
    with mesh.client() as client:
        wait_for(lambda: client.status().get("workers", 1) == 0, 30, "simulated workers gone")
        before = rss_bytes(pid) or 0
        log(f"scale: queueing {count} tasks with no worker")
        started = time.perf_counter()
        futures = client.submit_calls(noop, [((i,), {}) for i in range(count)])
        wait_for(lambda: all(f.task_id or f.done() for f in futures), 300, "tasks accepted", 0.1)
        accepted = time.perf_counter() - started
        queued = rss_bytes(pid) or 0
        finished: list[float] = []
        lock = threading.Lock()

        def note(_: Any) -> None:
            with lock:
                finished.append(time.perf_counter())

        for future in futures:
            future.add_done_callback(note)
        log("scale: draining with 2 real workers")
        spawned = time.perf_counter()
        for _ in range(2):
            mesh.add_worker()
        wait_for_workers(client, 2)
        client.gather(futures, timeout=1800)
        drained = time.perf_counter() - spawned
        first, last = min(finished), max(finished)
        # Results acknowledged, then the coordinator's idle check (once a second) checkpoints
        # the journal. What stays: one summary row per task, for its job's record.
        time.sleep(3.0)
        after = rss_bytes(pid) or 0
        journal = mesh.journal_bytes()
    return [(f"{count} tasks submitted and accepted (journaled) in", f"{accepted:.1f} s"),
            ("coordinator RSS before queueing", f"{before / MIB:.1f} MiB"),
            (f"coordinator RSS with {count} queued", f"{queued / MIB:.1f} MiB"),
            ("RSS per queued task", f"{(queued - before) / count:,.0f} B"),
            ("drain with 2 workers: dispatch rate (first to last result)",
             f"{(count - 1) / (last - first):,.0f} tasks/s"),
            ("drain with 2 workers: workers launched to last result", f"{drained:.1f} s"),
            ("coordinator RSS after the drain", f"{after / MIB:.1f} MiB"),
            ("journal size after (db + WAL)", f"{journal / MIB:.1f} MiB")]

