"""A function as source code with plain-data arguments, for workers on another Python version.

cloudpickle's output is tied to the interpreter's minor version (bytecode, code object layout).
When the mesh has workers on another Python, each call also carries this portable form: the
function's source without its decorators, the module-level imports it names, and its arguments
as msgpack. It covers plain top-level functions with plain-data arguments (the spec's
Limitations section says so); anything else simply runs only where the Python matches.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import logging
import sys
import textwrap
import types
from collections.abc import Callable, Mapping
from typing import Any

import msgpack

log = logging.getLogger("gpumesh.client")

PLAIN_TYPES = (type(None), bool, int, float, str, bytes)


class SourceForm:
    """The portable form of one function: its name and the module text that defines it."""

    def __init__(self, name: str, text: str) -> None:
        self.name = name
        self.frame = text.encode("utf-8")

    def frames(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[bytes] | None:
        """[source, packed arguments], or None when the arguments are not plain data that
        msgpack gives back as they were (so the call gets the very values on either path)."""
        if not (all(_plain(a) for a in args) and _plain(dict(kwargs))):
            return None
        try:
            return [self.frame, msgpack.packb([list(args), dict(kwargs)], use_bin_type=True)]
        except (TypeError, ValueError, OverflowError):  # the pickle alone goes
            return None


def source_form(fn: Callable[..., Any]) -> SourceForm | str:
    """The portable form of ``fn``, or why it has none (a message for verbose mode)."""
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__name__", "")
    if code is None or not name.isidentifier():
        return "it is not a plain Python function"
    if code.co_freevars:
        return f"it closes over local variables ({', '.join(code.co_freevars)})"
    try:
        text = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(text)
    except (OSError, TypeError, SyntaxError) as exc:
        return f"its source is not available ({exc})"
    node = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == name), None)
    if node is None or isinstance(node, ast.AsyncFunctionDef):
        return "it is not defined by a plain def statement"
    node.decorator_list = []  # @mesh/@accelerate wrap it on the submitting side only
    node.returns = None  # annotations may name types the worker cannot import
    for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs,
                node.args.vararg, node.args.kwarg]:
        if arg is not None:
            arg.annotation = None
    imports = _module_imports(fn, _names(code))
    missing = _module_globals(fn, node, imports)
    if missing:
        return (f"it uses module-level names that do not travel as source "
                f"({', '.join(sorted(missing))})")
    return SourceForm(name, "\n".join([*imports, ast.unparse(node), ""]))


def _names(code: types.CodeType) -> set[str]:
    """The global names ``code`` reads, its comprehensions', lambdas' and inner functions'
    included (each is a code object of its own)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _module_imports(fn: Callable[..., Any], names: set[str]) -> list[str]:
    """The top-level import statements of ``fn``'s module that bind a name ``fn`` uses."""
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    try:
        tree = ast.parse(inspect.getsource(module)) if module is not None else None
    except (OSError, TypeError, SyntaxError):
        return []
    found = []
    for node in tree.body if tree is not None else []:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound = {(alias.asname or alias.name).split(".")[0] for alias in node.names}
            if bound & names:
                found.append(ast.unparse(node))
    return found


def _module_globals(fn: Callable[..., Any], node: ast.FunctionDef, imports: list[str]) -> set[str]:
    """Names the function reads from its module other than imports and builtins: constants and
    helpers defined there, which the source form would not carry."""
    bound = {node.name}
    for statement in imports:
        for parsed in ast.parse(statement).body:
            if isinstance(parsed, (ast.Import, ast.ImportFrom)):
                bound.update((alias.asname or alias.name).split(".")[0] for alias in parsed.names)
    assigned = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)
                and isinstance(n.ctx, (ast.Store, ast.Del))}
    arguments = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
    inner = {n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.ClassDef,
                                                              ast.AsyncFunctionDef))}
    module_names = set(getattr(fn, "__globals__", {}))
    read = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return {name for name in read - bound - assigned - arguments - inner
            if name in module_names and not hasattr(builtins, name)}


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether msgpack gives ``value`` back equal and of the same types: exact types only (an
    IntEnum or numpy float comes back a plain int or float), no tuples (they come back lists),
    integers msgpack holds (64 bits)."""
    if depth > 64:
        return False
    kind = type(value)
    if kind is int:
        return _INT_LOW <= value <= _INT_HIGH
    if kind in PLAIN_TYPES:
        return True
    if kind is list:
        return all(_plain(v, depth + 1) for v in value)
    if kind is dict:
        return all(type(k) is str and _plain(v, depth + 1) for k, v in value.items())
    return False


_INT_LOW, _INT_HIGH = -(2**63), 2**64 - 1
