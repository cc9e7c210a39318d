"""PNG plots of a results dict (matplotlib, headless). Missing matplotlib: no plots, one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .report import METRICS


def write_plots(results: dict[str, Any], out: Path) -> list[Path]:
    """The metrics side by side, the round-trip distributions, and CPU per task by process."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [s for s in results.get("systems", []) if s["status"] in ("ok", "partial")]
    written = []
    for name, draw in (("metrics.png", _metrics), ("latency.png", _latency), ("cpu.png", _cpu)):
        fig = draw(plt, ran)
        path = out / name
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def _colors(systems: list[dict[str, Any]]) -> list[str]:
    return ["tab:red" if s["key"] == "gpumesh" else "tab:gray" for s in systems]


def _metrics(plt: Any, systems: list[dict[str, Any]]) -> Any:
    rows = -(-len(METRICS) // 4)
    fig, axes = plt.subplots(rows, 4, figsize=(17, 3.75 * rows))
    for axis, metric in zip(axes.flat, METRICS, strict=False):
        shown = [s for s in systems if s.get(metric.key) is not None]
        axis.barh([s["name"] for s in shown], [s[metric.key] for s in shown],
                  color=_colors(shown))
        axis.set_title(metric.header)
        axis.invert_yaxis()
        if metric.key in ("tasks_per_s", "p50_ms", "p99_ms", "cpu_us_per_task"):
            axis.set_xscale("log")
    for unused in list(axes.flat)[len(METRICS):]:
        unused.axis("off")
    fig.suptitle("gpumesh (red) and the alternatives, same run, same machine")
    fig.tight_layout()
    return fig


def _latency(plt: Any, systems: list[dict[str, Any]]) -> Any:
    fig, axis = plt.subplots(figsize=(8, 5))
    for system in systems:
        samples = sorted(system.get("latencies_ms") or [])
        if not samples:
            continue
        fractions = [(i + 1) / len(samples) for i in range(len(samples))]
        axis.plot(samples, fractions, label=system["name"],
                  linewidth=2.5 if system["key"] == "gpumesh" else 1.2)
    axis.set_xscale("log")
    axis.set_xlabel("single-call round trip (ms)")
    axis.set_ylabel("fraction of calls")
    axis.set_title("Sequential no-op calls: round-trip distribution")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    return fig


def _cpu(plt: Any, systems: list[dict[str, Any]]) -> Any:
    fig, axis = plt.subplots(figsize=(9, 5))
    names = []
    for row, system in enumerate(s for s in systems if s.get("cpu_split_us_per_task")):
        names.append(system["name"])
        left = 0.0
        for role, micros in system["cpu_split_us_per_task"].items():
            axis.barh(row, micros, left=left, edgecolor="white")
            if micros > 0.06 * system["cpu_us_per_task"]:
                axis.text(left + micros / 2, row, role, ha="center", va="center", fontsize=7)
            left += micros
    axis.set_yticks(range(len(names)), names)
    axis.invert_yaxis()
    axis.set_xlabel("CPU µs per tiny task (all processes)")
    axis.set_title("Where each system spends CPU on a no-op task")
    return fig
