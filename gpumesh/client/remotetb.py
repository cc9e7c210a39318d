"""Remote tracebacks with the caller's own source lines, as a local traceback would show them.

cloudpickle ships a function defined in the caller's script by value and names its code's file
``<dynamic-code>``, so a worker's traceback shows ``File "<dynamic-code>", line 12, in train``
with no source line. The line numbers are the caller's own: this finds the code object of that
name and line among the functions of ``__main__`` (what cloudpickle ships by value) and puts
back its file name and source line. Pure apart from reading ``__main__`` and ``linecache``.
"""

from __future__ import annotations

import linecache
import re
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

_LOCALIZED = "_gpumesh_localized"  # set on an error once its traceback was rewritten
_FRAME = re.compile(r'^(?P<indent>\s*)File "<dynamic-code>", line (?P<line>\d+), in (?P<name>\S+)$')


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _roots(namespace: dict[str, Any]) -> Iterator[types.CodeType]:
    for value in list(namespace.values()):
        for item in (value, _attribute(value, "__wrapped__"), _attribute(value, "fn")):
            code = _attribute(item, "__code__")
            if isinstance(code, types.CodeType):
                yield code
        if isinstance(value, type):
            for member in vars(value).values():
                member = _attribute(member, "__func__") or member
                code = _attribute(member, "__code__")
                if isinstance(code, types.CodeType):
                    yield code


def _attribute(value: Any, name: str) -> Any:
    """``getattr(value, name, None)`` that never raises: the caller's namespace holds objects
    whose ``__getattr__`` raises what it likes (gpumesh's own ``mesh`` without a saved
    configuration raises ConfigError), and the task's real error must not be traded for it."""
    try:
        return getattr(value, name, None)
    except Exception:
        return None


def _lines(code: types.CodeType) -> set[int]:
    return {line for _, _, line in code.co_lines() if line is not None}


def localize(text: str, roots: Iterable[types.CodeType] | None = None) -> str:
    """``text`` with each ``<dynamic-code>`` frame named after the caller's file and followed by
    its source line, when a code object of that name covers that line; others stay as they are."""
    if "<dynamic-code>" not in text:
        return text
    if roots is None:
        main = sys.modules.get("__main__")
        roots = _roots(vars(main)) if main is not None else ()
    codes = [c for root in roots for c in _codes(root)]
    out: list[str] = []
    lines = text.splitlines()
    for index, row in enumerate(lines):
        match = _FRAME.match(row)
        if match is None:
            out.append(row)
            continue
        number, name = int(match["line"]), match["name"]
        found = next((c for c in codes if c.co_name == name and number in _lines(c)), None)
        if found is None:
            out.append(row)
            continue
        indent = match["indent"]
        out.append(f'{indent}File "{found.co_filename}", line {number}, in {name}')
        source = linecache.getline(found.co_filename, number).strip()
        following = lines[index + 1] if index + 1 < len(lines) else ""
        if source and following.strip() != source:
            out.append(f"{indent}  {source}")  # two deeper than its File line, as Python's
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def localize_error(exc: BaseException) -> None:
    """Rewrite, in place, the remote traceback an error from a task carries (its
    ``remote_traceback`` and its note)."""
    remote = getattr(exc, "remote_traceback", None)
    if not isinstance(remote, str) or "<dynamic-code>" not in remote \
            or getattr(exc, _LOCALIZED, False):
        return
    try:
        setattr(exc, _LOCALIZED, True)  # once: a scan of __main__ each time it is read
        better = localize(remote)
    except Exception:  # a better traceback is a nicety: the task's error is what matters
        return
    if better == remote:
        return
    try:
        exc.remote_traceback = better  # type: ignore[attr-defined]
    except AttributeError:
        return
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, list):
        exc.__notes__ = [n.replace(remote, better) if isinstance(n, str) else n  # type: ignore[attr-defined]
                         for n in notes]
