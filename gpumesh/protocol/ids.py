"""Unguessable hex ids drawn from the kernel in bulk.

The coordinator makes a task id for every task it accepts, and a worker agent a nonce for every
task it hands ahead to a runner. ``secrets.token_hex`` for each was one ``getrandom`` system
call a task, a measurable share of a tiny task's cost. A pool draws many ids with one call;
each id is still its own random bits from the operating system's CSPRNG, used once. A forked
child starts with an empty pool, so it never hands out its parent's ids.
"""

from __future__ import annotations

import os
import secrets
import weakref

_POOLS: weakref.WeakSet[HexIds] = weakref.WeakSet()


class HexIds:
    """``HexIds(12)()`` -> a new id of 12 hex digits (48 bits)."""

    def __init__(self, digits: int, per_draw: int = 256) -> None:
        if digits <= 0 or digits % 2 or per_draw <= 0:
            raise ValueError("an even, positive number of digits, drawn a positive number at a time")
        self.digits = digits
        self.per_draw = per_draw
        self._pool: list[str] = []
        _POOLS.add(self)

    def __call__(self) -> str:
        try:
            return self._pool.pop()
        except IndexError:
            width = self.digits
            drawn = secrets.token_hex(width // 2 * self.per_draw)
            self._pool = [drawn[i:i + width] for i in range(width, len(drawn), width)]
            return drawn[:width]

    def forget(self) -> None:
        self._pool = []


def _forget_all() -> None:
    for pool in list(_POOLS):
        pool.forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all)
