"""Blob files of the coordinator's journal (store.py): big payloads live beside the database.

A payload whose frames total ``BLOB_THRESHOLD`` bytes or more is written, frame after frame
straight from its buffers, into one file of a private folder ``<db>.blobs/`` (0700, files 0600);
the journal row keeps only the file's name and the frame lengths. SQLite then never copies,
packs or logs the bulk bytes: its WAL would hold them twice, and its COMMIT would pay for them.

A file is written under a temporary name and renamed when complete, so a referenced name never
holds half a payload. Names are random, never reused, so a row can only ever meet its own bytes.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .fileio import read_into, write_all

log = logging.getLogger("gpumesh.store")

BLOB_THRESHOLD = 64 * 1024
_NAME = re.compile(r"[0-9a-f]{24}")
_TEMP_PREFIX = ".tmp-"


@dataclass(frozen=True, slots=True)
class BlobRef:
    """Where a payload's frames lie: the blob's name and each frame's length. The coordinator
    holds one in place of an input or result it let go of (coordinator/inputs.py, Ledger), and
    reads the frames back only to send them."""

    name: str
    lengths: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(self.lengths)


class BlobFolder:
    """The blob files of one journal. Owned by the store's thread, like the database."""

    def __init__(self, path: Path, *, sync: bool) -> None:
        self.path = path
        # synchronous=NORMAL (the coordinator's setting) does not fsync a commit either: both the
        # row and its blob survive a crash of the process (the bytes are in the page cache) and
        # may be lost to a power cut. FULL/EXTRA fsync the WAL at every commit, so then each blob
        # and its folder entry are fsynced before the row that names it can be committed.
        self.sync = sync
        self._ready = False

    def _ensure(self) -> None:
        if self._ready:
            return
        try:
            self.path.mkdir(mode=0o700)
        except FileExistsError:
            pass
        os.chmod(self.path, 0o700)  # mkdir applies the umask; an older folder is tightened too
        self._ready = True

    def write(self, views: Sequence[memoryview]) -> str:
        """Write the frames as one new blob and return its name. Raises OSError."""
        self._ensure()
        name = secrets.token_hex(12)
        temp = self.path / f"{_TEMP_PREFIX}{name}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                write_all(fd, views)
                if self.sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(temp, self.path / name)
        except BaseException:
            _unlink(temp)
            raise
        if self.sync:
            _fsync_dir(self.path)
        return name

    def check(self, name: str, lengths: Sequence[int]) -> BlobRef:
        """A reference to a blob that is there and exactly as long as its frames, read from a
        journal row (whose columns are not trusted: a row may be damaged or edited by hand).

        Raises ValueError as ``read`` does."""
        total = _checked_total(name, lengths)
        try:
            size = os.stat(self.path / name).st_size
        except FileNotFoundError:
            raise ValueError(f"its payload file {name} is missing from the journal's folder") from None
        except OSError as exc:
            raise ValueError(f"its payload file {name} cannot be read ({exc.strerror})") from None
        if size != total:
            raise ValueError(f"its payload file {name} has {size} bytes, not {total}")
        return BlobRef(name, tuple(lengths))

    def read(self, name: str, lengths: Sequence[int]) -> list[memoryview]:
        """The frames of a blob: views into one buffer, read with one copy.

        Raises ValueError when the name is not one this folder makes, or the file is missing or
        not exactly as long as the frames: its bytes are gone. Raises OSError for a failure that
        may pass (too many open files, no memory, an I/O error): try again later."""
        fd = self.open(name, lengths)
        try:
            total = sum(lengths)
            view = memoryview(bytearray(total))
            got = read_into(fd, view)
            if got < total:
                raise ValueError(f"its payload file {name} ended at {got} of {total} bytes")
        finally:
            os.close(fd)
        frames, start = [], 0
        for n in lengths:
            frames.append(view[start:start + n])
            start += n
        return frames

    def open(self, name: str, lengths: Sequence[int]) -> int:
        """A read-only descriptor of a blob, checked as ``read`` checks it (``read`` reads
        through it; protocol/pieces.py reads a piece at a time). Raises as ``read`` does."""
        total = _checked_total(name, lengths)
        try:
            fd = os.open(self.path / name, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ValueError(f"its payload file {name} is missing from the journal's folder") from None
        try:
            size = os.fstat(fd).st_size
            if size != total:
                raise ValueError(f"its payload file {name} has {size} bytes, not {total}")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def scratch(self, size: int) -> memoryview:
        """A writable buffer of ``size`` bytes in a file of this folder that has no name
        (O_TMPFILE), mapped: a message arriving in pieces (protocol/pieces.py) waits in the
        page cache, which the kernel may write out, not in the process's memory. The file
        goes with the last view of the buffer. Raises OSError."""
        self._ensure()
        with tempfile.TemporaryFile(dir=self.path) as scratch:
            # Allocated now, not sparse: a full disk is an OSError here, where a write into
            # the mapping of a sparse file would kill the process with SIGBUS.
            os.posix_fallocate(scratch.fileno(), 0, size)
            return memoryview(mmap.mmap(scratch.fileno(), size))  # the mapping keeps the file

    def unlink(self, names: Iterable[str]) -> None:
        for name in names:
            _unlink(self.path / name)

    def sweep(self, referenced: set[str]) -> int:
        """Delete every file no row refers to (a crash between writing a blob and committing
        its row, or between a commit and the unlink it allowed). Returns how many went."""
        try:
            entries = list(os.scandir(self.path))
        except FileNotFoundError:
            return 0
        self._ensure()
        gone = 0
        for entry in entries:
            if entry.name not in referenced:
                _unlink(Path(entry.path))
                gone += 1
        return gone

    def exists(self) -> bool:
        return self.path.is_dir()


def _checked_total(name: Any, lengths: Sequence[Any]) -> int:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError("a blob reference that this gpumesh does not write")
    if not all(type(n) is int and n >= 0 for n in lengths):
        raise ValueError("bad frame lengths in a blob reference")
    return sum(lengths)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # a stray directory, a read-only disk: keep the journal running
        log.warning("cannot delete the journal's blob %s: %s", path, exc.strerror)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
