"""The coordinator's SQLite journal: every accepted task and every unacknowledged result.

The in-memory queue is the working copy; this is what survives ``kill -9``. Writes go into one
open transaction and ``commit()`` closes it once per loop turn (group commit), so the coordinator
pays one commit for a whole burst of submissions. ACCEPTED and RESULT_ACK are sent only after
the commit that holds them.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from .errors import MeshError

log = logging.getLogger("gpumesh.store")

SCHEMA_VERSION = 1
# A task whose result its owner has collected: the row keeps only its job's summary of it.
COLLECTED = "collected"

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
    UNIQUE (client_id, seq)
);
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
    payload: list[bytes]
    state: str
    attempts: int
    result_header: dict[str, Any] | None
    result_payload: list[bytes] | None
    submitted_at: float


def _pack_frames(frames: Sequence[Any]) -> bytes:
    return msgpack.packb([_frame_bytes(f) for f in frames], use_bin_type=True)


def _frame_bytes(frame: Any) -> bytes:
    if isinstance(frame, bytes):
        return frame
    buffer = getattr(frame, "buffer", None)
    return bytes(buffer if buffer is not None else frame)


class Store:
    """One SQLite file in WAL mode, owned by the coordinator's loop thread."""

    def __init__(self, path: Path | str, *, synchronous: str = "NORMAL") -> None:
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            _create_private(self.path)
        try:
            self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"cannot open the database {path}: {exc}") from None
        self._lock: Any = None
        try:
            self._open(path, synchronous)
        except BaseException:
            self._db.close()
            if self._lock is not None:
                self._lock.close()
            raise
        self._in_transaction = False
        # Writes wait here until the turn's commit; consecutive writes of one statement go to
        # SQLite as one executemany, which costs a fraction of one call per row.
        self._runs: list[tuple[str, list[Sequence[Any]]]] = []

    def _open(self, path: Path | str, synchronous: str) -> None:
        if str(path) != ":memory:":
            os.chmod(path, 0o600)  # an existing file made by an older gpumesh: owner only now
            self._lock = _lock_exclusively(Path(f"{path}.lock"))
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={synchronous}")
            self._db.executescript(_SCHEMA)
            version = self._meta("schema_version")
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"cannot use the database {path}: {exc}") from None
        if version is None:
            self._set_meta("schema_version", SCHEMA_VERSION)
        elif version != SCHEMA_VERSION:
            raise StoreError(
                f"the database {path} has schema v{version}, this gpumesh uses v{SCHEMA_VERSION}: "
                "finish its jobs with the matching gpumesh, or start with another --db"
            )

    def _meta(self, key: str) -> int | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else int(row[0])

    def _set_meta(self, key: str, value: int) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

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
        """Apply the queued writes, in order, inside the open transaction."""
        if not self._runs:
            return
        if not self._in_transaction:
            self._db.execute("BEGIN")
            self._in_transaction = True
        runs, self._runs = self._runs, []
        for sql, rows in runs:
            if len(rows) == 1:
                self._apply_one(sql, rows[0])
                continue
            self._db.execute("SAVEPOINT run")
            try:
                self._db.executemany(sql, rows)
            except sqlite3.IntegrityError:
                # The broker guards against duplicates, so this is a bug: undo the run, apply its
                # good rows one by one, keep the coordinator running and say what was refused.
                self._db.execute("ROLLBACK TO run")
                for row in rows:
                    self._apply_one(sql, row)
            self._db.execute("RELEASE run")

    def _apply_one(self, sql: str, row: Sequence[Any]) -> None:
        try:
            self._db.execute(sql, row)
        except sqlite3.IntegrityError as exc:
            log.error("journal refused a write (%s): %s", exc, sql.split("(")[0])

    def add_task(
        self, task_id: str, client_id: str, seq: int, job_id: str, spec: dict[str, Any],
        payload: Sequence[Any], submitted_at: float,
    ) -> None:
        self._write(
            "INSERT INTO tasks (task_id, client_id, seq, job_id, spec, payload, state, "
            "submitted_at) VALUES (?, ?, ?, ?, ?, ?, 'pending', ?)",
            (task_id, client_id, seq, job_id, msgpack.packb(spec, use_bin_type=True),
             _pack_frames(payload), submitted_at),
        )

    def set_attempts(self, task_id: str, attempts: int) -> None:
        self._write("UPDATE tasks SET attempts = ? WHERE task_id = ?", (attempts, task_id))

    def finish_task(
        self, task_id: str, state: str, attempts: int, header: dict[str, Any], payload: Sequence[Any],
        *, keep_input: bool = False,
    ) -> None:
        """Record a terminal outcome. The task's input is dropped unless it may be retried."""
        self._write(
            "UPDATE tasks SET state = ?, attempts = ?, result_header = ?, result_payload = ?"
            + ("" if keep_input else ", payload = x''") + " WHERE task_id = ?",
            (state, attempts, msgpack.packb(header, use_bin_type=True), _pack_frames(payload),
             task_id),
        )

    def reopen_task(self, task_id: str) -> None:
        """A failed task goes back to the queue (``gpumesh retry``)."""
        self._write(
            "UPDATE tasks SET state = 'pending', attempts = 0, result_header = NULL, "
            "result_payload = NULL WHERE task_id = ?", (task_id,),
        )

    def add_job(self, job_id: str, name: str, client_id: str, created: float) -> None:
        self._write("INSERT OR IGNORE INTO jobs (job_id, name, client_id, created) "
                    "VALUES (?, ?, ?, ?)", (job_id, name, client_id, created))

    def delete_job(self, job_id: str) -> None:
        """Forget a job and the summaries of its collected tasks."""
        self._write("DELETE FROM tasks WHERE job_id = ? AND state = 'collected'", (job_id,))
        self._write("DELETE FROM jobs WHERE job_id = ?", (job_id,))

    def collect_task(self, task_id: str, summary: dict[str, Any]) -> None:
        """Keep only the job's summary of a task whose result is no longer needed."""
        # seq = -rowid frees (client, seq): if that client submits the seq again (its result was
        # dropped before it came back for it), the new task must be journaled, not refused.
        self._write(
            "UPDATE tasks SET state = 'collected', seq = -rowid, payload = x'', "
            "result_header = ?, result_payload = NULL WHERE task_id = ?",
            (msgpack.packb(summary, use_bin_type=True), task_id))

    def load_jobs(self) -> list[tuple[str, str, str, float]]:
        """(job id, name, client id, created) of every job on record, oldest first."""
        self._flush()
        return [tuple(row) for row in self._db.execute(
            "SELECT job_id, name, client_id, created FROM jobs ORDER BY created")]

    def delete_task(self, task_id: str) -> None:
        self._write("DELETE FROM tasks WHERE task_id = ?", (task_id,))

    def commit(self) -> None:
        self._flush()
        if self._in_transaction:
            self._db.execute("COMMIT")
            self._in_transaction = False

    def load(self) -> Iterator[StoredTask]:
        """Every task still in the journal, oldest first, for restoring after a restart."""
        self._flush()
        rows = self._db.execute(
            "SELECT task_id, client_id, seq, job_id, spec, payload, state, attempts, "
            "result_header, result_payload, submitted_at FROM tasks ORDER BY rowid"
        )
        for row in rows:
            try:
                yield StoredTask(
                    task_id=row[0], client_id=row[1], seq=row[2], job_id=row[3],
                    spec=msgpack.unpackb(row[4], raw=False, strict_map_key=False),
                    payload=msgpack.unpackb(row[5], raw=False) if row[5] else [],
                    state=row[6], attempts=row[7],
                    result_header=(
                        msgpack.unpackb(row[8], raw=False, strict_map_key=False) if row[8]
                        else None
                    ),
                    result_payload=msgpack.unpackb(row[9], raw=False) if row[9] else None,
                    submitted_at=row[10],
                )
            except Exception as exc:  # msgpack raises several unrelated types on garbage
                # A row that no longer decodes still names its task: the restore fails that
                # task with the reason instead of stopping (spec None says it is broken).
                yield StoredTask(task_id=str(row[0]), client_id=str(row[1]), seq=int(row[2]),
                                 job_id=str(row[3]), spec={CORRUPT: f"{type(exc).__name__}"},
                                 payload=[], state=str(row[6]), attempts=int(row[7] or 0),
                                 result_header=None, result_payload=None,
                                 submitted_at=float(row[10] or 0.0))

    def close(self) -> None:
        self.commit()
        self._db.close()
        if self._lock is not None:
            self._lock.close()
            self._lock = None


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
            f"another coordinator is using the journal {path.with_suffix('')}: stop it, or give "
            "this one its own with --db PATH"
        ) from None
    return handle
