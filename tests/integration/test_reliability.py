"""Failures that must cost time, never results: dead workers, dead runners, timeouts, restarts."""

from __future__ import annotations

import os
import time

import pytest
from conftest import wait_for

from gpumesh import GPUMesh, RunnerCrashed, TaskTimeout
from gpumesh.client import TaskOptions


def slow_square(i, seconds):
    time.sleep(seconds)
    return i * i


def exit_hard(code):
    os._exit(code)


def segfault():
    import ctypes

    ctypes.string_at(0)


def sleep_for(seconds):
    time.sleep(seconds)
    return seconds


def test_kill_9_of_a_worker_mid_task_loses_nothing(mesh_env):
    mesh_env.start_coordinator()
    victim = mesh_env.add_worker(slots=2)
    mesh_env.add_worker(slots=2)
    client = mesh_env.client()
    mesh_env.wait_workers(2, client)
    futures = client.submit_calls(slow_square, [((i, 0.3), {}) for i in range(24)])
    wait_for(lambda: any(f.done() and f.worker == victim.worker_id for f in futures)
             or any(w["id"] == victim.worker_id and w["running"] for w in client.workers()),
             what="the victim to be running a task")
    victim.kill()
    results = client.gather(futures, timeout=60)
    assert results == [i * i for i in range(24)]
    # Exactly one result per task: each future resolved once, to its own value.
    assert all(f.done() and not f.cancelled() for f in futures)
    assert len({f.task_id for f in futures}) == 24


def test_runner_exit_is_diagnosed_and_the_worker_stays(mesh_env):
    mesh_env.start_coordinator()
    mesh_env.add_worker()
    client = mesh_env.client()
    options = TaskOptions(max_attempts=1)
    future = client.submit_calls(exit_hard, [((3,), {})], options)[0]
    with pytest.raises(RunnerCrashed) as info:
        future.result(timeout=30)
    assert "exited with code 3" in str(info.value)
    assert client.submit(sleep_for, 0).result(timeout=30) == 0


def test_segfault_is_retried_then_reported(mesh_env):
    mesh_env.start_coordinator()
    mesh_env.add_worker()
    client = mesh_env.client()
    future = client.submit_calls(segfault, [((), {})], TaskOptions(max_attempts=2))[0]
    with pytest.raises(RunnerCrashed) as info:
        future.result(timeout=60)
    assert "SIGSEGV" in str(info.value)
    assert "gave up after 2 attempts" in str(info.value)
    assert client.submit(sleep_for, 0).result(timeout=30) == 0


def test_timeout_stops_the_task_and_frees_the_slot(mesh_env):
    mesh_env.start_coordinator()
    mesh_env.add_worker()
    client = mesh_env.client()
    started = time.time()
    future = client.submit_calls(sleep_for, [((60,), {})], TaskOptions(timeout=1))[0]
    with pytest.raises(TaskTimeout, match="timeout of 1s"):
        future.result(timeout=30)
    assert time.time() - started < 30
    assert client.submit(sleep_for, 0).result(timeout=30) == 0


def test_coordinator_kill_9_and_restart_restores_the_queue(mesh_env):
    coordinator = mesh_env.start_coordinator()
    client = mesh_env.client()
    futures = client.submit_calls(slow_square, [((i, 0), {}) for i in range(50)])
    wait_for(lambda: all(f.task_id for f in futures), what="every submission to be accepted")
    coordinator.kill()
    # Same database, same port: the journal holds every accepted task.
    mesh_env.start_coordinator(port=coordinator.port)
    mesh_env.add_worker(slots=2)
    assert client.gather(futures, timeout=90) == [i * i for i in range(50)]


def test_a_client_says_when_it_lost_the_coordinator_and_when_it_is_back(mesh_env, capfd):
    coordinator = mesh_env.start_coordinator()
    mesh_env.add_worker(slots=1)
    client = GPUMesh(coordinator.url, mesh_env.token, settings=mesh_env.settings)  # not quiet
    mesh_env.clients.append(client)
    assert client.submit(sleep_for, 0).result(timeout=30) == 0
    coordinator.kill()
    wait_for(lambda: "lost the coordinator" in capfd.readouterr().err,
             what="the client to say it lost the coordinator")
    mesh_env.start_coordinator(port=coordinator.port)
    wait_for(lambda: "back: reconnected to the coordinator" in capfd.readouterr().err,
             what="the client to say it is back")
    assert client.submit(sleep_for, 0).result(timeout=30) == 0


def test_stopped_worker_rejoins_and_its_tasks_ran_elsewhere(mesh_env):
    import signal

    mesh_env.start_coordinator()
    sleeper = mesh_env.add_worker()
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    future = client.submit(slow_square, 5, 4.0)
    wait_for(lambda: any(w["running"] for w in client.workers()), what="the task to start")
    os.killpg(sleeper.pid, signal.SIGSTOP)  # laptop lid closed, longer than the 2 s lease
    try:
        mesh_env.add_worker()
        assert future.result(timeout=60) == 25
        assert future.worker != sleeper.worker_id
    finally:
        os.killpg(sleeper.pid, signal.SIGCONT)
    wait_for(lambda: any(w["id"] == sleeper.worker_id and w["alive"] for w in client.workers()),
             what="the stopped worker to rejoin")
    # Its late result was dropped as a duplicate; it takes new work.
    assert client.map(slow_square, [(i, 0) for i in range(6)]) == [i * i for i in range(6)]
