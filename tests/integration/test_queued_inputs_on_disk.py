"""Big inputs queued from a client on another machine (one that does not share memory) wait in
the journal's blob files, not in the coordinator's memory, and a coordinator killed with SIGKILL
while they wait gives every result after its restart. Before, the coordinator held every queued
input in memory as it came: 96 MiB queued, 96 MiB more resident. docs/protocol.md, "Delivery
and durability", says what survives."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
from conftest import wait_for

from gpumesh import GPUMesh

MiB = 1024 * 1024
COUNT, SIZE = 12, 8 * MiB  # 96 MiB queued


def resident_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS line")


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(array.tobytes()).hexdigest()


def test_queued_inputs_wait_on_disk_and_survive_a_kill_9(mesh_env):
    # Keep 1 MiB of queued inputs in memory (512 by default): the rest wait on disk.
    mesh_env.env["GPUMESH_QUEUE_MEMORY_MB"] = "1"
    coordinator = mesh_env.start_coordinator()
    client = GPUMesh(coordinator.url, mesh_env.token, quiet=True,
                     settings=replace(mesh_env.settings, share_memory=False))
    mesh_env.clients.append(client)
    assert client.workers() == []  # connected, and nobody to run anything yet
    idle = resident_mib(coordinator.pid)
    rng = np.random.default_rng(11)
    items = [rng.integers(0, 255, SIZE, dtype=np.uint8) for _ in range(COUNT)]
    futures = client.submit_calls(digest, [((a,), {}) for a in items])
    wait_for(lambda: all(f.task_id for f in futures), timeout=60,
             what="every submission to be accepted")
    # Within a second of the last one the coordinator gave the buffers back to the system.
    wait_for(lambda: resident_mib(coordinator.pid) < idle + COUNT * SIZE / MiB / 2,
             what=f"the coordinator to hold the queued inputs on disk (idle it took {idle:.0f} "
                  f"MiB, now {resident_mib(coordinator.pid):.0f})")
    coordinator.kill()
    restarted = mesh_env.start_coordinator(port=coordinator.port)  # the same journal
    mesh_env.add_worker(slots=2)
    assert client.gather(futures, timeout=120) == [digest(a) for a in items]
    # The restart left them on disk as well: only what was being sent was read back.
    wait_for(lambda: resident_mib(restarted.pid) < idle + COUNT * SIZE / MiB / 2,
             what="the restarted coordinator to give back what it read to send")
