"""Giving the coordinator's freed memory back to the system once a burst of work has drained.

CPython returns a pymalloc arena only when every object in it is gone, and glibc's malloc keeps
freed pages for reuse: after 100,000 tasks drain, the process would hold its peak size for
good. ``trim_heap`` asks glibc to return what it holds free (``malloc_trim``); elsewhere it does
nothing. The broker calls it from its idle maintenance, rate-limited, never on a busy loop.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Any

log = logging.getLogger("gpumesh.coordinator")

_UNSET: Any = object()
_malloc_trim: Any = _UNSET


def _find_malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None (musl, macOS, Windows: nothing to call)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def trim_heap() -> bool:
    """Return the C heap's free pages to the system. True when glibc did something."""
    global _malloc_trim
    if _malloc_trim is _UNSET:
        _malloc_trim = _find_malloc_trim()
    if _malloc_trim is None:
        return False
    try:
        return bool(_malloc_trim(0))
    except OSError as exc:  # never fatal: the memory stays with us, as without the call
        log.debug("malloc_trim failed: %s", exc)
        return False
