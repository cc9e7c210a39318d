"""How much the join benchmark's score varies on one machine: the benchmark function that
``gpumesh join`` runs, each time in a fresh process (as a restarted worker would, with nothing
warm), and the spread of the scores around their median.

    python -m bench.stability [--runs 10] [--budget 1.0] [--all-blas-threads] [--json]

``--all-blas-threads`` times the method join used before (the numpy figures in the process
itself, its BLAS on every core), for comparison.

It reports the load average before and after: a machine that is not idle makes this a
measurement of the other work, not of the benchmark. Nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from .procs import REPO_ROOT

# One fresh interpreter per run: the inventory as join probes it (no torch), then join's call.
ONE_RUN = """
import json, time
from gpumesh.worker import devices
inventory = devices.probe(torch_probe=False)
start = time.perf_counter()
figures = {call}(inventory, budget={budget})
figures["seconds"] = time.perf_counter() - start
figures["score"] = devices.score_of(figures)
print(json.dumps(figures))
"""


# join's call, or the numpy figures in this process with the BLAS's own thread count.
CALLS = {"join": "devices.benchmark",
         "all-blas-threads": "(lambda inventory, budget: devices._benchmark_numpy(budget))"}


def one_run(budget: float, method: str = "join") -> dict[str, float]:
    code = ONE_RUN.format(budget=budget, call=CALLS[method])
    done = subprocess.run([sys.executable, "-c", code],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=True)
    figures = dict(json.loads(done.stdout))
    # join's one-thread child failed and the figures came from the process itself: say so.
    figures["fallback"] = float("measuring in this process instead" in done.stderr)
    return figures


def spread(values: list[float]) -> dict[str, float]:
    """min, median, max, and how far the extremes lie from the median, in percent of it."""
    median = statistics.median(values)
    low, high = min(values), max(values)
    return {"min": low, "median": median, "max": high,
            "below_pct": 100 * (low - median) / median if median else 0.0,
            "above_pct": 100 * (high - median) / median if median else 0.0}


def measure(runs: int, budget: float, method: str = "join") -> dict[str, Any]:
    load_before = os.getloadavg()
    samples = [one_run(budget, method) for _ in range(runs)]
    load_after = os.getloadavg()
    return {
        "method": method, "runs": runs, "budget": budget, "cpus": os.cpu_count(),
        "load_before": load_before, "load_after": load_after, "samples": samples,
        "score": spread([s["score"] for s in samples]),
        "gflops": spread([s["gflops"] for s in samples]),
        "bandwidth_gbps": spread([s["bandwidth_gbps"] for s in samples]),
        "seconds": spread([s["seconds"] for s in samples]),
    }


def render(result: dict[str, Any]) -> str:
    lines = [f"{result['method']}: {result['runs']} fresh processes, budget {result['budget']:g}s, "
             f"{result['cpus']} CPUs, load average {result['load_before'][0]:.2f} before, "
             f"{result['load_after'][0]:.2f} after",
             "",
             "| figure | min | median | max | min vs median | max vs median |",
             "|---|---|---|---|---|---|"]
    for name in ("score", "gflops", "bandwidth_gbps", "seconds"):
        s = result[name]
        lines.append(f"| {name} | {s['min']:.3f} | {s['median']:.3f} | {s['max']:.3f} | "
                     f"{s['below_pct']:+.1f}% | {s['above_pct']:+.1f}% |")
    lines.append("")
    lines.append("scores: " + ", ".join(f"{s['score']:.1f}" for s in result["samples"]))
    fallbacks = sum(1 for s in result["samples"] if s.get("fallback"))
    if fallbacks:
        lines.append(f"{fallbacks} run(s) measured without the one-thread child (it failed)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stability", description=__doc__)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--budget", type=float, default=1.0, help="join's budget (1.0)")
    parser.add_argument("--all-blas-threads", action="store_true",
                        help="the method before: numpy in the process, every BLAS thread")
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    args = parser.parse_args()
    method = "all-blas-threads" if args.all_blas_threads else "join"
    result = measure(args.runs, args.budget, method)
    print(json.dumps(result, indent=2) if args.json else render(result))


if __name__ == "__main__":
    main()
