"""A queued task's big input, and a big result waiting for its client, wait in the journal's
blob files, not in the coordinator's memory.

Before, every queued input stayed in memory as it came (a client elsewhere queueing 20 GB held
20 GB in the coordinator) besides the copy the journal wrote to disk, and so did every result
waiting for a client that had gone (up to the 2 GiB retention cap). Now the coordinator lets go
of the frames once they are journaled (an input after the turn's dispatch, so a task that starts
at once is sent from what came in) and reads them back only to send them. Broker driven by hand
on a journal in a temporary folder, no sockets."""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumesh.blobs import BLOB_THRESHOLD
from gpumesh.config import Limits, Timing
from gpumesh.coordinator.broker import Broker
from gpumesh.coordinator.state import Task, TaskState
from gpumesh.protocol import Command, Message, decode, encode, serialize
from gpumesh.store import Store

W, C = b"worker-routing", b"client-routing"
BIG = 4 * BLOB_THRESHOLD


def msg(command: Command, header: dict, payload: list | None = None) -> Message:
    return decode(encode(command, header, payload or []), Limits())


def sent(b: Broker, command: Command) -> list[Message]:
    return [m for m in (decode(frames, Limits()) for _, frames in b.outbox) if m.command is command]


def function() -> tuple[bytes, str]:
    frame = serialize.dumps(len)[0]
    return frame, serialize.function_digest(frame)


_OPEN: list[Store] = []


@pytest.fixture(autouse=True)
def close_stores():
    yield
    while _OPEN:
        _OPEN.pop().close()


def journal(db: Path) -> Store:
    store = Store(db)
    _OPEN.append(store)
    return store


def make(db: Path, *, worker: bool = False, in_memory: int = 0) -> Broker:
    """A broker that keeps ``in_memory`` bytes of journaled inputs in memory (none: each
    test sees the disk path unless it asks for the budget)."""
    b = Broker(journal(db), Timing(), Limits(queue_memory_bytes=in_memory), epoch=1, now=0.0)
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 0.0)
    if worker:
        hello_worker(b)
    b.outbox.clear()
    return b


def hello_worker(b: Broker) -> None:
    b.handle(W, msg(Command.HELLO, {"role": "worker", "id": "w1", "slots": 1, "credit": 1,
                                    "proto": [1, 1], "info": {"python": "3.11"}}), 0.0)


def submit(b: Broker, seq: int, data: bytes, *, by_digest: bool = True) -> str:
    fn, digest = function()
    spec = {"seq": seq, "nf": 2, "kind": "fn"}
    if by_digest:
        spec["fn"] = digest
    b.handle(C, msg(Command.SUBMIT, {"tasks": [spec]}, [fn, data]), 0.0)
    return next(t.task_id for t in b.tasks.values() if t.seq == seq)


def end_turn(b: Broker) -> None:
    """What the server loop does after its dispatch, then its commit."""
    b.ledger.spill_inputs()
    b.store.commit()


def task_frames(b: Broker) -> list[bytes]:
    (task,) = sent(b, Command.TASK)
    return [bytes(f) for f in task.payload]


def test_a_queued_input_waits_on_disk_and_goes_out_whole(tmp_path):
    b = make(tmp_path / "journal.db")
    data = bytes(range(256)) * (BIG // 256)
    task_id = submit(b, 1, data)
    end_turn(b)
    task = b.tasks[task_id]
    fn, _ = function()
    # Only the function stays (one copy for all of a .map's tasks); the input is counted still.
    assert task.payload == [fn] and task.input_file is not None
    assert task.input_file.nbytes == BIG and task.input_bytes == BIG + len(fn)
    hello_worker(b)
    b.outbox.clear()
    assert b.dispatch(1.0) == 1
    assert task_frames(b) == [fn, data]


def test_a_task_handed_out_in_its_own_turn_never_reads_its_file(tmp_path, monkeypatch):
    b = make(tmp_path / "journal.db", worker=True)

    def no_reads(blob):
        raise AssertionError("read back a file for a task that was sent from memory")

    monkeypatch.setattr(b.store, "read_blob", no_reads)
    data = b"\x01" * BIG
    submit(b, 1, data)
    assert b.dispatch(0.0) == 1
    end_turn(b)
    assert task_frames(b)[1] == data


def leased_from_disk(db: Path, data: bytes) -> tuple[Broker, Task]:
    """A task sent to the worker at once, whose input then left memory (no function apart)."""
    b = make(db, worker=True)
    task_id = submit(b, 1, data, by_digest=False)
    b.dispatch(0.0)
    end_turn(b)
    return b, b.tasks[task_id]


def test_a_requeued_task_is_sent_again_from_its_file(tmp_path):
    data = b"\x02" * BIG
    b, task = leased_from_disk(tmp_path / "journal.db", data)
    task_id = task.task_id
    assert task.state is TaskState.LEASED and task.payload == [] and task.input_file is not None
    b.outbox.clear()
    b.handle(W, msg(Command.RESULT, {"task": task_id, "lease": task.lease_id,
                                     "status": "crashed", "diagnosis": "killed", "granted": 1}),
             1.0)
    hello_worker(b)  # the same worker again (it restarted): it gets the task once more
    b.outbox.clear()
    b.dispatch(2.0)
    frames = task_frames(b)
    assert frames[1] == data


def test_a_failed_task_whose_input_is_on_disk_can_be_retried(tmp_path):
    data = b"\x03" * BIG
    b, task = leased_from_disk(tmp_path / "journal.db", data)
    b.handle(W, msg(Command.RESULT, {"task": task.task_id, "lease": task.lease_id, "status": "error",
                                     "granted": 1}, [b"err"]), 1.0)
    assert task.state is TaskState.FAILED and task.payload == []
    assert b.ledger.reopen(task, 2.0)
    hello_worker(b)  # a fresh credit
    b.outbox.clear()
    b.dispatch(2.0)
    assert task_frames(b)[1] == data


def test_a_restart_leaves_queued_inputs_on_disk(tmp_path):
    db = tmp_path / "journal.db"
    first = make(db)
    data = b"\x04" * BIG
    task_id = submit(first, 1, data)
    end_turn(first)
    _OPEN.remove(first.store)
    first.store.close()
    # With room in memory to spare: a restart reads nothing until it sends it.
    second = Broker(journal(db), Timing(restore_grace=0.0), Limits(), epoch=2, now=10.0)
    assert second.restore(10.0) == 1
    task = second.tasks[task_id]
    fn, _ = function()
    assert task.payload == [fn] and task.input_file is not None
    second.tick(11.0)  # the grace is over: restored becomes pending
    hello_worker(second)
    second.outbox.clear()
    assert second.dispatch(11.0) == 1
    assert task_frames(second) == [fn, data]


def test_an_input_file_removed_by_hand_fails_its_task_and_nothing_else(tmp_path, caplog):
    db = tmp_path / "journal.db"
    b = make(db)
    lost = submit(b, 1, b"\x05" * BIG)
    kept = submit(b, 2, b"\x06" * BIG)
    end_turn(b)
    gone = b.tasks[lost].input_file
    assert gone is not None
    (Path(f"{db}.blobs") / gone.name).unlink()
    hello_worker(b)
    b.handle(W, msg(Command.HELLO, {"role": "worker", "id": "w1", "slots": 2, "credit": 2,
                                    "proto": [1, 1], "info": {"python": "3.11"}}), 1.0)
    b.outbox.clear()
    with caplog.at_level(logging.WARNING, logger="gpumesh.coordinator"):
        assert b.dispatch(1.0) == 1
    task = b.tasks[lost]
    assert task.state is TaskState.FAILED
    assert "could not read this task's input back" in task.result_header["diagnosis"]
    assert "is missing from the journal's folder" in task.result_header["diagnosis"]
    assert b.tasks[kept].state is TaskState.LEASED
    assert not any(r.exc_info for r in caplog.records)  # no traceback: not a bug of ours
    assert not b.ledger.reopen(task, 2.0)  # a retry could only fail the same way
    b.store.commit()
    (row,) = [r for r in b.store.load() if r.task_id == lost]
    assert row.payload_file is None and row.payload == []  # the journal names no file either


@contextlib.contextmanager
def files_unreadable_for_now(b: Broker) -> Iterator[None]:
    """Every blob read fails as at the open-files limit, until the block ends (the descriptors
    are back)."""
    def at_the_limit(blob: Any) -> Any:
        raise OSError(errno.EMFILE, "Too many open files")

    read, b.store.read_blob = b.store.read_blob, at_the_limit
    try:
        yield
    finally:
        b.store.read_blob = read


def test_an_input_file_unreadable_for_now_waits_in_the_queue(tmp_path):
    b = make(tmp_path / "journal.db")
    data = b"\x0e" * BIG
    task_id = submit(b, 1, data)
    end_turn(b)
    hello_worker(b)
    with files_unreadable_for_now(b):
        b.outbox.clear()
        assert b.dispatch(1.0) == 0
        assert b.tasks[task_id].state is TaskState.PENDING and sent(b, Command.TASK) == []
    assert b.dispatch(2.0) == 1
    fn, _ = function()
    assert task_frames(b) == [fn, data]


def test_a_restarted_script_keeps_its_frames_in_memory(tmp_path):
    """Its job's summary previews its arguments, as before the restart."""
    db = tmp_path / "journal.db"
    first = make(db)
    frames = [b"#" * BIG, b'{"x": 1}']
    first.handle(C, msg(Command.SUBMIT, {"tasks": [{"seq": 1, "nf": 2, "kind": "script",
                                                    "name": "x.py"}]}, frames), 0.0)
    end_turn(first)
    _OPEN.remove(first.store)
    first.store.close()
    second = Broker(journal(db), Timing(), Limits(), epoch=2, now=10.0)
    second.restore(10.0)
    (task,) = second.tasks.values()
    assert task.input_file is None and [bytes(f) for f in task.payload] == frames


@pytest.mark.parametrize("kind", ["script", "small"])
def test_what_stays_in_memory(tmp_path, kind):
    """A script's frames stay (its job's summary previews them); so does an input under the
    journal's blob threshold (it is in the database row, nothing to read back)."""
    b = make(tmp_path / "journal.db")
    if kind == "script":
        spec = {"seq": 1, "nf": 2, "kind": "script", "name": "x.py"}
        payload = [b"print(1)", b"\x07" * BIG]
    else:
        fn, digest = function()
        spec = {"seq": 1, "nf": 2, "kind": "fn", "fn": digest}
        payload = [fn, b"\x08" * 100]
    b.handle(C, msg(Command.SUBMIT, {"tasks": [spec]}, payload), 0.0)
    end_turn(b)
    (task,) = b.tasks.values()
    assert task.input_file is None and [bytes(f) for f in task.payload] == payload


def test_inputs_stay_in_memory_within_the_budget_and_the_newest_go_to_disk(tmp_path):
    b = make(tmp_path / "journal.db", in_memory=int(2.5 * BIG))
    ids = [submit(b, seq, bytes([seq]) * BIG) for seq in range(4)]
    end_turn(b)
    on_disk = [b.tasks[t].input_file is not None for t in ids]
    assert on_disk == [False, False, True, True]  # the last to arrive are the last to go
    assert b.ledger.inputs.resident_bytes == 2 * BIG
    hello_worker(b)
    b.handle(W, msg(Command.HELLO, {"role": "worker", "id": "w1", "slots": 4, "credit": 4,
                                    "proto": [1, 1], "info": {"python": "3.11"}}), 1.0)
    b.outbox.clear()
    assert b.dispatch(1.0) == 4
    assert [bytes(m.payload[1]) for m in sent(b, Command.TASK)] == \
        [bytes([seq]) * BIG for seq in range(4)]
    for task_id in ids:  # they succeed: nothing is kept, in memory or counted
        task = b.tasks[task_id]
        b.handle(W, msg(Command.RESULT, {"task": task_id, "lease": task.lease_id,
                                         "status": "ok", "granted": 1}, [b"r"]), 2.0)
    assert b.ledger.inputs.resident_bytes == 0


def test_a_failed_task_keeps_its_input_on_disk_not_in_memory(tmp_path):
    b = make(tmp_path / "journal.db", worker=True, in_memory=10 * BIG)
    task_id = submit(b, 1, b"\x0d" * BIG)
    b.dispatch(0.0)
    end_turn(b)
    task = b.tasks[task_id]
    assert task.input_file is None and b.ledger.inputs.resident_bytes == BIG
    b.handle(W, msg(Command.RESULT, {"task": task_id, "lease": task.lease_id, "status": "error",
                                     "granted": 1}, [b"err"]), 1.0)
    assert task.input_file is not None and b.ledger.inputs.resident_bytes == 0


def finish_with(b: Broker, task_id: str, result: bytes, now: float) -> None:
    task = b.tasks[task_id]
    b.handle(W, msg(Command.RESULT, {"task": task_id, "lease": task.lease_id, "status": "ok",
                                     "granted": 1}, [result]), now)


def fetched(b: Broker, task_id: str, now: float) -> list[bytes]:
    b.outbox.clear()
    b.handle(C, msg(Command.FETCH, {"qid": 7, "tasks": [task_id]}), now)
    (answer,) = [m for m in sent(b, Command.RESULT) if m.header["task"] == task_id]
    assert answer.header["status"] == "ok"
    return [bytes(f) for f in answer.payload]


def result_for_a_client_that_left(db: Path, result: bytes) -> tuple[Broker, str]:
    b = make(db, worker=True)
    task_id = submit(b, 1, b"small input")
    b.dispatch(0.0)
    b.handle(C, msg(Command.DISCONNECT, {}), 1.0)  # the laptop closes
    finish_with(b, task_id, result, 2.0)
    return b, task_id


def test_a_result_for_a_client_that_left_waits_on_disk(tmp_path):
    result = b"\x09" * BIG
    b, task_id = result_for_a_client_that_left(tmp_path / "journal.db", result)
    task = b.tasks[task_id]
    assert task.state is TaskState.DONE
    assert task.result_payload == [] and task.result_file is not None
    assert task.result_bytes == BIG  # the retention cap still counts it
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 3.0)
    assert fetched(b, task_id, 3.0) == [result]


def test_a_result_its_client_did_not_take_at_once_is_journaled_then_leaves_memory(tmp_path):
    b = make(tmp_path / "journal.db", worker=True)
    task_id = submit(b, 1, b"small input")
    b.dispatch(0.0)
    result = b"\x0a" * BIG
    finish_with(b, task_id, result, 1.0)
    task = b.tasks[task_id]
    assert [bytes(f) for f in task.result_payload] == [result]  # held: its client may take it
    b.ledger.journal_held_results(2.0)  # it did not acknowledge it in time
    assert task.result_payload == [] and task.result_file is not None
    assert fetched(b, task_id, 5.0) == [result]


def test_a_restart_leaves_waiting_results_on_disk(tmp_path):
    db = tmp_path / "journal.db"
    result = b"\x0b" * BIG
    first, task_id = result_for_a_client_that_left(db, result)
    first.store.commit()
    _OPEN.remove(first.store)
    first.store.close()
    second = Broker(journal(db), Timing(), Limits(), epoch=2, now=10.0)
    second.restore(10.0)
    task = second.tasks[task_id]
    assert task.result_payload == [] and task.result_file is not None
    second.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 11.0)
    assert fetched(second, task_id, 11.0) == [result]


def test_a_waiting_result_whose_file_is_gone_reaches_its_client_as_lost(tmp_path):
    db = tmp_path / "journal.db"
    b, task_id = result_for_a_client_that_left(db, b"\x0c" * BIG)
    blob = b.tasks[task_id].result_file
    assert blob is not None
    (Path(f"{db}.blobs") / blob.name).unlink()
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 3.0)
    b.outbox.clear()
    b.handle(C, msg(Command.FETCH, {"qid": 7, "tasks": [task_id]}), 3.0)
    (answer,) = sent(b, Command.RESULT)
    assert answer.header["error"]["type"] == "gpumesh.ResultLost"
    assert "is missing" in answer.header["error"]["message"]


def test_a_result_file_unreadable_for_now_is_sent_later_not_lost(tmp_path):
    result = b"\x0f" * BIG
    b, task_id = result_for_a_client_that_left(tmp_path / "journal.db", result)
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 3.0)
    with files_unreadable_for_now(b):
        b.outbox.clear()
        b.handle(C, msg(Command.FETCH, {"qid": 7, "tasks": [task_id]}), 3.0)
        assert sent(b, Command.RESULT) == []
    b.ledger.deliver_deferred(5.0)
    (answer,) = sent(b, Command.RESULT)
    assert answer.header["status"] == "ok" and [bytes(f) for f in answer.payload] == [result]


def test_a_big_input_on_disk_goes_to_a_worker_that_reads_pieces_as_spans_of_its_file(
        tmp_path, monkeypatch):
    from gpumesh.fileio import FileSpan, SharedFd
    from gpumesh.protocol.pieces import STREAM_BYTES

    def no_reads(blob):
        raise AssertionError("read a big input back whole for a worker that reads pieces")

    b = make(tmp_path / "journal.db")
    data = bytes(range(256)) * (STREAM_BYTES // 256)
    task_id = submit_split(b, 1, data)
    end_turn(b)
    b.handle(W, msg(Command.HELLO, {"role": "worker", "id": "w1", "slots": 2, "credit": 2,
                                    "proto": [1, 1], "info": {"python": "3.11"},
                                    "pieces": True}), 0.0)
    b.outbox.clear()
    with monkeypatch.context() as patched:
        patched.setattr(b.store, "read_blob", no_reads)
        assert b.dispatch(1.0) == 1
    [(_, frames)] = b.outbox
    fn, _ = function()
    # A function that came in slices is journaled with its task (its digest was not checked),
    # so every payload frame is a span of the file.
    assert all(isinstance(f, FileSpan) for f in frames[3:])
    assert b"".join(f.read(0, f.length) for f in frames[3:]) == fn + data
    assert b.tasks[task_id].payload == []  # nothing of the input came back into memory
    # Beyond MAX_SPAN_FILES descriptors held, an input is read back whole, as before.
    b.outbox.clear()
    second = submit_split(b, 2, data)
    end_turn(b)
    monkeypatch.setattr(SharedFd, "opened", 10_000)
    b.outbox.clear()
    assert b.dispatch(2.0) == 1
    [(_, frames)] = b.outbox
    assert not any(isinstance(f, FileSpan) for f in frames)
    assert b"".join(bytes(f) for f in frames[3:]) == fn + data
    assert b.tasks[second].state is TaskState.LEASED


def submit_split(b: Broker, seq: int, data: bytes) -> str:
    """As the client sends a big buffer: in slices of a frame's size, with ``split``."""
    fn, digest = function()
    wire, layout = serialize.split_frames([fn, data], Limits().chunk_bytes)
    spec = {"seq": seq, "nf": len(wire), "kind": "fn", "fn": digest, "split": layout}
    b.handle(C, msg(Command.SUBMIT, {"tasks": [spec]}, wire), 0.0)
    return next(t.task_id for t in b.tasks.values() if t.seq == seq)


def test_a_big_result_on_disk_goes_to_a_client_that_reads_pieces_as_spans_of_its_file(
        tmp_path, monkeypatch):
    from gpumesh.fileio import FileSpan, SharedFd
    from gpumesh.protocol.pieces import STREAM_BYTES

    result = bytes(range(256)) * (STREAM_BYTES // 256)
    b = make(tmp_path / "journal.db", worker=True)
    task_id = submit(b, 1, b"small input")
    b.dispatch(0.0)
    b.handle(C, msg(Command.DISCONNECT, {}), 1.0)  # the laptop closes
    wire, layout = serialize.split_frames([result], Limits().chunk_bytes)  # as a worker sends
    b.handle(W, msg(Command.RESULT, {"task": task_id, "lease": b.tasks[task_id].lease_id,
                                     "status": "ok", "granted": 1, "split": layout}, wire), 2.0)
    assert b.tasks[task_id].result_file is not None
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1],
                                    "pieces": True}), 3.0)

    def no_reads(blob):
        raise AssertionError("read a big result back whole for a client that reads pieces")

    opened = SharedFd.opened
    with monkeypatch.context() as patched:
        patched.setattr(b.store, "read_blob", no_reads)
        b.outbox.clear()
        b.handle(C, msg(Command.FETCH, {"qid": 7, "tasks": [task_id]}), 3.0)
    [(_, frames)] = [(r, f) for r, f in b.outbox if f[1] == bytes([Command.RESULT])]
    assert frames[3:] and all(isinstance(f, FileSpan) for f in frames[3:])
    assert b"".join(f.read(0, f.length) for f in frames[3:]) == result
    assert b.tasks[task_id].result_payload == []  # nothing of it came back into memory
    assert SharedFd.opened == opened + 1
    b.outbox.clear()
    b.handle(C, msg(Command.FETCH, {"qid": 8, "tasks": [task_id]}), 4.5)
    assert sent(b, Command.RESULT) == []  # not a second copy while the first still goes
    assert SharedFd.opened == opened + 1
    del frames
    assert SharedFd.opened == opened  # the descriptor goes with the last span
    # Beyond MAX_SPAN_FILES descriptors held, it is read back whole, as before; and so for a
    # client that reads no pieces.
    with monkeypatch.context() as patched:
        patched.setattr(SharedFd, "opened", 10_000)
        assert b"".join(fetched(b, task_id, 5.0)) == result
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), 7.0)
    assert b"".join(fetched(b, task_id, 7.0)) == result


def results_for_a_client_that_left(db: Path, count: int, size: int = BIG, *, pieces: bool = False
                                   ) -> tuple[Broker, list[str]]:
    b = make(db)
    b.handle(W, msg(Command.HELLO, {"role": "worker", "id": "w1", "slots": count,
                                    "credit": count, "proto": [1, 1],
                                    "info": {"python": "3.11", "cores": count}}), 0.0)
    ids = [submit(b, seq, b"small input") for seq in range(1, count + 1)]
    assert b.dispatch(0.0) == count
    b.handle(C, msg(Command.DISCONNECT, {}), 1.0)  # the laptop closes
    for n, task_id in enumerate(ids):
        result = bytes([n]) * size
        wire, layout = serialize.split_frames([result], Limits().chunk_bytes)  # as a worker sends
        header = {"task": task_id, "lease": b.tasks[task_id].lease_id, "status": "ok",
                  "granted": 1}
        if layout is not None:
            header["split"] = layout
        b.handle(W, msg(Command.RESULT, header, wire), 2.0)
    assert all(b.tasks[t].result_file is not None for t in ids)
    hello = {"role": "client", "id": "c1", "proto": [1, 1]}
    b.handle(C, msg(Command.HELLO, {**hello, "pieces": True} if pieces else hello), 3.0)
    b.outbox.clear()
    return b, ids


def results_sent(b: Broker) -> list[int]:
    """The results sent since the outbox was last cleared, by their first byte; then clear."""
    got = []
    for _, frames in b.outbox:
        if frames[1] != bytes([Command.RESULT]):
            continue
        first = frames[3]
        got.append(first.read(0, 1)[0] if hasattr(first, "read") else bytes(first)[0])
    b.outbox.clear()
    return got


def test_a_fetch_of_many_results_on_disk_reads_them_back_as_the_client_takes_them(
        tmp_path, monkeypatch):
    # A FETCH of every result of a big job (a client back after its laptop slept, or after a
    # coordinator restart) read all of them back from disk in one turn, into the outbox at
    # once: 10,000 results of 100 KB, 1 GB. Now a window of them goes, and the rest follow as
    # the client acknowledges.
    from gpumesh.coordinator import ledger

    monkeypatch.setattr(ledger, "READ_BACK_WINDOW", 3 * BIG)
    b, ids = results_for_a_client_that_left(tmp_path / "journal.db", 8)
    reads = []
    read_blob = b.store.read_blob
    monkeypatch.setattr(b.store, "read_blob", lambda blob: reads.append(blob) or read_blob(blob))
    b.handle(C, msg(Command.FETCH, {"qid": 0, "tasks": ids}), 3.0)
    assert results_sent(b) == [0, 1, 2] and len(reads) == 3
    # Asked again later, what is on its way is not read and sent again, nor the rest.
    b.handle(C, msg(Command.FETCH, {"qid": 0, "tasks": ids}), 9.0)
    assert results_sent(b) == [] and len(reads) == 3
    b.handle(C, msg(Command.RESULT_ACK, {"tasks": ids[:2]}), 10.0)
    assert results_sent(b) == [3, 4]
    b.handle(C, msg(Command.RESULT_ACK, {"tasks": []}), 10.1)  # no room made: nothing goes
    assert results_sent(b) == []
    b.handle(C, msg(Command.RESULT_ACK, {"tasks": ids[2:5]}), 10.2)
    assert results_sent(b) == [5, 6, 7] and len(reads) == 8
    b.handle(C, msg(Command.RESULT_ACK, {"tasks": ids[5:]}), 10.3)
    assert all(b.tasks.get(t) is None or b.tasks[t].collected for t in ids)
    assert not b.ledger.read_back_clients


def test_results_sent_and_never_acknowledged_hold_the_line_only_so_long(tmp_path, monkeypatch):
    # A client drops a result it cannot match without acknowledging it: the window must not
    # stay full for the rest of the session (a real client does not FETCH again in it). One
    # that acknowledges nothing at all reads nothing: it is not sent window after window.
    from gpumesh.coordinator import ledger

    monkeypatch.setattr(ledger, "READ_BACK_WINDOW", 2 * BIG)
    expiry = ledger.READ_BACK_EXPIRY
    b, ids = results_for_a_client_that_left(tmp_path / "journal.db", 5)

    def tick(now: float) -> list[int]:
        b.handle(C, msg(Command.HEARTBEAT, {}), now)
        b.tick(now)
        return results_sent(b)

    b.handle(C, msg(Command.FETCH, {"qid": 0, "tasks": ids}), 3.0)
    assert results_sent(b) == [0, 1]
    assert tick(3.0 + expiry) == []  # nothing acknowledged: nothing more
    b.handle(C, msg(Command.RESULT_ACK, {"tasks": ids[:1]}), 4.0 + expiry)  # 1 is dropped
    assert results_sent(b) == [2]
    assert tick(4.0 + 2 * expiry - 1) == []
    assert tick(4.0 + 2 * expiry) == [3, 4]  # the window afresh: 1 and 2 count no more
    # A new session starts with an empty window: what the last one was sent is asked for again.
    later = 5.0 + 2 * expiry
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1]}), later)
    b.outbox.clear()
    b.handle(C, msg(Command.FETCH, {"qid": 0, "tasks": ids}), later)
    assert results_sent(b) == [1, 2]


def test_a_result_that_waited_as_whole_and_then_goes_in_pieces_leaves_the_line(
        tmp_path, monkeypatch):
    # Whether a big result goes as spans of its file depends on descriptors to spare: one that
    # waited in line as a whole read-back and then went as spans stayed in line, and was sent
    # again at every acknowledgement.
    from gpumesh.coordinator import ledger
    from gpumesh.fileio import SharedFd
    from gpumesh.protocol.pieces import STREAM_BYTES

    monkeypatch.setattr(ledger, "READ_BACK_WINDOW", STREAM_BYTES)
    b, ids = results_for_a_client_that_left(tmp_path / "journal.db", 3, STREAM_BYTES,
                                            pieces=True)
    monkeypatch.setattr(SharedFd, "opened", ledger.MAX_SPAN_FILES)  # none to spare
    b.handle(C, msg(Command.FETCH, {"qid": 0, "tasks": ids}), 3.0)
    assert results_sent(b) == [0]
    monkeypatch.setattr(SharedFd, "opened", 0)  # descriptors free again
    b.handle(C, msg(Command.RESULT_ACK, {"tasks": ids[:1]}), 4.0)
    assert results_sent(b) == [1, 2]  # as spans: nothing waits for them
    b.handle(C, msg(Command.RESULT_ACK, {"tasks": []}), 4.1)
    assert results_sent(b) == [] and not b.ledger.read_back_clients
