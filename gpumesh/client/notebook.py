"""Jupyter: ``%load_ext gpumesh`` puts ``mesh`` in the notebook and registers ``%%mesh``.

``%%mesh`` runs the cell as usual (its output shows as any cell's), then wraps every function
the cell itself defined with ``@mesh``: calling it, or its ``.map``, runs on the mesh. What the
cell imports or merely names again stays as it was. Within the cell itself, a function is
already the mesh's through ``.map``, ``.submit``, ``.aio``, ``.amap`` and ``.to`` (the spec's
``results = preprocess.map(...)`` in the cell that defines it; a ``def`` at the cell's top
level, not one inside an ``if`` or ``try``, which is wrapped after the cell), while a plain call
still runs here: a helper the cell calls, or applies as a decorator, as it defines the rest, runs as
written. A cell that raises fails as any cell does,
with its own error (nbclient and "Run all" stop there). A cell with a top-level ``await`` is
refused in Jupyter with what to do (the kernel's loop already runs the cell, so ``.aio`` and
``.amap`` are awaited in the next cell). What a task prints appears in the cell
that called it. The stop button raises KeyboardInterrupt in the waiting call, which cancels that
call's tasks on the mesh.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import inspect
import linecache
import types
from typing import Any

from ..errors import MeshError
from .decorators import InPlaceFunction, MeshFunction, mesh

# The name the cell's code calls, after each function it defines, to make it _CellFunction.
_AS_CELL_FUNCTION = "__gpumesh_cell_function__"


def load_ipython_extension(ipython: Any) -> None:
    ipython.push({"mesh": mesh})
    ipython.register_magic_function(_cell_magic(ipython), magic_kind="cell", magic_name="mesh")


def _cell_magic(ipython: Any) -> Any:
    def mesh_cell(line: str, cell: str) -> None:
        options = _magic_options(line)
        if _awaits_in_a_running_loop(ipython, cell):
            # The cell runs through a nested run_cell, which runs a cell that awaits with
            # run_until_complete on the kernel's own loop: running already, so it failed with
            # "This event loop is already running" after the cell's first lines.
            raise _usage_error(
                "%%mesh cannot run a cell with a top-level await in Jupyter: define the "
                "functions in the %%mesh cell, and await their .aio(...) or iterate their "
                ".amap(...) in the next cell")
        before = dict(ipython.user_ns)
        # The cell's own ExecutionResult: the inner run_cell replaces the displayhook's, and the
        # kernel's reply (ok or error) is read from this one.
        outer = ipython.displayhook.exec_result
        transformers = getattr(ipython, "ast_transformers", None)
        marking = _MarkDefinitions()
        ipython.user_ns[_AS_CELL_FUNCTION] = functools.partial(_CellFunction.of, options=options)
        if transformers is not None:
            transformers.append(marking)
        try:
            result = ipython.run_cell(cell)
        finally:
            ipython.displayhook.exec_result = outer
            if transformers is not None and marking in transformers:
                transformers.remove(marking)
            ipython.user_ns.pop(_AS_CELL_FUNCTION, None)
        source = _lines(ipython.transform_cell(cell))
        for name, value in list(ipython.user_ns.items()):
            if isinstance(value, _CellFunction):
                ipython.user_ns[name] = mesh(value.fn, **options)
            elif (isinstance(value, types.FunctionType) and before.get(name) is not value
                    and not isinstance(value, MeshFunction) and _returns_plainly(value)
                    and _defined_in(value, ipython.user_module.__name__, source)):
                ipython.user_ns[name] = mesh(value, **options)
        error = result.error_before_exec or result.error_in_exec
        if error is None:
            return
        if outer is None:
            raise error  # run outside a cell: nothing else would report the failure
        # The inner run_cell showed the traceback once already; failing the cell's result
        # makes the kernel reply "error" with it, without a second traceback.
        outer.error_in_exec = error

    return mesh_cell


def _awaits_in_a_running_loop(ipython: Any, cell: str) -> bool:
    should_run_async = getattr(ipython, "should_run_async", None)
    if should_run_async is None:
        return False
    try:
        # IPython 9.16 and later want the transformed cell too (a TypeError without it).
        if not should_run_async(cell, transformed_cell=ipython.transform_cell(cell)):
            return False
    except Exception:  # a cell IPython cannot read: run_cell says so, as for any cell
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False  # a terminal IPython runs the await itself
    return True


def _magic_options(line: str) -> dict[str, Any]:
    """``%%mesh gpu="A100", timeout=600``: the line's options, as ``@mesh(...)`` takes them.
    Literal values only (nothing on the line is run); an unknown name is refused, as
    ``@mesh`` refuses it, before the cell runs."""
    line = line.strip()
    if not line:
        return {}
    usage = (f"%%mesh takes @mesh's options as name=value pairs of literals, such as "
             f"%%mesh gpu=\"A100\", timeout=600; not {line!r}")
    try:
        call = ast.parse(f"_({line})", mode="eval").body
        if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
            raise ValueError("positional")
        options = {str(k.arg): ast.literal_eval(k.value) for k in call.keywords}
    except (SyntaxError, ValueError) as exc:
        raise _usage_error(usage) from exc
    try:
        mesh(**options)  # checks the names and values now, before the cell runs
    except (TypeError, ValueError, MeshError) as exc:
        raise _usage_error(f"%%mesh {line}: {exc}") from None
    return options


def _usage_error(text: str) -> Exception:
    try:
        from IPython.core.error import UsageError
    except ImportError:  # outside IPython (tests): the same words
        return ValueError(text)
    return UsageError(text)


def _returns_plainly(fn: types.FunctionType) -> bool:
    """A function whose call returns its value: coroutine and generator functions return what
    cannot leave a worker, and stay as the cell defined them."""
    return not (inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn)
                or inspect.isasyncgenfunction(fn))


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


class _CellFunction:
    """A function of a ``%%mesh`` cell while that cell runs: called, it runs here (a helper, a
    decorator the cell applies); its ``.map``, ``.submit``, ``.aio``, ``.amap`` and ``.to`` are
    the mesh's. After the cell it is replaced by ``mesh(fn)``; pickled, it is the function."""

    def __init__(self, fn: types.FunctionType, options: dict[str, Any] | None = None) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.options = options or {}  # the %%mesh line's, for .map and the rest in the cell too
        self._on_mesh: MeshFunction[Any, Any] | None = None

    @classmethod
    def of(cls, value: Any, options: dict[str, Any] | None = None) -> Any:
        """``value`` as a cell function when it is a plain function, else as it is (a name the
        decorators made into something else)."""
        if isinstance(value, types.FunctionType) and _returns_plainly(value):
            return cls(value, options)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> Any:
        return (InPlaceFunction, (self.fn,))

    def __repr__(self) -> str:
        return repr(self.fn)

    def _mesh(self) -> MeshFunction[Any, Any]:
        if self._on_mesh is None:
            self._on_mesh = mesh(self.fn, **self.options)
        return self._on_mesh

    def __getattr__(self, name: str) -> Any:
        if name in ("map", "submit", "aio", "amap", "to"):
            return getattr(self._mesh(), name)
        raise AttributeError(name)


class _MarkDefinitions(ast.NodeTransformer):
    """After each function the cell defines at its top level, ``name = mark(name)``."""

    def visit_Module(self, node: ast.Module) -> ast.Module:
        body: list[ast.stmt] = []
        for statement in node.body:
            body.append(statement)
            if isinstance(statement, ast.FunctionDef):
                name = statement.name
                mark = ast.Assign(
                    targets=[ast.Name(id=name, ctx=ast.Store())],
                    value=ast.Call(func=ast.Name(id=_AS_CELL_FUNCTION, ctx=ast.Load()),
                                   args=[ast.Name(id=name, ctx=ast.Load())], keywords=[]))
                body.append(ast.copy_location(mark, statement))
        node.body = body
        return ast.fix_missing_locations(node)
