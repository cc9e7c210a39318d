"""``python -m bench.ab`` end to end, tiny: two real meshes, one per tree, taking turns.

What it measures is not checked (no test asserts a speed); that it runs, that each side's
processes import their own tree's gpumesh, and that it writes its report, are."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="bench.ab exports the base commit with git archive")
def test_ab_runs_both_builds_in_turns_and_writes_its_report(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.ab", "--same", "--rounds", "2", "--calls", "5",
         "--tasks", "40", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "ab.json").read_text())
    assert len(result["measured"]["rounds"]) == 2
    assert all(len(ms) == 10 for ms in result["measured"]["latencies_ms"].values())
    assert result["base"] == result["new"]  # --same: the exported commit on both sides
    report = (tmp_path / "ab.md").read_text()
    assert "| call p50 ms ↓ |" in report and "| map tasks/s ↑ |" in report
    assert "| coordinator |" in report


def test_a_driver_refuses_a_tree_it_does_not_import_from(tmp_path: Path) -> None:
    (tmp_path / "gpumesh").mkdir()  # an empty folder: no gpumesh package to import there
    done = subprocess.run([sys.executable, "-m", "bench.ab_driver", str(tmp_path), "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert done.returncode != 0
    assert f"not from {tmp_path}" in done.stderr
