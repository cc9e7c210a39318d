"""The systems under comparison, each behind the same small interface (``base.System``)."""

from __future__ import annotations

from .base import System
from .dask_system import DaskSystem
from .floor import FloorSystem
from .gpumesh_system import GpumeshSystem
from .pools import PoolSystem, ProcessPoolSystem
from .ray_system import RaySystem

# The order of the table: the floor first, gpumesh last, so each ratio row reads downwards.
ALL: list[type[System]] = [FloorSystem, PoolSystem, ProcessPoolSystem, DaskSystem, RaySystem,
                           GpumeshSystem]

__all__ = ["ALL", "System"]
