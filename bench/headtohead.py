"""gpumesh and the floor in alternating rounds: both running at once, each round a tiny-task map
and the sequential calls on one then the other (the order flips every round), so that the
drift of a shared machine falls on both alike. On the 2-core test VM the floor's own
throughput swung from 2,800 to 7,000 tasks/s between runs minutes apart, so a ratio of two
figures measured a minute apart (the comparison table's) can say more about the minute than
about the systems; the per-round ratios and their median are what the two floor targets are
judged by here as well."""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable
from typing import Any

from .measure import describe, round_trips, throughput
from .params import Params
from .systems.base import System
from .systems.floor import FloorSystem
from .systems.gpumesh_system import GpumeshSystem
from .tasks import noop

ROUNDS = 5
QUICK_ROUNDS = 3
FIGURES = ("tasks_per_s", "p50_ms", "p99_ms")


def run_head_to_head(params: Params, *, rounds: int, log: Callable[[str], None]
                     ) -> dict[str, Any]:
    systems: dict[str, System] = {"floor": FloorSystem(params), "gpumesh": GpumeshSystem(params)}
    measured: list[dict[str, dict[str, float]]] = []
    try:
        for system in systems.values():
            system.start()
        for system in systems.values():
            system.wait_ready()
            system.map(noop, list(range(params.warmup_tasks)))
        for round_ in range(rounds):
            order = ("floor", "gpumesh") if round_ % 2 == 0 else ("gpumesh", "floor")
            figures: dict[str, dict[str, float]] = {}
            for name in order:
                gc.collect()
                found = {**throughput(systems[name], params), **round_trips(systems[name], params)}
                figures[name] = {key: float(found[key]) for key in FIGURES}
            measured.append(figures)
            log(f"head to head: round {round_ + 1} of {rounds} done")
    except Exception as exc:  # reported in the section; the rest of the run goes on
        failure = describe(exc)
        log(f"head to head: FAILED: {failure}")
        return {"failed": failure, "rounds": measured}
    finally:
        for system in systems.values():
            try:
                system.stop()
            except Exception as exc:
                log(f"head to head: stopping {system.name} failed: {type(exc).__name__}: {exc}")
    return {"rounds": measured, **summarize(measured)}


def summarize(measured: list[dict[str, dict[str, float]]]) -> dict[str, float]:
    """The medians of the per-round ratios (gpumesh over the floor) and of gpumesh's per-round
    p99; nothing for a figure no round could give."""
    def ratios(key: str) -> list[float]:
        return [r["gpumesh"][key] / r["floor"][key] for r in measured if r["floor"][key]]

    found = {"tasks_ratio": ratios("tasks_per_s"), "p50_ratio": ratios("p50_ms"),
             "gpumesh_p99_ms": [r["gpumesh"]["p99_ms"] for r in measured]}
    return {key: statistics.median(values) for key, values in found.items() if values}
