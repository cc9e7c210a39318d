"""Spare shared-memory files: made after a big frame, used by the next frame of that size,
never by another size, given back when idle or released, and never in the way (a system that
cannot name them writes new files, as before)."""

from __future__ import annotations

import os
import stat
import time

import pytest

from gpumesh import shmspares
from gpumesh.sharedmem import MIN_SHARED_BYTES, PROBE, SharedFolder

pytestmark = pytest.mark.skipif(not getattr(os, "O_TMPFILE", 0), reason="Linux O_TMPFILE")

BIG = bytes(range(256)) * (MIN_SHARED_BYTES // 256)


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setattr("gpumesh.sharedmem._base", lambda: tmp_path)
    made = SharedFolder.create("spares")
    assert made is not None
    yield made
    made.remove(n for n in os.listdir(made.path) if n not in (PROBE, ".lock"))
    made.close()


def spare_ready(folder: SharedFolder, size: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spares = folder._spares
        if spares is not None and spares._ready is not None and spares._ready[0] == size:
            return True
        time.sleep(0.01)
    return False


def inode_of(folder: SharedFolder, ref) -> int:
    return os.stat(folder.path / ref[1]).st_ino


def test_the_next_frame_of_a_size_goes_into_the_spare_made_for_it(folder):
    _, first = folder.share([BIG])
    assert spare_ready(folder, len(BIG))
    spare_fd = folder._spares._ready[1]
    spare_inode = os.fstat(spare_fd).st_ino
    _, second = folder.share([memoryview(BIG)])
    assert inode_of(folder, second[0]) == spare_inode  # the spare, now named
    assert bytes(folder.open(second[0][1], len(BIG))) == BIG
    info = os.stat(folder.path / second[0][1])
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_size == len(BIG)
    assert inode_of(folder, first[0]) != spare_inode
    assert spare_ready(folder, len(BIG))  # and another is made for the one after


def test_a_spare_is_never_used_for_another_size(folder):
    folder.share([BIG])
    assert spare_ready(folder, len(BIG))
    other = BIG + b"x"
    _, refs = folder.share([other])
    assert bytes(folder.open(refs[0][1], len(other))) == other
    assert spare_ready(folder, len(other))  # the spare follows the latest size


def test_release_gives_the_spare_back(folder):
    folder.share([BIG])
    assert spare_ready(folder, len(BIG))
    spare_fd = folder._spares._ready[1]
    folder.release()
    with pytest.raises(OSError):
        os.fstat(spare_fd)  # closed: its pages go back to the system
    assert folder._spares is None


def test_an_idle_spare_is_given_back(folder, monkeypatch):
    monkeypatch.setattr(shmspares, "SPARE_IDLE_SECONDS", 0.05)
    folder.share([BIG])
    assert spare_ready(folder, len(BIG))
    deadline = time.monotonic() + 10
    while folder._spares._ready is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert folder._spares._ready is None


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
    assert folder._spares._failed == len(BIG)  # and it is not tried again for that size


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
