"""The client: the futures engine, ``GPUMesh``, and the ``@mesh`` / ``@accelerate`` decorators."""

from .api import GPUMesh
from .decorators import Accelerate, DefaultMesh, MeshFunction, accelerate, mesh
from .engine import Engine, TaskFuture
from .launch import CoordinatorHandle, WorkerHandle
from .tasks import TaskOptions

__all__ = [
    "Accelerate",
    "CoordinatorHandle",
    "DefaultMesh",
    "Engine",
    "GPUMesh",
    "MeshFunction",
    "TaskFuture",
    "TaskOptions",
    "WorkerHandle",
    "accelerate",
    "mesh",
]
