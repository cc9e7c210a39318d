"""Jupyter: ``%load_ext gpumesh`` puts ``mesh`` in the notebook and registers ``%%mesh``.

``%%mesh`` runs the cell as usual (its output shows as any cell's), then wraps every function
the cell itself defined with ``@mesh``: calling it, or its ``.map``, runs on the mesh. What the
cell imports or merely names again stays as it was. A cell that raises fails as any cell does,
with its own error (nbclient and "Run all" stop there). What a task prints appears in the cell
that called it. The stop button raises KeyboardInterrupt in the waiting call, which cancels that
call's tasks on the mesh.
"""

from __future__ import annotations

import inspect
import linecache
import types
from typing import Any

from .decorators import MeshFunction, mesh


def load_ipython_extension(ipython: Any) -> None:
    ipython.push({"mesh": mesh})
    ipython.register_magic_function(_cell_magic(ipython), magic_kind="cell", magic_name="mesh")


def _cell_magic(ipython: Any) -> Any:
    def mesh_cell(line: str, cell: str) -> None:
        before = dict(ipython.user_ns)
        # The cell's own ExecutionResult: the inner run_cell replaces the displayhook's, and the
        # kernel's reply (ok or error) is read from this one.
        outer = ipython.displayhook.exec_result
        try:
            result = ipython.run_cell(cell)
        finally:
            ipython.displayhook.exec_result = outer
        source = _lines(ipython.transform_cell(cell))
        for name, value in list(ipython.user_ns.items()):
            if (isinstance(value, types.FunctionType) and before.get(name) is not value
                    and not isinstance(value, MeshFunction)
                    and _defined_in(value, ipython.user_module.__name__, source)):
                ipython.user_ns[name] = mesh(value)
        error = result.error_before_exec or result.error_in_exec
        if error is None:
            return
        if outer is None:
            raise error  # run outside a cell: nothing else would report the failure
        # The inner run_cell showed the traceback once already; failing the cell's result
        # makes the kernel reply "error" with it, without a second traceback.
        outer.error_in_exec = error

    return mesh_cell


def _lines(text: str) -> list[str]:
    return [line + "\n" for line in text.splitlines()]


def _defined_in(fn: types.FunctionType, module: str, source: list[str]) -> bool:
    """Whether ``fn`` (or what it wraps, for a decorated function) was compiled from the cell:
    IPython keeps each cell's code in linecache under the name its functions carry. The module
    test first: an imported function's file is never read for the comparison."""
    if fn.__module__ != module:
        return False
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return code is not None and linecache.getlines(code.co_filename) == source
