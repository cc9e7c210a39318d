"""The worker's load figures for its heartbeats: CPU, RAM and per-GPU use, sampled off the loop.

A daemon thread samples every SAMPLE_EVERY seconds; the agent's loop only reads the latest
sample (``latest()``, a plain attribute read), so a slow ``nvidia-smi`` never delays a
heartbeat. GPUs are read with ``nvidia-smi`` when it is on PATH, else through NVML as torch
exposes it when torch is already imported (the agent never imports torch for this, and never
calls anything that would open a CUDA context: that would hold VRAM on every GPU), else not at
all. CPU and RAM come from psutil when installed, else /proc.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("gpumesh.worker")

SAMPLE_EVERY = 2.0  # seconds between samples: heartbeats carry the latest one
SMI_TIMEOUT = 5.0  # seconds an nvidia-smi call may take before the sampler gives up on it
SMI_QUERY = ["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used,memory.total",
             "--format=csv,noheader,nounits"]
MIB = 1024 * 1024


class Sampler:
    """Samples in the background; ``latest()`` is what the next HEARTBEAT carries."""

    def __init__(self, gpu_indices: Sequence[int] | None = None,
                 interval: float = SAMPLE_EVERY) -> None:
        self.gpu_indices = list(gpu_indices) if gpu_indices else None
        self.interval = interval
        self._latest: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cpu = CpuMeter()
        self._gpus: Callable[[], list[dict[str, Any]]] | None = gpu_reader()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpumesh-telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def latest(self) -> dict[str, Any] | None:
        return self._latest

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._latest = self.sample()
            except Exception:  # a sampler bug costs the figures, never the worker
                log.debug("telemetry sample failed", exc_info=True)
            self._stop.wait(self.interval)

    def sample(self) -> dict[str, Any]:
        used, total = memory()
        stats: dict[str, Any] = {"ram": [used, total]}
        cpu = self._cpu.percent()
        if cpu is not None:
            stats["cpu"] = cpu
        gpus: list[dict[str, Any]] = []
        if self._gpus is not None:
            try:
                gpus = self._gpus()
            except Exception as exc:
                log.debug("reading GPU use failed (%s); not asking again", exc)
                self._gpus = None
        if self.gpu_indices is not None:
            gpus = [g for g in gpus if g.get("index") in self.gpu_indices]
        stats["gpus"] = [{k: v for k, v in g.items() if k != "index"} for g in gpus[:16]]
        return stats


class CpuMeter:
    """CPU busy percent since the previous call (the first call primes it and says None)."""

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None
        try:
            import psutil

            self._psutil: Any = psutil
            psutil.cpu_percent(interval=None)  # primes psutil's own counter
        except ImportError:
            self._psutil = None

    def percent(self) -> float | None:
        if self._psutil is not None:
            return min(max(float(self._psutil.cpu_percent(interval=None)), 0.0), 100.0)
        try:
            with open("/proc/stat", encoding="ascii") as handle:
                fields = [float(v) for v in handle.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle, total = fields[3] + (fields[4] if len(fields) > 4 else 0.0), sum(fields)
        last, self._last = self._last, (idle, total)
        if last is None or total <= last[1]:
            return None
        return round(100.0 * (1.0 - (idle - last[0]) / (total - last[1])), 1)


def memory() -> tuple[int, int]:
    """(used, total) bytes of RAM; used is what is not available to new programs."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total - vm.available), int(vm.total)
    except ImportError:
        pass
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    total = info.get("MemTotal", 0)
    return min(max(total - info.get("MemAvailable", total), 0), total), total


def gpu_reader() -> Callable[[], list[dict[str, Any]]] | None:
    """How this machine's GPU use is read, or None when it cannot be."""
    if shutil.which("nvidia-smi"):
        return read_nvidia_smi
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and getattr(cuda, "is_available", lambda: False)() \
            and hasattr(cuda, "utilization") and hasattr(cuda, "device_memory_used"):
        return lambda: read_torch_nvml(cuda)
    return None


def read_nvidia_smi() -> list[dict[str, Any]]:
    out = subprocess.run(SMI_QUERY, capture_output=True, text=True, timeout=SMI_TIMEOUT,
                         check=True, env={**os.environ, "LC_ALL": "C"}).stdout
    return parse_smi(out)


def parse_smi(text: str) -> list[dict[str, Any]]:
    """``index, util %, used MiB, total MiB`` lines; '[N/A]' (some boards) reads as unknown."""
    found = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4 or not parts[0].isdigit():
            continue
        util, used, total = (_number(p) for p in parts[1:])
        total_bytes = int((total or 0) * MIB)
        found.append({"index": int(parts[0]), "util": None if util is None else min(util, 100.0),
                      "used": min(int((used or 0) * MIB), total_bytes), "total": total_bytes})
    return found


def read_torch_nvml(cuda: Any) -> list[dict[str, Any]]:
    """Through torch's NVML calls, which open no CUDA context (mem_get_info would)."""
    found = []
    for index in range(cuda.device_count()):
        total = int(cuda.get_device_properties(index).total_memory)
        used = min(int(cuda.device_memory_used(index)), total)
        found.append({"index": index, "util": float(cuda.utilization(index)), "used": used,
                      "total": total})
    return found


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return min(max(value, 0.0), 1e12)
