"""Files gpumesh writes are owner-only from the moment they exist, not only once it is done.

Each test runs under umask 0, the worst case: a file created with default permissions and
tightened later would be world-readable for a moment, and whoever opens it then keeps it open.
The journal's modes are recorded right after every call into SQLite, so a file SQLite creates
(the database, -wal, -shm) is seen as it was created.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from gpumesh import store as store_module
from gpumesh.store import Store
from gpumesh.worker.control import ControlServer, registry_dir


@pytest.fixture
def no_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int | None:
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return None


class _Watched:
    """A sqlite3 connection that records the journal files' modes after every call."""

    def __init__(self, db: sqlite3.Connection, files: list[Path], seen: dict[str, set[int]]):
        self._db, self._files, self._seen = db, files, seen
        self._record()

    def _record(self) -> None:
        for path in self._files:
            mode = _mode(path)
            if mode is not None:
                self._seen.setdefault(path.name, set()).add(mode)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._db, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attribute(*args, **kwargs)
            finally:
                self._record()
        return call


def test_the_journal_and_its_wal_shm_and_lock_files_are_0600_from_creation(
        tmp_path: Path, no_umask: None, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "journal.db"
    files = [db, Path(f"{db}-wal"), Path(f"{db}-shm"), Path(f"{db}.lock")]
    seen: dict[str, set[int]] = {}
    real_connect = sqlite3.connect
    real_open = os.open

    def connect(*args: Any, **kwargs: Any) -> _Watched:
        return _Watched(real_connect(*args, **kwargs), files, seen)

    def record() -> None:
        for watched in files:
            if _mode(watched) is not None:
                seen.setdefault(watched.name, set()).add(_mode(watched))  # type: ignore[arg-type]

    def watched_os_open(path: Any, flags: int, mode: int = 0o777, *args: Any, **kwargs: Any) -> int:
        fd = real_open(path, flags, mode, *args, **kwargs)
        record()
        return fd

    def watched_open(*args: Any, **kwargs: Any) -> Any:
        handle = open(*args, **kwargs)  # noqa: SIM115 - the store closes what it opens
        record()
        return handle

    monkeypatch.setattr(store_module.sqlite3, "connect", connect)
    monkeypatch.setattr(store_module.os, "open", watched_os_open)
    monkeypatch.setattr(store_module, "open", watched_open, raising=False)
    store = Store(db)
    try:
        store.add_task("t1", "c1", 1, "j1", {"kind": "fn"}, [b"payload"], 0.0)
        store.commit()
        for path in files:
            seen.setdefault(path.name, set()).add(_mode(path))  # type: ignore[arg-type]
    finally:
        store.close()
    assert set(seen) == {path.name for path in files}
    assert seen == {path.name: {0o600} for path in files}, seen


def test_a_journal_in_a_new_folder_gets_a_0700_folder(tmp_path: Path, no_umask: None) -> None:
    db = tmp_path / "new" / "journal.db"
    Store(db).close()
    assert _mode(db.parent) == 0o700
    assert _mode(db) == 0o600


def test_join_creates_gpumesh_home_0700_not_only_its_registry(tmp_path: Path,
                                                              no_umask: None) -> None:
    home = tmp_path / "fresh-home"
    ctx = zmq.Context()
    try:
        server = ControlServer(ctx, home, "w1", "tcp://127.0.0.1:9")
        try:
            assert _mode(home) == 0o700
            assert _mode(registry_dir(home)) == 0o700
            assert _mode(server.path) == 0o600
            assert json.loads(server.path.read_text())["worker"] == "w1"
        finally:
            server.close()
    finally:
        ctx.term()


def test_join_tightens_a_loose_gpumesh_home(tmp_path: Path) -> None:
    home = tmp_path / "loose-home"
    home.mkdir()
    home.chmod(0o755)
    ctx = zmq.Context()
    try:
        ControlServer(ctx, home, "w2", "tcp://127.0.0.1:9").close()
    finally:
        ctx.term()
    assert _mode(home) == 0o700
