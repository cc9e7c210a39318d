"""Scenario 3: a laptop sleeps (its worker and runners stopped) longer than its lease, then wakes."""

from __future__ import annotations

import signal

from conftest import wait_for
from faultlab import Executions, assert_one_correct_result_each, signal_tree
from faulttasks import record_square


def test_laptop_sleep_longer_than_the_lease(mesh_env, tmp_path):
    n, delay = 200, 0.05
    mesh_env.start_coordinator()
    sleeper = mesh_env.add_worker(slots=2)
    other = mesh_env.add_worker(slots=2)
    client = mesh_env.client()
    mesh_env.wait_workers(2, client)
    log_dir = tmp_path / "runs"
    log_dir.mkdir()
    runs = Executions(log_dir)
    futures = client.submit_calls(record_square, [((i, str(log_dir), delay), {}) for i in range(n)])
    wait_for(lambda: sum(1 for i in range(n) if sleeper.pid in runs.ends(i)) >= 10
             and sleeper.pid in runs.in_flight(n).values(), what="the sleeper to be mid-task")
    stopped = signal_tree(sleeper.pid, signal.SIGSTOP)  # lid closed: agent and runners
    try:
        held = {i for i, agent in runs.in_flight(n).items() if agent == sleeper.pid}
        assert held
        # Its lease (2 s) runs out; its tasks run again on the other worker.
        wait_for(lambda: all(other.pid in runs.ends(i) for i in held), timeout=60,
                 what="the sleeper's tasks to be re-run elsewhere")
        assert not any(w["id"] == sleeper.worker_id and w["alive"] for w in client.workers())
    finally:
        signal_tree(sleeper.pid, signal.SIGCONT)
    results = client.gather(futures, timeout=120)
    assert_one_correct_result_each(futures, results, n)
    for i in held:
        assert futures[i].worker == other.worker_id
    # Lid open: it rejoins by itself, as the same processes, and its late work does not count.
    wait_for(lambda: any(w["id"] == sleeper.worker_id and w["alive"] for w in client.workers()),
             timeout=60, what="the sleeper to rejoin")
    assert sleeper.alive and stopped[0] == sleeper.pid  # no restart: the same agent process
    late = {i for i in held if sleeper.pid in runs.ends(i)}
    print(f"held by the sleeper: {len(held)}; finished late after waking: {len(late)}")
    assert client.gather(futures, timeout=1) == results  # late results changed nothing
    more = client.submit_calls(record_square, [((n + i, str(log_dir), delay), {}) for i in range(40)])
    assert client.gather(more, timeout=60) == [(n + i) ** 2 for i in range(40)]
    assert any(f.worker == sleeper.worker_id for f in more), "the woken worker took no new work"
