"""The device probe and the join benchmark, for real on this machine and with a stand-in torch."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
from conftest import require

from gpumesh.cli.join import default_slots
from gpumesh.worker import devices


def test_the_real_probe_describes_this_machine():
    inventory = devices.probe(torch_probe=False)
    assert inventory["cores"] >= 1 and inventory["memory"] > 0
    assert inventory["python"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert inventory["hostname"] and inventory["device"] in ("CPU", "GPU")
    assert inventory["gpus"] == [] and inventory["device_name"] == devices.cpu_name()


def test_the_real_cpu_benchmark_stays_within_its_budget_and_is_positive(monkeypatch):
    budgets = []
    timed = devices._timed
    monkeypatch.setattr(devices, "_timed", lambda fn, budget, **kw: budgets.append(budget) or timed(fn, budget, **kw))
    figures = devices._benchmark_numpy(0.4)  # what the CPU benchmark's child process runs
    assert sum(budgets) <= 0.4  # it splits its budget, so it takes seconds, not minutes
    assert figures["gflops"] > 0 and figures["bandwidth_gbps"] > 0
    assert devices.score_of(figures) == round(figures["gflops"] * 0.7
                                              + figures["bandwidth_gbps"] * 0.3, 3)


def test_the_cpu_benchmark_measures_one_blas_thread_in_a_child(monkeypatch):
    # A multi-threaded BLAS swung the score 10x on a loaded machine (bench/stability.py); the
    # thread-count variables work only before the BLAS loads, hence the child process.
    monkeypatch.setattr(devices, "_IN_CHILD", (
        "import json, os; print(json.dumps({'gflops': float(os.environ['OPENBLAS_NUM_THREADS']),"
        " 'bandwidth_gbps': float(os.environ['OMP_NUM_THREADS']), 'backend': 0}))"))
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "8")
    assert devices.benchmark({"gpus": []}, budget=0.2) == {
        "gflops": 1.0, "bandwidth_gbps": 1.0, "backend": 0.0}
    figures = devices.benchmark({"gpus": []}, budget=0.2)  # the real child
    assert figures["gflops"] > 0 and figures["bandwidth_gbps"] > 0


def test_the_cpu_benchmark_measures_here_when_no_child_can_run(monkeypatch, caplog):
    monkeypatch.setattr(devices.sys, "executable", "/nonexistent/python")
    with caplog.at_level("WARNING", logger="gpumesh.worker"):
        figures = devices.benchmark({"gpus": []}, budget=0.2)
    assert figures["gflops"] > 0 and figures["bandwidth_gbps"] > 0
    assert "measuring in this process instead" in caplog.text


def test_the_pure_python_benchmark_runs_without_numpy():
    figures = devices._benchmark_pure_python(0.2)
    assert figures["gflops"] > 0 and figures["bandwidth_gbps"] > 0


def fake_torch(names: list[str], vram: int = 24 * 10**9) -> SimpleNamespace:
    cuda = SimpleNamespace(
        is_available=lambda: bool(names), device_count=lambda: len(names),
        get_device_properties=lambda i: SimpleNamespace(name=names[i], total_memory=vram))
    return SimpleNamespace(cuda=cuda, backends=SimpleNamespace(mps=None), __version__="9.9")


def test_cuda_devices_are_listed_one_per_gpu():
    found = devices.gpus(fake_torch(["NVIDIA RTX 4090", "NVIDIA RTX 3090"]))
    assert [(g["index"], g["name"], g["backend"]) for g in found] == [
        (0, "NVIDIA RTX 4090", "cuda"), (1, "NVIDIA RTX 3090", "cuda")]
    assert default_slots({"gpus": found, "cores": 32}) == 2  # one slot per GPU


def test_apple_mps_counts_as_one_gpu():
    torch = fake_torch([])
    torch.backends = SimpleNamespace(mps=SimpleNamespace(is_available=lambda: True))
    assert devices.gpus(torch) == [{"index": 0, "name": "Apple MPS", "vram": 0, "backend": "mps"}]


def test_cuda_that_raises_makes_a_cpu_worker_said_in_the_log(caplog):
    torch = fake_torch(["NVIDIA RTX 3090"])

    def lost(index):
        raise RuntimeError("CUDA error: unspecified launch failure")

    torch.cuda.get_device_properties = lost
    with caplog.at_level("WARNING", logger="gpumesh.worker"):
        assert devices.gpus(torch) == []
    assert "unspecified launch failure" in caplog.text and "CPU worker" in caplog.text


def test_cpu_slots_default_to_the_cores_up_to_four():
    assert default_slots({"gpus": [], "cores": 2}) == 2
    assert default_slots({"gpus": [], "cores": 64}) == 4


def test_torch_cpu_build_reports_no_gpu():
    torch = require("torch")  # CI installs the CPU build
    assert devices.gpus(torch) == []
    assert devices.probe()["torch"] == torch.__version__


def test_a_test_inventory_replaces_probed_values(monkeypatch):
    monkeypatch.setenv(devices.TEST_INVENTORY_VARIABLE,
                       json.dumps({"gpus": [{"name": "A100", "vram": 4e10}], "python": "3.99"}))
    inventory = devices.probe(torch_probe=False)
    assert inventory["device"] == "GPU" and inventory["device_name"] == "A100"
    assert inventory["gpus"] == [{"index": 0, "vram": 4e10, "backend": "fake", "name": "A100"}]
    assert inventory["python"] == "3.99"
    # A fake GPU is never handed to torch: the benchmark stays on the CPU.
    assert devices.benchmark(inventory, budget=0.2)["backend"] == 0.0
    monkeypatch.setenv(devices.TEST_INVENTORY_VARIABLE, "[1]")
    with pytest.raises(ValueError, match="JSON object"):
        devices.probe(torch_probe=False)


def test_no_gpu_driver_means_torch_is_not_imported(monkeypatch):
    # Importing torch costs about a second on every `join`; without a driver it finds nothing.
    monkeypatch.setattr(devices, "gpu_driver_present", lambda: False)
    monkeypatch.setattr(devices, "_torch", lambda: pytest.fail("torch was imported"))
    inventory = devices.probe()
    assert inventory["gpus"] == [] and inventory["device"] == "CPU"


def test_a_gpu_driver_lets_torch_look(monkeypatch):
    monkeypatch.setattr(devices, "gpu_driver_present", lambda: True)
    monkeypatch.setattr(devices, "_torch", lambda: fake_torch(["NVIDIA RTX 4090"]))
    assert devices.probe()["gpus"][0]["name"] == "NVIDIA RTX 4090"

