"""Results into Markdown and JSON. Pure: a results dict in, text out (no I/O, no clock)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Results = dict[str, Any]


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    higher_is_better: bool
    digits: int = 2

    @property
    def header(self) -> str:
        return f"{self.label} {'↑' if self.higher_is_better else '↓'}"


METRICS = [
    Metric("tasks_per_s", "tiny tasks/s", True, 0),
    Metric("p50_ms", "call p50 ms", False, 3),
    Metric("p99_ms", "call p99 ms", False, 3),
    Metric("mid_tasks_per_s", "256 KiB map tasks/s", True, 0),
    Metric("big_mb_s", "64 MiB round trip MB/s", True, 0),
    Metric("big_bytes_mb_s", "64 MiB bytes round trip MB/s", True, 0),
    Metric("sleep_efficiency", "sleep efficiency", True, 3),
    Metric("cold_start_s", "cold start s", False, 2),
    Metric("cpu_us_per_task", "CPU µs/task", False, 0),
]
GPUMESH = "gpumesh"


def number(value: float | None, digits: int = 2) -> str:
    """A figure for a table: thousands separated, ``digits`` decimals, but at least three
    significant figures for small values."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if value != 0 and abs(value) < 10 ** (2 - digits):
        return f"{value:.3g}"
    return f"{value:,.{digits}f}"


def ratio(mine: float | None, theirs: float | None) -> float | None:
    if mine is None or theirs is None or theirs == 0:
        return None
    return mine / theirs


def times(mine: float | None, theirs: float | None) -> str:
    """``mine / theirs`` as a table cell: "1.23×", or "–" when it cannot be divided."""
    r = ratio(mine, theirs)
    return "–" if r is None else f"{r:.2f}×"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(header: list[str], rows: list[list[str]], align: str) -> list[str]:
    """A Markdown table; ``align`` has one letter per column, l or r."""
    aligns = ["---" if c == "l" else "---:" for c in align]
    return [_row(header), _row(aligns), *(_row(r) for r in rows)]


def by_key(results: Results) -> dict[str, dict[str, Any]]:
    return {s["key"]: s for s in results.get("systems", [])}


def comparison_table(results: Results) -> list[str]:
    """Every system's figures, then one row per other system: gpumesh's figure divided by its."""
    systems = results.get("systems", [])
    header = ["system", *(m.header for m in METRICS)]
    rows = []
    for system in systems:
        if system["status"] in ("skipped", "failed"):
            why = system.get("reason") or "; ".join(system.get("errors", {}).values())
            rows.append([system["name"], f"{system['status']}: {why}", *([""] * (len(METRICS) - 1))])
            continue
        rows.append([system["name"], *(number(system.get(m.key), m.digits) for m in METRICS)])
    mine = by_key(results).get(GPUMESH)
    if mine is not None and mine["status"] not in ("skipped", "failed"):
        for other in systems:
            if other["key"] == GPUMESH or other["status"] in ("skipped", "failed"):
                continue
            cells = [times(mine.get(m.key), other.get(m.key)) for m in METRICS]
            rows.append([f"**gpumesh / {other['name']}**", *cells])
    return _table(header, rows, "l" + "r" * len(METRICS))


@dataclass(frozen=True)
class Target:
    """A stated goal: ``measure(results)`` gives (the measured value as text, met or not),
    or None when a system it compares with did not run."""

    text: str
    measure: Callable[[dict[str, dict[str, Any]]], tuple[str, bool] | None]


def _versus(key: str, other: str, at_least: float, *, inverse: bool = False, digits: int = 2
            ) -> Callable[[dict[str, dict[str, Any]]], tuple[str, bool] | None]:
    def measure(systems: dict[str, dict[str, Any]]) -> tuple[str, bool] | None:
        mine = systems.get(GPUMESH, {}).get(key)
        theirs = systems.get(other, {}).get(key)
        r = ratio(mine, theirs)
        if r is None:
            return None
        shown = f"{r:.2f}× ({number(mine, digits)} vs {number(theirs, digits)})"
        return shown, (r <= at_least if inverse else r >= at_least)
    return measure


def _absolute(key: str, limit: float, *, below: bool, unit: str = ""
              ) -> Callable[[dict[str, dict[str, Any]]], tuple[str, bool] | None]:
    def measure(systems: dict[str, dict[str, Any]]) -> tuple[str, bool] | None:
        value = systems.get(GPUMESH, {}).get(key)
        if value is None:
            return None
        return f"{number(value, 3)}{unit}", (value < limit if below else value >= limit)
    return measure


TARGETS = [
    Target(".map throughput ≥ 1.0× the floor", _versus("tasks_per_s", "floor", 1.0, digits=0)),
    Target(".map throughput ≥ 5× Ray", _versus("tasks_per_s", "ray", 5.0, digits=0)),
    Target("single-call p50 ≤ 2× the floor's", _versus("p50_ms", "floor", 2.0, inverse=True, digits=3)),
    Target("single-call p99 ≤ 3 ms", _absolute("p99_ms", 3.0000001, below=True, unit=" ms")),
    Target("64 MiB round trip ≥ Ray's MB/s", _versus("big_mb_s", "ray", 1.0, digits=0)),
    Target("sleep efficiency ≥ 0.97", _absolute("sleep_efficiency", 0.97, below=False)),
    Target("cold start < 1.5 s", _absolute("cold_start_s", 1.5, below=True, unit=" s")),
]


def targets_table(results: Results) -> list[str]:
    systems = by_key(results)
    rows = []
    for target in TARGETS:
        outcome = target.measure(systems)
        if outcome is None:
            rows.append([target.text, "not measured", "–"])
        else:
            rows.append([target.text, outcome[0], "met" if outcome[1] else "**not met**"])
    first = _first_big_call(systems, results.get("params", {}))
    if first is not None:
        rows.append(["64 MiB round trip ≥ Ray's MB/s, first call of that size (for reference: "
                     "new shared-memory files)", first[0], "met" if first[1] else "**not met**"])
    rows += _head_to_head_targets(results.get("head_to_head", {}))
    return _table(["target", "measured (gpumesh)", ""], rows, "lll")


def _first_big_call(systems: dict[str, dict[str, Any]], params: dict[str, Any]
                    ) -> tuple[str, bool] | None:
    """The 64 MiB target judged by each system's first call alone: the column takes the best
    of its repeats, and a first call also pays for files (gpumesh) or store pages (Ray) that
    later calls of the same size reuse."""
    size = params.get("big_bytes")
    mine = (systems.get(GPUMESH, {}).get("big_seconds") or [None])[0]
    theirs = (systems.get("ray", {}).get("big_seconds") or [None])[0]
    if not size or not mine or not theirs or len(systems[GPUMESH]["big_seconds"]) < 2:
        return None  # one call only: the column is the first call already
    mine_mb_s, theirs_mb_s = 2 * size / mine / 1e6, 2 * size / theirs / 1e6
    r = mine_mb_s / theirs_mb_s
    return f"{r:.2f}× ({number(mine_mb_s, 0)} vs {number(theirs_mb_s, 0)})", r >= 1.0


HEAD_TO_HEAD_MEDIANS = ("tasks_ratio", "p50_ratio", "gpumesh_p99_ms")  # bench/headtohead.py


def _head_to_head_targets(section: dict[str, Any]) -> list[list[str]]:
    """The floor targets again, judged by the median of the alternating rounds' ratios."""
    if not all(key in section for key in HEAD_TO_HEAD_MEDIANS):
        return []
    met = lambda ok: "met" if ok else "**not met**"  # noqa: E731
    rounds = len(section.get("rounds", []))
    tasks, p50 = section["tasks_ratio"], section["p50_ratio"]
    p99 = section["gpumesh_p99_ms"]
    return [
        [".map throughput ≥ 1.0× the floor, alternating rounds",
         f"{tasks:.2f}× (median of {rounds} rounds' ratios)", met(tasks >= 1.0)],
        ["single-call p50 ≤ 2× the floor's, alternating rounds",
         f"{p50:.2f}× (median of {rounds} rounds' ratios)", met(p50 <= 2.0)],
        ["single-call p99 ≤ 3 ms, alternating rounds",
         f"{number(p99, 3)} ms (median of the rounds' p99s)", met(p99 <= 3.0)],
    ]


def head_to_head_lines(section: dict[str, Any]) -> list[str]:
    title = ["## gpumesh and the floor, alternating rounds", "",
             "Both running at once; each round measures one then the other (the order flips "
             "every round), so the machine's drift falls on both. Ratios are gpumesh's figure "
             "over the floor's in the same round.", ""]
    rows = []
    for index, r in enumerate(section.get("rounds", []), 1):
        floor, mesh = r["floor"], r["gpumesh"]
        rows.append([str(index), number(floor["tasks_per_s"], 0), number(mesh["tasks_per_s"], 0),
                     times(mesh["tasks_per_s"], floor["tasks_per_s"]),
                     number(floor["p50_ms"], 3), number(mesh["p50_ms"], 3),
                     times(mesh["p50_ms"], floor["p50_ms"]), number(mesh["p99_ms"], 3)])
    if all(key in section for key in HEAD_TO_HEAD_MEDIANS):
        rows.append(["**median**", "", "", f"**{section['tasks_ratio']:.2f}×**", "", "",
                     f"**{section['p50_ratio']:.2f}×**",
                     f"**{number(section['gpumesh_p99_ms'], 3)}**"])
    table = _table(["round", "floor tasks/s", "gpumesh tasks/s", "ratio ↑", "floor p50 ms",
                    "gpumesh p50 ms", "ratio ↓", "gpumesh p99 ms"], rows, "lrrrrrrr")
    failed = [f"Failed: {section['failed']}", ""] if "failed" in section else []
    return [*title, *table, "", *failed]


def cpu_table(results: Results, per: str = "task") -> list[str]:
    """CPU per tiny task of the map (``per="task"``) or per single call (``per="call"``), by
    process, for every system that ran that measurement."""
    rows = []
    for system in results.get("systems", []):
        split = system.get(f"cpu_split_us_per_{per}")
        if not split:
            continue
        for role, micros in split.items():
            rows.append([system["name"], role, number(micros, 0)])
        rows.append([system["name"], "**total**",
                     f"**{number(system[f'cpu_us_per_{per}'], 0)}**"])
    return _table(["system", "process", f"CPU µs per {per}"], rows, "llr")


def machine_lines(machine: dict[str, Any]) -> list[str]:
    versions = ", ".join(f"{k} {v}" for k, v in machine.get("versions", {}).items())
    return [
        f"Machine: {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, "
        f"{number(machine.get('ram_gib'), 1)} GiB RAM, {machine.get('os', '?')}; "
        f"Python {machine.get('python', '?')}.",
        f"Versions: {versions}.",
    ]


def params_line(results: Results) -> str:
    p = results.get("params", {})
    return (f"Run: {results.get('mode', '?')} ({results.get('started', '?')}); "
            f"{p.get('workers')} workers; {p.get('tiny_tasks')} tiny tasks; "
            f"{p.get('round_trips')} sequential calls; {p.get('mid_tasks')} × "
            f"{(p.get('mid_bytes') or 0) // 1024} KiB map; 64 MiB best of {p.get('big_repeats')}; "
            f"{p.get('sleep_tasks')} × sleep({p.get('sleep_seconds')}).")


def scale_lines(scale: dict[str, Any]) -> list[str]:
    if "skipped" in scale:
        return ["## Scale", "", f"Skipped: {scale['skipped']}", ""]
    rows = [[label, value] for label, value in scale.get("rows", [])]
    return ["## Scale (coordinator alone)", "", *_table(["measure", "value"], rows, "lr"), ""]


def two_hosts_lines(section: dict[str, Any]) -> list[str]:
    if "skipped" in section:
        return ["## Two hosts", "", f"Skipped: {section['skipped']}", ""]
    rows = [[row["name"], number(row.get("mb_s"), 0), row.get("note", "")]
            for row in section.get("rows", [])]
    return ["## Two hosts (network namespaces, veth)", "",
            *_table(["path", "64 MiB round trip MB/s ↑", "note"], rows, "lrl"), ""]


def journal_cost_lines(section: dict[str, Any]) -> list[str]:
    title = ["## Journal cost (gpumesh tiny tasks/s, journal on disk vs in memory)", ""]
    if "failed" in section:
        return [*title, f"Failed: {section['failed']}", ""]
    rows = [[label, number(section.get(key), 0),
             ", ".join(number(r, 0) for r in section.get("rates", {}).get(which, []))]
            for label, key, which in (("journal on disk (default)", "on_tasks_per_s", "on"),
                                      ("journal in memory (--db :memory:)", "off_tasks_per_s",
                                       "off"))]
    cost = section.get("cost_percent")
    return [*title, *_table(["coordinator", "median tasks/s ↑", "rounds"], rows, "lrl"), "",
            f"On / off: {number(section.get('ratio'), 3)}× — the journal costs "
            f"{number(cost, 1)}% of throughput (target: at most 15%).", ""]


def markdown(results: Results) -> str:
    lines = ["# gpumesh benchmark", "", *machine_lines(results.get("machine", {})),
             params_line(results), "", "## Comparison", "", *comparison_table(results), "",
             "Ratio rows divide gpumesh's figure by the other system's: above 1 is better for ↑ "
             "columns, below 1 is better for ↓ columns.", "",
             "## Targets", "", *targets_table(results), "",
             "## CPU per tiny task, by process", "", *cpu_table(results), ""]
    if any(system.get("cpu_split_us_per_call") for system in results.get("systems", [])):
        lines += ["## CPU per single call, by process", "",
                  "The sequential calls of the p50/p99 columns: what each process spent per "
                  "call, on the call's path or beside it (a journal commit, acknowledgements).",
                  "", *cpu_table(results, "call"), ""]
    if "head_to_head" in results:
        lines += head_to_head_lines(results["head_to_head"])
    if "journal_cost" in results:
        lines += journal_cost_lines(results["journal_cost"])
    if "scale" in results:
        lines += scale_lines(results["scale"])
    if "two_hosts" in results:
        lines += two_hosts_lines(results["two_hosts"])
    return "\n".join(lines)


def to_json(results: Results) -> str:
    return json.dumps(results, indent=2, sort_keys=False, default=str)
