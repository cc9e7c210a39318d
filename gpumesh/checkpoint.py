"""The journal's WAL checkpoints, from a thread of their own.

A checkpoint copies what the write-ahead log holds back into the database file and fsyncs both.
SQLite runs one by itself inside the commit that fills the log past 1,000 pages: on the
coordinator's loop thread, a few milliseconds of disk wait every hundred or so single calls
(the p99 of a call was that wait). Here the journal's own connection never checkpoints
(``wal_autocheckpoint=0``); this thread, with a connection of its own, runs a PASSIVE
checkpoint, which copies what it can without waiting for the writer, and the writer goes on
appending meanwhile. SQLite releases the GIL while it works.

It waits for the journal to be quiet: a checkpoint still cost the calls around it (back-to-back
single calls on the test machine were 3-7 ms instead of 1.3 for a few calls once a second, the
checkpoint's period, and that was the p99), so it runs when nothing was committed for
``QUIET`` seconds, and otherwise only once ``FORCE_AFTER`` commits or ``MAX_DELAY`` seconds
have passed, which bounds the WAL under load that never pauses.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path

log = logging.getLogger("gpumesh.store")

CHECKPOINT_EVERY = 0.1  # seconds between looks at whether a checkpoint is due
QUIET = 0.05  # seconds without a commit: the journal is quiet, the checkpoint costs nobody
# Under load that never pauses, checkpoint anyway after this many commits or seconds: about
# two seconds of writes stay in the WAL (the old fixed period kept one).
FORCE_AFTER = 2000
MAX_DELAY = 2.0


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
        # Written by the journal's thread (note_commit), read by this one: ints and floats,
        # each replaced whole, so a read sees an old value or a new one, either of them safe.
        self._commits = 0
        self._last_commit = 0.0
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

    def note_commit(self) -> None:
        """The journal committed something (called on its thread, after the COMMIT)."""
        self._last_commit = time.monotonic()
        self._commits += 1

    def due(self, now: float, done: int, since: float) -> bool:
        """Whether to checkpoint now, ``done`` commits having been checkpointed, commits
        waiting for one since about ``since``."""
        waiting = self._commits - done
        if waiting <= 0:
            return False
        return (now - self._last_commit >= QUIET or waiting >= FORCE_AFTER
                or now - since >= MAX_DELAY)

    def _run(self) -> None:
        done, last = 0, time.monotonic()
        try:
            while not self._stop.wait(self._every):
                now = time.monotonic()
                if self._commits == done:
                    last = now  # MAX_DELAY counts from the first commit not checkpointed
                    continue
                if not self.due(now, done, last):
                    continue
                commits = self._commits  # those before this point are in the WAL now
                try:
                    with self.lock:
                        self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    done, last = commits, now
                    self.ran.set()
                except sqlite3.Error as exc:  # a full disk: the next one tries again
                    log.debug("journal checkpoint skipped: %s", exc)
        finally:
            self._db.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
