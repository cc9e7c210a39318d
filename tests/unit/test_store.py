"""Unit tests for gpumesh.store: the coordinator's SQLite journal, on a tmp_path file."""

from __future__ import annotations

import os
import sqlite3
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from gpumesh.blobs import BLOB_THRESHOLD, BlobFolder
from gpumesh.store import CORRUPT, SCHEMA_VERSION, Store, StoredTask, StoreError

SPEC = {"fn": "abc123", "gpu": "A100", "cores": 2, "nested": {"k": [1, 2]}}
PAYLOAD = [b"main-pickle", b"\x00" * 10, b""]


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "journal" / "mesh.db"


@pytest.fixture
def store(db_path: Path) -> Iterator[Store]:
    s = Store(db_path)
    yield s
    s.close()


def _reopen_and_load(path: Path) -> list[StoredTask]:
    s = Store(path)
    try:
        return list(s.load())
    finally:
        s.close()


def _whole_input(db_path: Path, row: StoredTask) -> list[bytes]:
    """A loaded row's input: the frames in the row, then those its blob file holds."""
    frames = list(row.payload)
    if row.payload_file is not None:
        blobs = BlobFolder(Path(f"{db_path}.blobs"), sync=False)
        frames += blobs.read(row.payload_file.name, row.payload_file.lengths)
    return [bytes(f) for f in frames]


def _add(s: Store, task_id: str = "t1", seq: int = 1, client: str = "c1", **kw) -> None:
    s.add_task(
        task_id,
        client,
        seq,
        kw.get("job_id", "job-1"),
        kw.get("spec", SPEC),
        kw.get("payload", PAYLOAD),
        kw.get("submitted_at", 1234.5),
    )


def test_new_store_is_empty_and_creates_parent_dir(db_path: Path) -> None:
    assert not db_path.parent.exists()
    s = Store(db_path)
    try:
        assert db_path.parent.is_dir()
        assert list(s.load()) == []
    finally:
        s.close()


def test_add_task_commit_reopen_loads_it(db_path: Path) -> None:
    s = Store(db_path)
    _add(s)
    s.commit()
    s.close()

    tasks = _reopen_and_load(db_path)
    assert tasks == [
        StoredTask(
            task_id="t1",
            client_id="c1",
            seq=1,
            job_id="job-1",
            spec=SPEC,
            payload=PAYLOAD,
            state="pending",
            attempts=0,
            result_header=None,
            result_payload=None,
            submitted_at=1234.5,
        )
    ]


def test_add_task_accepts_memoryview_and_frame_like_payloads(db_path: Path) -> None:
    class FakeFrame:
        def __init__(self, data: bytes) -> None:
            self.buffer = memoryview(data)

    s = Store(db_path)
    _add(s, payload=[memoryview(b"view"), bytearray(b"ba"), FakeFrame(b"frame")])
    s.commit()
    s.close()
    (task,) = _reopen_and_load(db_path)
    assert task.payload == [b"view", b"ba", b"frame"]


def test_load_returns_tasks_oldest_first(db_path: Path) -> None:
    s = Store(db_path)
    for i, task_id in enumerate(["z", "a", "m"]):
        _add(s, task_id=task_id, seq=i)
    s.commit()
    s.close()
    assert [t.task_id for t in _reopen_and_load(db_path)] == ["z", "a", "m"]


def test_duplicate_client_seq_is_refused_without_losing_the_batch(store: Store, caplog) -> None:
    _add(store, task_id="t1", seq=7)
    _add(store, task_id="t2", seq=7)
    _add(store, task_id="t3", seq=8)
    store.commit()
    assert [t.task_id for t in store.load()] == ["t1", "t3"]
    assert "journal refused a write" in caplog.text


def test_writes_reach_sqlite_in_order_as_runs(store: Store) -> None:
    _add(store, task_id="t1", seq=1)
    store.finish_task("t1", "done", 1, {"status": "ok"}, [b"v"])
    store.delete_task("t1")
    _add(store, task_id="t2", seq=2)
    store.set_attempts("t2", 2)
    store.commit()
    (task,) = store.load()
    assert task.task_id == "t2" and task.attempts == 2


def test_set_attempts_survives_reopen(db_path: Path) -> None:
    s = Store(db_path)
    _add(s)
    s.set_attempts("t1", 3)
    s.commit()
    s.close()
    (task,) = _reopen_and_load(db_path)
    assert task.attempts == 3
    assert task.state == "pending"


def test_finish_task_restores_result_and_empties_payload(db_path: Path) -> None:
    s = Store(db_path)
    _add(s)
    s.commit()
    header = {"status": "ok", "elapsed": 0.25, "worker": "w1", 7: "int key"}
    result = [b"result-pickle", b"\xff" * 100]
    s.finish_task("t1", "done", 2, header, result)
    s.commit()
    s.close()

    (task,) = _reopen_and_load(db_path)
    assert task.state == "done"
    assert task.attempts == 2
    assert task.result_header == header
    assert task.result_payload == result
    assert task.payload == []
    assert task.spec == SPEC  # the spec is kept


def test_finish_task_with_empty_result_payload(db_path: Path) -> None:
    s = Store(db_path)
    _add(s)
    s.finish_task("t1", "failed", 1, {"error": "boom"}, [])
    s.close()
    (task,) = _reopen_and_load(db_path)
    assert task.result_header == {"error": "boom"}
    assert task.result_payload == []
    assert task.payload == []


def test_delete_task(db_path: Path) -> None:
    s = Store(db_path)
    _add(s, task_id="keep", seq=1)
    _add(s, task_id="drop", seq=2)
    s.commit()
    s.delete_task("drop")
    s.delete_task("never-existed")  # no error
    s.commit()
    s.close()
    assert [t.task_id for t in _reopen_and_load(db_path)] == ["keep"]


def test_next_epoch_increases_across_reopen(db_path: Path) -> None:
    s = Store(db_path)
    first = s.next_epoch()
    second = s.next_epoch()
    s.close()
    assert (first, second) == (1, 2)

    s = Store(db_path)
    third = s.next_epoch()
    s.close()
    assert third == 3


def test_next_epoch_is_durable_without_commit_or_close(db_path: Path) -> None:
    s = Store(db_path)
    assert s.next_epoch() == 1
    s._lock.close()  # the process died: the kernel released its lock
    # A second connection (another process after a crash) already sees it.
    other = Store(db_path)
    try:
        assert other.next_epoch() == 2
    finally:
        other.close()
        s._db.close()


def test_uncommitted_writes_are_lost_on_crash(db_path: Path) -> None:
    s = Store(db_path)
    s._lock.close()  # as after a crash: the next coordinator may open the journal
    _add(s, task_id="committed", seq=1)
    s.commit()
    _add(s, task_id="uncommitted", seq=2)
    s.finish_task("committed", "done", 1, {"x": 1}, [b"r"])

    # While the first connection still holds the open transaction, nobody else sees it.
    assert [t.task_id for t in _reopen_and_load(db_path)] == ["committed"]

    # Crash: the connection goes away without commit() (close() would commit).
    s._db.close()

    (task,) = _reopen_and_load(db_path)
    assert task.task_id == "committed"
    assert task.state == "pending"
    assert task.result_header is None
    assert task.payload == PAYLOAD


def test_close_commits_pending_writes(db_path: Path) -> None:
    s = Store(db_path)
    _add(s)
    s.close()
    assert [t.task_id for t in _reopen_and_load(db_path)] == ["t1"]


def test_commit_without_writes_is_harmless(store: Store) -> None:
    store.commit()
    store.commit()
    assert list(store.load()) == []


def test_writes_after_commit_open_a_new_transaction(db_path: Path) -> None:
    s = Store(db_path)
    s._lock.close()  # let a second reader in while this one is still open
    _add(s, task_id="a", seq=1)
    s.commit()
    _add(s, task_id="b", seq=2)
    s.commit()
    _add(s, task_id="c", seq=3)  # never committed
    assert [t.task_id for t in _reopen_and_load(db_path)] == ["a", "b"]
    s._db.close()
    assert [t.task_id for t in _reopen_and_load(db_path)] == ["a", "b"]


def test_schema_version_is_recorded(db_path: Path) -> None:
    Store(db_path).close()
    with sqlite3.connect(db_path) as raw:
        (value,) = raw.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    raw.close()
    assert value == SCHEMA_VERSION


@pytest.fixture
def connections(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[sqlite3.Connection]]:
    """Record every connection Store opens; close any still open at the end of the test."""
    opened: list[sqlite3.Connection] = []
    real_connect = sqlite3.connect

    def connect(*args, **kwargs):
        conn = real_connect(*args, **kwargs)
        opened.append(conn)
        return conn

    monkeypatch.setattr(sqlite3, "connect", connect)
    yield opened
    for conn in opened:
        conn.close()


def _is_open(conn: sqlite3.Connection) -> bool:
    try:
        conn.execute("SELECT 1")
    except sqlite3.ProgrammingError:
        return False
    return True


def _set_schema_version(path: Path, value: int) -> None:
    raw = sqlite3.connect(path)
    with raw:
        raw.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (value,))
    raw.close()


def test_schema_version_mismatch_is_store_error(
    db_path: Path, connections: list[sqlite3.Connection]
) -> None:
    Store(db_path).close()
    _set_schema_version(db_path, 99)
    with pytest.raises(StoreError) as info:
        Store(db_path)
    assert "v99" in str(info.value)
    assert f"v{SCHEMA_VERSION}" in str(info.value)


def test_schema_version_mismatch_leaves_the_file_alone(
    db_path: Path, connections: list[sqlite3.Connection]
) -> None:
    s = Store(db_path)
    _add(s)
    s.close()
    _set_schema_version(db_path, 99)
    with pytest.raises(StoreError):
        Store(db_path)
    _set_schema_version(db_path, SCHEMA_VERSION)
    assert [t.task_id for t in _reopen_and_load(db_path)] == ["t1"]


def test_store_error_closes_its_connection(
    db_path: Path, connections: list[sqlite3.Connection]
) -> None:
    Store(db_path).close()
    _set_schema_version(db_path, 99)
    with pytest.raises(StoreError):
        Store(db_path)
    # The first Store and its checkpointer's, the raw UPDATE, the refused Store (which
    # failed before it started a checkpointer).
    assert len(connections) == 4
    assert not any(_is_open(connection) for connection in connections)


def test_not_a_database_is_store_error(
    db_path: Path, connections: list[sqlite3.Connection]
) -> None:
    db_path.parent.mkdir(parents=True)
    db_path.write_bytes(b"this is not an sqlite file at all" * 100)
    with pytest.raises(StoreError):
        Store(db_path)


def test_in_memory_store() -> None:
    s = Store(":memory:")
    try:
        _add(s)
        s.commit()
        assert [t.task_id for t in s.load()] == ["t1"]
    finally:
        s.close()


def test_a_second_store_on_a_live_journal_is_refused(db_path: Path) -> None:
    s = Store(db_path)
    try:
        with pytest.raises(StoreError, match="another coordinator is using the journal"):
            Store(db_path)
    finally:
        s.close()
    Store(db_path).close()  # released on close


# ----------------------------------------------------------------- blob files (big payloads)

BIG = [b"main-pickle", bytes(range(256)) * 256, b"", b"\x07" * (BLOB_THRESHOLD // 2)]


def _blob_dir(db_path: Path) -> Path:
    return Path(f"{db_path}.blobs")


def _blob_files(db_path: Path) -> list[Path]:
    folder = _blob_dir(db_path)
    return sorted(folder.iterdir()) if folder.exists() else []


def test_small_payloads_stay_in_the_database(db_path: Path) -> None:
    s = Store(db_path)
    _add(s, payload=[b"x" * (BLOB_THRESHOLD - 1)])
    s.close()
    assert _blob_files(db_path) == []


def test_big_payload_and_result_round_trip_through_a_reopen(db_path: Path) -> None:
    class FakeFrame:
        def __init__(self, data: bytes) -> None:
            self.buffer = memoryview(data)

    s = Store(db_path)
    _add(s, payload=[FakeFrame(BIG[0]), memoryview(BIG[1]), bytearray(BIG[2]), BIG[3]])
    s.commit()
    assert len(_blob_files(db_path)) == 1
    result = [b"r" * 10, b"\xee" * BLOB_THRESHOLD]
    s.finish_task("t1", "failed", 1, {"status": "error"}, result, keep_input=True)
    s.close()
    assert len(_blob_files(db_path)) == 2

    (task,) = _reopen_and_load(db_path)
    # The input stays in its file (checked, not read): a restart does not load the queue.
    assert task.payload == [] and task.payload_file is not None
    assert task.payload_file.lengths == tuple(len(f) for f in BIG)
    assert _whole_input(db_path, task) == BIG
    # The result likewise: it is read back when it is sent.
    assert task.result_payload is None and task.result_file is not None
    back = BlobFolder(Path(f"{db_path}.blobs"), sync=False).read(task.result_file.name,
                                                                  task.result_file.lengths)
    assert [bytes(f) for f in back] == result
    assert task.spec == SPEC
    # One buffer per file, handed out as views: no copy per frame.
    assert all(isinstance(f, memoryview) for f in back) and back[0].obj is back[1].obj


def test_blob_folder_is_0700_and_files_0600(db_path: Path) -> None:
    old = os.umask(0)
    try:
        s = Store(db_path)
        _add(s, payload=BIG)
        s.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(_blob_dir(db_path).stat().st_mode) == 0o700
    (blob,) = _blob_files(db_path)
    assert stat.S_IMODE(blob.stat().st_mode) == 0o600


def test_a_loose_blob_folder_is_tightened(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    _blob_dir(db_path).mkdir(mode=0o755)
    os.chmod(_blob_dir(db_path), 0o755)
    s = Store(db_path)
    _add(s, payload=BIG)
    s.close()
    assert stat.S_IMODE(_blob_dir(db_path).stat().st_mode) == 0o700


@pytest.mark.parametrize("damage", ["missing", "short", "long"])
def test_a_missing_or_short_blob_makes_a_corrupt_row_not_an_exception(
        db_path: Path, damage: str) -> None:
    s = Store(db_path)
    _add(s, task_id="bad", seq=1, payload=BIG)
    _add(s, task_id="good", seq=2)
    s.close()
    (blob,) = _blob_files(db_path)
    if damage == "missing":
        blob.unlink()
    elif damage == "short":
        os.truncate(blob, blob.stat().st_size - 1)
    else:
        with open(blob, "ab") as handle:
            handle.write(b"!")
    bad, good = _reopen_and_load(db_path)
    assert bad.task_id == "bad" and CORRUPT in bad.spec
    assert bad.payload == [] and bad.client_id == "c1" and bad.state == "pending"
    assert good.task_id == "good" and good.payload == PAYLOAD


def test_a_reference_to_a_file_outside_the_folder_is_corrupt(db_path: Path) -> None:
    s = Store(db_path)
    _add(s, payload=BIG)
    s.close()
    raw = sqlite3.connect(db_path)
    with raw:
        raw.execute("UPDATE tasks SET payload_ref = ?",
                    (msgpack.packb(["../mesh.db", [1]], use_bin_type=True),))
    raw.close()
    (task,) = _reopen_and_load(db_path)
    assert CORRUPT in task.spec


def test_the_result_blob_replaces_the_input_blob_when_the_task_is_done(db_path: Path) -> None:
    s = Store(db_path)
    _add(s, payload=BIG)
    s.commit()
    (input_blob,) = _blob_files(db_path)
    s.finish_task("t1", "done", 1, {"status": "ok"}, BIG[:2])
    assert input_blob.exists()  # until the commit: a crash would bring the pending row back
    s.commit()
    (result_blob,) = _blob_files(db_path)
    assert result_blob != input_blob
    s.reopen_task("t1", 1 << 40)
    s.commit()
    assert _blob_files(db_path) == []
    s.close()


def test_blobs_go_with_deleted_and_collected_tasks(db_path: Path) -> None:
    s = Store(db_path)
    _add(s, task_id="a", seq=1, payload=BIG)
    _add(s, task_id="b", seq=2, payload=BIG)
    s.finish_task("b", "failed", 1, {"status": "error"}, BIG, keep_input=True)
    s.commit()
    assert len(_blob_files(db_path)) == 3
    s.delete_task("a")
    s.collect_task("b", {"id": "b"})
    s.commit()
    assert _blob_files(db_path) == []
    s.close()
    (task,) = _reopen_and_load(db_path)
    assert task.task_id == "b" and task.state == "collected" and task.payload == []


def test_uncommitted_blob_is_an_orphan_swept_at_open(db_path: Path) -> None:
    s = Store(db_path)
    s._lock.close()  # as after a crash
    _add(s, task_id="kept", seq=1, payload=BIG)
    s.commit()
    _add(s, task_id="lost", seq=2, payload=BIG)  # written, never committed
    (_blob_dir(db_path) / ".tmp-0123456789abcdef01234567").write_bytes(b"half")
    s._db.close()
    assert len(_blob_files(db_path)) == 3
    (task,) = _reopen_and_load(db_path)
    assert task.task_id == "kept" and _whole_input(db_path, task) == BIG
    assert len(_blob_files(db_path)) == 1


def test_a_deleted_task_keeps_its_blob_until_the_commit(db_path: Path) -> None:
    s = Store(db_path)
    s._lock.close()
    _add(s, payload=BIG)
    s.commit()
    s.delete_task("t1")
    s._db.close()  # crash before the commit: the row comes back, and its blob with it
    (task,) = _reopen_and_load(db_path)
    assert _whole_input(db_path, task) == BIG


def test_a_refused_insert_does_not_leave_its_blob(store: Store, db_path: Path) -> None:
    _add(store, task_id="t1", seq=1)
    _add(store, task_id="t2", seq=1, payload=BIG)  # same (client, seq): refused
    store.commit()
    assert [t.task_id for t in store.load()] == ["t1"]
    assert _blob_files(db_path) == []


def test_a_failed_write_rolls_its_transaction_back_and_nothing_is_committed_after(
        db_path: Path) -> None:
    # A full disk or an I/O error mid-turn: committing the writes before it (and deleting the
    # blobs the lost writes dropped) would acknowledge work the journal does not hold.
    s = Store(db_path)
    _add(s, task_id="kept", seq=1, payload=BIG)
    s.commit()
    s.collect_task("kept", {"id": "kept"})  # drops its blob: once committed, not before
    _add(s, task_id="t1", seq=2)
    s._write("INSERT INTO no_such_table VALUES (?)", (1,))  # fails as a full disk would
    _add(s, task_id="t2", seq=3)
    with pytest.raises(sqlite3.Error):
        s.job_tasks("job-1", 10)  # a status query flushes the turn's writes
    with pytest.raises(sqlite3.Error):
        s.commit()  # and the turn's commit refuses: the coordinator stops on it
    _add(s, task_id="t3", seq=4)
    with pytest.raises(sqlite3.Error):
        s.close()
    (task,) = _reopen_and_load(db_path)
    assert task.task_id == "kept" and task.state == "pending"  # as last committed
    assert _whole_input(db_path, task) == BIG  # its blob was not deleted


def test_a_new_task_whose_id_a_collected_task_had_is_journaled(db_path: Path, caplog) -> None:
    # Task ids are 48 random bits checked against the tasks the coordinator holds, not
    # against the summaries of collected ones the journal keeps: a clash must not lose the
    # new task (its INSERT refused while ACCEPTED went out).
    s = Store(db_path)
    _add(s, task_id="same", seq=1, client="old", job_id="old-job")
    s.collect_task("same", {"id": "same", "state": "done"})
    s.commit()
    _add(s, task_id="other", seq=7, client="new", job_id="new-job")
    _add(s, task_id="same", seq=8, client="new", job_id="new-job")  # in a run of inserts
    s.commit()
    _add(s, task_id="alone", seq=1, client="old", job_id="old-job")
    s.collect_task("alone", {"id": "alone"})
    s.commit()
    _add(s, task_id="alone", seq=9, client="new", job_id="new-job")  # an insert on its own
    s.commit()
    s.close()
    rows = {t.task_id: t for t in _reopen_and_load(db_path)}
    assert rows["same"].client_id == "new" and rows["same"].state == "pending"
    assert rows["alone"].client_id == "new" and rows["same"].seq == 8
    assert "was a finished task's" in caplog.text


def test_an_insert_that_clashes_on_more_than_its_id_is_refused_and_the_journal_goes_on(
        db_path: Path, caplog) -> None:
    s = Store(db_path)
    _add(s, task_id="same", seq=1, client="old")
    s.collect_task("same", {"id": "same"})
    _add(s, task_id="live", seq=5, client="new")
    s.commit()
    _add(s, task_id="same", seq=5, client="new")  # its id a summary's, its (client, seq) taken
    s.commit()  # refused and said, as any refused row: not a failed journal
    _add(s, task_id="after", seq=6, client="new")
    s.close()
    assert {t.task_id for t in _reopen_and_load(db_path)} >= {"live", "after"}
    assert "journal refused a write" in caplog.text


def test_in_memory_store_keeps_big_payloads_inline() -> None:
    s = Store(":memory:")
    try:
        _add(s, payload=BIG)
        s.commit()
        (task,) = s.load()
        assert task.payload == BIG
    finally:
        s.close()


# ----------------------------------------------------------------- space and schema v1

def _size(db_path: Path) -> int:
    return sum(Path(f"{db_path}{suffix}").stat().st_size for suffix in ("", "-wal")
               if Path(f"{db_path}{suffix}").exists())


def test_idle_maintenance_gives_the_space_back(db_path: Path) -> None:
    s = Store(db_path)
    try:
        filler = [b"p" * 2000]
        for i in range(3000):
            _add(s, task_id=f"t{i}", seq=i, payload=filler)
        s.commit()
        grown = _size(db_path)
        for i in range(3000):
            s.delete_task(f"t{i}")
        s.idle_maintenance()
        assert _size(db_path) < grown / 10
        assert list(s.load()) == []
    finally:
        s.close()


_V1_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE tasks (
    task_id TEXT PRIMARY KEY, client_id TEXT NOT NULL, seq INTEGER NOT NULL,
    job_id TEXT NOT NULL, spec BLOB NOT NULL, payload BLOB NOT NULL, state TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0, result_header BLOB, result_payload BLOB,
    submitted_at REAL NOT NULL, UNIQUE (client_id, seq)
);
INSERT INTO meta VALUES ('schema_version', 1);
INSERT INTO meta VALUES ('epoch', 4);
"""


def test_a_v1_journal_is_migrated_in_place(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    raw = sqlite3.connect(db_path)
    raw.executescript("PRAGMA journal_mode=WAL;" + _V1_SCHEMA)
    with raw:
        raw.execute("INSERT INTO tasks (task_id, client_id, seq, job_id, spec, payload, state, "
                    "submitted_at) VALUES ('old', 'c1', 1, 'job-1', ?, ?, 'pending', 1.0)",
                    (msgpack.packb(SPEC), msgpack.packb(PAYLOAD)))
    raw.close()
    s = Store(db_path)
    try:
        assert s.next_epoch() == 5
        (task,) = s.load()
        assert task.task_id == "old" and task.payload == PAYLOAD
        _add(s, task_id="new", seq=2, payload=BIG)
        s.commit()
    finally:
        s.close()
    raw = sqlite3.connect(db_path)
    assert raw.execute("PRAGMA auto_vacuum").fetchone() == (2,)
    assert raw.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (
        SCHEMA_VERSION,)
    raw.close()
    assert [t.task_id for t in _reopen_and_load(db_path)] == ["old", "new"]


def test_a_map_journals_its_function_once_and_a_task_gets_it_back(db_path: Path) -> None:
    from gpumesh.store import IDLE_AFTER

    function = b"a pickled function" * 100
    s = Store(db_path)
    try:
        for i in range(IDLE_AFTER):
            s.add_task(f"t{i}", "c1", i, "job-1", SPEC, [function, b"args%d" % i, b""], 1.0,
                       function="f" * 24)
        s.add_task("plain", "c1", 10**6, "job-1", SPEC, [b"inline fn", b"args"], 1.0)
        s.commit()
        raw = sqlite3.connect(db_path)
        assert raw.execute("SELECT count(*) FROM functions").fetchone() == (1,)
        assert raw.execute("SELECT length(payload) FROM tasks WHERE task_id = 't0'").fetchone()[0] < 40
        raw.close()
    finally:
        s.close()
    loaded = {t.task_id: t for t in _reopen_and_load(db_path)}
    assert loaded["t7"].payload == [function, b"args7", b""]
    assert loaded["plain"].payload == [b"inline fn", b"args"]
    s = Store(db_path)
    try:
        for i in range(IDLE_AFTER):  # every task of the .map finishes: its function may go
            s.finish_task(f"t{i}", "done", 1, {"status": "ok"}, [b"r"])
        s.idle_maintenance()
        raw = sqlite3.connect(db_path)
        assert raw.execute("SELECT count(*) FROM functions").fetchone() == (0,)
        raw.close()
        # The next task of that function journals it again.
        s.add_task("later", "c1", 10**6 + 1, "job-1", SPEC, [function, b"x"], 2.0,
                   function="f" * 24)
        s.commit()
    finally:
        s.close()
    assert {t.task_id: t for t in _reopen_and_load(db_path)}["later"].payload == [function, b"x"]


def test_a_task_whose_journaled_function_is_gone_restores_as_corrupt(db_path: Path) -> None:
    s = Store(db_path)
    try:
        s.add_task("t1", "c1", 1, "job-1", SPEC, [b"fn", b"args"], 1.0, function="e" * 24)
        s.commit()
    finally:
        s.close()
    raw = sqlite3.connect(db_path)
    with raw:
        raw.execute("DELETE FROM functions")
    raw.close()
    (task,) = _reopen_and_load(db_path)
    assert "missing from the journal" in task.spec[CORRUPT] and task.payload == []


@pytest.mark.parametrize("version", [2, 3])
def test_a_v2_or_v3_journal_is_migrated_and_keeps_its_tasks(db_path: Path, version: int) -> None:
    s = Store(db_path)
    try:
        _add(s, task_id="old", seq=1)
        s.commit()
    finally:
        s.close()
    raw = sqlite3.connect(db_path)  # back to what that schema was
    with raw:
        if version == 2:  # no fn column, no functions table: functions inline in the payload
            raw.execute("DROP TABLE functions")
            raw.execute("ALTER TABLE tasks DROP COLUMN fn")
        raw.execute("ALTER TABLE tasks DROP COLUMN lease_floor")  # v3 had no lease floor
        raw.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (version,))
    raw.close()
    (task,) = _reopen_and_load(db_path)
    assert task.task_id == "old" and task.payload == PAYLOAD and task.lease_floor == 0
    raw = sqlite3.connect(db_path)
    assert raw.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (
        SCHEMA_VERSION,)
    raw.close()


def test_a_memory_journal_keeps_big_payloads_in_its_blob_folder(tmp_path):
    from gpumesh.blobs import BLOB_THRESHOLD

    store = Store(":memory:", blob_folder=tmp_path / "blobs")
    big = b"x" * BLOB_THRESHOLD
    store.add_task("t1", "c1", 1, "j1", {"kind": "fn"}, [b"f", big], 0.0)
    store.commit()
    assert [p.stat().st_size for p in (tmp_path / "blobs").iterdir()] == [1 + len(big)]
    (row,) = store.load()
    assert row.payload == [] and row.payload_file is not None
    assert [bytes(f) for f in store.read_blob(row.payload_file)] == [b"f", big]
    store.finish_task("t1", "done", 1, {"status": "ok"}, [b"r"])
    store.commit()
    assert list((tmp_path / "blobs").iterdir()) == []
    store.close()


def test_the_wal_is_checkpointed_by_a_thread_of_its_own_never_inside_a_commit(db_path: Path):
    store = Store(db_path)
    try:
        assert store._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
        store.add_job("J", "n", "c", 0.0)
        for i in range(50):
            store.add_task(f"t{i}", "c", i, "J", {"kind": "fn"}, [b"x" * 100], 1.0)
        store.commit()

        def in_the_file() -> int:
            # immutable=1 reads the database file alone: what a checkpoint copied out of the WAL.
            peek = sqlite3.connect(f"file:{db_path}?immutable=1", uri=True)
            try:
                return peek.execute("SELECT count(*) FROM tasks").fetchone()[0]
            except sqlite3.OperationalError:  # not even the table has reached the file yet
                return 0
            finally:
                peek.close()

        checkpointer = store._checkpointer
        assert checkpointer is not None
        deadline = time.monotonic() + 10
        while in_the_file() < 50:  # once the journal has been quiet for a moment
            assert time.monotonic() < deadline, "the committed rows never reached the file"
            checkpointer.ran.wait(0.2)
            checkpointer.ran.clear()
    finally:
        store.close()
    assert store._checkpointer is None


def test_a_checkpoint_waits_for_a_quiet_journal_unless_the_wal_has_grown(db_path: Path):
    from gpumesh import checkpoint

    store = Store(db_path)
    try:
        cp = store._checkpointer
        assert cp is not None
        now = time.monotonic()
        assert not cp.due(now, cp._commits, now - 1)  # nothing new to copy
        cp.note_commit()
        start = cp._last_commit
        assert not cp.due(start, 0, start)  # a commit just now: the loop is busy
        assert cp.due(start + 2 * checkpoint.QUIET, 0, start)  # quiet since
        cp._commits = checkpoint.FORCE_AFTER
        assert cp.due(start, 0, start)  # busy, but the WAL has grown: now anyway
        cp._commits = 1
        assert cp.due(start, 0, start - checkpoint.MAX_DELAY)  # busy for too long
    finally:
        store.close()


def test_idle_maintenance_truncates_the_wal_between_the_checkpointers_checkpoints(
        db_path: Path, caplog: pytest.LogCaptureFixture):
    import threading

    store = Store(db_path)
    try:
        assert store._checkpointer is not None
        held = []

        class Recording:
            lock = threading.Lock()

            def __enter__(self):
                self.lock.acquire()
                held.append("in")

            def __exit__(self, *exc):
                held.append("out")
                self.lock.release()

        store._checkpointer.lock = Recording()  # type: ignore[assignment]
        store._give_back()
        assert held == ["in", "out"]
        assert "maintenance failed" not in caplog.text
    finally:
        store.close()


def test_a_retried_tasks_lease_floor_survives_a_restart(db_path: Path) -> None:
    s = Store(db_path)
    try:
        _add(s, task_id="retried", seq=1)
        _add(s, task_id="plain", seq=2)
        s.finish_task("retried", "failed", 1, {"status": "error"}, [], keep_input=True)
        s.commit()
        s.reopen_task("retried", (3 << 40) + 7)
        s.commit()
    finally:
        s.close()
    loaded = {t.task_id: t for t in _reopen_and_load(db_path)}
    assert loaded["retried"].state == "pending" and loaded["retried"].lease_floor == (3 << 40) + 7
    assert loaded["plain"].lease_floor == 0


def test_zmq_frames_are_journaled_without_a_copy_small_in_the_row_big_in_a_blob(
        db_path: Path) -> None:
    """The coordinator journals the frames pyzmq hands it (zmq.Frame): the small ones go into
    the row, frames that add up to BLOB_THRESHOLD still go to a blob file, and neither is read
    through ``Frame.bytes``, which copies the frame and keeps the copy for the frame's life
    (a queued task's input, a held result)."""
    import zmq

    copied: list[int] = []

    class Watched(zmq.Frame):
        @property
        def bytes(self) -> bytes:  # type: ignore[override]
            copied.append(len(self))
            return super().bytes

    s = Store(db_path)
    small = [Watched(b"args"), Watched(b""), Watched(b"\x00" * 100)]
    edge = [Watched(b"a" * (BLOB_THRESHOLD // 2)), Watched(b"b" * (BLOB_THRESHOLD // 2))]
    assert s.add_task("small", "c1", 1, "job-1", SPEC, small, 1.0) is None
    assert s.add_task("edge", "c1", 2, "job-1", SPEC, edge, 1.0) is not None
    s.finish_task("small", "done", 1, {"status": "ok"}, [Watched(b"result")])
    s.commit()
    s.close()
    assert copied == []
    rows = {row.task_id: row for row in _reopen_and_load(db_path)}
    assert rows["small"].payload_file is None
    assert [bytes(f) for f in rows["small"].result_payload] == [b"result"]
    assert rows["edge"].payload_file is not None
    assert _whole_input(db_path, rows["edge"]) == [b"a" * (BLOB_THRESHOLD // 2),
                                                   b"b" * (BLOB_THRESHOLD // 2)]


def test_a_journal_that_cannot_open_on_a_full_disk_names_the_disk(db_path: Path, monkeypatch,
                                                                  connections) -> None:
    # SQLite says "disk I/O error" when the disk is full: it read as a failing disk.
    import shutil
    from collections import namedtuple

    from gpumesh import store

    db_path.parent.mkdir(parents=True, exist_ok=True)
    db_path.write_bytes(b"not a journal " * 512)  # any reason SQLite cannot use it
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 4096, 4096))
    with pytest.raises(StoreError, match="the disk holding it has 4,096 bytes free"):
        store.Store(db_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, 10**12))
    with pytest.raises(StoreError) as info:
        store.Store(db_path)
    assert "disk" not in str(info.value)


def test_a_full_disk_for_blobs_is_said_once_a_minute_not_per_payload(db_path: Path, caplog,
                                                                    connections) -> None:
    # A full disk failed every big payload's blob file, one warning line each (95 in a row).
    import errno
    import logging

    s = Store(db_path)

    def full(views):
        raise OSError(errno.ENOSPC, "No space left on device")

    assert s._blobs is not None
    s._blobs.write = full  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="gpumesh.store"):
        for n in range(5):
            _add(s, task_id=f"t{n}", seq=n + 1, payload=[b"x" * BLOB_THRESHOLD])
    s.commit()
    assert sum("cannot write a blob" in r.getMessage() for r in caplog.records) == 1
    s.close()
    kept = _reopen_and_load(db_path)  # in the database instead, whole
    assert sorted(t.task_id for t in kept) == [f"t{n}" for n in range(5)]
    assert all(bytes(t.payload[0]) == b"x" * BLOB_THRESHOLD for t in kept)
