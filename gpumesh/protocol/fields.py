"""Typed readers for header fields: type, range and size checked, or a MALFORMED ProtocolError.

Everything a peer sends is hostile until it has passed one of these. msgpack gives back only
None, bool, int, float, str, bytes, list and dict, so each reader names the one type it takes
(bool is never accepted where a number is asked for) and the bounds that keep it harmless to
store, journal and compare.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeVar

from .messages import ErrorCode, ProtocolError

E = TypeVar("E")

# A value that stands for "the field is required": a reader called without a default raises
# when the field is missing.
_REQUIRED: Any = object()

INT64 = 2**63 - 1


def malformed(detail: str) -> ProtocolError:
    return ProtocolError(ErrorCode.MALFORMED, detail)


def _get(header: Mapping[str, Any], name: str, default: Any) -> Any:
    value = header.get(name, default)
    if value is _REQUIRED:
        raise malformed(f"header field {name!r} is missing")
    return value


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


def flag(header: Mapping[str, Any], name: str, *, default: Any = _REQUIRED) -> Any:
    value = _get(header, name, default)
    if value is default and default is not _REQUIRED:
        return value
    if not isinstance(value, bool):
        raise malformed(f"{name!r} must be true or false, not {type(value).__name__}")
    return value


def choice(header: Mapping[str, Any], name: str, kind: type[E], *, default: Any = _REQUIRED) -> E:
    """A value of the str enum ``kind``."""
    value = _get(header, name, default)
    if value is default and default is not _REQUIRED:
        return value  # type: ignore[no-any-return]
    try:
        return kind(value)  # type: ignore[call-arg]
    except (ValueError, TypeError):
        allowed = ", ".join(repr(v.value) for v in kind)  # type: ignore[attr-defined]
        raise malformed(f"{name!r} must be one of {allowed}, not {_short(value)}") from None


def mapping(header: Mapping[str, Any], name: str, *, max_items: int,
            default: Any = _REQUIRED) -> Any:
    value = _get(header, name, default)
    if value is default and default is not _REQUIRED:
        return value
    if not isinstance(value, dict):
        raise malformed(f"{name!r} must be a map, not {type(value).__name__}")
    if len(value) > max_items:
        raise malformed(f"{name!r} has {len(value)} entries, at most {max_items} allowed")
    return value


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
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
