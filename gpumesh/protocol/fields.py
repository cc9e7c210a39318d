"""Typed readers for header fields: type, range and size checked, or a MALFORMED ProtocolError.

Everything a peer sends is hostile until it has passed one of these. msgpack gives back only
None, bool, int, float, str, bytes, list and dict, so each reader names the one type it takes
(bool is never accepted where a number is asked for) and the bounds that keep it harmless to
store, journal and compare.
"""

from __future__ import annotations

import enum
import math
import re
import reprlib
import unicodedata
from collections.abc import Mapping
from typing import Any, TypeVar, overload

from .messages import ErrorCode, ProtocolError

E = TypeVar("E", bound=enum.Enum)
D = TypeVar("D")

# A value that stands for "the field is required": a reader called without a default raises
# when the field is missing.
_REQUIRED: Any = object()

INT64 = 2**63 - 1
# A version as pip takes it (epoch, local part and all), short: it is quoted in messages that
# say what to install, so nothing else a peer or a LAN advertisement sends may pass for one.
VERSION_TEXT = re.compile(r"[0-9][0-9A-Za-z.!+_-]{0,31}")


def for_terminal(text: str) -> str:
    """Text a peer sent (another user's task error or output, a coordinator's message) made
    safe to print: control characters other than newline and tab, an escape code's ESC among
    them, are written out as ``\\x1b`` rather than sent to the terminal to act on."""
    if text.isprintable():
        return text
    # Spaces other than ASCII's (no-break, ideographic: Zs) are not printable to Python but
    # act on nothing: French and CJK text keeps them.
    return "".join(c if c.isprintable() or c in "\n\t" or unicodedata.category(c) == "Zs"
                   else repr(c)[1:-1] for c in text)


def malformed(detail: str) -> ProtocolError:
    return ProtocolError(ErrorCode.MALFORMED, detail)


def _get(header: Mapping[str, Any], name: str, default: Any) -> Any:
    value = header.get(name, default)
    if value is _REQUIRED:
        raise malformed(f"header field {name!r} is missing")
    return value


# Each reader has two signatures: without ``default`` the field is required and the result is of
# the reader's type; with one, the result may also be the default (often None).


@overload
def text(header: Mapping[str, Any], name: str, *, max_len: int, min_len: int = 0) -> str: ...
@overload
def text(header: Mapping[str, Any], name: str, *, max_len: int, default: D,
         min_len: int = 0) -> str | D: ...
def text(header: Mapping[str, Any], name: str, *, max_len: int, default: Any = _REQUIRED,
         min_len: int = 0) -> Any:
    """A str of ``min_len``..``max_len`` characters (or ``default`` when absent)."""
    value = _get(header, name, default)
    if value is default and default is not _REQUIRED:
        return value
    if not isinstance(value, str):
        raise malformed(f"{name!r} must be a string, not {type(value).__name__}")
    if not min_len <= len(value) <= max_len:
        raise malformed(f"{name!r} must be {min_len}-{max_len} characters, not {len(value)}")
    return value


@overload
def integer(header: Mapping[str, Any], name: str, *, low: int, high: int) -> int: ...
@overload
def integer(header: Mapping[str, Any], name: str, *, low: int, high: int,
            default: D) -> int | D: ...
def integer(header: Mapping[str, Any], name: str, *, low: int, high: int,
            default: Any = _REQUIRED) -> Any:
    """An int (never a bool) within ``low``..``high``."""
    value = _get(header, name, default)
    if value is default and default is not _REQUIRED:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise malformed(f"{name!r} must be a whole number, not {type(value).__name__}")
    if not low <= value <= high:
        raise malformed(f"{name!r} must be {low}-{high}, not {value}")
    return value


@overload
def number(header: Mapping[str, Any], name: str, *, low: float, high: float) -> float: ...
@overload
def number(header: Mapping[str, Any], name: str, *, low: float, high: float,
           default: D) -> float | D: ...
def number(header: Mapping[str, Any], name: str, *, low: float, high: float,
           default: Any = _REQUIRED) -> Any:
    """A finite int or float within ``low``..``high``, as a float."""
    value = _get(header, name, default)
    if value is default and default is not _REQUIRED:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise malformed(f"{name!r} must be a number, not {type(value).__name__}")
    if not (math.isfinite(value) and low <= value <= high):
        raise malformed(f"{name!r} must be {low:g}-{high:g}, not {value!r}")
    return float(value)


@overload
def flag(header: Mapping[str, Any], name: str) -> bool: ...
@overload
def flag(header: Mapping[str, Any], name: str, *, default: D) -> bool | D: ...
def flag(header: Mapping[str, Any], name: str, *, default: Any = _REQUIRED) -> Any:
    value = _get(header, name, default)
    if value is default and default is not _REQUIRED:
        return value
    if not isinstance(value, bool):
        raise malformed(f"{name!r} must be true or false, not {type(value).__name__}")
    return value


@overload
def choice(header: Mapping[str, Any], name: str, kind: type[E]) -> E: ...
@overload
def choice(header: Mapping[str, Any], name: str, kind: type[E], *, default: D) -> E | D: ...
def choice(header: Mapping[str, Any], name: str, kind: type[E], *,
           default: Any = _REQUIRED) -> Any:
    """A value of the str enum ``kind``."""
    value = _get(header, name, default)
    if value is default and default is not _REQUIRED:
        return value
    try:
        if not isinstance(value, str):  # Enum's own error message repr()s the whole value
            raise TypeError(name)
        return kind(value)
    except (ValueError, TypeError):
        allowed = ", ".join(repr(v.value) for v in kind)
        raise malformed(f"{name!r} must be one of {allowed}, not {_short(value)}") from None


@overload
def mapping(header: Mapping[str, Any], name: str, *, max_items: int) -> dict[Any, Any]: ...
@overload
def mapping(header: Mapping[str, Any], name: str, *, max_items: int,
            default: D) -> dict[Any, Any] | D: ...
def mapping(header: Mapping[str, Any], name: str, *, max_items: int,
            default: Any = _REQUIRED) -> Any:
    """A map of at most ``max_items`` entries (keys and values are the caller's to check)."""
    value = _get(header, name, default)
    if value is default and default is not _REQUIRED:
        return value
    if not isinstance(value, dict):
        raise malformed(f"{name!r} must be a map, not {type(value).__name__}")
    if len(value) > max_items:
        raise malformed(f"{name!r} has {len(value)} entries, at most {max_items} allowed")
    return value


@overload
def items(header: Mapping[str, Any], name: str, *, max_items: int) -> list[Any]: ...
@overload
def items(header: Mapping[str, Any], name: str, *, max_items: int,
          default: D) -> list[Any] | D: ...
def items(header: Mapping[str, Any], name: str, *, max_items: int,
          default: Any = _REQUIRED) -> Any:
    """A list of at most ``max_items`` entries (their own checks are the caller's)."""
    value = _get(header, name, default)
    if value is default and default is not _REQUIRED:
        return value
    if not isinstance(value, list):
        raise malformed(f"{name!r} must be a list, not {type(value).__name__}")
    if len(value) > max_items:
        raise malformed(f"{name!r} has {len(value)} entries, at most {max_items} allowed")
    return value


@overload
def text_list(header: Mapping[str, Any], name: str, *, max_items: int,
              max_len: int) -> tuple[str, ...]: ...
@overload
def text_list(header: Mapping[str, Any], name: str, *, max_items: int, max_len: int,
              default: D) -> tuple[str, ...] | D: ...
def text_list(header: Mapping[str, Any], name: str, *, max_items: int, max_len: int,
              default: Any = _REQUIRED) -> Any:
    """A list of strings, each at most ``max_len`` characters."""
    value = items(header, name, max_items=max_items, default=default)
    if value is default and default is not _REQUIRED:
        return value
    for entry in value:
        if not isinstance(entry, str) or len(entry) > max_len:
            raise malformed(f"{name!r} must hold strings of at most {max_len} characters")
    return tuple(value)


@overload
def int_list(header: Mapping[str, Any], name: str, *, max_items: int, low: int = 0,
             high: int = INT64) -> tuple[int, ...]: ...
@overload
def int_list(header: Mapping[str, Any], name: str, *, max_items: int, low: int = 0,
             high: int = INT64, default: D) -> tuple[int, ...] | D: ...
def int_list(header: Mapping[str, Any], name: str, *, max_items: int, low: int = 0,
             high: int = INT64, default: Any = _REQUIRED) -> Any:
    """A list of ints (never bools) within ``low``..``high``."""
    value = items(header, name, max_items=max_items, default=default)
    if value is default and default is not _REQUIRED:
        return value
    for entry in value:
        if isinstance(entry, bool) or not isinstance(entry, int) or not low <= entry <= high:
            raise malformed(f"{name!r} must hold whole numbers {low}-{high}")
    return tuple(value)


def _short(value: Any) -> str:
    """A peer's value, shortened for an error message; reprlib stops at a few levels and
    items, where repr() of a 1,000-deep list raised RecursionError (and cost its whole size)."""
    text = _REPR.repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 40, 40
