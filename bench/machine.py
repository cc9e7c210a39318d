"""What the figures were measured on: CPU, cores, memory, OS, Python, library versions."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ["gpumesh", "pyzmq", "msgpack", "cloudpickle", "numpy", "ray", "dask", "distributed",
            "psutil", "matplotlib"]


def describe() -> dict[str, Any]:
    import zmq

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    versions["libzmq"] = zmq.zmq_version()
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "ram_gib": _ram_gib(),
            "os": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "versions": versions}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return None
