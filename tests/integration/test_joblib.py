"""The joblib backend "gpumesh": scikit-learn unchanged, failures cancel the rest, and joblib's own
backend-agnostic tests of ``test_parallel.py`` (through ``joblib_mesh_plugin``)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import require, wait_for


def slow_or_fail(x):
    if x == 0:
        raise ValueError("batch 0 failed")
    time.sleep(30)
    return x


def test_grid_search_on_the_mesh_gives_the_local_results(mesh_env, monkeypatch):
    require("sklearn")
    import numpy as np
    from joblib import parallel_config
    from sklearn.datasets import load_iris
    from sklearn.model_selection import GridSearchCV
    from sklearn.svm import SVC

    import gpumesh  # noqa: F401  (registers the backend)

    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=2)
    mesh_env.add_worker(slots=2)
    mesh_env.wait_workers(2)
    for key, value in mesh_env.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("GPUMESH_URL", mesh_env.coordinator.url)
    monkeypatch.setenv("GPUMESH_TOKEN", mesh_env.token)
    X, y = load_iris(return_X_y=True)
    grid = {"C": [0.1, 1, 10], "gamma": ["scale", 0.1]}
    local = GridSearchCV(SVC(), grid, n_jobs=1).fit(X, y)
    from gpumesh.client.joblib_backend import MeshBackend

    client = mesh_env.client()
    with parallel_config(backend=MeshBackend(mesh=client)):
        remote = GridSearchCV(SVC(), grid, n_jobs=-1).fit(X, y)
    _assert_same_cv_results(local, remote, np)
    assert local.best_params_ == remote.best_params_
    # The tasks ran on the mesh: the coordinator lists the job.
    assert any(j["name"].startswith("joblib") for j in client.status()["jobs"])
    with parallel_config(backend="gpumesh"):  # by name, through the saved/env connection
        by_name = GridSearchCV(SVC(), grid, n_jobs=-1).fit(X, y)
    _assert_same_cv_results(local, by_name, np)
    assert local.best_params_ == by_name.best_params_
    assert sum(j["name"].startswith("joblib") for j in client.status()["jobs"]) == 2


def _assert_same_cv_results(local, remote, np):  # type: ignore[no-untyped-def]
    """Every key of ``cv_results_`` but the timings, equal."""
    assert set(local.cv_results_) == set(remote.cv_results_)
    for key, value in local.cv_results_.items():
        if "time" in key:
            continue
        if not isinstance(value, np.ndarray) or isinstance(value, np.ma.MaskedArray) \
                or value.dtype == object:
            assert list(value) == list(remote.cv_results_[key]), key
        else:
            np.testing.assert_array_equal(value, remote.cv_results_[key], err_msg=key)


def test_a_failed_batch_cancels_the_others_on_the_mesh(mesh_env):
    require("joblib")
    from joblib import Parallel, delayed, parallel_config

    from gpumesh.client.joblib_backend import MeshBackend

    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=2)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    started = time.time()
    with pytest.raises(ValueError, match="batch 0 failed"), \
            parallel_config(backend=MeshBackend(mesh=client)):
        Parallel(n_jobs=4, batch_size=1)(delayed(slow_or_fail)(x) for x in range(4))
    assert time.time() - started < 25  # did not wait for the 30 s batches
    wait_for(lambda: not client.status(tasks=False)["counts"].get("running")
             and not client.status(tasks=False)["counts"].get("pending"),
             what="nothing left running or pending on the mesh")


# The run takes 10-75 s on a loaded 2-core machine (the global timeout is 120 s); its tests have
# 60 s each and the whole run RUN_LIMIT.
RUN_LIMIT = 420


@pytest.mark.timeout(RUN_LIMIT + 60)
def test_joblib_own_parallel_tests_pass_on_the_mesh(tmp_path):
    require("joblib")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    before = set(os.listdir(SHM)) if os.path.isdir(SHM) else set()
    try:
        done = _run_joblib_tests(tmp_path, env)
    finally:
        _sweep_joblib_litter(before)
    tail = done.stdout[-3000:]
    assert done.returncode == 0, tail + done.stderr[-2000:]
    outcomes = _outcomes(tail)
    # Only passes: a skip or an xfail is a test of the backend that did not run.
    assert set(outcomes) <= {"passed", "deselected", "warnings", "warning"}, tail
    assert outcomes.get("passed", 0) >= 70, tail  # 76 of joblib 1.6's tests take the backend
    # And they ran on the mesh: the plugin never falls back to loky, and it counts the tests
    # whose Parallel calls got results of mesh tasks (the others run n_jobs=1 in place, or
    # abort on purpose), and the tasks the coordinator finished.
    line = next((x for x in tail.splitlines() if x.startswith("gpumesh joblib plugin: ")), None)
    assert line is not None, tail
    ran, tests, results, finished = (int(n) for n in re.findall(r"\d+", line))
    assert tests == outcomes["passed"] and ran >= 35, line  # 42 with joblib 1.6
    assert 0 < results <= finished, line


def _outcomes(tail: str) -> dict[str, int]:
    """pytest's last line, ``2 failed, 74 passed, 669 deselected, 18 warnings in 71.51s``."""
    last = tail.strip().splitlines()[-1].strip("= ")
    counts = last.rsplit(" in ", 1)[0]
    return {word: int(n) for n, word in (part.split() for part in counts.split(", "))}


SHM = "/dev/shm"


def _sweep_joblib_litter(before: set[str]) -> None:
    """joblib's own tests leave loky semaphores and memmapping folders in /dev/shm when the
    processes that made them are gone: remove the ones this run made, so the suite leaves none."""
    if not os.path.isdir(SHM):
        return
    for name in set(os.listdir(SHM)) - before:
        if name.startswith(("joblib_memmapping_folder_", "sem.loky-")):
            path = os.path.join(SHM, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)


def _run_joblib_tests(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(tmp_path / "pytest.ini"), "-p", "joblib_mesh_plugin",
         "-p", "no:cacheprovider", "--pyargs", "joblib.test.test_parallel", "-k", "gpumesh",
         "-q", "--timeout", "60", "-W", "ignore::pytest.PytestUnknownMarkWarning"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_LIMIT)
