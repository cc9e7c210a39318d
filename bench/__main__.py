"""``python -m bench``: gpumesh and the alternatives, in one run on this machine.

Writes ``results.md`` (also printed), ``results.json`` and PNG plots into ``--out``
(default ``bench/results/``). ``--quick`` takes about a minute; ``--scale`` and ``--two-hosts``
add the coordinator-alone and two-namespace sections. gpumesh and the floor also run in
alternating rounds (bench/headtohead.py) unless ``--no-head-to-head``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from .machine import describe
from .measure import run_system
from .params import Params
from .procs import REPO_ROOT, install_teardown
from .report import markdown, to_json
from .systems import ALL

DEFAULT_OUT = REPO_ROOT / "bench" / "results"


def log(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs: about a minute")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--only", default="",
                        help="comma-separated systems to run: " + ",".join(s.key for s in ALL))
    parser.add_argument("--scale", action="store_true",
                        help="also: the coordinator with 1,000 simulated workers and 100,000 "
                             "queued tasks")
    parser.add_argument("--two-hosts", action="store_true",
                        help="also: 64 MiB round trips between two network namespaces (root)")
    parser.add_argument("--prefetch", default=None,
                        help="gpumesh workers' join --prefetch (default: join's own default)")
    parser.add_argument("--no-journal-cost", action="store_true",
                        help="skip the journal-on/journal-off gpumesh throughput comparison "
                             "(it runs whenever gpumesh does)")
    parser.add_argument("--no-head-to-head", action="store_true",
                        help="skip gpumesh and the floor in alternating rounds (they run "
                             "whenever both systems do)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return parser.parse_args(argv)


def chosen_systems(only: str) -> list[Any]:
    if not only:
        return ALL
    wanted = {k.strip() for k in only.split(",") if k.strip()}
    unknown = wanted - {s.key for s in ALL}
    if unknown:
        raise SystemExit(f"unknown system(s): {', '.join(sorted(unknown))}")
    return [s for s in ALL if s.key in wanted]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    install_teardown()
    params = Params.quick() if args.quick else Params()
    params = dataclasses.replace(params, gpumesh_prefetch=args.prefetch)
    results: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": describe(), "params": dataclasses.asdict(params), "systems": []}
    began = time.perf_counter()
    for system_type in chosen_systems(args.only):
        results["systems"].append(run_system(system_type, params, log))
    keys = {s.key for s in chosen_systems(args.only)}
    if not args.no_head_to_head and {"floor", "gpumesh"} <= keys:
        from .headtohead import QUICK_ROUNDS, ROUNDS, run_head_to_head

        results["head_to_head"] = run_head_to_head(
            params, rounds=QUICK_ROUNDS if args.quick else ROUNDS, log=log)
    if not args.no_journal_cost and "gpumesh" in keys:
        from .journal import run_journal_cost

        results["journal_cost"] = run_journal_cost(params, log=log)
    if args.scale:
        from .scale import run_scale

        results["scale"] = run_scale(quick=args.quick, log=log)
    if args.two_hosts:
        from .twohosts import run_two_hosts

        results["two_hosts"] = run_two_hosts(params, log=log)
    results["seconds"] = round(time.perf_counter() - began, 1)
    write_outputs(results, args.out, plots=not args.no_plots)
    return 0


def write_outputs(results: dict[str, Any], out: Path, *, plots: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(results)
    print(text)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(to_json(results) + "\n")
    written = ["results.md", "results.json"]
    if plots:
        # matplotlib is in the bench extra, not in the dev install the README's test command
        # makes: without it the tables are the result, and the plots are said to be missing.
        try:
            import matplotlib  # noqa: F401 (only whether it is there)
        except ImportError:
            log("matplotlib is not installed: no plots (pip install -e '.[bench]')")
        else:
            from .plots import write_plots

            written += [p.name for p in write_plots(results, out)]
    log(f"wrote {', '.join(written)} to {out} in {results['seconds']:g}s of measuring")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted: every process started here is being stopped")
        sys.exit(130)
