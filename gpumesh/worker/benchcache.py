"""The join benchmark's figures, kept per machine: a worker's score (which placement ranks
workers by) should not move with every restart, nor with whatever else the machine was doing
during one measurement. ``join --rebenchmark`` measures again."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..fileio import replace_private

CACHE_FILE = "benchmark.json"
BENCHMARK_VERSION = 3  # the method (median of rounds; one BLAS thread): a change measures again
MAX_AGE = 30 * 86400.0  # seconds: drivers and clocks change; a month-old figure is measured again


def hardware_key(inventory: dict[str, Any]) -> str:
    """What the figures depend on: the device, its GPUs, the cores; and the method."""
    gpus = [[str(g.get("name", "")), g.get("vram"), str(g.get("backend", ""))]
            for g in inventory.get("gpus", []) if isinstance(g, dict)]
    material = json.dumps([BENCHMARK_VERSION, inventory.get("device"), inventory.get("device_name"),
                           inventory.get("cores"), gpus], sort_keys=True, default=str)
    return hashlib.sha256(material.encode()).hexdigest()[:32]


def measured(home: Path, inventory: dict[str, Any], *, rerun: bool,
             run: Callable[[dict[str, Any]], dict[str, float]],
             now: float | None = None) -> tuple[dict[str, float], float | None]:
    """(figures, when they were measured if they came from the cache, else None)."""
    now = time.time() if now is None else now
    key = hardware_key(inventory)
    path = home / CACHE_FILE
    if not rerun:
        cached = _read(path)
        if cached is not None and cached.get("key") == key \
                and 0 <= now - float(cached.get("at", 0)) < MAX_AGE:
            figures = cached.get("figures")
            if isinstance(figures, dict) and _valid(figures):
                return {k: float(figures[k]) for k in ("gflops", "bandwidth_gbps")}, \
                    float(cached["at"])
    figures = run(inventory)
    try:
        replace_private(path, json.dumps({"key": key, "at": now, "figures": figures}).encode())
    except OSError:
        pass  # a cache: not having it only costs a measurement next time
    return figures, None


def _valid(figures: dict[str, Any]) -> bool:
    return all(isinstance(figures.get(k), (int, float)) and not isinstance(figures.get(k), bool)
               and 0 <= figures[k] < 1e9 for k in ("gflops", "bandwidth_gbps"))


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
