"""The shared-memory folder: who may use it, what a reference may name, and that the
coordinator hands shared frames only to peers that proved they can read them, reads them back
for the others, and removes each file once nobody needs it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest
from conftest import wait_for

from gpumesh import sharedmem, shmowners, shmspares
from gpumesh.config import Limits, Timing
from gpumesh.coordinator.broker import ORPHAN_SWEEP, Broker
from gpumesh.protocol import Command, Message, decode, encode
from gpumesh.protocol.refs import NAME_PATTERN, parse_refs
from gpumesh.sharedmem import (
    JOURNAL,
    MIN_MAPPED_BYTES,
    MIN_SHARED_BYTES,
    ORPHAN_AGE,
    ORPHAN_GRACE,
    PROBE,
    SharedFolder,
)
from gpumesh.shmowners import OWNER, PREFIX_CHARS
from gpumesh.shmpool import RETIRED
from gpumesh.store import Store

pytestmark = pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX shared memory")

BIG = bytes(range(256)) * (MIN_MAPPED_BYTES // 256)  # a size consumers map
LIMITS = Limits()


def names(folder: SharedFolder) -> set[str]:
    """Its frames' files and retired files: not its probe, journal path, locks or owners."""
    return {n for n in os.listdir(folder.path)
            if n not in (PROBE, JOURNAL, ".lock") and not shmowners.is_owner_file(n)}


def test_the_folder_is_private_and_joined_only_with_the_proof(folder):
    assert stat.S_IMODE(os.stat(folder.path).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(folder.path / PROBE).st_mode) == 0o600
    offer = folder.offer()
    assert folder.proof not in str(offer)  # only its hash travels
    joined = SharedFolder.join(offer)
    assert joined is not None and folder.verifies(joined.proof)
    assert SharedFolder.join({**offer, "check": "0" * 32}) is None  # another folder's proof
    for bad in (None, "x", {"path": "relative", "check": offer["check"]},
                {"path": str(folder.path), "check": 5}, {"path": "/nonexistent", **{"check": "a" * 32}}):
        assert SharedFolder.join(bad) is None
    assert not folder.verifies("nope") and not folder.verifies(None)


def test_a_folder_open_to_others_is_not_joined(folder):
    os.chmod(folder.path, 0o755)
    try:
        assert SharedFolder.join(folder.offer()) is None
    finally:
        os.chmod(folder.path, 0o700)


def test_big_frames_go_by_name_and_come_back_writable(folder):
    frames, refs = folder.share([b"small", BIG, memoryview(BIG)])
    assert frames[0] == b"small" and frames[1] == b"" and frames[2] == b""
    assert [(i, size) for i, _, size in refs] == [(1, len(BIG)), (2, len(BIG))]
    back = folder.resolve(frames, refs)
    assert bytes(back[1]) == BIG and bytes(back[2]) == BIG
    back[1][0] = 0  # copy-on-write: the receiver may change what it got...
    assert bytes(folder.open(refs[0][1], len(BIG)))[0] == BIG[0]  # ...the file stays


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_mid_size_frames_go_by_name_and_are_read_back_holding_nothing(folder):
    # From 64 KiB a frame goes through the folder (through a socket it would also cost the
    # journal a file of its own); under 1 MiB its consumer reads it instead of mapping it, so a
    # caller keeping thousands of results keeps no descriptor for each.
    mid = bytes(range(256)) * (MIN_SHARED_BYTES // 256)
    frames, refs = folder.share([mid[:-1], mid])
    assert frames[0] == mid[:-1] and frames[1] == b"" and len(refs) == 1
    consumer = SharedFolder.join(folder.offer())
    assert consumer is not None
    _, name, size = refs[0]
    before = _open_descriptors()
    held = [consumer.open(name, size) for _ in range(64)]
    # A mapping would hold 64 more; the producer's spare-making thread may open one meanwhile.
    assert _open_descriptors() - before < 8
    assert all(bytes(h) == mid for h in held)
    held[0][0] = 255  # the receiver's own copy: writable, and the file stays as it was
    assert bytes(consumer.open(name, size)) == mid
    _, big = folder.share([BIG])
    before = _open_descriptors()
    mapped = [consumer.open(big[0][1], len(BIG)) for _ in range(64)]
    # What mapping each mid-size frame would cost (a helper thread's descriptor may close
    # meanwhile).
    assert _open_descriptors() - before >= 60
    del mapped


def test_mid_size_frames_leave_a_quarter_of_the_folder_free(folder, monkeypatch):
    # /dev/shm is memory other programs use too (64 MiB in a Docker container): a frame that may
    # as well go through the socket does so once the folder would pass three quarters full.
    blocks = 1000
    free = {"blocks": 300}

    def statvfs(path):
        return os.statvfs_result((4096, 4096, blocks, free["blocks"], free["blocks"],
                                  0, 0, 0, 0, 255))

    monkeypatch.setattr(sharedmem.os, "statvfs", statvfs)
    mid = bytes(MIN_SHARED_BYTES)
    frames, refs = folder.share([mid])
    assert frames == [b""] and len(refs) == 1  # 300 - 16 blocks left of 1000: room
    free["blocks"] = 260
    frames, refs = folder.share([mid])
    assert frames == [mid] and refs == []  # 244 of 1000 would be left: it goes as bytes
    frames, refs = folder.share([BIG])
    assert frames == [b""] and len(refs) == 1  # a big frame may fill it, as before


@pytest.mark.parametrize(("function", "argument", "by_table"), [
    (300_000, 100, True),  # a big closure, small arguments: its one copy goes in the table
    (300_000, 128 * 1024, False),  # an argument in the folder: the function goes there too
    (500, 128 * 1024, False),  # a small function travels with each task, as before
    (2 << 20, 100, False),  # more than one frame: the table cannot carry it
])
def test_a_function_goes_once_by_table_unless_its_task_names_shared_frames(
        folder, function, argument, by_table):
    from gpumesh.client.engine import function_goes_by_table

    frames = [bytes(function), bytes(argument)]
    spec = {"kind": "fn", "fn": "d" * 24}
    assert function_goes_by_table(spec, frames, LIMITS.chunk_bytes) is by_table
    assert function_goes_by_table({"kind": "script"}, frames, LIMITS.chunk_bytes) is False
    out, refs = folder.share(frames, start=1 if by_table else 0)
    # Never a task whose function stays on the wire while an argument is in the folder.
    assert not (refs and out[0] == frames[0] and function >= MIN_SHARED_BYTES)


@pytest.mark.parametrize("name", ["../../etc/passwd", PROBE, "A" * 32, "0" * 31, 7])
def test_a_reference_names_only_a_frame_file(folder, name):
    with pytest.raises(ValueError):
        folder.open(name, 1)


def test_a_missing_or_resized_frame_is_a_clear_error(folder):
    _, refs = folder.share([BIG])
    with pytest.raises(ValueError, match="not the"):
        folder.open(refs[0][1], len(BIG) + 1)
    folder.remove([refs[0][1]])
    with pytest.raises(ValueError, match="gone"):
        folder.resolve([b""], refs)


@pytest.mark.parametrize("value", [
    "x", [[0, "a" * 32]], [[5, "a" * 32, 1]], [[0, "a" * 32, 1], [0, "b" * 32, 1]],
    [[0, "../x", 1]], [[0, "a" * 32, -1]], [[True, "a" * 32, 1]], [[0, "a" * 32, 2**41]],
])
def test_hostile_references_do_not_parse(value):
    with pytest.raises(ValueError):
        parse_refs(value, 2)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
def test_a_fifo_under_a_frames_name_is_refused_without_blocking(folder):
    # Opening it for reading waited for a writer: the coordinator's loop would have stopped.
    import threading

    name = "ab" * 16
    os.mkfifo(folder.path / name, 0o600)
    outcome: list[object] = []

    def open_it() -> None:
        try:
            folder.open(name, 10)
        except Exception as exc:
            outcome.append(exc)

    opener = threading.Thread(target=open_it, daemon=True)
    opener.start()
    opener.join(5)
    assert not opener.is_alive() and isinstance(outcome[0], ValueError)
    from gpumesh.shmpool import holds

    asker = threading.Thread(target=lambda: outcome.append(holds(folder.path / name)),
                             daemon=True)
    asker.start()
    asker.join(5)
    assert not asker.is_alive()


def written_by_a_process_killed_after(folder: SharedFolder, count: int) -> list[str]:
    """The names of ``count`` big frames another process wrote into ``folder`` before it was
    killed with SIGKILL: a client gone before its SUBMIT was accepted."""
    code = ("import json, os, signal, sys\n"
            "from gpumesh.sharedmem import SharedFolder\n"
            "folder = SharedFolder.join(json.loads(sys.argv[1]))\n"
            f"print(json.dumps([folder.write([bytes({MIN_MAPPED_BYTES})]) for _ in range({count})]),"
            " flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(folder.offer())],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    written = json.loads(done.stdout)
    assert all(isinstance(name, str) for name in written)
    return written


def age(folder: SharedFolder, name: str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(folder.path / name, (then, then))


def owner_files(folder: SharedFolder) -> set[str]:
    return {n for n in os.listdir(folder.path) if n.startswith(OWNER)}


def test_frames_of_a_killed_writer_go_once_old_and_unreferenced(folder):
    referenced, old, young = written_by_a_process_killed_after(folder, 3)
    prefix = referenced[:PREFIX_CHARS]
    assert old.startswith(prefix) and young.startswith(prefix)
    assert owner_files(folder) == {OWNER + prefix}
    assert shmowners.alive(folder.path, prefix) is False  # its lock went with it
    age(folder, referenced, ORPHAN_GRACE + 1)
    age(folder, old, ORPHAN_GRACE + 1)
    assert folder.sweep({referenced}, unknown_after=None) == 1
    assert names(folder) == {referenced, young}
    assert owner_files(folder) == {OWNER + prefix}  # its frames are not all gone yet
    age(folder, young, ORPHAN_GRACE + 1)
    assert folder.sweep(lambda: {referenced}, unknown_after=None) == 1
    assert folder.sweep(set(), unknown_after=None) == 1  # once nothing names it any more
    assert names(folder) == set() and owner_files(folder) == set()


def joined(folder: SharedFolder) -> SharedFolder:
    """The folder as a client or worker of this machine joins it (this process writing)."""
    other = SharedFolder.join(folder.offer())
    assert other is not None
    return other


def test_the_orphan_sweep_ages_files_by_the_wall_clock_its_files_carry(folder):
    # The coordinator's steady clock differs from the wall clock by any step since it started:
    # after a step back of two hours every file looked two hours older, and a frame written
    # in this run by a writer without an owner file (a parked SUBMIT's) was removed.
    import time as wall

    steady = wall.time() + 7200.0  # the steady clock, two hours ahead of the wall
    b = Broker(Store(":memory:"), Timing(), LIMITS, epoch=1, now=steady - 60.0, shm=folder)
    fresh = "e" * 32  # this run began a minute ago; this file was written now
    (folder.path / fresh).write_bytes(b"x")
    b._sweep_orphans(steady)
    assert names(folder) == {fresh}


def test_frames_of_a_live_writer_stay_however_old_and_unreferenced(folder):
    _, refs = joined(folder).share([BIG, BIG])
    for _, name, _ in refs:
        age(folder, name, 10 * ORPHAN_AGE)
    asked = []
    assert folder.sweep(lambda: asked.append(1) or set(), unknown_after=0) == 0
    assert not asked  # nothing could go: the task table was not even looked at
    assert names(folder) == {name for _, name, _ in refs}


def test_frames_of_an_unknown_writer_go_only_after_a_restart(folder):
    unknown = "f" * 32  # named as before owners, or its owner file went with an older folder
    (folder.path / unknown).write_bytes(b"x")
    age(folder, unknown, ORPHAN_AGE + 1)
    assert folder.sweep(set(), unknown_after=None) == 0  # running: a parked SUBMIT's, maybe
    assert folder.sweep(set()) == 1  # at a restart, as ever, once ORPHAN_AGE old
    assert names(folder) == set()


def test_the_coordinators_own_frames_are_nobodys_and_go_by_the_restart_rule(folder):
    # What it writes its tasks name until they end: a coordinator killed and started again
    # must not find them swept a minute on, as a gone writer's would be.
    name = folder.write([BIG])
    assert name is not None and folder.owner_prefix() is None
    assert shmowners.alive(folder.path, name[:PREFIX_CHARS]) is None
    assert owner_files(folder) == set()


def test_a_runner_without_its_agents_prefix_names_its_results_at_random(folder):
    from gpumesh.runner.__main__ import _FOLDERS, _shared_folder

    try:
        for header in ({"shm_dir": str(folder.path)},
                       {"shm_dir": str(folder.path), "shm_owner": "../../etc"}):
            runner = _shared_folder(header)
            assert runner is not None and runner.owner_prefix() is None
        assert owner_files(folder) == set()  # never one of its own, which dies with it
    finally:
        _FOLDERS.clear()


def test_a_runner_names_its_frames_as_its_agent_and_a_forked_child_as_itself(folder):
    agent = joined(folder).owner_prefix()
    assert agent is not None
    runner = SharedFolder(folder.path, "")
    runner.owner = shmowners.tagged(agent, 77)
    written = runner.write([BIG])
    assert written.startswith(runner.owner) and NAME_PATTERN.fullmatch(written)
    assert folder.remove_starting([agent]) == 0  # never every frame of an owner
    assert folder.remove_starting([shmowners.tagged(agent, 78)]) == 0
    assert folder.remove_starting([runner.owner]) == 1
    runner.owner = agent
    assert runner.write([BIG]).startswith(agent)
    parents = joined(folder)
    assert parents.write([BIG]).startswith(agent)
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's exit status says how it went
        mine = SharedFolder(folder.path, "").write([BIG])
        inherited = parents.write([BIG])  # the parent's folder object, its prefix known
        os._exit(0 if mine is not None and not mine.startswith(agent)
                 and inherited is not None and inherited[:PREFIX_CHARS] == mine[:PREFIX_CHARS]
                 else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert shmowners.alive(folder.path, agent) is True  # the child let go of its copy only
    assert len(owner_files(folder)) == 2


@pytest.mark.parametrize("rejoined", [True, False], ids=["after a new WELCOME",
                                                       "with the old folder object"])
def test_a_writer_makes_its_lock_file_again_in_a_folder_made_again(tmp_path, monkeypatch,
                                                                   rejoined):
    # With the old object: a client writes its next SUBMIT's frames before it has handled the
    # restarted coordinator's WELCOME. It looks for its lock file again within a second.
    monkeypatch.setattr("gpumesh.sharedmem._base", lambda: tmp_path)
    monkeypatch.setattr(sharedmem, "OWNER_RECHECK_SECONDS", 0.0)  # as if a second went by
    first = SharedFolder.create("again")
    assert first is not None
    client = SharedFolder.join(first.offer())
    assert client is not None
    prefix = client.owner_prefix()
    first.close()  # no frame left: the folder goes, the client's lock file with it
    assert not first.path.exists()
    second = SharedFolder.create("again")
    assert second is not None
    try:
        writer = SharedFolder.join(second.offer()) if rejoined else client
        assert writer is not None
        name = writer.write([BIG])
        assert name is not None and not name.startswith(prefix)
        assert shmowners.alive(second.path, name[:PREFIX_CHARS]) is True
    finally:
        second.remove(names(second))
        second.close()


def test_a_lock_file_never_renamed_goes_once_old(folder):
    making = folder.path / f".{OWNER}{'a' * PREFIX_CHARS}"
    making.write_bytes(b"")
    folder.sweep(set(), unknown_after=None)
    assert making.exists()  # it may be being made right now
    age(folder, making.name, ORPHAN_GRACE + 1)
    folder.sweep(set(), unknown_after=None)
    assert not making.exists()


def test_close_keeps_a_folder_that_still_holds_frames(folder):
    _, refs = folder.share([BIG])
    folder.close()
    assert folder.path.is_dir()
    folder.remove([refs[0][1]])
    folder.close()
    assert not folder.path.exists()


@pytest.mark.parametrize("journal_left", [True, False, "unreadable"])
def test_a_gone_coordinators_frames_go_only_with_their_journal(tmp_path, monkeypatch,
                                                               journal_left):
    monkeypatch.setattr("gpumesh.sharedmem._base", lambda: tmp_path)
    journal = tmp_path / "home" / "coordinator.db"
    journal.parent.mkdir()
    journal.write_bytes(b"")
    gone = SharedFolder.create("gone", str(journal))
    assert gone is not None
    gone.share([BIG])
    gone.close()  # stopped (or killed) with a frame its journal still names: kept
    assert gone.path.is_dir()
    if not journal_left:
        journal.unlink()  # a temporary mesh's home, removed
    elif journal_left == "unreadable":
        # Behind a permission (or on a disk that errs): not gone, though exists() said so.
        real_stat = os.stat
        monkeypatch.setattr("gpumesh.sharedmem.os.stat", lambda path, *a, **k: (
            _raise(PermissionError(13, "denied")) if str(path) == str(journal)
            else real_stat(path, *a, **k)))
    other = SharedFolder.create("other", str(tmp_path / "other.db"))
    assert other is not None
    try:  # a starting coordinator sweeps the folders of those that are gone
        assert gone.path.is_dir() == bool(journal_left)
    finally:
        other.close()


def _raise(exc: BaseException):
    raise exc


# ----------------------------------------------------------------- the coordinator

W, W2, C = b"worker-routing", b"worker-2", b"client-routing"


@pytest.fixture
def broker(folder) -> Broker:
    b = Broker(Store(":memory:"), Timing(), LIMITS, epoch=1, now=0.0, shm=folder)
    b.handle(W, decode(encode(Command.HELLO, {"role": "worker", "id": "w1", "slots": 1,
                                              "proto": [1, 1], "info": {"python": "3.11"},
                                              "shmlock": True}), LIMITS), 0.0)
    b.handle(C, decode(encode(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1],
                                              "shmlock": True}), LIMITS), 0.0)
    return b


def handle(b: Broker, routing: bytes, command: Command, header: dict, payload=()) -> None:
    b.handle(routing, decode(encode(command, header, list(payload)), LIMITS), 1.0)


def sent(b: Broker, routing: bytes, command: Command) -> list[Message]:
    out = [decode(f, LIMITS) for r, f in b.outbox if r == routing]
    b.outbox.clear()
    return [m for m in out if m.command is command]


def submit_shared(b: Broker, folder: SharedFolder) -> tuple[str, str]:
    frames, refs = folder.share([b"fn", BIG])
    spec = {"seq": 1, "nf": 2, "kind": "fn", "shm": [list(r) for r in refs]}
    handle(b, C, Command.SUBMIT, {"tasks": [spec]}, frames)
    accepted = sent(b, C, Command.ACCEPTED)[-1].header
    return (accepted["accepted"][0][1] if accepted["accepted"] else ""), refs[0][1]


def test_the_welcome_offers_the_folder_and_a_heartbeat_proves_access(broker, folder):
    assert not broker.clients["c1"].shm
    handle(broker, C, Command.HEARTBEAT, {"shm": "forged"})
    assert not broker.clients["c1"].shm
    handle(broker, C, Command.HEARTBEAT, {"shm": folder.proof})
    assert broker.clients["c1"].shm


def test_shared_frames_from_a_client_that_did_not_prove_access_are_refused(broker, folder):
    task, name = submit_shared(broker, folder)
    assert task == "" and broker.tasks == {}


def test_a_worker_that_shares_gets_names_and_one_that_does_not_gets_bytes(broker, folder):
    handle(broker, C, Command.HEARTBEAT, {"shm": folder.proof})
    task_id, name = submit_shared(broker, folder)
    assert broker.tasks[task_id].input_bytes >= len(BIG)  # the quota counts shared input
    broker.dispatch(1.0)
    task = sent(broker, W, Command.TASK)[-1]
    assert "shm" not in task.header and b"".join(bytes(f) for f in task.payload[1:]) == BIG
    # The runner died: the task goes again, to a worker that proved access: only the name.
    handle(broker, W2, Command.HELLO, {"role": "worker", "id": "w2", "slots": 1, "proto": [1, 1],
                                       "info": {"python": "3.11"}, "shmlock": True})
    handle(broker, W2, Command.HEARTBEAT, {"leases": [], "shm": folder.proof})
    handle(broker, W, Command.RESULT, {"task": task_id, "lease": task.header["lease"],
                                       "status": "crashed", "diagnosis": "x"})
    broker.dispatch(2.0)
    again = sent(broker, W2, Command.TASK)[-1]
    assert again.header["shm"][0][1] == name and again.payload == [b"fn", b""]


def sharing_worker(b: Broker, folder: SharedFolder) -> None:
    handle(b, W, Command.HEARTBEAT, {"leases": [], "shm": folder.proof})


def test_big_input_from_a_socket_goes_to_a_sharing_worker_by_name_and_goes_with_its_task(
        broker, folder):
    sharing_worker(broker, folder)  # the client did not prove access: its bytes came inline
    pieces = [BIG[:len(BIG) // 2], BIG[len(BIG) // 2:]]  # a frame split for the wire
    spec = {"seq": 1, "nf": 3, "kind": "fn", "split": [1, 2]}
    handle(broker, C, Command.SUBMIT, {"tasks": [spec]}, [b"fn", *pieces])
    task_id = sent(broker, C, Command.ACCEPTED)[-1].header["accepted"][0][1]
    broker.dispatch(1.0)
    task = sent(broker, W, Command.TASK)[-1]
    (index, name, size), = task.header["shm"]
    assert (index, size) == (1, len(BIG)) and "split" not in task.header
    assert task.payload == [b"fn", b""]
    assert bytes(folder.open(name, size)) == BIG  # the slices, written in order
    handle(broker, W, Command.RESULT, {"task": task_id, "lease": task.header["lease"],
                                       "status": "ok"}, [b"result"])
    handle(broker, C, Command.RESULT_ACK, {"tasks": [task_id]})
    assert name not in committed(broker, folder)  # gone once its task is


@pytest.mark.parametrize("kind", ["script", "small", "full"])
def test_input_that_cannot_or_need_not_move_goes_as_bytes(broker, folder, monkeypatch, kind):
    sharing_worker(broker, folder)
    if kind == "full":  # the folder cannot take it: the task still runs, with its bytes
        monkeypatch.setattr(SharedFolder, "write", lambda self, pieces: None)
    big = b"x" * 100 if kind == "small" else BIG
    spec = {"seq": 1, "nf": 2, "kind": "script" if kind == "script" else "fn"}
    if kind == "script":
        spec["name"] = "job.py"
    handle(broker, C, Command.SUBMIT, {"tasks": [spec]}, [b"code", big])
    broker.dispatch(1.0)
    task = sent(broker, W, Command.TASK)[-1]
    assert "shm" not in task.header and bytes(task.payload[-1]) == big


def test_a_peer_that_reads_the_folder_but_does_not_lock_gets_bytes_and_may_send_names(broker,
                                                                                       folder):
    # A gpumesh before protocol 1.7: it could map a file its producer then writes again.
    handle(broker, W2, Command.HELLO, {"role": "worker", "id": "w2", "slots": 1, "proto": [1, 1],
                                       "info": {"python": "3.11"}})
    handle(broker, W2, Command.HEARTBEAT, {"leases": [], "shm": folder.proof})
    handle(broker, W, Command.DISCONNECT, {"reason": "left"})  # W2 is the only worker
    handle(broker, C, Command.HEARTBEAT, {"shm": folder.proof})
    task_id, name = submit_shared(broker, folder)
    broker.dispatch(1.0)
    task = sent(broker, W2, Command.TASK)[-1]
    assert "shm" not in task.header and b"".join(bytes(f) for f in task.payload[1:]) == BIG
    frames, refs = folder.share([b"pickle", BIG])  # its own big result: by name, as before
    handle(broker, W2, Command.RESULT, {"task": task_id, "lease": task.header["lease"],
                                        "status": "ok", "shm": [list(r) for r in refs]}, frames)
    assert broker.tasks[task_id].state.value == "done"
    assert sent(broker, C, Command.RESULT)[-1].header["shm"][0][1] == refs[0][1]


def committed(b: Broker, folder: SharedFolder) -> set[str]:
    """What the server does at the end of a turn, as far as files go: commit, then remove what
    the turn dropped (on the folder's own thread, waited for here). The files left."""
    b.store.commit()
    b.ledger.remove_unneeded_files()
    folder.settle()
    return names(folder)


def finish_shared(b: Broker, folder: SharedFolder) -> tuple[str, str, str]:
    """A task with a shared input, run to a shared result: (task, input file, result file)."""
    handle(b, C, Command.HEARTBEAT, {"shm": folder.proof})
    handle(b, W, Command.HEARTBEAT, {"leases": [], "shm": folder.proof})
    task_id, name = submit_shared(b, folder)
    b.dispatch(1.0)
    lease = sent(b, W, Command.TASK)[-1].header["lease"]
    frames, refs = folder.share([b"pickle", BIG])
    handle(b, W, Command.RESULT, {"task": task_id, "lease": lease, "status": "ok",
                                  "shm": [list(r) for r in refs]}, frames)
    return task_id, name, refs[0][1]


def test_shared_files_are_removed_once_nobody_needs_them(broker, folder):
    task_id, name, result_name = finish_shared(broker, folder)
    result = sent(broker, C, Command.RESULT)[-1]
    assert result.header["shm"][0][1] == result_name
    # The result is held out of the journal for its client to collect, so the journal still
    # says the task is to run: its input stays.
    assert committed(broker, folder) == {name, result_name}
    handle(broker, C, Command.RESULT_ACK, {"tasks": [task_id]})
    assert names(folder) == {name, result_name}  # not before the collection is committed
    assert committed(broker, folder) == set()


def test_a_running_coordinator_sweeps_what_a_killed_client_left_and_keeps_what_it_sent(
        broker, folder):
    """A client killed between writing its arguments and the coordinator accepting the SUBMIT
    left them in /dev/shm (memory) until the coordinator restarted. What its accepted tasks
    name stays, and so does what a live client wrote, however long its SUBMIT waits."""
    sent_one, left_one = written_by_a_process_killed_after(folder, 2)
    handle(broker, C, Command.HEARTBEAT, {"shm": folder.proof})
    spec = {"seq": 1, "nf": 2, "kind": "fn", "shm": [[1, sent_one, MIN_MAPPED_BYTES]]}
    handle(broker, C, Command.SUBMIT, {"tasks": [spec]}, [b"fn", b""])
    assert sent(broker, C, Command.ACCEPTED)[-1].header["accepted"]
    _, refs = joined(folder).share([BIG])  # a live client's, not sent yet
    parked = refs[0][1]
    for name in (sent_one, left_one, parked):
        age(folder, name, ORPHAN_GRACE + 1)
    now = time.time()
    broker.tick(now)  # the first look comes ORPHAN_SWEEP after the start (0.0 here)
    assert names(folder) == {sent_one, parked}
    age(folder, parked, 100 * ORPHAN_AGE)
    broker.tick(now + ORPHAN_SWEEP)
    assert names(folder) == {sent_one, parked}


def test_a_running_coordinator_sweeps_unknown_frames_left_from_before_it_started(
        broker, folder):
    # Its own copies of a remote client's inputs (named at random, with no owner) stayed
    # after a restart until a later restart came ORPHAN_AGE after they were written: weeks of
    # RAM, up to a GiB a task. The journal holds their bytes: the restored task needs none.
    broker.ledger.started_at = time.time() - 2 * ORPHAN_AGE
    left, written_since = "e" * 32, "d" * 32
    for name, seconds in ((left, 3 * ORPHAN_AGE), (written_since, ORPHAN_AGE + 1)):
        (folder.path / name).write_bytes(b"x")
        age(folder, name, seconds)
    broker.tick(time.time())
    assert left not in names(folder)
    assert written_since in names(folder)  # this run's: a parked SUBMIT's, maybe


def test_the_sweep_leaves_what_this_turn_dropped_to_its_commit(broker, folder):
    # A task forgotten earlier in the turn no longer names its files, but the journal does
    # until the commit: a coordinator killed before it restarts from there.
    (name,) = written_by_a_process_killed_after(folder, 1)
    age(folder, name, ORPHAN_GRACE + 1)
    broker.ledger.drop_files([name])
    broker.tick(time.time())
    assert names(folder) == {name}
    assert committed(broker, folder) == set()  # then it goes, as every dropped file does


def test_the_files_a_crashed_result_names_go_too(broker, folder):
    # They stayed in /dev/shm (memory) for as long as the coordinator ran.
    task_id = result_left_in_the_folder(broker, folder, status="crashed", diagnosis="x")
    assert broker.tasks[task_id].state.value == "pending"  # it runs again
    assert committed(broker, folder) == set()


@pytest.mark.parametrize("damage", ["removed", "truncated"])
def test_a_result_whose_file_is_gone_when_it_arrives_runs_again_instead_of_being_lost(
        broker, folder, damage):
    # Its worker killed as it sent it again, its file swept meanwhile (or a cleaned /dev/shm):
    # taken as it came, the caller would have been told later that its result was lost.
    handle(broker, W, Command.HEARTBEAT, {"leases": [], "shm": folder.proof})
    handle(broker, C, Command.SUBMIT, {"tasks": [{"seq": 1, "nf": 2, "kind": "fn"}]},
           [b"fn", b"a"])
    task_id = sent(broker, C, Command.ACCEPTED)[-1].header["accepted"][0][1]
    broker.dispatch(1.0)
    lease = sent(broker, W, Command.TASK)[-1].header["lease"]
    frames, refs = folder.share([b"pickle", BIG])
    if damage == "removed":
        os.unlink(folder.path / refs[0][1])
    else:
        os.truncate(folder.path / refs[0][1], 10)
    handle(broker, W, Command.RESULT, {"task": task_id, "lease": lease, "status": "ok",
                                       "shm": [list(r) for r in refs]}, frames)
    assert sent(broker, W, Command.RESULT_ACK)[-1].header["disposition"] == "accepted"
    task = broker.tasks[task_id]
    assert task.state.value == "pending" and task.result_header is None
    assert committed(broker, folder) == set()  # a truncated one goes too


def test_the_files_of_a_result_refused_as_unreadable_go(broker, folder):
    # A script's result sent as a pickle in shared memory is refused and its task failed; the
    # files it named stayed, under its agent's prefix, for as long as that agent ran.
    handle(broker, W, Command.HEARTBEAT, {"leases": [], "shm": folder.proof})
    handle(broker, C, Command.SUBMIT, {"tasks": [{"seq": 1, "nf": 2, "kind": "script",
                                                  "name": "s.py"}]}, [b"print(1)", b"{}"])
    task_id = sent(broker, C, Command.ACCEPTED)[-1].header["accepted"][0][1]
    broker.dispatch(1.0)
    lease = sent(broker, W, Command.TASK)[-1].header["lease"]
    frames, refs = folder.share([b"pickle", BIG])
    handle(broker, W, Command.RESULT, {"task": task_id, "lease": lease, "status": "ok",
                                       "shm": [list(r) for r in refs]}, frames)
    assert broker.tasks[task_id].state.value == "failed"
    assert committed(broker, folder) == set()


def retired(folder: SharedFolder) -> set[str]:
    return {n[len(RETIRED):] for n in os.listdir(folder.path) if n.startswith(RETIRED)}


def test_files_their_producer_keeps_are_retired_while_every_peer_locks_what_it_maps(broker,
                                                                                    folder):
    task_id, name, result_name = finish_shared(broker, folder)  # this process wrote both
    handle(broker, C, Command.RESULT_ACK, {"tasks": [task_id]})
    broker.store.commit()
    broker.ledger.remove_unneeded_files()
    wait_for(lambda: retired(folder) == {name, result_name}, what="both files retired")
    assert names(folder) == {RETIRED + name, RETIRED + result_name}


def test_a_result_sent_again_after_a_reconnect_leaves_the_taken_ones_files(broker, folder):
    task_id, name, result_name = finish_shared(broker, folder)
    lease = broker.tasks[task_id].lease_id
    # The worker lost its link before the acknowledgement, and sends its result again.
    handle(broker, W, Command.RESULT, {"task": task_id, "lease": lease, "status": "ok",
                                       "shm": [[1, result_name, len(BIG)]]}, [b"pickle", b""])
    assert committed(broker, folder) == {name, result_name}  # the client has yet to collect it


def test_a_journaled_result_lets_its_input_go_and_keeps_its_own(broker, folder):
    from gpumesh.coordinator.ledger import RESULT_JOURNAL_DELAY

    task_id, name, result_name = finish_shared(broker, folder)
    broker.ledger.journal_held_results(1.0 + RESULT_JOURNAL_DELAY)  # its client was slow
    assert committed(broker, folder) == {result_name}  # the client has yet to collect it


def test_removals_wait_for_the_folder_to_close(tmp_path, monkeypatch):
    monkeypatch.setattr("gpumesh.sharedmem._base", lambda: tmp_path)
    folder = SharedFolder.create("closing")
    assert folder is not None
    _, refs = folder.share([BIG, BIG])
    folder.retire_soon(name for _, name, _ in refs)
    folder.close()  # waits for the removals, so the empty folder goes too
    assert not folder.path.exists()


def test_a_result_for_a_client_that_does_not_share_is_read_back_in(broker, folder):
    result_left_in_the_folder(broker, folder)
    result = sent(broker, C, Command.RESULT)[-1]
    assert "shm" not in result.header
    assert b"".join(bytes(f) for f in result.payload[1:]) == BIG


def result_left_in_the_folder(b: Broker, folder: SharedFolder, now: float = 1.0,
                              before=lambda: None, **result) -> str:
    """A worker on this machine leaves a task's result in the folder; the client is elsewhere
    (it never proved access): the task's id. ``before`` runs as the RESULT comes; ``result``
    changes its header (``status="crashed"``)."""
    handle(b, W, Command.HEARTBEAT, {"leases": [], "shm": folder.proof})
    handle(b, C, Command.SUBMIT, {"tasks": [{"seq": 1, "nf": 2, "kind": "fn"}]}, [b"fn", b"a"])
    task_id = sent(b, C, Command.ACCEPTED)[-1].header["accepted"][0][1]
    b.dispatch(now)
    lease = sent(b, W, Command.TASK)[-1].header["lease"]
    frames, refs = folder.share([b"pickle", BIG])
    before()
    header = {"task": task_id, "lease": lease, "status": "ok", **result,
              "shm": [list(r) for r in refs]}
    b.handle(W, decode(encode(Command.RESULT, header, frames), LIMITS), now)
    return task_id


def descriptors_run_out(monkeypatch, folder: SharedFolder):
    """From now on, opening a file of ``folder`` fails with "Too many open files" (EMFILE);
    returns what undoes it."""
    import errno

    real_open = os.open

    def short_of_descriptors(path, flags, *args, **kwargs):
        if str(path).startswith(str(folder.path)):
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", short_of_descriptors)
    return lambda: monkeypatch.setattr(os, "open", real_open)


def test_a_result_not_read_back_for_want_of_descriptors_waits_and_is_not_lost(broker, folder,
                                                                             monkeypatch):
    # "Too many open files" was taken for the frame being gone: the client got ResultLost for
    # a result that was there (and a worker's input, the task failed for good).
    undo: list = []
    task_id = result_left_in_the_folder(
        broker, folder, before=lambda: undo.append(descriptors_run_out(monkeypatch, folder)))
    with pytest.raises(sharedmem.SharedFrameBusy):
        folder.open("0" * 32, 1)
    assert sent(broker, C, Command.RESULT) == []  # it waits
    undo[0]()
    broker.ledger.deliver_deferred(5.0)
    result = sent(broker, C, Command.RESULT)[-1]
    assert result.header["task"] == task_id and result.header["status"] == "ok"
    assert b"".join(bytes(f) for f in result.payload[1:]) == BIG


def test_a_result_read_back_is_not_read_again_for_a_fetch_while_it_waits_to_go(broker, folder):
    # A client that stops reading its socket but sends FETCH every second made the coordinator
    # map (or copy) the result again each time, a descriptor each: it ran out of them.
    import gc

    task_id = result_left_in_the_folder(broker, folder)
    first = [frames for routing, frames in broker.outbox if routing == C]  # not sent yet
    broker.outbox.clear()
    handle(broker, C, Command.FETCH, {"qid": 1, "tasks": [task_id]})
    broker.handle(C, decode(encode(Command.FETCH, {"qid": 2, "tasks": [task_id]}), LIMITS), 3.0)
    assert sent(broker, C, Command.RESULT) == []  # the first copy still waits in the outbox
    del first
    gc.collect()
    broker.handle(C, decode(encode(Command.FETCH, {"qid": 3, "tasks": [task_id]}), LIMITS), 5.0)
    assert len(sent(broker, C, Command.RESULT)) == 1


def _engine_nobody_answers(tmp_path):
    """A client engine dialling a loopback port nobody listens on: nothing it sends arrives."""
    import socket

    from gpumesh.client.engine import Engine
    from gpumesh.config import Endpoint, Settings

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return Engine(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}),
                  Endpoint("127.0.0.1", port), "a-token-for-nobody")


def test_a_result_the_client_cannot_read_for_want_of_descriptors_is_read_again(
        folder, tmp_path, monkeypatch):
    # It became the caller's error while its acknowledgement told the coordinator to drop it.
    # Then it was asked for again with a FETCH, which a coordinator does not answer while a
    # copy read back from disk is on its way: it is read again from the RESULT it came in
    # (its shared files stay until it is acknowledged), and nothing is asked for.
    from gpumesh.client.engine import REDECODE_AFTER
    from gpumesh.protocol import serialize

    engine = _engine_nobody_answers(tmp_path)
    try:
        future, = engine.submit([({"kind": "fn"}, [b"x"])], "j1")
        wait_for(lambda: engine._outstanding, what="the submission filed")
        seq, = engine._outstanding
        engine._shm = folder
        value = bytearray(BIG)
        frames, refs = folder.share(serialize.dumps(value))
        assert refs
        result = encode(Command.RESULT, {"task": "t1", "seq": seq, "status": "ok",
                                         "shm": [list(r) for r in refs]}, frames)
        restore = descriptors_run_out(monkeypatch, folder)
        engine._on_result(decode(result, LIMITS), 1.0)
        assert not future.done() and "t1" not in engine._acks
        asked: list[list[str]] = []
        monkeypatch.setattr(engine, "_send_ids", lambda command, ids, **extra: asked.append(
            [command.name, *ids]))
        engine._timers(1.0 + REDECODE_AFTER)  # still short: it waits again
        assert not future.done() and "t1" in engine._redecode
        restore()
        engine._timers(1.0 + 2.5 * REDECODE_AFTER)
        assert future.result(timeout=5) == value and engine._acks[-1] == "t1"
        assert asked == [] and engine._redecode == {}
    finally:
        engine.close()


def test_a_submission_cancelled_before_it_was_ever_sent_takes_its_files_with_it(
        folder, tmp_path, monkeypatch):
    # Its big frames went into the folder for a send that failed (the link's queue full);
    # cancelled then, it was forgotten and its files stayed as long as the client lived.
    from gpumesh.client.engine import TaskFuture, _Submission

    engine = _engine_nobody_answers(tmp_path)
    try:
        engine._shm = joined(folder)
        monkeypatch.setattr(engine._link, "send", lambda frames: False)  # not sent
        sub = _Submission(1, {"kind": "fn"}, [b"fn", BIG], TaskFuture(), "j1", "m")
        engine._outstanding[1] = sub
        engine._send_submissions([sub], 0.0)
        assert names(folder) and not sub.sent_at  # written, for a send that did not happen
        assert sub.future.cancel()
        engine._send_submissions([sub], 1.0)
        assert 1 not in engine._outstanding
        assert names(folder) == set()
    finally:
        engine.close()


@pytest.mark.parametrize("failure", ["gone", "short of descriptors"])
def test_a_worker_whose_result_it_cannot_read_back_reports_a_crash_and_stays_up(
        folder, monkeypatch, failure):
    # The coordinator moved to another folder: the agent reads its result's frames back to
    # send them. Short of descriptors, SharedFrameBusy came out of the agent's loop and the
    # worker exited with its runners.
    import types

    from gpumesh.worker import agent

    frames, refs = folder.share([b"pickle", BIG])
    if failure == "gone":
        folder.remove([refs[0][1]])
    else:
        descriptors_run_out(monkeypatch, folder)
    posted: list[list] = []
    moved = types.SimpleNamespace(shm=None, granted=1, settings=types.SimpleNamespace(
        limits=LIMITS), link=types.SimpleNamespace(post=posted.append))
    header = {"task": "t1", "lease": 7, "status": "ok", "elapsed": 0.1,
              "shm": [list(r) for r in refs], agent._SHM_DIR: str(folder.path)}
    agent.WorkerAgent._send_result(moved, header, list(frames))
    sent = decode(posted[0], LIMITS)
    assert sent.header["status"] == "crashed" and sent.header["task"] == "t1"
    assert "lost before it was sent" in sent.header["diagnosis"] and sent.payload == []


def test_past_so_many_mappings_a_big_frame_is_read_into_memory_holding_no_descriptor(
        folder, monkeypatch):
    import gc

    gc.collect()
    start = sharedmem.mapped()
    monkeypatch.setattr(sharedmem, "MAX_MAPPED", start + 4)
    _, refs = folder.share([BIG])
    name = refs[0][1]
    held = [folder.open(name, len(BIG)) for _ in range(4)]
    assert sharedmem.mapped() == start + 4
    if os.path.isdir("/proc/self/fd"):
        before = _open_descriptors()
        held += [folder.open(name, len(BIG)) for _ in range(40)]
        assert _open_descriptors() - before < 8  # not one each
    else:
        held += [folder.open(name, len(BIG)) for _ in range(40)]
    assert all(bytes(h) == BIG for h in held) and sharedmem.mapped() == start + 4
    held[-1][0] = 7  # its own copy: writable, and the file stays as it was
    assert bytes(folder.open(name, len(BIG)))[0] == BIG[0]
    del held
    gc.collect()
    assert sharedmem.mapped() == start


def test_a_frame_with_no_memory_for_its_copy_is_mapped_past_the_bound(folder, monkeypatch):
    # ENOMEM for the copy would have made the frame "busy" for good: a task queued forever.
    import errno
    import mmap as real_mmap

    class NoAnonymousMemory:  # stands in for the mmap module
        MAP_PRIVATE, ACCESS_COPY = real_mmap.MAP_PRIVATE, real_mmap.ACCESS_COPY

        @staticmethod
        def mmap(fileno, length, **options):
            if fileno == -1:
                raise OSError(errno.ENOMEM, "Cannot allocate memory")
            return real_mmap.mmap(fileno, length, **options)

    monkeypatch.setattr(sharedmem, "MAX_MAPPED", 0)
    monkeypatch.setattr(sharedmem, "mmap", NoAnonymousMemory)
    _, refs = folder.share([BIG])
    view = folder.open(refs[0][1], len(BIG))
    assert bytes(view) == BIG and isinstance(view.obj, real_mmap.mmap)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_copy_past_the_mapping_bound_is_private_to_its_process_across_a_fork(tmp_path):
    # An anonymous mmap is MAP_SHARED by default: a child forked after the result came (a
    # DataLoader, a fork pool) wrote into the parent's array. A mapping of the file is
    # copy-on-write, so the copy must be private too. (In a child process: forking pytest,
    # which runs threads, warns.)
    import subprocess
    import sys

    script = f"""
import os, pathlib
from gpumesh import sharedmem
sharedmem._base = lambda: pathlib.Path({str(tmp_path)!r})
folder = sharedmem.SharedFolder.create("fork")
_, refs = folder.share([bytes({len(BIG)})])
sharedmem.MAX_MAPPED = 0
view = folder.open(refs[0][1], {len(BIG)})
assert not isinstance(view.obj, bytearray)
pid = os.fork()
if pid == 0:
    view[0] = 1
    os._exit(0)
os.waitpid(pid, 0)
print("private" if view[0] == 0 else "shared")
folder.close()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "private", out.stderr


def test_shared_result_frames_from_a_worker_without_access_are_malformed(broker, folder):
    frames, refs = folder.share([b"pickle", BIG])
    handle(broker, W, Command.RESULT, {"task": "t", "lease": 1, "status": "ok",
                                       "shm": [list(r) for r in refs]}, frames)
    assert sent(broker, W, Command.ERROR)[-1].header["code"] == "malformed"


def test_a_task_whose_shared_input_is_gone_fails_saying_so(broker, folder):
    handle(broker, C, Command.HEARTBEAT, {"shm": folder.proof})
    task_id, name = submit_shared(broker, folder)
    folder.remove([name])
    broker.dispatch(1.0)
    assert broker.tasks[task_id].state.terminal
    result = sent(broker, C, Command.RESULT)[-1]
    assert "gone" in result.header["diagnosis"]


def test_a_task_whose_shared_input_is_gone_fails_saying_so_on_a_worker_of_this_machine_too(
        broker, folder):
    # The worker maps the folder, so the task went to it as references: its runner crashed on
    # the missing file, and the task was retried as crashed on every worker to the same end.
    handle(broker, C, Command.HEARTBEAT, {"shm": folder.proof})
    handle(broker, W, Command.HEARTBEAT, {"shm": folder.proof})
    assert broker.ledger.workers["w1"].maps_shared
    task_id, name = submit_shared(broker, folder)
    folder.remove([name])
    broker.outbox.clear()
    broker.dispatch(1.0)
    assert broker.tasks[task_id].state.terminal
    result = sent(broker, C, Command.RESULT)[-1]
    assert "shared memory is gone" in result.header["diagnosis"]


def test_folders_of_coordinators_that_are_gone_are_swept_unless_they_hold_frames(tmp_path,
                                                                                 monkeypatch):
    monkeypatch.setattr("gpumesh.sharedmem._base", lambda: tmp_path)
    killed = SharedFolder.create("killed")  # as if its coordinator died with SIGKILL:
    killed_with_frames = SharedFolder.create("frames")
    running = SharedFolder.create("running")
    assert killed and killed_with_frames and running
    killed_with_frames.share([BIG])
    for gone in (killed, killed_with_frames):
        os.close(gone._lock)  # the lock dies with the process; close() never ran
        gone._lock = None
    mine = SharedFolder.create("new")
    assert mine is not None
    assert not killed.path.exists()  # empty and unlocked: removed
    assert killed_with_frames.path.exists()  # its journal may need the frame after a restart
    assert running.path.exists()  # locked by a live coordinator
    for folder in (running, mine):
        folder.close()


# ----------------------------------------------------------------- spare files (gpumesh/shmspares.py)
# Made after a big frame, used by the next frame of that size, never by another size, given
# back when idle or released, and never in the way (a system that cannot name them writes new
# files, as before).

needs_tmpfile = pytest.mark.skipif(not getattr(os, "O_TMPFILE", 0), reason="Linux O_TMPFILE")

def spare_ready(folder: SharedFolder, size: int, timeout: float = 10.0) -> bool:
    """Whether a spare of ``size`` is made within ``timeout`` (its thread notifies each one)."""
    if folder._spares is None:
        return False
    state = folder._spares._state
    with state.wake:
        return state.wake.wait_for(lambda: size in state.ready, timeout)


def inode_of(folder: SharedFolder, ref) -> int:
    return os.stat(folder.path / ref[1]).st_ino


@needs_tmpfile
def test_the_next_frame_of_a_size_goes_into_the_spare_made_for_it(folder):
    _, first = folder.share([BIG])
    assert spare_ready(folder, len(BIG))
    spare_fd = folder._spares._state.ready[len(BIG)][0]
    spare_inode = os.fstat(spare_fd).st_ino
    _, second = folder.share([memoryview(BIG)])
    assert inode_of(folder, second[0]) == spare_inode  # the spare, now named
    assert bytes(folder.open(second[0][1], len(BIG))) == BIG
    info = os.stat(folder.path / second[0][1])
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_size == len(BIG)
    assert inode_of(folder, first[0]) != spare_inode
    assert spare_ready(folder, len(BIG))  # and another is made for the one after


@needs_tmpfile
def test_a_spare_is_never_used_for_another_size_and_each_size_has_its_own(folder):
    folder.share([BIG])
    assert spare_ready(folder, len(BIG))
    big_spare = os.fstat(folder._spares._state.ready[len(BIG)][0]).st_ino
    other = BIG + b"x"
    _, refs = folder.share([other])
    assert bytes(folder.open(refs[0][1], len(other))) == other
    assert os.stat(folder.path / refs[0][1]).st_ino != big_spare
    assert spare_ready(folder, len(other))  # a task's two arrays: a spare for each size
    assert spare_ready(folder, len(BIG))
    _, refs = folder.share([BIG, other])
    assert {os.stat(folder.path / name).st_size for _, name, _ in refs} == {len(BIG), len(other)}
    assert os.stat(folder.path / refs[0][1]).st_ino == big_spare


@needs_tmpfile
def test_spares_are_bounded_in_count_and_bytes(folder, monkeypatch):
    monkeypatch.setattr(shmspares, "MAX_SPARES", 2)
    sizes = [len(BIG) + n for n in range(3)]
    for size in sizes:
        folder.share([bytes(size)])
        assert spare_ready(folder, size)
    assert set(folder._spares._state.ready) == set(sizes[1:])  # the oldest went
    monkeypatch.setattr(shmspares, "SPARE_MAX_BYTES", sizes[2] + 1)
    folder.share([bytes(sizes[0])])
    assert spare_ready(folder, sizes[0])
    assert set(folder._spares._state.ready) == {sizes[0]}  # one fits in the bytes allowed


@needs_tmpfile
def test_release_gives_the_spare_back(folder):
    folder.share([BIG])
    assert spare_ready(folder, len(BIG))
    spare_fd = folder._spares._state.ready[len(BIG)][0]
    folder.release()
    with pytest.raises(OSError):
        os.fstat(spare_fd)  # closed: its pages go back to the system
    assert folder._spares is None
    folder.share([BIG])  # a frame after the release: a new file, and no spare made for it
    assert folder._spares is None


@needs_tmpfile
def test_a_folder_dropped_without_release_ends_its_spare_thread(tmp_path, monkeypatch):
    import gc
    import threading

    monkeypatch.setattr("gpumesh.sharedmem._base", lambda: tmp_path)
    joined = SharedFolder(tmp_path, "")  # as a runner makes one
    joined.share([BIG])
    state = joined._spares._state
    assert spare_ready(joined, len(BIG))
    spare_fd = state.ready[len(BIG)][0]
    thread = state.thread
    assert thread is not None
    del joined
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()
    assert state.thread is None and state.closed
    assert not any(t.name == "gpumesh-shm-spares" and t.is_alive() and t is state.thread
                   for t in threading.enumerate())
    with pytest.raises(OSError):
        os.fstat(spare_fd)


@needs_tmpfile
def test_a_forked_child_gives_the_inherited_spare_back(folder):
    folder.share([BIG])
    assert spare_ready(folder, len(BIG))
    spare_fd = folder._spares._state.ready[len(BIG)][0]
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its spare is closed and it makes none
        try:
            state = folder._spares._state
            closed = state.closed and not state.ready
            try:
                os.fstat(spare_fd)
                gone = False
            except OSError:
                gone = True
            os.write(write_end, b"ok" if closed and gone else b"no")
        finally:
            os._exit(0)
    os.close(write_end)
    answer = os.read(read_end, 2)
    os.close(read_end)
    os.waitpid(pid, 0)
    assert answer == b"ok"
    assert os.fstat(spare_fd)  # the parent's is still its own


@needs_tmpfile
def test_an_idle_spare_is_given_back(folder, monkeypatch):
    monkeypatch.setattr(shmspares, "SPARE_IDLE_SECONDS", 0.05)
    folder.share([BIG])
    assert spare_ready(folder, len(BIG))
    state = folder._spares._state
    with state.wake:
        assert state.wake.wait_for(lambda: not state.ready, 10)
    assert not folder._spares._state.ready


@needs_tmpfile
def test_no_spare_where_the_file_system_is_nearly_full(folder, monkeypatch):
    real = os.statvfs

    class Full:
        def __init__(self, path):
            info = real(path)
            self.f_frsize = info.f_frsize
            self.f_bavail = 3 * len(BIG) // info.f_frsize  # under four frames free

    monkeypatch.setattr(shmspares.os, "statvfs", Full)
    folder.share([BIG])
    assert not spare_ready(folder, len(BIG), timeout=0.5)
    state = folder._spares._state
    assert state.failed[0] == len(BIG)  # and not tried again for that size for a while
    folder.share([BIG])
    assert not spare_ready(folder, len(BIG), timeout=0.3)
    state.failed = (len(BIG), time.monotonic())  # the while is over
    monkeypatch.undo()
    folder.share([BIG])
    assert spare_ready(folder, len(BIG))


@needs_tmpfile
def test_a_system_that_cannot_name_a_spare_writes_new_files(folder, monkeypatch):
    folder.share([BIG])
    assert spare_ready(folder, len(BIG))

    def no_link(*args, **kwargs):
        raise PermissionError("no /proc here")

    monkeypatch.setattr(shmspares.os, "link", no_link)
    _, refs = folder.share([BIG])
    assert bytes(folder.open(refs[0][1], len(BIG))) == BIG
    folder.share([BIG])
    assert not spare_ready(folder, len(BIG), timeout=0.3)  # spares are off from then on


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX limits")
def test_serve_and_join_raise_their_descriptor_limit_within_the_hard_one():
    # Many desktops start every process at 1,024 descriptors; a coordinator with hundreds of
    # peers and mapped frames needs more, and the hard limit is usually far above.
    import subprocess
    import sys

    script = """
import resource
from gpumesh.fileio import raise_descriptor_limit
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
got = raise_descriptor_limit(4096)
want = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
print(got == want == resource.getrlimit(resource.RLIMIT_NOFILE)[0])
higher = 8192 if hard == resource.RLIM_INFINITY else min(8192, hard)
resource.setrlimit(resource.RLIMIT_NOFILE, (higher, hard))
print(raise_descriptor_limit(4096) == higher)  # never lowered
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == ["True", "True"], out.stderr


def test_a_restart_with_the_folder_full_keeps_it_and_its_proof(tmp_path, monkeypatch):
    # Its frames may fill /dev/shm: the new probe could not be written (ENOSPC), the folder
    # was given up, and every restored task whose input is in it failed as "could not schedule".
    import errno

    from gpumesh import sharedmem

    monkeypatch.setattr(sharedmem, "_base", lambda: tmp_path)
    first = SharedFolder.create("k", "/journal.db")
    assert first is not None
    frames, refs = first.share([b"pickle", BIG])  # a journaled task's input
    proof = first.proof
    os.close(first._lock)  # killed: its lock goes with it, the folder and its frames stay
    first._lock = None
    real_open = os.open

    def full(path, flags, mode=0o777, **kw):
        if flags & os.O_CREAT and not os.path.exists(path):  # a new file needs room
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(sharedmem.os, "open", full)
    monkeypatch.setattr(sharedmem, "replace_private", lambda *a: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    again = SharedFolder.create("k", "/journal.db")
    monkeypatch.setattr(sharedmem.os, "open", real_open)
    assert again is not None and again.proof == proof
    assert again.resolve(frames, refs)[1] == BIG  # the restored task's input is still there
    again.close()


def test_a_folder_lock_another_coordinator_holds_for_a_moment_is_waited_for(tmp_path,
                                                                             monkeypatch):
    # Another coordinator's start looks whether this folder is abandoned by taking its lock
    # for a moment: a start at that moment gave up sharing memory for its whole run.
    import fcntl
    import threading

    from gpumesh import sharedmem

    monkeypatch.setattr(sharedmem, "_base", lambda: tmp_path)
    first = SharedFolder.create("k")
    assert first is not None
    path = first.path
    os.close(first._lock)
    first._lock = None
    other = os.open(path / ".lock", os.O_RDWR)
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the other's sweep, looking
    threading.Timer(0.3, lambda: os.close(other)).start()
    again = SharedFolder.create("k")
    assert again is not None and again.path == path
    again.close()


@contextlib.contextmanager
def _big_submission_sent(folder, tmp_path, monkeypatch, sends=(5.0,)):
    """A client engine of this machine that sent one big function task (its frames in the
    folder) at each of ``sends``, nobody answering: (engine, submission). Closed after."""
    from gpumesh.client.engine import TaskFuture, _Submission

    engine = _engine_nobody_answers(tmp_path)
    try:
        engine._shm = joined(folder)
        monkeypatch.setattr(engine._link, "send", lambda frames: True)  # on its way
        sub = _Submission(1, {"kind": "fn"}, [b"fn", BIG], TaskFuture(), "j1", "m")
        engine._outstanding[1] = sub
        for when in sends:
            engine._send_submissions([sub], when)
        yield engine, sub
    finally:
        engine.close()


def _busy(engine, now: float) -> None:
    """The coordinator's answer: refused for now by this client's queue quota."""
    busy = encode(Command.ACCEPTED, {"accepted": [], "rejected": [[1, "busy", "full"]]})
    engine._on_accepted(decode(busy, LIMITS), now)


def test_a_submission_sent_and_not_yet_accepted_keeps_its_files_when_the_client_closes(
        folder, tmp_path, monkeypatch):
    # The coordinator may have journaled it (its ACCEPTED lost with a crash): the files were
    # removed as the client closed, and after the restart the task crashed three times on a
    # missing input. The coordinator's sweep takes them once nothing names them.
    with _big_submission_sent(folder, tmp_path, monkeypatch) as (_, sub):
        assert names(folder) and sub.sent_at and not sub.task_id
    assert names(folder)


def test_a_submission_the_coordinator_parks_as_busy_gives_its_files_back_until_sent_again(
        folder, tmp_path, monkeypatch):
    # Refused for now by the queue quota, it held its input in /dev/shm for as long as it
    # waited: a .map of a thousand 64 MiB arrays filled the machine's shared memory.
    with _big_submission_sent(folder, tmp_path, monkeypatch) as (engine, sub):
        assert names(folder)
        _busy(engine, 6.0)
        assert sub.busy and names(folder) == set()
        engine._connected.set()
        engine._unpark(7.0, 1)  # its turn again: written again for the send
        assert names(folder) and not sub.busy


def test_a_busy_submission_sent_twice_keeps_its_files_for_the_copy_still_on_its_way(
        folder, tmp_path, monkeypatch):
    # Sent again on silence, its second copy may be taken once the quota frees: removing the
    # files on the first copy's "busy" made that task fail at its lease, its input gone.
    with _big_submission_sent(folder, tmp_path, monkeypatch, sends=(5.0, 7.0)) as (engine, sub):
        _busy(engine, 8.0)
        assert sub.busy and names(folder)
