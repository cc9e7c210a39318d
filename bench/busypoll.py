"""The coordinator's busy polling when results come back slowly, as from a worker on a LAN:
single calls with it off and on, side by side, for tasks that take longer and longer.

    python -m bench.busypoll [--task-ms 0,0.5,1,2,5] [--calls 1000]

A worker over a LAN sends its RESULT a round trip after the TASK left; on this machine a task
that sleeps that long does the same to the coordinator's loop (this VM's kernel has no netem
to delay a veth). For each task time the same calls run against a coordinator with
``GPUMESH_BUSY_POLL_US=0`` and one with the default, one after the other on loopback, and the
table gives the p50, the p99 and the coordinator's CPU per call: whether it spins for nothing
once results come back slower than its busy time (1 ms by default).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any

from .params import positive_int
from .procs import cpu_seconds, install_teardown
from .systems.gpumesh_system import Mesh, wait_for_workers
from .tasks import nap

BUSY_POLL_SETTINGS = (("off", "0"), ("default", None))  # None: the coordinator's own default


def _task_times(text: str) -> list[float]:
    """Comma-separated task times in ms, each from 0 to 1000."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: task times in ms, comma-separated") from None
    if not values or any(not (math.isfinite(v) and 0 <= v <= 1000) for v in values):
        raise argparse.ArgumentTypeError(f"{text}: each task time from 0 to 1000 ms")
    return values


def _coordinator_env(busy_poll: str | None) -> None:
    """What Mesh passes its coordinator: this process's environment."""
    os.environ.pop("GPUMESH_BUSY_POLL_US", None)
    if busy_poll is not None:
        os.environ["GPUMESH_BUSY_POLL_US"] = busy_poll


def measure(task_ms: float, calls: int, busy_poll: str | None) -> dict[str, Any]:
    """``calls`` single calls of a task sleeping ``task_ms`` on a fresh one-worker mesh."""
    _coordinator_env(busy_poll)
    mesh = Mesh.fresh()
    try:
        mesh.start_coordinator()
        mesh.wait_listening()
        mesh.add_worker()
        assert mesh.coordinator is not None
        with mesh.client() as client:
            wait_for_workers(client, 1)
            for _ in range(20):  # the runner started, the function known
                client.submit(nap, 0).result(60)
            before = cpu_seconds(mesh.coordinator.pid) or 0.0
            latencies = []
            for _ in range(calls):
                started = time.perf_counter()
                client.submit(nap, task_ms / 1000).result(60)
                latencies.append((time.perf_counter() - started) * 1000)
            spent = (cpu_seconds(mesh.coordinator.pid) or 0.0) - before
    finally:
        mesh.stop()
    centiles = statistics.quantiles(latencies, n=100, method="inclusive")
    return {"p50_ms": statistics.median(latencies), "p99_ms": centiles[98],
            "coordinator_cpu_us_per_call": spent * 1e6 / calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--task-ms", type=_task_times, default=[0.0, 0.5, 1.0, 2.0, 5.0],
                        help="how long each task sleeps, ms, comma-separated "
                             "(default 0,0.5,1,2,5)")
    parser.add_argument("--calls", type=positive_int, default=1000,
                        help="single calls per coordinator (default 1000)")
    args = parser.parse_args()
    install_teardown()
    saved = os.environ.get("GPUMESH_BUSY_POLL_US")
    print("| task ms | busy polling | p50 ms | p99 ms | coordinator CPU µs/call |")
    print("| ---: | --- | ---: | ---: | ---: |", flush=True)
    try:
        for task_ms in args.task_ms:
            for label, value in BUSY_POLL_SETTINGS:
                row = measure(task_ms, args.calls, value)
                print(f"| {task_ms:g} | {label} | {row['p50_ms']:.3f} | {row['p99_ms']:.3f} "
                      f"| {row['coordinator_cpu_us_per_call']:,.0f} |", flush=True)
    finally:
        _coordinator_env(saved)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
