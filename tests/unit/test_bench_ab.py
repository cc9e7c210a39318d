"""bench/ab.py's arithmetic, report and each side's environment (the speeds are made up)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.ab import markdown, side_env, summarize


def _measured() -> dict:
    def figures(base_p50: float, new_p50: float, base_rate: float, new_rate: float) -> dict:
        return {"base": {"p50_ms": base_p50, "tasks_per_s": base_rate},
                "new": {"p50_ms": new_p50, "tasks_per_s": new_rate}}

    # The machine drifts 2x between rounds; new is 10% faster at p50 in each of them.
    return {"rounds": [figures(1.0, 0.9, 1000.0, 1100.0), figures(2.0, 1.8, 500.0, 500.0),
                       figures(1.5, 1.35, 800.0, 720.0)],
            "latencies_ms": {"base": [1.0] * 50 + [2.0] * 50 + [10.0] * 2,
                             "new": [0.9] * 50 + [1.8] * 50 + [5.0] * 2},
            "cpu_us_per_call": {"base": {"client": 300.0, "coordinator": 600.0},
                                "new": {"client": 250.0, "coordinator": 600.0}}}


def test_ratios_are_medians_of_per_round_ratios_so_drift_cancels() -> None:
    summary = summarize(_measured())
    p50 = summary["ratios"]["p50_ms"]
    assert round(p50["median"], 6) == 0.9 and round(p50["low"], 6) == 0.9
    rate = summary["ratios"]["tasks_per_s"]
    assert rate["median"] == 1.0 and rate["low"] == 0.9 and round(rate["high"], 6) == 1.1
    assert summary["sides"]["base"]["tasks_per_s"] == 800.0
    assert summary["ratios"]["p99_ms"]["pooled"] < 1.0


def test_report_names_both_builds_and_splits_cpu_by_process() -> None:
    measured = _measured()
    text = markdown({"base": "abc123 Old", "new": "this checkout's working tree", "rounds": 3,
                     "calls": 100, "tasks": 500, "measured": measured,
                     "summary": summarize(measured)})
    assert "Base: abc123 Old. New: this checkout's working tree." in text
    assert "| call p50 ms ↓ | 2.000 | 1.800 | **0.900×** (0.900–0.900) |" in text
    assert "| client | 300 | 250 |" in text
    assert "| **total** | **900** | **850** |" in text


def test_a_payload_task_travels_by_value_so_an_older_tree_runs_it() -> None:
    import cloudpickle

    from bench.ab_driver import task_and_items

    task, items, expected = task_and_items(10, 1000)
    assert b"bench.ab_driver" not in cloudpickle.dumps(task)  # not by reference: by value
    assert [len(item) for item in items] == [1000] * 10
    assert [task(item) for item in items] == expected == [i % 8 for i in range(10)]
    assert task_and_items(3, 0)[1:] == ([0, 1, 2], [0, 1, 2])  # no payload: the no-op tasks


def test_report_says_what_each_task_carried() -> None:
    measured = _measured()
    text = markdown({"base": "b", "new": "n", "rounds": 3, "calls": 100, "tasks": 500,
                     "payload": 262144, "measured": measured, "summary": summarize(measured)})
    assert "each task takes 262,144 bytes." in text


def test_a_negative_payload_is_refused_before_anything_starts(capsys) -> None:
    import pytest

    from bench.ab import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--payload", "-1"])
    assert "not a byte count" in capsys.readouterr().err


def test_each_side_s_coordinator_and_workers_import_its_own_tree(tmp_path) -> None:
    # They are started with ``python -m gpumesh``, which puts the folder it starts in ahead of
    # PYTHONPATH: started in this checkout, the base side ran this checkout's coordinator and
    # workers (only its client was the base's). A stand-in gpumesh in a tree of its own says
    # where it was imported from, as the coordinator and as a worker.
    from bench.ab_driver import side_mesh

    tree = tmp_path / "tree"
    (tree / "gpumesh").mkdir(parents=True)
    (tree / "gpumesh" / "__init__.py").write_text("")
    (tree / "gpumesh" / "__main__.py").write_text(
        "import os, sys, gpumesh\n"
        "home = os.environ['GPUMESH_HOME']\n"
        "with open(os.path.join(home, sys.argv[1] + '.txt'), 'w') as f:\n"
        "    f.write(gpumesh.__file__)\n"
        "if '--ready-fd' in sys.argv:\n"
        "    os.write(int(sys.argv[sys.argv.index('--ready-fd') + 1]), b'ready')\n")
    mesh = side_mesh(tree).fresh()
    try:
        mesh.start_coordinator()
        mesh.wait_listening(timeout=30)
        mesh.add_worker()
        mesh.workers[0].wait(30)
        for role in ("serve", "join"):
            imported = Path((mesh.home / f"{role}.txt").read_text())
            assert imported.resolve() == (tree / "gpumesh" / "__init__.py").resolve(), role
    finally:
        mesh.stop()


def test_each_side_compiles_its_own_bytecode_not_a_stale_one_in_the_tree(tmp_path) -> None:
    # Bytecode in __pycache__ whose recorded size and time match an edited source is taken for
    # it: the edit is not run. Each side's processes compile into a folder of their own.
    tree = tmp_path / "tree"
    tree.mkdir()
    source = tree / "edited.py"
    source.write_text("VALUE = 1\n")
    stamp = source.stat().st_mtime_ns
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE",
                                                               "PYTHONPYCACHEPREFIX")}
    subprocess.run([sys.executable, "-c", "import edited"], cwd=tree, env=env, check=True)
    source.write_text("VALUE = 2\n")  # the same size; then the time the bytecode recorded
    os.utime(source, ns=(stamp, stamp))

    def value(environment: dict[str, str]) -> str:
        return subprocess.run([sys.executable, "-c", "import edited; print(edited.VALUE)"],
                              cwd=tree, env=environment, capture_output=True, text=True,
                              check=True).stdout.strip()

    assert value(env) == "1"  # the stale bytecode, as a plain run takes it
    sides = {name: side_env(name, tmp_path / "scratch") for name in ("base", "new")}
    assert sides["base"]["PYTHONPYCACHEPREFIX"] != sides["new"]["PYTHONPYCACHEPREFIX"]
    assert value({**env, "PYTHONPYCACHEPREFIX": sides["new"]["PYTHONPYCACHEPREFIX"]}) == "2"
