"""The journal's WAL checkpoints, from a thread of their own.

A checkpoint copies what the write-ahead log holds back into the database file and fsyncs both.
SQLite runs one by itself inside the commit that fills the log past 1,000 pages: on the
coordinator's loop thread, a few milliseconds of disk wait every hundred or so single calls
(the p99 of a call was that wait). Here the journal's own connection never checkpoints
(``wal_autocheckpoint=0``); this thread, with a connection of its own, runs a PASSIVE
checkpoint every ``every`` seconds, which copies what it can without waiting for the writer,
and the writer goes on appending meanwhile. SQLite releases the GIL while it works.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

log = logging.getLogger("gpumesh.store")

CHECKPOINT_EVERY = 1.0  # seconds between checkpoints: each costs the disk an fsync or two


class Checkpointer:
    """Checkpoint the WAL of the database at ``path`` until ``stop()``; ``start`` returns None
    where it cannot open its connection (then SQLite's own checkpoints stay on)."""

    def __init__(self, db: sqlite3.Connection, every: float) -> None:
        self._db = db
        self._every = every
        self._stop = threading.Event()
        # Held while a checkpoint runs: the journal's own TRUNCATE checkpoint (idle
        # maintenance) takes it too, instead of failing busy against this one.
        self.lock = threading.Lock()
        self.ran = threading.Event()  # set after each one (a test waits on it)
        self._thread = threading.Thread(target=self._run, name="gpumesh-checkpoint", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, path: Path, every: float = CHECKPOINT_EVERY) -> Checkpointer | None:
        try:
            # Made here, used only by the thread (hence check_same_thread=False).
            db = sqlite3.connect(str(path), isolation_level=None, timeout=0.0,
                                 check_same_thread=False)
        except sqlite3.Error as exc:
            log.warning("journal checkpoints: cannot open %s (%s); SQLite checkpoints in the "
                        "loop instead", path, exc)
            return None
        return cls(db, every)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._every):
                try:
                    with self.lock:
                        self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    self.ran.set()
                except sqlite3.Error as exc:  # a full disk: the next one tries again
                    log.debug("journal checkpoint skipped: %s", exc)
        finally:
            self._db.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
