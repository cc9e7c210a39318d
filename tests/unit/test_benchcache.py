"""The join benchmark's figures, kept per machine and measured again when asked or stale."""

from __future__ import annotations

import json

from gpumesh.worker import benchcache

CPU = {"device": "CPU", "device_name": "AMD EPYC", "cores": 2, "gpus": []}


def test_a_machine_keeps_its_figures_until_asked_stale_or_changed(tmp_path):
    runs = []

    def run(inventory):
        runs.append(1)
        return {"gflops": 10.0 * len(runs), "bandwidth_gbps": 5.0}

    first, when = benchcache.measured(tmp_path, CPU, rerun=False, run=run, now=1000.0)
    assert when is None and first["gflops"] == 10.0
    again, when = benchcache.measured(tmp_path, CPU, rerun=False, run=run, now=2000.0)
    assert again == first and when == 1000.0 and len(runs) == 1  # a restart: the same score
    fresh, when = benchcache.measured(tmp_path, CPU, rerun=True, run=run, now=3000.0)
    assert when is None and fresh["gflops"] == 20.0  # --rebenchmark
    stale, _ = benchcache.measured(tmp_path, CPU, rerun=False, run=run,
                                   now=3000.0 + benchcache.MAX_AGE + 1)
    assert stale["gflops"] == 30.0
    gpu = {**CPU, "device": "GPU", "gpus": [{"name": "RTX 4090", "vram": 24e9, "backend": "cuda"}]}
    other, when = benchcache.measured(tmp_path, gpu, rerun=False, run=run, now=4000.0 + 10**7)
    assert when is None and other["gflops"] == 40.0  # other hardware: measured for it
    assert oct((tmp_path / benchcache.CACHE_FILE).stat().st_mode & 0o777) == "0o600"


def test_a_damaged_cache_is_measured_again(tmp_path):
    calls = []

    def run(inventory):
        calls.append(1)
        return {"gflops": 1.0, "bandwidth_gbps": 1.0}

    for damage in ("{", json.dumps([1]), json.dumps({"key": benchcache.hardware_key(CPU), "at": 1,
                                                      "figures": {"gflops": "fast"}})):
        (tmp_path / benchcache.CACHE_FILE).write_text(damage)
        figures, when = benchcache.measured(tmp_path, CPU, rerun=False, run=run, now=5.0)
        assert when is None and figures == {"gflops": 1.0, "bandwidth_gbps": 1.0}
    assert len(calls) == 3
