"""``mesh.executor()`` and ``MeshExecutor``: chunks, the window, one job per executor."""

from __future__ import annotations

import concurrent.futures

import pytest

from gpumesh import MeshExecutor


def square(x):
    return x * x


def test_executor_map_in_chunks_shares_the_mesh_and_is_one_job(mesh_env):
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=2)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    with client.executor(max_workers=2) as pool:
        assert list(pool.map(square, range(10), chunksize=4)) == [x * x for x in range(10)]
        assert pool.submit(square, 7).result(timeout=30) == 49
        job = pool.job
    assert client.connected  # the executor's shutdown left the shared connection open
    status = client.status(job, tasks=False)
    assert status["total"] == 4  # 3 chunks and one call
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(square, 1)


def test_an_executor_of_its_own_closes_its_connection(mesh_env, monkeypatch):
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=1)
    mesh_env.wait_workers(1)
    for key, value in mesh_env.env.items():
        monkeypatch.setenv(key, value)
    pool = MeshExecutor(mesh_env.coordinator.url, mesh_env.token, max_workers=1)
    futures = [pool.submit(square, x) for x in range(3)]
    pool.shutdown(wait=True)
    assert [f.result() for f in futures] == [0, 1, 4]
    assert not pool._mesh.connected
    with pytest.raises(ValueError):
        MeshExecutor(mesh_env.coordinator.url, mesh_env.token, max_workers=0)
    assert isinstance(pool, concurrent.futures.Executor)
