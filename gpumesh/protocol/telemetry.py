"""A worker's load figures as HEARTBEAT ``stats`` carries them (since 1.5), parsed and bounded.

They are only shown (``workers``, the dashboard), never scheduled on, so a malformed ``stats`` is
dropped and the rest of its HEARTBEAT still counts: a worker with a broken sampler keeps its
leases. Every number is checked for type and range like any other peer field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import fields as f
from .messages import ProtocolError

MAX_STAT_GPUS = 16
MAX_BYTES = 2**60  # a machine's RAM or a GPU's VRAM, as requirements.parse_size allows


@dataclass(frozen=True)
class GpuLoad:
    util: float | None  # percent busy; None when the driver does not say
    used: int  # VRAM bytes in use
    total: int

    def to_dict(self) -> dict[str, Any]:
        return {"util": self.util, "used": self.used, "total": self.total}


@dataclass(frozen=True)
class Telemetry:
    cpu: float | None  # percent of the whole machine
    ram_used: int
    ram_total: int
    gpus: tuple[GpuLoad, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"cpu": self.cpu, "ram": [self.ram_used, self.ram_total],
                "gpus": [g.to_dict() for g in self.gpus]}

    @classmethod
    def from_mapping(cls, raw: Any) -> Telemetry:
        """Raises a MALFORMED ProtocolError naming what is wrong."""
        if not isinstance(raw, dict) or len(raw) > 16:
            raise f.malformed("'stats' must be a map of at most 16 entries")
        used, total = _pair(raw.get("ram", [0, 0]), "ram")
        gpus = tuple(_gpu(g) for g in f.items(raw, "gpus", max_items=MAX_STAT_GPUS, default=[]))
        return cls(cpu=f.number(raw, "cpu", low=0.0, high=100.0, default=None),
                   ram_used=used, ram_total=total, gpus=gpus)


def _pair(value: Any, name: str) -> tuple[int, int]:
    """``[used, total]`` bytes, each an int 0..2^60, used never above total."""
    if not (isinstance(value, list) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_BYTES
            for v in value)):
        raise f.malformed(f"stats {name!r} must be [used, total] bytes")
    if value[0] > value[1]:
        raise f.malformed(f"stats {name!r}: more used than there is")
    return value[0], value[1]


def _gpu(raw: Any) -> GpuLoad:
    if not isinstance(raw, Mapping):
        raise f.malformed("stats 'gpus' must be a list of maps")
    used, total = _pair([raw.get("used", 0), raw.get("total", 0)], "gpus")
    return GpuLoad(util=f.number(raw, "util", low=0.0, high=100.0, default=None),
                   used=used, total=total)


def parse_stats(header: Mapping[str, Any]) -> Telemetry | None:
    """HEARTBEAT ``stats``, or None when absent or malformed (dropped, never fatal)."""
    raw = header.get("stats")
    if raw is None:
        return None
    try:
        return Telemetry.from_mapping(raw)
    except ProtocolError:
        return None
