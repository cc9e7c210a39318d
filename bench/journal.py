"""What the coordinator's journal costs: gpumesh tiny-task throughput with its SQLite journal on
disk (as ``gpumesh serve`` runs by default) and in memory (``serve --db :memory:``), the same
workers and client code otherwise. Both meshes run side by side and the maps alternate between
them, so the machine's noise falls on both alike; the median of the rounds is reported."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from .params import Params
from .systems.gpumesh_system import CALL_TIMEOUT, Mesh, wait_for_workers
from .tasks import noop

ROUNDS = 3


def run_journal_cost(params: Params, *, log: Callable[[str], None]) -> dict[str, Any]:
    meshes = {"on": Mesh.fresh(), "off": Mesh.fresh(journal=False)}
    clients: dict[str, Any] = {}
    rates: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for mesh in meshes.values():
            mesh.start_coordinator()
            for _ in range(params.workers):
                mesh.add_worker(prefetch=params.gpumesh_prefetch)
        for name, mesh in meshes.items():
            mesh.wait_listening()
            clients[name] = mesh.client()
            wait_for_workers(clients[name], params.workers)
            clients[name].map(noop, list(range(params.warmup_tasks)), timeout=CALL_TIMEOUT)
        items = list(range(params.tiny_tasks))
        for round_ in range(ROUNDS):
            for name in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
                started = time.perf_counter()
                results = clients[name].map(noop, items, timeout=CALL_TIMEOUT)
                rates[name].append(len(items) / (time.perf_counter() - started))
                if results != items:
                    raise RuntimeError("the map returned wrong results")
            log(f"journal cost: round {round_ + 1} of {ROUNDS} done")
    except Exception as exc:
        log(f"journal cost: FAILED: {type(exc).__name__}: {exc}")
        return {"failed": f"{type(exc).__name__}: {exc}", "rates": rates}
    finally:
        for client in clients.values():
            client.close()
        for mesh in meshes.values():
            mesh.stop()
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    return {"rounds": ROUNDS, "tasks": params.tiny_tasks, "rates": rates,
            "on_tasks_per_s": on, "off_tasks_per_s": off, "ratio": on / off,
            "cost_percent": (1 - on / off) * 100}
