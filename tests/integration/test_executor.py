"""``mesh.executor()`` and ``MeshExecutor``: chunks, the window, one job per executor."""

from __future__ import annotations

import concurrent.futures

import pytest
from conftest import poll_until, wait_for

from gpumesh import MeshExecutor


def square(x):
    return x * x


def _one_worker_mesh(mesh_env):
    """A coordinator, one worker of two slots, and a client that has seen it join."""
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=2)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    return client


def test_executor_map_in_chunks_shares_the_mesh_and_is_one_job(mesh_env):
    client = _one_worker_mesh(mesh_env)
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


def test_a_call_that_cannot_be_sent_fails_alone_not_the_calls_sent_with_it(mesh_env):
    import threading

    client = _one_worker_mesh(mesh_env)
    with client.executor(max_workers=8) as pool:
        # Held back until all four are queued: the dispatcher takes them as one group.
        with pool._changed:
            futures = [pool.submit(square, x) for x in (1, 2, threading.Lock(), 4)]
        assert futures[0].result(timeout=30) == 1 and futures[1].result(timeout=30) == 4
        with pytest.raises(TypeError, match="pickle"):
            futures[2].result(timeout=30)
        assert futures[3].result(timeout=30) == 16


def test_waiting_in_a_done_callback_raises_instead_of_hanging_the_connection(mesh_env):
    client = _one_worker_mesh(mesh_env)
    seen: list[BaseException | None] = []
    done = concurrent.futures.Future()

    def waits(_):
        try:
            slow = client.submit(square, 3)
            try:
                slow.result(timeout=30)  # delivered by the thread this callback runs on
            except RuntimeError as exc:
                seen.append(exc)
            try:
                client.workers()
            except RuntimeError as exc:
                seen.append(exc)
        finally:
            done.set_result(True)

    client.submit(square, 2).add_done_callback(waits)
    assert done.result(timeout=30)
    errors = [e for e in seen if e is not None]
    assert len(errors) == 2 and all("done-callback" in str(e) for e in errors)
    # The connection still works: the I/O thread was never stuck.
    assert client.submit(square, 5).result(timeout=30) == 25

    pool = client.executor(max_workers=2)
    raised = concurrent.futures.Future()

    def shuts_down(_):
        try:
            pool.shutdown(wait=True)
        except RuntimeError as exc:
            raised.set_result(exc)
        else:
            raised.set_result(None)

    pool.submit(square, 6).add_done_callback(shuts_down)
    assert "shutdown(wait=True)" in str(raised.result(timeout=30))
    assert client.submit(square, 7).result(timeout=30) == 49


def record(log: str, x: int) -> int:
    with open(log, "a") as out:
        out.write(f"{x}\n")
    return x


class FailsOnceTheFirstRan:
    """An argument that cannot be pickled, and fails only once the calls sent ahead of it (a
    group's first 16, if any went early) ran: a re-send of those would run them twice."""

    def __init__(self, log):
        self.log = log

    def __reduce__(self):
        poll_until(lambda: self.log.exists() and len(self.log.read_text().split()) >= 16, 10)
        raise TypeError("cannot pickle this argument")


def test_a_big_group_with_a_call_that_cannot_be_sent_runs_every_other_call_once(mesh_env,
                                                                                tmp_path):
    client = _one_worker_mesh(mesh_env)
    log = tmp_path / "ran"
    with client.executor(max_workers=500) as pool:
        with pool._changed:  # all 150 queued first: the dispatcher takes them together
            futures = [pool.submit(record, str(log), FailsOnceTheFirstRan(log) if x == 120 else x)
                       for x in range(150)]
        for x, future in enumerate(futures):
            if x == 120:
                with pytest.raises(TypeError, match="pickle"):
                    future.result(timeout=60)
            else:
                assert future.result(timeout=60) == x
    ran = sorted(int(line) for line in log.read_text().split())
    assert ran == [x for x in range(150) if x != 120]  # each once: none sent twice


def test_a_map_or_an_executor_result_waited_for_in_a_done_callback_raises(mesh_env):
    client = _one_worker_mesh(mesh_env)
    pool = client.executor(max_workers=4)
    outcome: concurrent.futures.Future = concurrent.futures.Future()

    def waits(_):
        errors = []
        other = pool.submit(square, 9)
        try:
            other.result(timeout=30)
        except RuntimeError as exc:
            errors.append(str(exc))
        try:
            client.map(square, range(5))
        except RuntimeError as exc:
            errors.append(str(exc))
        outcome.set_result(errors)

    pool.submit(square, 3).add_done_callback(waits)
    errors = outcome.result(timeout=30)
    assert len(errors) == 2 and all("done-callback" in e for e in errors)
    # The map's tasks were cancelled, not left running for nobody.
    wait_for(lambda: client.status(tasks=False)["counts"].get("pending", 0)
             + client.status(tasks=False)["counts"].get("running", 0) == 0,
             what="nothing of the refused map left")
    pool.shutdown()


def nap(seconds):
    import threading

    threading.Event().wait(seconds)  # a task's work
    return seconds


def test_a_maps_calls_nobody_will_read_are_stopped_on_the_mesh(mesh_env):
    """Without max_workers every call is on the mesh at once ("running"): a thread pool's
    map cannot stop those after a timeout, but a task on the mesh can, and it holds a
    friend's GPU for a result nobody reads."""
    client = _one_worker_mesh(mesh_env)
    with client.executor() as pool:
        results = pool.map(nap, [0.01] + [60] * 5, timeout=3)
        assert next(results) == 0.01
        with pytest.raises(TimeoutError):
            next(results)
        job = pool.job
    # Leaving the block did not wait the five minutes: they were cancelled.
    wait_for(lambda: client.status(job, tasks=False)["counts"] == {"done": 1, "cancelled": 5},
             what="the five unread calls cancelled on the mesh")


def test_map_with_buffersize_reads_an_endless_iterable_lazily(mesh_env):
    import itertools

    client = _one_worker_mesh(mesh_env)
    with client.executor() as pool:
        squares = pool.map(square, itertools.count(), buffersize=2)
        assert [next(squares) for _ in range(5)] == [0, 1, 4, 9, 16]
        squares.close()  # the one submitted ahead is stopped, not left running
        job = pool.job
        with pytest.raises(ValueError, match="buffersize"):
            pool.map(square, [1], buffersize=0)
        with pytest.raises(TypeError, match="buffersize must be an integer or None"):
            pool.map(square, [1], buffersize=2.0)
    counts = client.status(job, tasks=False)["counts"]
    assert counts["done"] >= 5 and sum(counts.values()) <= 7


def test_calls_cancelled_by_shutdown_wake_those_waiting_on_them(mesh_env):
    client = _one_worker_mesh(mesh_env)
    pool = client.executor(max_workers=1)
    running = pool.submit(nap, 60)
    queued = [pool.submit(square, x) for x in range(3)]
    waiter = concurrent.futures.ThreadPoolExecutor(1).submit(
        concurrent.futures.wait, queued, timeout=30)
    pool.shutdown(wait=False, cancel_futures=True)
    done, not_done = waiter.result(timeout=30)
    assert len(done) == 3 and not not_done and all(f.cancelled() for f in queued)
    assert not running.done()  # running: shutdown(cancel_futures=True) leaves it, as the stdlib
