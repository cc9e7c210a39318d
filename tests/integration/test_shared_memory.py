"""Big arguments and results between processes of one machine go through the coordinator's
shared-memory folder, not the sockets, and that path loses nothing: a coordinator killed with
SIGKILL mid-job, and one killed before it accepted, still give every result, and no file is left
behind once the results are collected. docs/protocol.md, "Shared memory", says what survives."""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import wait_for

from gpumesh import GPUMesh
from gpumesh.protocol.refs import NAME_PATTERN
from gpumesh.sharedmem import MIN_MAPPED_BYTES, MIN_SHARED_BYTES
from gpumesh.shmowners import OWNER

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")

SIZE = 4 * MIN_MAPPED_BYTES  # big: its receivers map it


def checksum_after(array, seconds):
    """Changes its argument in place (it must be writable) and returns a digest and a copy."""
    time.sleep(seconds)
    array[0] ^= 0xFF
    return hashlib.sha256(array.tobytes()).hexdigest(), array


def expected(array):
    changed = array.copy()
    changed[0] ^= 0xFF
    return hashlib.sha256(changed.tobytes()).hexdigest(), changed


def folders() -> dict[str, set[str]]:
    shm = Path("/dev/shm")
    return {d.name: {f.name for f in d.iterdir() if NAME_PATTERN.fullmatch(f.name)}
            for d in shm.iterdir() if d.name.startswith(f"gpumesh-{os.getuid()}-")}


def frames_in(mesh_env) -> set[str]:
    """The frame files of this test's coordinator (its folder is named after its journal)."""
    mine = set()
    for files in folders().values():
        mine |= files
    return mine


def arrays(count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 255, SIZE, dtype=np.uint8) for _ in range(count)]


@pytest.mark.parametrize("shared", ["1", "0"], ids=["shared-memory", "sockets"])
def test_big_arguments_and_results_round_trip_writable(mesh_env, shared):
    mesh_env.env["GPUMESH_SHARED_MEMORY"] = shared
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=2)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    items = arrays(3)
    before = frames_in(mesh_env)
    results = client.map(checksum_after, [(a, 0.0) for a in items], timeout=60)
    for (digest, value), item in zip(results, items, strict=True):
        want_digest, want_value = expected(item)
        assert digest == want_digest and np.array_equal(value, want_value)
        value[1] = 0  # what comes back is the caller's to change
    engine = client._engine
    assert (engine is not None and engine._shm is not None) == (shared == "1")
    # Collected: the coordinator removed every file of this job.
    wait_for(lambda: frames_in(mesh_env) <= before, what="the shared files to be removed")


def flip_first(data):
    """Returns its bytes or bytearray, the first byte changed, as the same type."""
    changed = bytearray(data)
    changed[0] ^= 0xFF
    return type(data)(changed), type(data).__name__


@pytest.mark.parametrize("shared", ["1", "0"], ids=["shared-memory", "sockets"])
def test_big_bytes_and_bytearrays_round_trip_as_themselves(mesh_env, shared):
    # Big bytes leave the pickle as out-of-band frames (serialize._BigBytes), as arrays do,
    # and a bytearray goes in-band: each side rebuilds the type it was given, from the folder
    # or from the socket.
    mesh_env.env["GPUMESH_SHARED_MEMORY"] = shared
    mesh_env.start_coordinator()
    mesh_env.add_worker()
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    data = bytes(arrays(1)[0])
    for kind in (bytes, bytearray):
        value, name = client.submit(flip_first, kind(data)).result(60)
        assert type(value) is kind and name == kind.__name__
        assert value[0] == data[0] ^ 0xFF and value[1:] == data[1:]


def descendants(pid: int) -> set[int]:
    """The processes below ``pid``, from /proc (its runners, for a worker agent)."""
    parents: dict[int, int] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                # The command name may hold spaces: the fields after its closing parenthesis.
                parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def holders_of_owner_files() -> dict[str, set[int]]:
    """Each producer lock file (gpumesh/shmowners.py) in this user's folders: the processes
    holding it open, from /proc."""
    held: dict[str, set[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # gone, or not ours
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if "/gpumesh-" in link and f"/{OWNER}" in link:
                held.setdefault(link, set()).add(int(pid))
    return held


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc")
def test_a_runner_writes_its_results_as_its_worker_which_keeps_them_until_sent(mesh_env):
    """A result stays named by the agent's lock file: the agent holds it, unacknowledged, also
    while the coordinator is away, and outlives its runner; a runner's own lock file would let
    the coordinator sweep a result a restarted runner left with its agent."""
    mesh_env.start_coordinator()
    worker = mesh_env.add_worker(slots=1)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    results = client.map(checksum_after, [(a, 0.0) for a in arrays(2)], timeout=60)
    assert len(results) == 2
    ours = {os.getpid(), worker.pid, *descendants(worker.pid)}  # not another test's leftovers
    holders = set().union(*holders_of_owner_files().values()) & ours
    assert holders == {os.getpid(), worker.pid}  # the client and the agent; no runner


def test_mid_size_arguments_go_by_name_not_into_journal_files(mesh_env):
    """From 64 KiB, not only from 1 MiB: through the socket each input would also cost the
    journal a file of its own on disk. Results of that size come back whole and writable."""
    import sqlite3

    mesh_env.start_coordinator()
    client = mesh_env.client()
    rng = np.random.default_rng(3)
    mid = 256 * 1024
    assert MIN_SHARED_BYTES <= mid < MIN_MAPPED_BYTES
    items = [rng.integers(0, 255, mid, dtype=np.uint8) for _ in range(12)]
    futures = client.submit_calls(checksum_after, [((a, 0.0), {}) for a in items])
    wait_for(lambda: all(f.task_id for f in futures), what="the tasks to be accepted")
    raw = sqlite3.connect(f"file:{mesh_env.db}?mode=ro", uri=True)
    try:
        (on_disk,) = raw.execute("SELECT count(*) FROM tasks WHERE payload_ref IS NOT NULL"
                                 ).fetchone()
        (biggest,) = raw.execute("SELECT max(length(payload)) FROM tasks").fetchone()
    finally:
        raw.close()
    assert on_disk == 0 and biggest < 4096  # the rows name files in the folder
    mesh_env.add_worker(slots=2)
    for (digest, value), item in zip(client.gather(futures, timeout=60), items, strict=True):
        want_digest, want_value = expected(item)
        assert digest == want_digest and np.array_equal(value, want_value)
        value[1] = 0


def test_a_big_closure_with_mid_size_arguments_goes_through_the_folder_and_runs(mesh_env):
    """A task that names shared frames cannot name its function by reference, so a function
    closing over 300 KiB goes into the folder with its 128 KiB argument, not on the socket."""
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=2)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    table = np.arange(300 * 1024, dtype=np.uint8)

    def lookup(array):
        return int(table[int(array[0]) * 1000]) + int(array[-1])

    items = [np.full(128 * 1024, i, dtype=np.uint8) for i in range(6)]
    assert client.map(lookup, items, timeout=60) == [int(table[i * 1000]) + i for i in range(6)]


def mapped_from_the_folder(array):
    """Whether this runner maps a file of a coordinator's shared-memory folder (not a memfd of
    its agent's pipe), and the argument's digest."""
    with open("/proc/self/maps") as maps:
        folder = any(f"/gpumesh-{os.getuid()}-" in line and "memfd:" not in line for line in maps)
    return folder, hashlib.sha256(array.tobytes()).hexdigest()


def test_big_input_from_a_client_that_does_not_share_memory_reaches_the_worker_by_name(
        mesh_env):
    """The coordinator moves such a task's big frames into its folder for a worker that maps
    it, instead of encrypting them again on the way there (a client on another machine); the
    file goes once the result is collected."""
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=1)
    client = GPUMesh(mesh_env.coordinator.url, mesh_env.token, quiet=True,
                     settings=replace(mesh_env.settings, share_memory=False))
    mesh_env.clients.append(client)
    mesh_env.wait_workers(1, client)
    before = frames_in(mesh_env)
    item = arrays(1)[0]
    mapped, digest = client.submit(mapped_from_the_folder, item).result(timeout=60)
    assert client._engine is not None and client._engine._shm is None
    assert digest == hashlib.sha256(item.tobytes()).hexdigest()
    assert mapped, "the worker's runner got the input through its pipe, not the folder"
    wait_for(lambda: frames_in(mesh_env) <= before, what="the shared file to be removed")


def test_coordinator_kill_9_after_it_moved_socket_input_into_the_folder_loses_nothing(
        mesh_env):
    """The folder's copy is not the journal's: a restarted coordinator runs the task again from
    the bytes it journaled at SUBMIT."""
    coordinator = mesh_env.start_coordinator()
    mesh_env.add_worker(slots=1)
    client = GPUMesh(coordinator.url, mesh_env.token, quiet=True,
                     settings=replace(mesh_env.settings, share_memory=False))
    mesh_env.clients.append(client)
    mesh_env.wait_workers(1, client)
    before = frames_in(mesh_env)
    items = arrays(2)
    futures = client.submit_calls(checksum_after, [((a, 2.0), {}) for a in items])
    # The first is running: its input was written into the folder for the worker.
    wait_for(lambda: frames_in(mesh_env) - before, what="the input moved into the folder")
    coordinator.kill()
    mesh_env.start_coordinator(port=coordinator.port)  # same journal, same folder
    results = client.gather(futures, timeout=90)
    assert [r[0] for r in results] == [expected(a)[0] for a in items]


def test_coordinator_kill_9_mid_job_keeps_shared_inputs(mesh_env):
    coordinator = mesh_env.start_coordinator()
    client = mesh_env.client()
    items = arrays(4)
    futures = client.submit_calls(checksum_after, [((a, 0.2), {}) for a in items])
    wait_for(lambda: all(f.task_id for f in futures), what="every submission to be accepted")
    assert len(frames_in(mesh_env)) >= 4  # the inputs are in the folder, by name in the journal
    coordinator.kill()
    mesh_env.start_coordinator(port=coordinator.port)  # same journal, same folder
    mesh_env.add_worker(slots=2)
    results = client.gather(futures, timeout=90)
    assert [r[0] for r in results] == [expected(a)[0] for a in items]


def test_coordinator_kill_9_before_it_accepts_loses_nothing(mesh_env):
    coordinator = mesh_env.start_coordinator()
    client = mesh_env.client()
    assert client.workers() == []  # connected: the client has joined the folder
    before = frames_in(mesh_env)
    coordinator.kill()  # the client writes its frames and sends; nobody is there to accept
    futures = client.submit_calls(checksum_after, [((a, 0.0), {}) for a in arrays(2)])
    # Written to the folder while no coordinator runs: the same files must serve the re-send.
    wait_for(lambda: len(frames_in(mesh_env) - before) >= 2, what="the client's shared frames")
    mesh_env.start_coordinator(port=coordinator.port)
    mesh_env.add_worker(slots=2)
    results = client.gather(futures, timeout=90)
    assert [r[0] for r in results] == [expected(a)[0] for a in arrays(2)]


KEPT_BY_THE_TASK: list[np.ndarray] = []


def echo(array):
    return array


def keep(array):
    """Keeps its argument past the task, as a cache in a runner would."""
    KEPT_BY_THE_TASK.append(array)
    return int(array[0])


def kept_values(_):
    """The first byte of each argument this runner kept, or -1 for one that changed since."""
    return [int(a[0]) if (a == a[0]).all() else -1 for a in KEPT_BY_THE_TASK]


def test_a_frame_file_is_written_again_only_once_nobody_maps_it(mesh_env, monkeypatch):
    from gpumesh import shmpool

    refilled = []
    refill = shmpool.Pool.refill

    def counted(self, pieces, name):
        done = refill(self, pieces, name)
        refilled.append(done)
        return done

    monkeypatch.setattr(shmpool.Pool, "refill", counted)  # this process: the client's files
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=1)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    # Results dropped at once: the files are written again in place (the pool's point).
    for i in range(8):
        item = np.full(SIZE, i, np.uint8)
        assert np.array_equal(client.submit(echo, item).result(timeout=60), item)
    assert any(refilled), "no argument file was ever written again"
    # Results the caller keeps, and arguments the task keeps: never written under them.
    kept = [(np.full(SIZE, 100 + i, np.uint8), client.submit(echo, np.full(SIZE, 100 + i,
                                                                          np.uint8)))
            for i in range(6)]
    for item, future in kept:
        assert np.array_equal(future.result(timeout=60), item)
    for i in range(6):
        assert client.submit(keep, np.full(SIZE, 50 + i, np.uint8)).result(timeout=60) == 50 + i
    for i in range(4):  # more traffic of the same size, which would reuse a file if it could
        item = np.full(SIZE, 200 + i, np.uint8)
        assert np.array_equal(client.submit(echo, item).result(timeout=60), item)
    assert all(np.array_equal(future.result(), item) for item, future in kept)
    assert client.submit(kept_values, 0).result(timeout=60) == list(range(50, 56))


def filled(value):
    return np.full(MIN_MAPPED_BYTES, value % 251, dtype=np.uint8)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts /proc/self/fd")
def test_a_caller_holding_many_big_results_holds_a_bounded_number_of_descriptors(
        mesh_env, monkeypatch):
    # Each big result was mapped, and CPython's mmap keeps a descriptor per mapping: a caller
    # holding 2,000 results of 1 MiB (a preprocessing .map on a laptop) ran out of them at
    # 1,024 and got "shared frame ... is gone" for the rest. Past MAX_MAPPED they are copied.
    from gpumesh import sharedmem

    monkeypatch.setattr(sharedmem, "MAX_MAPPED", sharedmem.mapped() + 16)
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=2)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    client.map(filled, [0])  # sessions, runners and the folder open before counting
    before = len(os.listdir("/proc/self/fd"))
    results = client.map(filled, range(120), timeout=120)
    assert len(os.listdir("/proc/self/fd")) - before < 40  # 120 mapped would hold 120
    assert all(r.shape == (MIN_MAPPED_BYTES,) and r[0] == n % 251 and r[-1] == n % 251
               for n, r in enumerate(results))
    results[5][0] = 9  # writable, as a mapped result is
