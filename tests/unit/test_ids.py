"""Ids drawn in bulk (gpumesh/protocol/ids.py): as random as one draw each, never handed out twice."""

from __future__ import annotations

import os
import string

import pytest

from gpumesh.protocol.ids import HexIds


def test_each_id_is_its_own_hex_digits_and_a_draw_serves_many():
    ids = HexIds(12, per_draw=8)
    drawn = [ids() for _ in range(50)]  # seven draws and a bit
    assert all(len(i) == 12 and set(i) <= set(string.hexdigits.lower()) for i in drawn)
    assert len(set(drawn)) == 50


def test_a_forked_child_never_hands_out_what_its_parent_still_holds():
    ids = HexIds(16, per_draw=64)
    ids()  # the pool now holds 63 ids
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first id must not be one of the parent's next
        try:
            os.close(read)
            os.write(write, ids().encode())
        finally:
            os._exit(0)  # never back into pytest as a second process
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    parents = [ids() for _ in range(63)]
    assert len(child) == 16 and child not in parents


@pytest.mark.parametrize("digits, per_draw", [(0, 8), (7, 8), (12, 0)])
def test_nonsense_sizes_are_refused(digits, per_draw):
    with pytest.raises(ValueError):
        HexIds(digits, per_draw)
