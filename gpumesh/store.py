"""The coordinator's SQLite journal: every accepted task and every unacknowledged result.

The in-memory queue is the working copy; this is what survives ``kill -9``. Writes go into one
open transaction and ``commit()`` closes it once per loop turn (group commit), so the coordinator
pays one commit for a whole burst of submissions. ACCEPTED and RESULT_ACK are sent only after
the commit that holds them.

Payloads of ``BLOB_THRESHOLD`` bytes or more are kept in blob files beside the database
(blobs.py); their rows hold a reference. A blob is written before its row is committed and
deleted only after the commit that drops the reference, so a crash leaves at worst an orphan
file, which the next open sweeps away.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from .blobs import BLOB_THRESHOLD, BlobFolder, BlobRef
from .checkpoint import Checkpointer
from .errors import MeshError

log = logging.getLogger("gpumesh.store")

# v2: payload_ref/result_ref columns (blob files) and incremental auto-vacuum; v3: functions
# journaled once (fn, functions); v4: a retried task's lease_floor. Older ones are migrated.
SCHEMA_VERSION = 4
# Freed rows after which commit() gives space back by itself; idle_maintenance() does it sooner.
MAINTENANCE_AFTER = 20_000
# ... and idle_maintenance() once this many were freed.
IDLE_AFTER = 256
# The WAL is cut back to this size whenever SQLite restarts it after a checkpoint.
WAL_SIZE_LIMIT = 4 << 20
# A task whose result its owner has collected: the row keeps only its job's summary of it.
COLLECTED = "collected"
# A journal that cannot be opened beside less free space than this: the disk is named as why.
DISK_FULL_BYTES = 16 << 20
BLOB_WARNING_EVERY = 60.0  # seconds between two warnings that a blob file could not be written

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS tasks (
    task_id        TEXT PRIMARY KEY,
    client_id      TEXT NOT NULL,
    seq            INTEGER NOT NULL,
    job_id         TEXT NOT NULL,
    spec           BLOB NOT NULL,
    payload        BLOB NOT NULL,
    state          TEXT NOT NULL,
    attempts       INTEGER NOT NULL DEFAULT 0,
    result_header  BLOB,
    result_payload BLOB,
    submitted_at   REAL NOT NULL,
    payload_ref    BLOB,
    result_ref     BLOB,
    fn             TEXT,
    lease_floor    INTEGER NOT NULL DEFAULT 0,
    UNIQUE (client_id, seq)
);
CREATE TABLE IF NOT EXISTS functions (digest TEXT PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    job_id    TEXT PRIMARY KEY,
    name      TEXT NOT NULL,
    client_id TEXT NOT NULL,
    created   REAL NOT NULL
);
"""


CORRUPT = "__corrupt__"  # spec key of a row whose columns no longer decode (Store.load)


class StoreError(MeshError):
    """The database cannot be used (wrong schema, unreadable file)."""


@dataclass
class StoredTask:
    task_id: str
    client_id: str
    seq: int
    job_id: str
    spec: dict[str, Any]
    payload: list[bytes | memoryview]
    state: str
    attempts: int
    result_header: dict[str, Any] | None
    result_payload: list[bytes | memoryview] | None
    submitted_at: float
    # The input frames that are in a blob file, checked there but not read: the restored task
    # holds this in place of them (``payload`` then holds only its function, if any).
    payload_file: BlobRef | None = None
    result_file: BlobRef | None = None  # likewise for the result (``result_payload`` is None)
    lease_floor: int = 0  # results of leases below it are from attempts before a retry


def _frame_view(frame: Any) -> memoryview:
    buffer = getattr(frame, "buffer", None)  # zmq.Frame, without importing zmq
    view = memoryview(buffer if buffer is not None else frame)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _small_frames(frames: Sequence[Any]) -> list[Any] | None:
    """``frames`` for msgpack when they are bytes or zmq Frames under BLOB_THRESHOLD together;
    None for anything else, or when they are bigger. Nothing is copied: a Frame goes as its
    ``buffer`` (a view), never as its ``bytes``, which would copy it and keep the copy on the
    frame for as long as the frame lives (the task's queued input, a held result)."""
    out: list[Any] = []
    total = 0
    for frame in frames:
        kind = type(frame)
        # A zmq.Frame (not imported here) is told by its class: looking the properties up on
        # the object would run them, and ``bytes`` copies.
        if kind is not bytes and not (hasattr(kind, "buffer") and hasattr(kind, "bytes")):
            return None
        total += len(frame)  # a Frame's len is its byte count too
        if total >= BLOB_THRESHOLD:
            return None
        out.append(frame if kind is bytes else frame.buffer)
    return out


class Store:
    """One SQLite file in WAL mode, owned by the coordinator's loop thread."""

    def __init__(self, path: Path | str, *, synchronous: str = "NORMAL",
                 blob_folder: Path | None = None) -> None:
        """``path`` ":memory:" keeps the journal in memory (nothing survives the process); big
        payloads then stay in the database unless ``blob_folder`` names a folder for them."""
        self.path = Path(path)
        self._blobs: BlobFolder | None = None
        self._blob_warned = -BLOB_WARNING_EVERY  # when a blob file last failed to be written
        if str(path) == ":memory:":
            if blob_folder is not None:
                self._blobs = BlobFolder(blob_folder, sync=False)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            _create_private(self.path)
            self._blobs = BlobFolder(Path(f"{path}.blobs"),
                                     sync=synchronous.upper() in ("FULL", "EXTRA", "2", "3"))
        try:
            self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"cannot open the database {path}: {exc}") from None
        self._lock: Any = None
        self._checkpointer: Checkpointer | None = None
        # task id -> [input blob, result blob] names, for the tasks that have one
        self._refs: dict[str, list[str | None]] = {}
        # blobs whose references the open transaction drops: deleted once it is committed
        self._doomed: list[str] = []
        self._freed = 0  # rows deleted or emptied since space was last given back
        self._functions_kept: set[str] = set()  # digests journaled since the last clean-up
        try:
            self._open(path, synchronous)
        except BaseException:
            if self._checkpointer is not None:
                self._checkpointer.stop()
            self._db.close()
            if self._lock is not None:
                self._lock.close()
            raise
        self._in_transaction = False
        # Writes wait here until the turn's commit; consecutive writes of one statement go to
        # SQLite as one executemany, which costs a fraction of one call per row.
        self._runs: list[tuple[str, list[Sequence[Any]]]] = []
        # A write that failed (a full disk, an I/O error): the transaction it was in is rolled
        # back, and every later write or commit raises this, so nothing acknowledges work
        # the journal does not hold (the coordinator stops on it).
        self._failed: sqlite3.Error | None = None

    def _open(self, path: Path | str, synchronous: str) -> None:
        if str(path) != ":memory:":
            os.chmod(path, 0o600)  # an existing file made by an older gpumesh: owner only now
            self._lock = _lock_exclusively(Path(f"{path}.lock"))
        try:
            if self._db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0:
                # Only a new file takes it, and before the switch to WAL: freed pages go back to
                # the system (idle_maintenance), not only to SQLite's free list.
                self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={synchronous}")
            self._db.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
            self._db.executescript(_SCHEMA)
            version = self._meta("schema_version")
            if version is None:
                self._set_meta("schema_version", SCHEMA_VERSION)
            elif version in (1, 2, 3):
                self._migrate(path, version)
            elif version != SCHEMA_VERSION:
                raise StoreError(
                    f"the database {path} has schema v{version}, this gpumesh uses "
                    f"v{SCHEMA_VERSION}: finish its jobs with the matching gpumesh, or start "
                    "with another --db"
                )
            self._load_refs()
            if str(path) != ":memory:":
                # After any migration (a VACUUM wants the file to itself).
                self._checkpointer = Checkpointer.start(Path(path))
                if self._checkpointer is not None:
                    self._db.execute("PRAGMA wal_autocheckpoint=0")  # its thread does them
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"cannot use the database {path}: {exc}{_disk_full(path)}") from None

    def _migrate(self, path: Path | str, version: int) -> None:
        """Older journals in place. v1 → v2: two columns for blob files (v1 rows have none),
        then one VACUUM to turn on incremental auto-vacuum, which also gives back what the v1
        file had grown to. v2 → v3: the ``fn`` column (older rows keep their function among
        their frames, and say so with NULL) beside the ``functions`` table. v3 → v4: the
        ``lease_floor`` column (0, as every task that was never retried has)."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            if version == 1:
                self._db.execute("ALTER TABLE tasks ADD COLUMN payload_ref BLOB")
                self._db.execute("ALTER TABLE tasks ADD COLUMN result_ref BLOB")
            if version <= 2:
                self._db.execute("ALTER TABLE tasks ADD COLUMN fn TEXT")
            self._db.execute(
                "ALTER TABLE tasks ADD COLUMN lease_floor INTEGER NOT NULL DEFAULT 0")
            self._set_meta("schema_version", SCHEMA_VERSION)
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        log.info("journal %s: schema v%d migrated to v%d", path, version, SCHEMA_VERSION)
        if version != 1:
            return
        try:
            self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")
            self._db.execute("VACUUM")
        except sqlite3.OperationalError as exc:  # e.g. no room for the copy: it can wait
            log.warning("journal %s: could not compact it (%s); it stays as large as it is",
                        path, exc)

    def _load_refs(self) -> None:
        """Which task owns which blob; and away with every blob file no row refers to."""
        if self._blobs is None:
            return
        rows = self._db.execute(
            "SELECT task_id, payload_ref, result_ref FROM tasks "
            "WHERE payload_ref IS NOT NULL OR result_ref IS NOT NULL")
        for task_id, payload_ref, result_ref in rows:
            self._refs[task_id] = [_ref_name(payload_ref), _ref_name(result_ref)]
        if self._blobs.exists():
            kept = {name for names in self._refs.values() for name in names if name}
            swept = self._blobs.sweep(kept)
            if swept:
                log.info("journal %s: removed %d blob files no task refers to", self.path, swept)

    def _meta(self, key: str) -> int | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else int(row[0])

    def _set_meta(self, key: str, value: int) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def size_bytes(self) -> int:
        """The journal's size on disk: the database and its write-ahead log (0 in memory)."""
        if str(self.path) == ":memory:":
            return 0
        total = 0
        for path in (self.path, Path(f"{self.path}-wal")):
            try:
                total += path.stat().st_size
            except OSError:
                pass
        return total

    def next_epoch(self) -> int:
        """A new coordinator epoch, durable before it is used: lease ids stay monotonic."""
        epoch = (self._meta("epoch") or 0) + 1
        self._set_meta("epoch", epoch)
        return epoch

    def _write(self, sql: str, args: Sequence[Any]) -> None:
        runs = self._runs
        if runs and runs[-1][0] == sql:
            runs[-1][1].append(args)
        else:
            runs.append((sql, [args]))

    def _flush(self) -> None:
        """Apply the queued writes, in order, inside the open transaction. A write that fails
        for any reason but a refused row rolls the whole transaction back, and from then on
        the store raises (``_failed``): half a turn's writes must never be committed, nor a
        blob deleted whose dropping write was lost."""
        if self._failed is not None:
            raise self._failed
        if not self._runs:
            return
        runs, self._runs = self._runs, []
        try:
            if not self._in_transaction:
                self._db.execute("BEGIN")
                self._in_transaction = True
            for sql, rows in runs:
                if len(rows) == 1:
                    self._apply_one(sql, rows[0])
                    continue
                self._db.execute("SAVEPOINT run")
                try:
                    self._db.executemany(sql, rows)
                except sqlite3.IntegrityError:
                    # Undo the run, apply its rows one by one: a task id that clashes with a
                    # collected row's is made room for; anything else is a bug, said and skipped.
                    self._db.execute("ROLLBACK TO run")
                    for row in rows:
                        self._apply_one(sql, row)
                self._db.execute("RELEASE run")
        except sqlite3.Error as exc:
            self._fail(exc)
            raise

    def _fail(self, exc: sqlite3.Error) -> None:
        log.error("the journal failed a write (%s): its open transaction is rolled back, and "
                  "nothing more is written or acknowledged", exc)
        self._failed = exc
        if self._in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")
            self._in_transaction = False
        # The rows that dropped these blobs were rolled back: they still name them. (Blobs
        # written for rows that never were are swept as orphans when the journal opens.)
        self._doomed = []

    def _apply_one(self, sql: str, row: Sequence[Any]) -> None:
        try:
            self._db.execute(sql, row)
        except sqlite3.IntegrityError as refused:
            why = str(refused)
            if sql is _INSERT_TASK and self._made_room_for(str(row[0])):
                try:
                    self._db.execute(sql, row)
                    return
                except sqlite3.IntegrityError as again:  # it clashes on more than its id
                    why = str(again)
            log.error("journal refused a write (%s): %s", why, sql.split("(")[0])
            if sql is _INSERT_TASK and row[7] is not None:  # its blob belongs to no row
                name = _ref_name(row[7])
                refs = self._refs.get(str(row[0]))
                if refs is not None and refs[0] == name:
                    refs[0] = None
                if name:
                    self._doomed.append(name)

    def _made_room_for(self, task_id: str) -> bool:
        """A new task whose random id is a collected task's, kept only as its job's summary
        (the coordinator checks ids against the tasks it holds, not against those): the
        summary goes, the new task is journaled. True when there was such a row."""
        gone = self._db.execute("DELETE FROM tasks WHERE task_id = ? AND state = ?",
                                (task_id, COLLECTED)).rowcount
        if gone:
            log.warning("a new task's id %s was a finished task's, kept as its job's summary: "
                        "that summary was dropped", task_id)
        return bool(gone)

    def _store_frames(self, frames: Sequence[Any]
                      ) -> tuple[bytes | None, bytes | None, BlobRef | None]:
        """(inline column value, reference column value, blob) for a payload."""
        small = _small_frames(frames)
        if small is not None:
            # The common case (a tiny task's pickled arguments or result): packed as they are.
            return msgpack.packb(small, use_bin_type=True), None, None
        views = [_frame_view(f) for f in frames]
        lengths = [v.nbytes for v in views]
        if self._blobs is not None and sum(lengths) >= BLOB_THRESHOLD:
            try:
                name = self._blobs.write(views)
            except OSError as exc:
                # Once a minute at most: a full disk failed every big payload, one line each.
                now = time.monotonic()
                if now - self._blob_warned >= BLOB_WARNING_EVERY:
                    self._blob_warned = now
                    log.warning("journal: cannot write a blob (%s); keeping the payload in the "
                                "database (said once a minute)", exc.strerror)
            else:
                return (None, msgpack.packb([name, lengths], use_bin_type=True),
                        BlobRef(name, tuple(lengths)))
        packed = [f if isinstance(f, bytes) else v.tobytes() for f, v in zip(frames, views, strict=True)]
        return msgpack.packb(packed, use_bin_type=True), None, None

    def _drop_blob(self, task_id: str, which: int) -> None:
        """The open transaction drops the task's input (0) or result (1) blob."""
        refs = self._refs.get(task_id)
        name = None if refs is None else refs[which]
        if refs is None or name is None:
            return
        refs[which] = None
        self._doomed.append(name)
        if refs == [None, None]:
            del self._refs[task_id]

    def _keep_blob(self, task_id: str, which: int, name: str | None) -> None:
        self._drop_blob(task_id, which)
        if name is not None:
            self._refs.setdefault(task_id, [None, None])[which] = name

    def add_task(
        self, task_id: str, client_id: str, seq: int, job_id: str, spec: dict[str, Any],
        payload: Sequence[Any], submitted_at: float, *, function: str | None = None,
    ) -> BlobRef | None:
        """Journal a new task. With ``function`` (its digest), ``payload[0]`` is that pickled
        function: it is journaled once in the functions table, and the row keeps the rest.

        Returns the blob the rest went into (already written, under its final name), or None
        where they stay in the row: the caller may let go of those frames and read them back
        with ``read_blob`` until the task's input is dropped."""
        if function is not None and payload:
            if function not in self._functions_kept:
                self._functions_kept.add(function)
                self._write("INSERT OR IGNORE INTO functions (digest, data) VALUES (?, ?)",
                            (function, bytes(_frame_view(payload[0]))))
            payload = payload[1:]
        else:
            function = None
        inline, ref, blob = self._store_frames(payload)
        self._keep_blob(task_id, 0, None if blob is None else blob.name)
        self._write(
            _INSERT_TASK,
            (task_id, client_id, seq, job_id, msgpack.packb(spec, use_bin_type=True),
             b"" if inline is None else inline, submitted_at, ref, function),
        )
        return blob

    def read_blob(self, blob: BlobRef) -> list[memoryview]:
        """The frames of a blob ``add_task`` or ``load`` gave out, read back with one copy.
        Raises ValueError (missing or short file: its bytes are gone) or OSError (a failure
        that may pass: try again later)."""
        if self._blobs is None:
            raise ValueError("a blob reference in an in-memory journal")
        return self._blobs.read(blob.name, blob.lengths)

    def open_blob(self, blob: BlobRef) -> int:
        """A read-only descriptor of a blob's file, checked as ``read_blob`` checks it, for
        sending its frames a piece at a time. Raises as ``read_blob`` does."""
        if self._blobs is None:
            raise ValueError("a blob reference in an in-memory journal")
        return self._blobs.open(blob.name, blob.lengths)

    def scratch_buffer(self, size: int) -> memoryview:
        """A buffer for a message arriving in pieces: a mapped file without a name in the blob
        folder (``BlobFolder.scratch``), or memory for a journal without one or when the file
        cannot be made (a full disk: the message is then held in memory, as before)."""
        if self._blobs is not None:
            try:
                return self._blobs.scratch(size)
            except OSError as exc:
                log.warning("cannot make a file to receive a big message in (%s): it is "
                            "received in memory", exc.strerror or exc)
        return memoryview(bytearray(size))

    def set_attempts(self, task_id: str, attempts: int) -> None:
        self._write("UPDATE tasks SET attempts = ? WHERE task_id = ?", (attempts, task_id))

    def finish_task(
        self, task_id: str, state: str, attempts: int, header: dict[str, Any], payload: Sequence[Any],
        *, keep_input: bool = False,
    ) -> BlobRef | None:
        """Record a terminal outcome. The task's input is dropped unless it may be retried.

        Returns the blob the result went into, or None (in the row): as for ``add_task``."""
        inline, ref, blob = self._store_frames(payload)
        self._keep_blob(task_id, 1, None if blob is None else blob.name)
        if not keep_input:
            self._drop_blob(task_id, 0)
            self._freed += 1
        self._write(
            "UPDATE tasks SET state = ?, attempts = ?, result_header = ?, result_payload = ?, "
            "result_ref = ?" + ("" if keep_input else ", payload = x'', payload_ref = NULL, fn = NULL")
            + " WHERE task_id = ?",
            (state, attempts, msgpack.packb(header, use_bin_type=True), inline, ref, task_id),
        )
        return blob

    def collect_failure(self, task_id: str, header: dict[str, Any]) -> None:
        """Its owner has a failed task's result: the result goes, the input stays (for ``gpumesh
        retry``), and the header says it was collected, so a restart does not hold it for the
        owner again."""
        self._drop_blob(task_id, 1)
        self._write("UPDATE tasks SET result_header = ?, result_payload = NULL, result_ref = NULL "
                    "WHERE task_id = ?",
                    (msgpack.packb({**header, "collected": True}, use_bin_type=True), task_id))

    def reopen_task(self, task_id: str, lease_floor: int) -> None:
        """A failed task goes back to the queue (``gpumesh retry``). Results of leases below
        ``lease_floor`` belong to attempts before the retry, a restart or not."""
        self._drop_blob(task_id, 1)
        self._write(
            "UPDATE tasks SET state = 'pending', attempts = 0, result_header = NULL, "
            "result_payload = NULL, result_ref = NULL, lease_floor = ? WHERE task_id = ?",
            (lease_floor, task_id),
        )

    def add_job(self, job_id: str, name: str, client_id: str, created: float) -> None:
        self._write("INSERT OR IGNORE INTO jobs (job_id, name, client_id, created) "
                    "VALUES (?, ?, ?, ?)", (job_id, name, client_id, created))

    def delete_job(self, job_id: str) -> None:
        """Forget a job and the summaries of its collected tasks."""
        # Collected rows have no blobs left (collect_task dropped them).
        self._write("DELETE FROM tasks WHERE job_id = ? AND state = 'collected'", (job_id,))
        self._write("DELETE FROM jobs WHERE job_id = ?", (job_id,))
        self._freed += 1

    def collect_task(self, task_id: str, summary: dict[str, Any]) -> None:
        """Keep only the job's summary of a task whose result is no longer needed."""
        self._drop_blob(task_id, 0)
        self._drop_blob(task_id, 1)
        self._freed += 1
        # seq = -rowid frees (client, seq): if that client submits the seq again (its result was
        # dropped before it came back for it), the new task must be journaled, not refused.
        self._write(
            "UPDATE tasks SET state = 'collected', seq = -rowid, payload = x'', fn = NULL, "
            "result_header = ?, result_payload = NULL, payload_ref = NULL, result_ref = NULL "
            "WHERE task_id = ?",
            (msgpack.packb(summary, use_bin_type=True), task_id))

    def load_jobs(self) -> list[tuple[str, str, str, float]]:
        """(job id, name, client id, created) of every job on record, oldest first."""
        self._flush()
        return [tuple(row) for row in self._db.execute(
            "SELECT job_id, name, client_id, created FROM jobs ORDER BY created")]

    def job_tasks(self, job_id: str, limit: int) -> list[tuple[str, dict[str, Any] | None]]:
        """The first ``limit`` tasks of a job in submission order: (task id, the summary of a
        collected task, None for the others). It scans the table (no index on jobs: that would
        cost every submission a write), which only a status query with its task list asks for."""
        self._flush()
        found: list[tuple[str, dict[str, Any] | None]] = []
        for task_id, state, header in self._db.execute(
                "SELECT task_id, state, result_header FROM tasks WHERE job_id = ? "
                "ORDER BY rowid LIMIT ?", (job_id, limit)):
            summary = None
            if state == COLLECTED:
                try:
                    summary = msgpack.unpackb(header, raw=False, strict_map_key=False)
                except Exception:  # msgpack raises several unrelated types on garbage
                    summary = None
                if not isinstance(summary, dict):
                    summary = {"id": task_id, "state": "unknown"}
            found.append((str(task_id), summary))
        return found

    def delete_task(self, task_id: str) -> None:
        self._drop_blob(task_id, 0)
        self._drop_blob(task_id, 1)
        self._freed += 1
        self._write("DELETE FROM tasks WHERE task_id = ?", (task_id,))

    def commit(self) -> None:
        self._flush()
        if self._in_transaction:
            try:
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._fail(exc)
                raise
            self._in_transaction = False
            if self._checkpointer is not None:
                self._checkpointer.note_commit()
        if self._doomed and self._blobs is not None:
            # Only now: before this commit a crash would bring back rows that still name them.
            doomed, self._doomed = self._doomed, []
            self._blobs.unlink(doomed)
        if self._freed >= MAINTENANCE_AFTER:
            self._give_back()

    def idle_maintenance(self) -> None:
        """Commit, and give the journal's freed space back to the system: the pages of deleted
        rows and the write-ahead log. Call it when the queue is empty (nothing pending or
        leased): it does nothing until IDLE_AFTER rows were freed since it last ran, and then
        costs a checkpoint (milliseconds). ``commit()`` does the same every MAINTENANCE_AFTER
        freed rows, so a journal that is never idle does not grow without end either."""
        self.commit()
        if self._freed >= IDLE_AFTER:
            self._give_back()

    def compact(self) -> None:
        """Right-size the in-memory table of blob owners (dicts never shrink by themselves)."""
        self._refs = dict(self._refs)

    def _give_back(self) -> None:
        self._freed = 0
        # Functions no unfinished task names any more go too (the next task of one of them
        # journals it again: INSERT OR IGNORE).
        self._functions_kept.clear()
        checkpoints = (self._checkpointer.lock if self._checkpointer is not None
                       else contextlib.nullcontext())
        try:
            with checkpoints:  # not beside a checkpoint of the checkpointer's: busy
                # executescript: sqlite3's execute() steps a pragma once, which frees one page.
                self._db.executescript(
                    "DELETE FROM functions WHERE digest NOT IN "
                    "(SELECT fn FROM tasks WHERE fn IS NOT NULL); "
                    "PRAGMA incremental_vacuum; PRAGMA wal_checkpoint(TRUNCATE);")
        except sqlite3.OperationalError as exc:  # busy, or a full disk: try again next time
            log.warning("journal maintenance failed: %s", exc)

    def load(self) -> Iterator[StoredTask]:
        """Every task still in the journal, oldest first, for restoring after a restart.

        A row that does not decode, or whose blob file is missing or short, comes back with
        ``spec == {CORRUPT: reason}`` and empty payloads. Payloads kept in blob files are checked
        (there, and as long as their frames) but not read: they come back as ``payload_file``
        and ``result_file`` (``read_blob`` reads them)."""
        self._flush()
        rows = self._db.execute(
            "SELECT task_id, client_id, seq, job_id, spec, payload, state, attempts, "
            "result_header, result_payload, submitted_at, payload_ref, result_ref, fn, "
            "lease_floor FROM tasks ORDER BY rowid"
        )
        functions: dict[str, bytes] = {}
        for row in rows:
            try:
                # A queued input in a blob file stays there (checked, not read): a restart with
                # gigabytes queued must not hold them in memory, only the ones being sent.
                payload_file = None if row[11] is None else self._check_blob(row[11])
                payload = [] if payload_file is not None else self._load_frames(row[5]) or []
                result_file = None if row[12] is None else self._check_blob(row[12])
                if row[13] is not None:
                    payload = [self._function(row[13], functions), *payload]
                yield StoredTask(
                    task_id=row[0], client_id=row[1], seq=row[2], job_id=row[3],
                    spec=msgpack.unpackb(row[4], raw=False, strict_map_key=False),
                    payload=payload,
                    state=row[6], attempts=row[7],
                    result_header=(
                        msgpack.unpackb(row[8], raw=False, strict_map_key=False) if row[8]
                        else None
                    ),
                    result_payload=None if result_file is not None
                    else self._load_frames(row[9]),
                    submitted_at=row[10],
                    payload_file=payload_file,
                    result_file=result_file,
                    lease_floor=int(row[14] or 0),
                )
            except Exception as exc:  # msgpack raises several unrelated types on garbage
                # A row that no longer decodes still names its task: the restore fails that
                # task with the reason instead of stopping (spec None says it is broken).
                reason = str(exc) if isinstance(exc, _BlobMissing) else type(exc).__name__
                yield StoredTask(task_id=str(row[0]), client_id=str(row[1]), seq=int(row[2]),
                                 job_id=str(row[3]), spec={CORRUPT: reason},
                                 payload=[], state=str(row[6]), attempts=int(row[7] or 0),
                                 result_header=None, result_payload=None,
                                 submitted_at=float(row[10] or 0.0))

    def _function(self, digest: str, loaded: dict[str, bytes]) -> bytes:
        """A journaled function (cached for one load: a .map's tasks share it)."""
        data = loaded.get(digest)
        if data is None:
            row = self._db.execute("SELECT data FROM functions WHERE digest = ?",
                                   (digest,)).fetchone()
            if row is None:
                raise _BlobMissing(f"its function {str(digest)[:32]} is missing from the journal")
            data = loaded[digest] = bytes(row[0])
        return data

    def _check_blob(self, ref: Any) -> BlobRef:
        name, lengths = msgpack.unpackb(ref, raw=False)
        if self._blobs is None:
            raise _BlobMissing("a blob reference in an in-memory journal")
        try:
            return self._blobs.check(name, lengths)
        except ValueError as exc:
            raise _BlobMissing(str(exc)) from None

    @staticmethod
    def _load_frames(inline: Any) -> list[bytes | memoryview] | None:
        """The frames a row holds itself (those in a blob file: ``_check_blob``)."""
        if not inline:
            return None
        frames = msgpack.unpackb(inline, raw=False)
        if not isinstance(frames, list):
            raise TypeError("payload is not a list of frames")
        return frames

    def close(self) -> None:
        """Commit and close; a commit that fails (a full disk) still closes, then raises."""
        try:
            self.commit()
        finally:
            if self._checkpointer is not None:
                self._checkpointer.stop()
                self._checkpointer = None
            self._db.close()
            if self._lock is not None:
                self._lock.close()
                self._lock = None


_INSERT_TASK = (
    "INSERT INTO tasks (task_id, client_id, seq, job_id, spec, payload, state, submitted_at, "
    "payload_ref, fn) VALUES (?, ?, ?, ?, ?, ?, 'pending', ?, ?, ?)"
)


class _BlobMissing(ValueError):
    """A row's blob file is gone or short: the row is reported CORRUPT with this reason."""


def _ref_name(ref: Any) -> str | None:
    """The blob name in a reference column, or None (also for a reference that does not
    decode: load() reports that row as CORRUPT)."""
    if ref is None:
        return None
    try:
        name = msgpack.unpackb(ref, raw=False)[0]
    except Exception:
        return None
    return name if isinstance(name, str) else None


def _create_private(path: Path) -> None:
    """Create ``path`` empty and owner-only before SQLite opens it: payloads are code and data,
    and a file that is readable even for a moment can be opened and kept open by anyone.
    SQLite gives its -wal and -shm files the mode of the database file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    except OSError as exc:
        raise StoreError(f"cannot create the database {path}: {exc.strerror}") from None
    os.close(fd)


def _lock_exclusively(path: Path) -> Any:
    """Hold an exclusive lock for the life of the store: two coordinators on one journal would
    each re-run the other's tasks."""
    import fcntl

    _create_private(path)
    handle = open(path, "a+b")  # noqa: SIM115 - held open until close()
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise StoreError(
            f"another coordinator is using the journal {path.with_suffix('')}: stop it, or run "
            "this one beside it on another --port (each port has a journal of its own) or with "
            "its own --db PATH"
        ) from None
    return handle


def _disk_full(path: Path | str) -> str:
    """What to add to a journal that cannot be opened when its disk is full: SQLite says only
    "disk I/O error" then, which reads as a failing disk."""
    if str(path) == ":memory:":
        return ""
    try:
        free = shutil.disk_usage(Path(path).resolve().parent).free
    except OSError:
        return ""
    return (f" (the disk holding it has {free:,} bytes free: free some space, then start "
            "serve again)") if free < DISK_FULL_BYTES else ""
