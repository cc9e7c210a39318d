"""``python -m bench.shmwrite``: its arguments, and a tiny run that writes and retires real
frames in a coordinator process of its own and leaves no folder behind."""

from __future__ import annotations

import argparse
import os

import pytest

from bench.shmwrite import _numbers, main, measure, table


def test_sizes_and_depths_are_positive_integers_comma_separated():
    assert _numbers("65536, 8,1") == [65536, 8, 1]


@pytest.mark.parametrize("bad", ["", ",", "big", "0", "-8", "1.5"])
def test_anything_else_is_refused(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="positive integers"):
        _numbers(bad)


def test_the_table_names_sizes_in_their_unit():
    rows = [{"size": size, "depth": 8, "rounds": [1.0, 2.0], "median": 1.5}
            for size in (65536, 16 << 20, 1000)]
    lines = table(rows).splitlines()
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| 64 KiB", "| 16 MiB", "| 1000 B"]


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not hasattr(os, "fork"),
                    reason="a shared-memory folder and fork")
@pytest.mark.parametrize("off", [[], ["--no-pool", "--no-spares"]])
def test_a_tiny_run_measures_every_size_and_depth_and_leaves_all_as_it_was(capsys, off):
    def folders() -> set[str]:
        return {n for n in os.listdir("/dev/shm") if "shmwrite" in n}

    before = folders()
    main(["--sizes", "65536,1048576", "--depths", "1,3", "--frames", "4", "--rounds", "2", *off])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "iB |" in line]
    assert [row.split(" | ")[:2] for row in rows] == [
        ["| 64 KiB", "1"], ["| 64 KiB", "3"], ["| 1 MiB", "1"], ["| 1 MiB", "3"]]
    assert ("off: pool, spares" in out) == bool(off)
    assert folders() == before
    from gpumesh import shmpool, shmspares  # and the pool and spares are switched on again
    assert shmpool.Pool.refill.__module__ == "gpumesh.shmpool"
    assert shmspares.Spares.want.__module__ == "gpumesh.shmspares"


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not hasattr(os, "fork"),
                    reason="a shared-memory folder and fork")
def test_a_run_that_fails_halfway_leaves_no_frame_behind(monkeypatch):
    from gpumesh.sharedmem import SharedFolder

    def folders() -> set[str]:
        return {n for n in os.listdir("/dev/shm") if "shmwrite" in n}

    share = SharedFolder.share
    calls = []

    def failing(self, frames, start=0):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("the folder is full")
        return share(self, frames, start)

    monkeypatch.setattr(SharedFolder, "share", failing)
    before = folders()
    with pytest.raises(RuntimeError, match="full"):
        measure(65536, 8, 10, 1)  # four frames in flight when it fails
    assert folders() == before
