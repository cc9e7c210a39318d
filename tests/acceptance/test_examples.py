"""The examples the README shows, run exactly as its lines say, against a live mesh."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from conftest import require

ROOT = Path(__file__).parents[2]


def readme_command(starts: str) -> list[str]:
    """The README's command line that starts with ``starts`` (its comment dropped)."""
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith(starts):
            return shlex.split(line.split("  #", 1)[0])
    raise AssertionError(f"the README has no line starting with {starts!r}")


def run(mesh_env, argv: list[str]) -> subprocess.CompletedProcess[str]:
    if argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    elif argv[0] == "gpumesh":
        argv = [sys.executable, "-m", "gpumesh", *argv[1:]]
    env = {**os.environ, **mesh_env.env, "GPUMESH_URL": mesh_env.coordinator.url,
           "GPUMESH_TOKEN": mesh_env.token}
    return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_pytorch_training_example_trains_on_the_mesh_and_picks_the_best(mesh_env):
    require("torch")
    mesh_env.start_coordinator()
    worker = mesh_env.add_worker(slots=2)
    done = run(mesh_env, readme_command("python examples/torch_train.py"))
    assert done.returncode == 0, done.stderr
    losses = {float(lr): float(loss) for lr, loss in
              re.findall(r"lr=(\S+)\s+loss=(\S+)\s+on (?:cpu|cuda)", done.stdout)}
    assert set(losses) == {0.001, 0.003, 0.01, 0.03}
    best = min(losses, key=losses.__getitem__)
    assert f"best: lr={best} " in done.stdout
    assert losses[0.03] < 0.05  # it really trained: sin(3x) learned to a small error
    status = mesh_env.client().workers()
    assert [w["completed"] for w in status if w["id"] == worker.worker_id] == [4]


def test_the_preprocessing_example_cleans_every_slice(mesh_env):
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=2)
    done = run(mesh_env, readme_command("gpumesh submit examples/preprocess.py"))
    assert done.returncode == 0, done.stderr
    parts = [json.loads(m) for m in re.findall(r'(\{"part".*\})', done.stdout)]
    assert sorted((p["part"], p["rows"], p["kept"]) for p in parts) == [(0, 4, 3), (1, 4, 3),
                                                                        (2, 4, 3)]
    assert sum(sum(p["by_city"].values()) for p in parts) == 9
