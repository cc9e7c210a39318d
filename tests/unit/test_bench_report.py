"""bench/report.py: Markdown and JSON from a results dict (pure code; no speed is measured)."""

from __future__ import annotations

import json

from bench.report import markdown, number, targets_table, to_json


def _results() -> dict:
    def system(key: str, name: str, rate: float, p50: float) -> dict:
        return {"key": key, "name": name, "status": "ok", "tasks_per_s": rate, "p50_ms": p50,
                "p99_ms": 2.0, "big_mb_s": 100.0, "sleep_efficiency": 0.98, "cold_start_s": 1.0,
                "cpu_us_per_task": 50.0, "cpu_split_us_per_task": {"client": 50.0}}

    return {"mode": "quick", "machine": {"cpu": "Test CPU", "cores": 2}, "params": {},
            "systems": [system("floor", "floor", 1000.0, 0.5),
                        {"key": "ray", "name": "Ray", "status": "skipped",
                         "reason": "ray is not installed"},
                        system("gpumesh", "gpumesh", 2000.0, 1.5)]}


def test_ratio_rows_divide_gpumesh_by_each_system_that_ran() -> None:
    text = markdown(_results())
    assert "| **gpumesh / floor** | 2.00× | 3.00× |" in text
    assert "gpumesh / Ray" not in text
    assert "skipped: ray is not installed" in text


def test_targets_say_met_not_met_or_not_measured() -> None:
    rows = "\n".join(targets_table(_results()))
    assert "| .map throughput ≥ 1.0× the floor | 2.00× (2,000 vs 1,000) | met |" in rows
    assert "| single-call p50 ≤ 2× the floor's | 3.00× (1.500 vs 0.500) | **not met** |" in rows
    assert "| .map throughput ≥ 5× Ray | not measured | – |" in rows


def test_the_64_mib_target_is_also_judged_by_each_systems_first_call() -> None:
    results = _results()
    results["params"] = {"big_bytes": 1_000_000}
    assert "first call" not in "\n".join(targets_table(results))  # Ray did not run
    results["systems"][1] = {"key": "ray", "name": "Ray", "status": "ok",
                             "big_seconds": [0.020, 0.010]}
    results["systems"][2]["big_seconds"] = [0.040, 0.005]
    rows = "\n".join(targets_table(results))
    # The first calls alone: 2 MB both ways in 40 ms against 20 ms.
    assert "first call of that size (for reference: new shared-memory files) | 0.50× (50 vs 100) " \
        "| **not met** |" in rows
    results["systems"][2]["big_seconds"] = [0.040]  # one call: the column says it already
    assert "first call" not in "\n".join(targets_table(results))


def test_cpu_per_call_has_its_own_table_only_for_systems_that_measured_it() -> None:
    results = _results()
    assert "CPU per single call" not in markdown(results)
    results["systems"][2].update(cpu_us_per_call=900.0,
                                 cpu_split_us_per_call={"client": 300.0, "coordinator": 600.0})
    text = markdown(results)
    calls = text[text.index("## CPU per single call"):]
    assert "| gpumesh | coordinator | 600 |" in calls
    assert "| gpumesh | **total** | **900** |" in calls
    assert "| floor |" not in calls  # the floor's dict has no per-call split


def test_json_round_trips_and_numbers_read_well() -> None:
    assert json.loads(to_json(_results()))["systems"][2]["tasks_per_s"] == 2000.0
    assert number(12345.678, 0) == "12,346"
    assert number(0.0306, 2) == "0.0306"
    assert number(None) == "–"


def test_journal_cost_section_gives_both_rates_and_the_ratio() -> None:
    section = {"rates": {"on": [900.0, 950.0], "off": [1000.0, 1000.0]},
               "on_tasks_per_s": 925.0, "off_tasks_per_s": 1000.0, "ratio": 0.925,
               "cost_percent": 7.5}
    text = markdown({"systems": [], "journal_cost": section})
    assert "| journal on disk (default) | 925 | 900, 950 |" in text
    assert "0.925×" in text and "costs 7.5% of throughput" in text
    failed = markdown({"systems": [], "journal_cost": {"failed": "TimeoutError: x"}})
    assert "Failed: TimeoutError: x" in failed


def test_alternating_rounds_give_per_round_ratios_and_judge_the_floor_targets_by_their_median():
    from bench.headtohead import summarize

    def figures(floor_rate, mesh_rate, floor_p50, mesh_p50, mesh_p99=2.0):
        return {"floor": {"tasks_per_s": floor_rate, "p50_ms": floor_p50, "p99_ms": 1.0},
                "gpumesh": {"tasks_per_s": mesh_rate, "p50_ms": mesh_p50, "p99_ms": mesh_p99}}

    # The machine slowed by half in round 2: both systems did, and the ratios hold still.
    rounds = [figures(6000, 6600, 0.5, 1.5), figures(3000, 3300, 1.0, 3.0, 4.0),
              figures(5000, 4500, 0.5, 0.9)]
    section = {"rounds": rounds, **summarize(rounds)}
    assert section["tasks_ratio"] == 1.1 and section["p50_ratio"] == 3.0
    assert section["gpumesh_p99_ms"] == 2.0
    text = markdown({**_results(), "head_to_head": section})
    assert "| 2 | 3,000 | 3,300 | 1.10× | 1.000 | 3.000 | 3.00× | 4.000 |" in text
    assert "| **median** |  |  | **1.10×** |  |  | **3.00×** | **2.000** |" in text
    assert ("| .map throughput ≥ 1.0× the floor, alternating rounds | 1.10× (median of 3 "
            "rounds' ratios) | met |") in text
    assert "| single-call p50 ≤ 2× the floor's, alternating rounds | 3.00× (median of 3" in text
    assert ("| single-call p99 ≤ 3 ms, alternating rounds | 2.000 ms (median of the rounds' "
            "p99s) | met |") in text
    failed = markdown({"systems": [], "head_to_head": {"failed": "RuntimeError: x",
                                                         "rounds": []}})
    assert "Failed: RuntimeError: x" in failed
    # A floor that measured nothing gives no ratios, and no crash.
    zero = [figures(0, 100, 0, 1.0)]
    assert summarize(zero) == {"gpumesh_p99_ms": 2.0}
    assert "| 1 | 0 | 100 | – |" in markdown({"systems": [], "head_to_head": {
        "rounds": zero, **summarize(zero)}})


def test_without_matplotlib_the_tables_are_still_written(tmp_path, monkeypatch) -> None:
    import sys

    from bench.__main__ import write_outputs

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the README's dev install has none
    write_outputs({**_results(), "seconds": 1.0}, tmp_path, plots=True)
    assert (tmp_path / "results.md").read_text().startswith("# gpumesh benchmark")
    assert not list(tmp_path.glob("*.png"))
