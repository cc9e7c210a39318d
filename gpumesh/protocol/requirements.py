"""What a task needs of a worker (``gpu``, ``cores``, ``memory``, ``vram``, ``python``), sizes
like ``16GB``, and the one rule for whether a GPU satisfies a need.

The client parses these from payload keys and decorator options, the coordinator from a SUBMIT
spec, the scheduler filters with them, and the worker agent uses ``gpu_satisfies`` to pick the
slot whose own GPU fits: one rule in one place.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_PYTHON = re.compile(r"\d{1,2}\.\d{1,3}")

MAX_SIZE = 2**60  # an exabyte: past any machine, and far inside int64
MAX_CORES = 4096
MAX_GPU_NAME = 200


def parse_size(value: Any) -> int:
    """``16GB``, ``512MiB``, ``2g`` or a plain number of bytes, as bytes (0..2**60)."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or not 0 <= value <= MAX_SIZE:
            raise ValueError(f"a size must be 0-{MAX_SIZE} bytes, not {value!r}")
        return int(value)
    if not isinstance(value, str) or len(value) > 32:
        raise ValueError(f"not a size: {_short(value)} (use e.g. '16GB' or '512MiB')")
    match = _SIZE.match(value)
    if not match:
        raise ValueError(f"not a size: {value!r} (use e.g. '16GB' or '512MiB')")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    letter = unit[:1] if unit[:1] in "kmgtp" else ""
    scale = 1024 ** ("kmgtp".index(letter) + 1) if "i" in unit and letter else _DECIMAL[letter]
    return parse_size(number * scale)


def parse_python(value: Any) -> str:
    """A Python ``major.minor`` such as ``3.11``."""
    if not isinstance(value, str) or not _PYTHON.fullmatch(value):
        raise ValueError(f"python must be a version such as '3.11', not {_short(value)}")
    return value


@dataclass(frozen=True)
class Requirements:
    gpu: str | bool | None = None
    cores: int | None = None
    memory: int | None = None
    vram: int | None = None
    python: str | None = None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Requirements:
        """Read the scheduler's keys from a task spec or payload dict; others are ignored.

        Raises ValueError naming the field for any value of the wrong type or range."""
        gpu = data.get("gpu")
        if gpu is not None and not isinstance(gpu, (str, bool)):
            raise ValueError(f"gpu must be a model name or true, not {_short(gpu)}")
        if isinstance(gpu, str) and len(gpu) > MAX_GPU_NAME:
            raise ValueError(f"gpu must be a model name of at most {MAX_GPU_NAME} characters")
        cores = data.get("cores")
        if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int)
                                  or not 1 <= cores <= MAX_CORES):
            raise ValueError(f"cores must be a whole number 1-{MAX_CORES}, not {_short(cores)}")
        memory, vram, python = data.get("memory"), data.get("vram"), data.get("python")
        return cls(
            gpu=gpu if gpu not in (False, "") else None,
            cores=cores,
            memory=_size_field("memory", memory),
            vram=_size_field("vram", vram),
            python=parse_python(python) if python is not None else None,
        )

    def to_mapping(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    def describe(self) -> str:
        parts = []
        if self.gpu is True:
            parts.append("a GPU")
        elif self.gpu:
            parts.append(f"gpu={self.gpu!r}")
        if self.cores:
            parts.append(f"cores>={self.cores}")
        if self.memory:
            parts.append(f"memory>={self.memory / 1e9:.1f}GB")
        if self.vram:
            parts.append(f"vram>={self.vram / 1e9:.1f}GB")
        if self.python:
            parts.append(f"Python {self.python}")
        return ", ".join(parts) or "nothing"


@dataclass(frozen=True)
class Gpu:
    name: str
    vram: int = 0


def gpu_satisfies(gpu: Gpu, model: str | bool | None, vram: int | None) -> bool:
    """Whether one GPU meets a task's ``gpu`` (model substring, or True) and ``vram`` needs."""
    if isinstance(model, str) and model.lower() not in gpu.name.lower():
        return False
    return not vram or gpu.vram >= vram


def _size_field(name: str, value: Any) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
