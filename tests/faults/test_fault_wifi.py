"""Scenario 4: a laptop's Wi-Fi drops for 20 s mid-job, then comes back.

Two fake hosts in network namespaces: ``coord`` runs the coordinator, a local worker and the
client (on its own loopback); ``laptop`` runs a worker that reaches the coordinator over the lab
link. The laptop's link goes down while it holds leases and comes back up; the same worker
process must rejoin by itself, and the job must end with one correct result per task.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from conftest import wait_for
from faultlab import Driver, Executions, Lab, driver_args, require_netns


def _laptop_alive(driver: Driver, worker_id: str) -> bool:
    return any(w["id"] == worker_id and w["alive"] for w in driver.call("workers"))


def _wifi_drop(mesh_env, tmp_path, outage: float) -> None:
    require_netns()
    n, delay = 240, 0.15
    lab = Lab(["coord", "laptop"])
    env = {**os.environ, **mesh_env.env, "GPUMESH_TOKEN": mesh_env.token}
    log_dir = tmp_path / "runs"
    log_dir.mkdir()
    runs = Executions(log_dir)
    try:
        _, port = lab.spawn("coord", ["-m", "gpumesh", "serve", "--host", "0.0.0.0", "--port", "0",
                                      "--no-self-worker", "--no-save", "--db",
                                      str(tmp_path / "j.db")], env, ready=True)
        port = int(port)
        local_url = f"tcp://127.0.0.1:{port}"
        lan_url = f"tcp://{lab.address('coord')}:{port}"
        desk, desk_id = lab.spawn("coord", ["-m", "gpumesh", "join", local_url, "--slots", "1",
                                            "--no-benchmark", "--no-save"], env, ready=True)
        laptop, laptop_id = lab.spawn("laptop", ["-m", "gpumesh", "join", lan_url, "--slots", "2",
                                                 "--no-benchmark", "--no-save"], env, ready=True)
        driver_proc, _ = lab.spawn("coord", driver_args(), env, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE)
        driver = Driver(driver_proc)
        assert driver.call("connect", url=local_url) is True
        wait_for(lambda: len([w for w in driver.call("workers") if w["alive"]]) == 2,
                 what="both workers")
        driver.call("submit", name="job", n=n, log_dir=str(log_dir), delay=delay)
        wait_for(lambda: sum(1 for i in range(n) if laptop.pid in runs.ends(i)) >= 6
                 and laptop.pid in runs.in_flight(n).values(), what="the laptop to be mid-job")

        lab.link("laptop", up=False)
        down_at = time.time()
        held = {i for i, agent in runs.in_flight(n).items() if agent == laptop.pid}
        wait_for(lambda: not _laptop_alive(driver, laptop_id), timeout=outage,
                 what="the coordinator to notice the laptop is gone")
        lost_after = time.time() - down_at
        progress = driver.call("progress", name="job")
        # The outage lasts its full length; the job goes on without the laptop meanwhile.
        wait_for(lambda: time.time() - down_at >= outage, timeout=outage + 5, what="the outage")
        assert driver.call("progress", name="job") > progress, "the job stalled during the outage"
        lab.link("laptop", up=True)
        up_at = time.time()

        wait_for(lambda: _laptop_alive(driver, laptop_id), timeout=90,
                 what="the laptop's worker to rejoin after the link came back")
        rejoin = time.time() - up_at
        assert laptop.poll() is None and desk.poll() is None  # same processes, no restart
        job = driver.call("gather", wait=180, name="job", timeout=150)
        assert job["results"] == [i * i for i in range(n)]
        assert len(set(job["task_ids"])) == n
        # Its leases ran out during the outage, so its tasks went back to the queue. Whichever
        # result came first counts: the desk's re-run, or the laptop's late one re-sent after it
        # rejoined while the task still waited in the queue. Never both.
        late = {i for i in held if job["workers"][i] == laptop_id}
        for i in held - late:
            assert job["workers"][i] == desk_id
            assert desk.pid in runs.ends(i)
        for i in late:
            assert runs.ends(i)[0] == laptop.pid
        assert min(runs.runs(n)) == 1
        # It takes work again as the same worker.
        more_dir = tmp_path / "more"
        more_dir.mkdir()
        driver.call("submit", name="more", n=30, log_dir=str(more_dir), delay=0.1)
        more = driver.call("gather", wait=120, name="more", timeout=90)
        assert more["results"] == [i * i for i in range(30)]
        assert laptop_id in more["workers"], "the rejoined laptop took no new work"
        print(f"outage {outage:g}s: lost after {lost_after:.1f}s, rejoined {rejoin:.1f}s after "
              f"the link came back; of {len(held)} held task(s), {len(late)} kept the laptop's "
              "late result")
    finally:
        lab.close()


def test_wifi_drop_for_20_seconds(mesh_env, tmp_path):
    _wifi_drop(mesh_env, tmp_path, outage=20)


@pytest.mark.slow
def test_wifi_drop_longer_than_the_longest_backoff(mesh_env, tmp_path):
    _wifi_drop(mesh_env, tmp_path, outage=75)
