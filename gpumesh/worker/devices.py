"""What this machine offers: the device inventory and a short benchmark that gives it a score.

``score = gflops * 0.7 + bandwidth_gbps * 0.3`` (a CPU's on one core): relative and unbounded,
only meaningful next to the other workers of the same mesh. torch is imported only when it is
installed and only here.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import shutil
import socket
import statistics
import sys
import time
from typing import Any

import cloudpickle

from .._version import __version__

log = logging.getLogger("gpumesh.worker")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def total_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _torch() -> Any | None:
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    return torch


def gpu_driver_present() -> bool:
    """Whether this machine could have a GPU torch would see, judged without importing torch
    (about a second on a CPU-only machine, on the path of every `join`): an NVIDIA or AMD
    driver's device files on Linux, Apple silicon (MPS), nvidia-smi elsewhere."""
    system = platform.system()
    if system == "Linux":
        return (os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/kfd")
                or os.path.exists("/dev/nvidia0") or os.path.exists("/dev/dxg"))  # dxg: WSL2
    if system == "Darwin":
        return platform.machine() == "arm64"
    return shutil.which("nvidia-smi") is not None


def _installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpus(torch: Any | None = None) -> list[dict[str, Any]]:
    """One entry per usable GPU: CUDA devices, or Apple's MPS as one device."""
    torch = torch if torch is not None else _torch()
    if torch is None:
        return []
    found = []
    try:
        # These raise where the driver and this torch's CUDA disagree, a GPU fell off the
        # bus, or CUDA_VISIBLE_DEVICES names one that is not there.
        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(index)
                found.append({"index": index, "name": props.name,
                              "vram": int(props.total_memory), "backend": "cuda"})
            return found
    except Exception as exc:
        log.warning("torch cannot use this machine's GPUs (%s: %s): it works as a CPU worker; "
                    "'gpumesh doctor' says more", type(exc).__name__, " ".join(str(exc).split())[:200])
        return []
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        found.append({"index": 0, "name": "Apple MPS", "vram": 0, "backend": "mps"})
    return found


# A JSON object whose keys replace probed values, e.g. {"gpus": [{"name": "A100", "vram": 4e10}]}.
# For tests and demos of placement on one machine; a GPU given here is never used by torch.
TEST_INVENTORY_VARIABLE = "GPUMESH_TEST_INVENTORY"


def probe(torch_probe: bool = True) -> dict[str, Any]:
    """The inventory sent in HELLO (no benchmark figures yet)."""
    torch = _torch() if torch_probe and gpu_driver_present() else None
    found = gpus(torch) if torch is not None else []
    name = found[0]["name"] if found else cpu_name()
    inventory = {
        "hostname": socket.gethostname(),
        "device": "GPU" if found else "CPU",
        "device_name": name,
        "cores": os.cpu_count() or 1,
        "memory": total_memory(),
        "gpus": found,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "python_full": platform.python_version(),
        "platform": platform.system(),
        "cloudpickle": cloudpickle.__version__,
        "gpumesh": __version__,
        "torch": (getattr(torch, "__version__", None) if torch is not None
                  else _installed_version("torch")),
    }
    return _apply_test_inventory(inventory, os.environ.get(TEST_INVENTORY_VARIABLE))


def _apply_test_inventory(inventory: dict[str, Any], text: str | None) -> dict[str, Any]:
    if not text:
        return inventory
    try:
        override = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{TEST_INVENTORY_VARIABLE} is not valid JSON: {exc}") from None
    if not isinstance(override, dict):
        raise ValueError(f"{TEST_INVENTORY_VARIABLE} must be a JSON object")
    fake_gpus = override.get("gpus")
    if isinstance(fake_gpus, list):
        override["gpus"] = [{"index": i, "vram": 0, "backend": "fake", **g}
                            for i, g in enumerate(fake_gpus) if isinstance(g, dict)]
        if override["gpus"]:
            override.setdefault("device", "GPU")
            override.setdefault("device_name", override["gpus"][0].get("name", "GPU"))
    return {**inventory, **override}


def benchmark(inventory: dict[str, Any], budget: float = 1.0) -> dict[str, float]:
    """GFLOP/s from a matrix multiply and GB/s from a large copy, within about ``budget`` s."""
    if inventory.get("gpus") and inventory["gpus"][0].get("backend") in ("cuda", "mps"):
        torch = _torch()
        if torch is not None:
            return _benchmark_torch(torch, inventory["gpus"][0], budget)
    return _benchmark_cpu(budget)


def score_of(figures: dict[str, float]) -> float:
    return round(figures["gflops"] * 0.7 + figures["bandwidth_gbps"] * 0.3, 3)


ROUNDS = 5  # the benchmark's rounds: its figure is the median of their bests


def _timed(fn: Any, budget: float, *, rounds: int = ROUNDS,
           clock: Any = time.perf_counter) -> float:
    """Seconds per call of ``fn``: the median over ``rounds`` rounds of each round's best call.

    One best over the whole budget swung 6x between runs on a busy machine (a burst of other
    work, or of this process's own start-up, lands in one round): the median of several
    rounds' bests leaves out such a round, so the same machine gets the same score.
    """
    fn()  # warm up: caches, lazy initialisation, the BLAS thread pool
    bests = []
    for _ in range(rounds):
        best = float("inf")
        deadline = clock() + budget / rounds
        calls = 0
        while calls < 3 or (clock() < deadline and calls < 20):
            start = clock()
            fn()
            best = min(best, clock() - start)
            calls += 1
        bests.append(best)
    return statistics.median(bests)


# Every BLAS's thread-count variable: the CPU benchmark measures one core (see _benchmark_cpu).
ONE_BLAS_THREAD = {name: "1" for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                          "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                                          "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")}
# The child imports this very gpumesh (argv[2] is the folder it was imported from).
_IN_CHILD = ("import json, sys; sys.path.insert(0, sys.argv[2]); "
             "from gpumesh.worker.devices import _benchmark_numpy; "
             "print(json.dumps(_benchmark_numpy(float(sys.argv[1]))))")


def _benchmark_cpu(budget: float) -> dict[str, float]:
    """One core's figures, measured in a child process whose BLAS runs one thread.

    A multi-threaded BLAS made the score swing 10x on a machine with other work (measured on 2
    cores under load: each 512x512 matmul took either 1.5 ms or 24 ms, a scheduler tick, as
    one BLAS thread waited for a core another process held; ``bench/stability.py``). One thread
    waits for nobody. It is also about what one task gets: a worker runs a task per slot, and
    a CPU worker has a slot per core (up to four). The variables are read when the BLAS loads,
    hence the child; if it cannot run, the figures are measured here instead.
    """
    import subprocess

    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        done = subprocess.run([sys.executable, "-c", _IN_CHILD, repr(budget), package_root],
                              env={**os.environ, **ONE_BLAS_THREAD},
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=60 + 10 * budget, check=True)
        figures = json.loads(done.stdout)
        return {key: float(figures[key]) for key in ("gflops", "bandwidth_gbps", "backend")}
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError) as exc:
        # Said, because figures from here may swing with the machine's other work.
        why = getattr(exc, "stderr", None) or str(exc)
        log.warning("the benchmark's one-thread process failed (%s): measuring in this "
                    "process instead", why.strip().splitlines()[-1][:200] if why.strip() else exc)
        return _benchmark_numpy(budget)


def _benchmark_numpy(budget: float) -> dict[str, float]:
    """The CPU figures with numpy (without it, in pure Python)."""
    try:
        import numpy as np
    except ImportError:
        return _benchmark_pure_python(budget)
    n = 512
    a = np.random.default_rng(0).random((n, n), dtype=np.float32)
    b = np.random.default_rng(1).random((n, n), dtype=np.float32)
    seconds = _timed(lambda: a @ b, budget / 2)
    gflops = 2 * n**3 / seconds / 1e9
    src = np.ones(16 * 1024 * 1024 // 4, dtype=np.float32)
    dst = np.empty_like(src)
    seconds = _timed(lambda: np.copyto(dst, src), budget / 2)
    bandwidth = 2 * src.nbytes / seconds / 1e9  # read + write
    return {"gflops": round(gflops, 3), "bandwidth_gbps": round(bandwidth, 3), "backend": 0.0}


def _benchmark_pure_python(budget: float) -> dict[str, float]:
    n = 40
    a = [[float(i * j % 7) for j in range(n)] for i in range(n)]

    def matmul() -> None:
        cols = list(zip(*a, strict=True))
        [[sum(x * y for x, y in zip(row, col, strict=True)) for col in cols] for row in a]

    seconds = _timed(matmul, budget / 2)
    blob = bytes(8 * 1024 * 1024)
    copy_seconds = _timed(lambda: bytearray(blob), budget / 2)
    return {"gflops": round(2 * n**3 / seconds / 1e9, 3),
            "bandwidth_gbps": round(2 * len(blob) / copy_seconds / 1e9, 3), "backend": 0.0}


def _benchmark_torch(torch: Any, gpu: dict[str, Any], budget: float) -> dict[str, float]:
    device = torch.device("mps" if gpu.get("backend") == "mps" else f"cuda:{gpu.get('index', 0)}")
    sync = torch.cuda.synchronize if device.type == "cuda" else torch.mps.synchronize
    n = 4096
    a = torch.randn(n, n, device=device, dtype=torch.float32)
    b = torch.randn(n, n, device=device, dtype=torch.float32)

    def matmul() -> None:
        a @ b
        sync()

    seconds = _timed(matmul, budget / 2)
    src = torch.empty(256 * 1024 * 1024 // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        sync()

    copy_seconds = _timed(copy, budget / 2)
    return {"gflops": round(2 * n**3 / seconds / 1e9, 3),
            "bandwidth_gbps": round(2 * src.numel() * 4 / copy_seconds / 1e9, 3), "backend": 1.0}
