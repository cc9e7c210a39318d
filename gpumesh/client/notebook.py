"""Jupyter: ``%load_ext gpumesh`` puts ``mesh`` in the notebook and registers ``%%mesh``.

``%%mesh`` runs the cell as usual (its output shows as any cell's), then wraps every function
the cell defined with ``@mesh``: calling it, or its ``.map``, runs on the mesh. What a task prints
appears in the cell that called it. The stop button raises KeyboardInterrupt in the waiting call,
which cancels that call's tasks on the mesh.
"""

from __future__ import annotations

import types
from typing import Any

from .decorators import MeshFunction, mesh


def load_ipython_extension(ipython: Any) -> None:
    ipython.push({"mesh": mesh})
    ipython.register_magic_function(_cell_magic(ipython), magic_kind="cell", magic_name="mesh")


def _cell_magic(ipython: Any) -> Any:
    def mesh_cell(line: str, cell: str) -> None:
        before = dict(ipython.user_ns)
        ipython.run_cell(cell)
        for name, value in list(ipython.user_ns.items()):
            if (isinstance(value, types.FunctionType) and before.get(name) is not value
                    and not isinstance(value, MeshFunction)):
                ipython.user_ns[name] = mesh(value)

    return mesh_cell
