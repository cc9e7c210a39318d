"""A big input waiting on the coordinator's disk goes to a worker on another machine (one that
does not share the coordinator's memory) in pieces read from its file as they are sent, never
whole: before, the coordinator read it back whole and handed it to ZeroMQ, which held it until
the network had taken the last byte (1 GiB for nine seconds on a gigabit LAN). And a worker or
coordinator killed with SIGKILL in the middle of such a transfer loses nothing: the task runs
again from the journal. A big result waiting on disk for a client elsewhere goes to it the same
way. docs/protocol.md, "Big messages in pieces"."""

from __future__ import annotations

import hashlib
import os
import signal
from dataclasses import replace

import numpy as np
from conftest import user_script, wait_for

from gpumesh import GPUMesh

MiB = 1024 * 1024
NO_SHARING = {"GPUMESH_SHARED_MEMORY": "0"}  # as a worker on another machine
# The default heartbeat, not the tests' fast one: a worker handing a task of hundreds of MiB to
# its runner (one copy into a memfd, on the agent's loop) can pass the fast silence limit of
# one second on a loaded 2-core machine, and then loses the lease it is running.
BIG_TIMING = {"GPUMESH_HEARTBEAT": "1", "GPUMESH_LEASE_TTL": "10"}


def status_mib(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} line")


def reset_peak(pid: int) -> None:
    """Start VmHWM (the peak resident size) over from now (Linux 4.0 and later)."""
    with open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(array.tobytes()).hexdigest()


def remote_client(mesh_env) -> GPUMesh:
    client = GPUMesh(mesh_env.coordinator.url, mesh_env.token, quiet=True,
                     settings=replace(mesh_env.settings, share_memory=False))
    mesh_env.clients.append(client)
    return client


def queued(client: GPUMesh, items: list[np.ndarray]) -> list:
    """Submit ``items`` with no worker there. With GPUMESH_QUEUE_MEMORY_MB=1 each input waits
    in its journal file once it is accepted (the turn that journals it lets go of it)."""
    assert client.workers() == []
    futures = client.submit_calls(digest, [((a,), {}) for a in items])
    wait_for(lambda: all(f.task_id for f in futures), timeout=60,
             what="every submission to be accepted")
    return futures


def test_a_big_input_on_disk_goes_to_a_worker_in_pieces_not_whole(mesh_env):
    mesh_env.env["GPUMESH_QUEUE_MEMORY_MB"] = "1"  # queued inputs wait on disk
    coordinator = mesh_env.start_coordinator()
    client = remote_client(mesh_env)
    rng = np.random.default_rng(5)
    size = 128 * MiB
    items = [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(2)]
    idle = status_mib(coordinator.pid, "VmRSS")
    futures = queued(client, items)
    wait_for(lambda: status_mib(coordinator.pid, "VmRSS") < idle + size / MiB / 2,
             what=f"the coordinator to give back the memory the inputs came in (idle it took "
                  f"{idle:.0f} MiB, now {status_mib(coordinator.pid, 'VmRSS'):.0f})")
    before = status_mib(coordinator.pid, "VmRSS")
    reset_peak(coordinator.pid)
    mesh_env.add_worker(slots=1, env=NO_SHARING)
    assert client.gather(futures, timeout=120) == [digest(a) for a in items]
    peak = status_mib(coordinator.pid, "VmHWM")
    # Read back whole, each input alone took 128 MiB more; in pieces, the window (16 MiB) and
    # the pieces being encrypted.
    assert peak < before + size / MiB / 4, (
        f"the coordinator peaked at {peak:.0f} MiB sending {size // MiB} MiB inputs, from "
        f"{before:.0f} MiB before: more than a quarter of an input")


def mid_transfer(worker_pid: int, idle: float, what: str) -> None:
    """Wait until the worker has taken in part of a big message (its buffer fills as pieces
    come, so its resident size grows) and not yet all of it."""
    wait_for(lambda: status_mib(worker_pid, "VmRSS") > idle + 24, timeout=60,
             what=f"{what} to be receiving the task's input")


def task_going_to_a_worker(mesh_env, seed: int) -> tuple:
    """A 512 MiB task queued on disk, and a worker that has started to receive it."""
    mesh_env.env.update(BIG_TIMING, GPUMESH_QUEUE_MEMORY_MB="1")
    coordinator = mesh_env.start_coordinator()
    client = remote_client(mesh_env)
    item = np.random.default_rng(seed).integers(0, 255, 512 * MiB, dtype=np.uint8)
    [future] = queued(client, [item])
    worker = mesh_env.add_worker(slots=1, env=NO_SHARING)
    wait_for(lambda: worker.pid and status_mib(worker.pid, "VmRSS") > 0, what="the worker up")
    idle = status_mib(worker.pid, "VmRSS")
    mid_transfer(worker.pid, idle, "the worker")
    assert not future.done()
    return coordinator, worker, future, item


def test_a_worker_killed_mid_transfer_loses_nothing(mesh_env):
    _, first, future, item = task_going_to_a_worker(mesh_env, 6)
    first.kill()
    mesh_env.add_worker(slots=1, env=NO_SHARING)
    assert future.result(timeout=120) == digest(item)


def test_a_coordinator_killed_mid_transfer_loses_nothing(mesh_env):
    coordinator, _, future, item = task_going_to_a_worker(mesh_env, 7)
    coordinator.kill()
    mesh_env.start_coordinator(port=coordinator.port)  # the same journal
    assert future.result(timeout=120) == digest(item)


def rss_anon_mib(pid: int) -> float:
    return status_mib(pid, "RssAnon")


class AnonPeak:
    """The highest anonymous resident size of a process while a block runs, sampled every
    few milliseconds (a big message held in memory stays there for far longer)."""

    def __init__(self, pid: int) -> None:
        import threading

        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.003):
            self.peak = max(self.peak, rss_anon_mib(self.pid))

    def __enter__(self) -> AnonPeak:
        self.peak = rss_anon_mib(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def echo(array: np.ndarray) -> np.ndarray:
    return array


def test_a_big_input_and_result_go_to_the_coordinator_in_pieces_into_files(mesh_env):
    """The other way: a client elsewhere sends a big input, a worker elsewhere a big result,
    each in pieces the coordinator writes into a file it maps (page cache, not its memory)."""
    mesh_env.env.update(BIG_TIMING)
    coordinator = mesh_env.start_coordinator()
    client = remote_client(mesh_env)
    mesh_env.add_worker(slots=1, env=NO_SHARING)
    mesh_env.wait_workers(1, client)
    size = 256 * MiB
    item = np.random.default_rng(8).integers(0, 255, size, dtype=np.uint8)
    idle = rss_anon_mib(coordinator.pid)
    with AnonPeak(coordinator.pid) as peak:
        back = client.submit(echo, item).result(timeout=120)
    assert np.array_equal(back, item)
    # Whole, the input alone took 256 MiB of the coordinator's own memory while it arrived.
    assert peak.peak < idle + size / MiB / 4, (
        f"the coordinator's anonymous memory peaked at {peak.peak:.0f} MiB (idle {idle:.0f}) "
        f"passing on a {size // MiB} MiB input and result")


def test_a_coordinator_killed_mid_upload_loses_nothing(mesh_env):
    mesh_env.env.update(BIG_TIMING)
    coordinator = mesh_env.start_coordinator()
    client = remote_client(mesh_env)
    item = np.random.default_rng(9).integers(0, 255, 768 * MiB, dtype=np.uint8)
    idle = status_mib(coordinator.pid, "RssFile")
    future = client.submit(digest, item)
    # The coordinator's mapped file fills as the pieces come: kill it half-way.
    wait_for(lambda: status_mib(coordinator.pid, "RssFile") > idle + 64, timeout=60,
             what="the coordinator to be receiving the input")
    assert not future.task_id
    coordinator.kill()
    mesh_env.start_coordinator(port=coordinator.port)
    mesh_env.add_worker(slots=1, env=NO_SHARING)
    assert future.result(timeout=180) == digest(item)


AWAY_CLIENT = """
import hashlib, os, sys
import numpy as np
from gpumesh import GPUMesh

def filled(n):
    return np.full(n, 7, dtype=np.uint8)

with GPUMesh(os.environ["GPUMESH_URL"], os.environ["GPUMESH_TOKEN"], quiet=True) as mesh:
    future = mesh.submit(filled, int(sys.argv[1]))
    print("submitted", flush=True)
    result = future.result(timeout=180)
print(hashlib.sha256(result.tobytes()).hexdigest(), flush=True)
"""


def test_a_big_result_waiting_on_disk_goes_to_its_client_in_pieces_not_whole(mesh_env, tmp_path):
    """A client elsewhere that was away when its big result came (a laptop asleep) gets it
    from the journal file a piece at a time: before, the coordinator read it back whole."""
    mesh_env.env.update(BIG_TIMING)
    coordinator = mesh_env.start_coordinator()
    monitor = mesh_env.client()
    script = tmp_path / "away.py"
    script.write_text(AWAY_CLIENT)
    size = 128 * MiB
    env = {**os.environ, **mesh_env.env, **NO_SHARING, "GPUMESH_URL": coordinator.url,
           "GPUMESH_TOKEN": mesh_env.token}
    with user_script(script, [str(size)], env) as away:
        assert away.stdout is not None and away.stdout.readline().strip() == "submitted"
        wait_for(lambda: monitor.health()["queue"].get("pending") == 1,
                 what="the task to be queued")
        os.killpg(away.pid, signal.SIGSTOP)
        wait_for(lambda: monitor.health()["clients"] == 1, timeout=30,
                 what="the coordinator to notice the client is away")
        idle = status_mib(coordinator.pid, "VmRSS")
        mesh_env.add_worker(slots=1, env=NO_SHARING)
        wait_for(lambda: monitor.health()["finished_total"] == 1, timeout=120,
                 what="the task to finish while its client is away")
        wait_for(lambda: status_mib(coordinator.pid, "VmRSS") < idle + size / MiB / 4,
                 timeout=30, what="the result to leave the coordinator's memory for its file")
        before = status_mib(coordinator.pid, "VmRSS")
        reset_peak(coordinator.pid)
        os.killpg(away.pid, signal.SIGCONT)
        out, err = away.communicate(timeout=180)
    assert away.returncode == 0, err
    assert out.strip() == hashlib.sha256(np.full(size, 7, dtype=np.uint8).tobytes()).hexdigest()
    peak = status_mib(coordinator.pid, "VmHWM")
    assert peak < before + size / MiB / 4, (
        f"the coordinator peaked at {peak:.0f} MiB sending a {size // MiB} MiB result from its "
        f"file, from {before:.0f} MiB before: more than a quarter of it")
