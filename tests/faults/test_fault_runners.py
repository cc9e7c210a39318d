"""Scenario 6: user code kills its runner in every way it can; the caller learns what happened,
and the worker stays in the pool."""

from __future__ import annotations

import pytest
from faulttasks import die

from gpumesh import RunnerCrashed, TaskTimeout
from gpumesh.client import TaskOptions

DEATHS = {
    3: "exit", 50: "exit", 17: "segv", 120: "segv", 33: "oom", 150: "oom",
    71: "oom-kill", 180: "oom-kill", 99: "hang",
}
EXPECTED = {
    "exit": (RunnerCrashed, "the runner process exited with code 1"),
    "segv": (RunnerCrashed, "killed by SIGSEGV (a segmentation fault in native code)"),
    "oom": (MemoryError, ""),
    "oom-kill": (RunnerCrashed, "killed by SIGKILL (out of memory, or killed by the system)"),
    "hang": (TaskTimeout, "the task ran past its timeout of 5s and was stopped"),
}


def test_runner_deaths_are_named_and_the_worker_stays(mesh_env):
    n = 200
    mesh_env.start_coordinator()
    worker = mesh_env.add_worker(slots=2)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    futures = client.submit_calls(die, [((i, DEATHS.get(i, "none")), {}) for i in range(n)],
                                  TaskOptions(max_attempts=2, timeout=5))
    for i, future in enumerate(futures):
        how = DEATHS.get(i)
        if how is None:
            assert future.result(timeout=120) == i * i
            continue
        kind, words = EXPECTED[how]
        with pytest.raises(kind) as info:
            future.result(timeout=120)
        assert words in str(info.value), f"task {i} ({how}): {info.value!r}"
        if kind is RunnerCrashed:
            assert "gave up after 2 attempts" in str(info.value)
        if how == "oom":
            # The remote traceback says where the allocation failed.
            assert "bytearray(1024 * 2**20)" in getattr(info.value, "remote_traceback", "")
    # The same worker process is still in the pool and serves the next job.
    assert worker.alive
    alive = [w for w in client.workers() if w["alive"]]
    assert [w["id"] for w in alive] == [worker.worker_id]
    assert client.map(die, [(i, "none") for i in range(20)]) == [i * i for i in range(20)]
