"""``python -m bench.ab``: this checkout's gpumesh against another commit's, interleaved.

A speed change is judged by comparing two builds, and on a shared machine two runs a minute
apart differ by more than most changes do (the 2-core test VM's p50 drifted 2x within an hour
on the same code). Here both builds run at once, each a mesh of its own (bench/ab_driver.py:
``serve``, two ``join``, a client), and take turns in short rounds: a block of single calls
on one, then on the other, then a map on each, the order flipping every round. Drift falls on
both alike, and each round gives one ratio; the median of those ratios is the result. Run
``--same`` first to see what the machine allows: on the 2-core test VM two equal builds read
within about 4% at p50 and 7% in map throughput, so smaller differences need more rounds.

    python -m bench.ab                   # the working tree against HEAD
    python -m bench.ab --base HEAD~3     # against an older commit
    python -m bench.ab --base HEAD --same  # HEAD against itself: the harness's own noise

The base is exported with ``git archive`` into a temporary folder (nothing in the checkout
changes); each side's processes import their own ``gpumesh``. Writes ``ab.md`` and ``ab.json``
into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from .procs import REPO_ROOT, install_teardown, python_env, python_exe
from .report import number

SIDES = ("base", "new")


def log(text: str) -> None:
    print(f"[ab {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ab", description=(__doc__ or "").split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  python -m bench.ab                     # the working tree against HEAD\n"
               "  python -m bench.ab --base HEAD~3       # against an older commit\n"
               "  python -m bench.ab --same --rounds 20  # HEAD against itself: the noise\n"
               "  python -m bench.ab --payload 262144 --tasks 1000  # 256 KiB arguments")
    parser.add_argument("--base", default="HEAD", help="the commit to compare with (HEAD)")
    parser.add_argument("--same", action="store_true",
                        help="run the base on both sides: how far apart two equal builds read")
    parser.add_argument("--rounds", type=int, default=10, help="rounds (10)")
    parser.add_argument("--calls", type=int, default=200,
                        help="single calls per side per round (200)")
    parser.add_argument("--tasks", type=int, default=5000,
                        help="no-op tasks in each side's map per round (5000; 0 skips maps)")
    parser.add_argument("--workers", type=int, default=2, help="workers per mesh (2)")
    parser.add_argument("--payload", type=_byte_count, default=0, metavar="BYTES",
                        help="each task takes a buffer of this many bytes and returns its first "
                             "byte (0: no-op tasks)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results",
                        help="output folder")
    return parser.parse_args(argv)


def _byte_count(text: str) -> int:
    count = int(text)
    if count < 0:
        raise argparse.ArgumentTypeError(f"{count} is not a byte count (0 or more)")
    return count


def export(ref: str, into: Path) -> str:
    """The tree of ``ref`` in ``into``; returns the commit's short id and subject."""
    commit = subprocess.run(["git", "-C", str(REPO_ROOT), "log", "-1", "--format=%h %s", ref],
                            capture_output=True, text=True)
    if commit.returncode != 0:
        raise SystemExit(f"git does not know {ref!r}: {commit.stderr.strip()}")
    archive = subprocess.Popen(["git", "-C", str(REPO_ROOT), "archive", "--format=tar", ref],
                               stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"git archive {ref} failed")
    return commit.stdout.strip()


def side_env(name: str, scratch: Path) -> dict[str, str]:
    """The environment of one side's processes: bytecode compiled afresh, into a folder of its
    own. A checkout's ``__pycache__`` can hold bytecode that Python takes for its source's
    (the same size and modification time): on 2026-12-06 such files made the working tree's
    side run a map of 256 KiB arguments at 0.71-0.76x the same code exported."""
    return python_env({"PYTHONPYCACHEPREFIX": str(scratch / f"pycache-{name}")})


class Side:
    """A driver process (bench/ab_driver.py) for one tree, spoken to a line at a time."""

    def __init__(self, name: str, tree: Path, workers: int, log_file: IO[Any],
                 scratch: Path) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [python_exe(), "-m", "bench.ab_driver", str(tree), str(workers)],
            cwd=REPO_ROOT, env=side_env(name, scratch), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=log_file, text=True, start_new_session=True)

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} side stopped (its output is in ab.log)")
        return json.loads(line)

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("quit")
            except (OSError, RuntimeError, ValueError):
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def run_rounds(sides: dict[str, Side], args: argparse.Namespace) -> dict[str, Any]:
    """Each round: calls then a map on each side, in an order that flips every round."""
    latencies: dict[str, list[float]] = {name: [] for name in sides}
    rounds: list[dict[str, dict[str, float]]] = []
    # role -> CPU seconds spent in the blocks of calls
    cpu_calls: dict[str, dict[str, float]] = {name: {} for name in sides}
    for index in range(args.rounds):
        order = SIDES if index % 2 == 0 else SIDES[::-1]
        figures: dict[str, dict[str, float]] = {name: {} for name in sides}
        for name in order:
            before = sides[name].ask("cpu")["cpu"]
            ms = sides[name].ask(f"calls {args.calls} {args.payload}")["ms"]
            after = sides[name].ask("cpu")["cpu"]
            for role, seconds in after.items():
                spent = seconds - before.get(role, 0.0)
                cpu_calls[name][role] = cpu_calls[name].get(role, 0.0) + spent
            latencies[name] += ms
            figures[name]["p50_ms"] = statistics.median(ms)
        if args.tasks:
            for name in order:
                seconds = sides[name].ask(f"map {args.tasks} {args.payload}")["seconds"]
                figures[name]["tasks_per_s"] = args.tasks / seconds
        rounds.append(figures)
        log(f"round {index + 1} of {args.rounds} done")
    calls = args.rounds * args.calls
    return {"rounds": rounds, "latencies_ms": latencies,
            "cpu_us_per_call": {name: {role: seconds * 1e6 / calls
                                       for role, seconds in sorted(split.items())}
                                for name, split in cpu_calls.items()}}


def summarize(measured: dict[str, Any]) -> dict[str, Any]:
    """Per side: p50/p99 over all calls and the median map rate; new / base: the median of
    the per-round ratios (what is judged) and, for p99, the ratio of the pooled figures."""
    summary: dict[str, Any] = {}
    for name, ms in measured["latencies_ms"].items():
        centiles = statistics.quantiles(ms, n=100, method="inclusive")
        rates = [r[name]["tasks_per_s"] for r in measured["rounds"] if "tasks_per_s" in r[name]]
        summary[name] = {"p50_ms": statistics.median(ms), "p99_ms": centiles[98],
                         "tasks_per_s": statistics.median(rates) if rates else None}
    ratios: dict[str, Any] = {}
    for key in ("p50_ms", "tasks_per_s"):
        per_round = [r["new"][key] / r["base"][key] for r in measured["rounds"]
                     if key in r["new"] and key in r["base"] and r["base"][key]]
        if per_round:
            ratios[key] = {"median": statistics.median(per_round),
                           "low": min(per_round), "high": max(per_round)}
    ratios["p99_ms"] = {"pooled": summary["new"]["p99_ms"] / summary["base"]["p99_ms"]}
    return {"sides": summary, "ratios": ratios}


def markdown(result: dict[str, Any]) -> str:
    sides, ratios = result["summary"]["sides"], result["summary"]["ratios"]
    lines = ["# gpumesh A/B: new against base, interleaved", "",
             f"Base: {result['base']}. New: {result['new']}.",
             f"{result['rounds']} rounds of {result['calls']} single calls and a "
             f"{result['tasks']}-task map on each side, the order flipping every round; "
             + (f"each task takes {result['payload']:,} bytes." if result.get("payload")
                else "no-op tasks."), "",
             "| figure | base | new | new / base (median of rounds; range) |",
             "| --- | ---: | ---: | --- |"]
    for key, label, digits in (("p50_ms", "call p50 ms ↓", 3), ("p99_ms", "call p99 ms ↓", 3),
                               ("tasks_per_s", "map tasks/s ↑", 0)):
        ratio = ratios.get(key, {})
        if "median" in ratio:
            said = (f"**{ratio['median']:.3f}×** ({ratio['low']:.3f}–{ratio['high']:.3f})")
        elif "pooled" in ratio:
            said = f"{ratio['pooled']:.3f}× (all calls pooled)"
        else:
            said = "–"
        lines.append(f"| {label} | {number(sides['base'][key], digits)} | "
                     f"{number(sides['new'][key], digits)} | {said} |")
    cpu = result["measured"]["cpu_us_per_call"]
    lines += ["", "CPU µs per single call, by process:", "",
              "| process | base | new |", "| --- | ---: | ---: |"]
    for role in sorted({*cpu["base"], *cpu["new"]}):
        lines.append(f"| {role} | {number(cpu['base'].get(role), 0)} | "
                     f"{number(cpu['new'].get(role), 0)} |")
    lines.append(f"| **total** | **{number(sum(cpu['base'].values()), 0)}** | "
                 f"**{number(sum(cpu['new'].values()), 0)}** |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    install_teardown()
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpumesh-ab-"))
    sides: dict[str, Side] = {}
    try:
        base_label = export(args.base, scratch)
        trees = {"base": scratch, "new": scratch if args.same else REPO_ROOT}
        labels = {"base": base_label,
                  "new": base_label if args.same else "this checkout's working tree"}
        with open(args.out / "ab.log", "w") as log_file:
            log(f"base {base_label}; new {labels['new']}: starting both meshes")
            for name in SIDES:
                sides[name] = Side(name, trees[name], args.workers, log_file, scratch)
            for side in sides.values():
                side.read()  # {"ready": true}
            measured = run_rounds(sides, args)
        result = {"base": labels["base"], "new": labels["new"], "rounds": args.rounds,
                  "calls": args.calls, "tasks": args.tasks, "payload": args.payload,
                  "measured": measured,
                  "summary": summarize(measured)}
    finally:
        for side in sides.values():
            side.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    text = markdown(result)
    (args.out / "ab.md").write_text(text)
    (args.out / "ab.json").write_text(json.dumps(result, indent=2))
    print(text)
    log(f"wrote ab.md, ab.json and ab.log to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
