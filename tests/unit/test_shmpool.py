"""A producer's kept files (gpumesh/shmpool.py): written again in place only once the
coordinator has retired them and nobody maps them; removed, not retired, when nobody holds
them; bounded, given back when idle, and never written or unlocked by a forked child."""

from __future__ import annotations

import os

import pytest
from conftest import wait_for

from gpumesh import sharedmem, shmpool
from gpumesh.sharedmem import JOURNAL, MIN_MAPPED_BYTES, PROBE, SharedFolder, _still_named
from gpumesh.shmowners import is_owner_file
from gpumesh.shmpool import RETIRED, holds

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX locks and fork")
fcntl = pytest.importorskip("fcntl")

BIG = bytes(range(256)) * (MIN_MAPPED_BYTES // 256)  # a size consumers map
OTHER = bytes(reversed(BIG))


def share(folder: SharedFolder, data: bytes) -> str:
    _, (ref,) = folder.share([data])
    return ref[1]


def inode(folder: SharedFolder, name: str) -> int:
    return os.stat(folder.path / name).st_ino


def listing(folder: SharedFolder) -> set[str]:
    """Frames and retired files: not the probe, journal path, locks or writers' lock files."""
    return {n for n in os.listdir(folder.path)
            if n not in (PROBE, JOURNAL, ".lock") and not is_owner_file(n)}


def test_a_retired_file_nobody_maps_is_written_again_in_place(folder):
    first = share(folder, BIG)
    was = inode(folder, first)
    assert folder.retire(first)  # its producer (this process) keeps it: retired, not removed
    assert listing(folder) == {RETIRED + first}
    second = share(folder, OTHER)
    assert second != first and inode(folder, second) == was
    assert listing(folder) == {second}
    assert bytes(folder.open(second, len(OTHER))) == OTHER


def test_a_file_not_yet_retired_is_never_written_again(folder):
    first = share(folder, BIG)  # the coordinator still needs it (a journaled input, say)
    second = share(folder, OTHER)
    assert inode(folder, second) != inode(folder, first)
    assert bytes(folder.open(first, len(BIG))) == BIG


def test_a_file_someone_maps_is_never_written_again_until_they_let_go(folder):
    first = share(folder, BIG)
    was = inode(folder, first)
    mapped = folder.open(first, len(BIG))  # a consumer: a runner's argument, a caller's result
    assert folder.retire(first)
    second = share(folder, OTHER)
    assert inode(folder, second) != was
    assert bytes(mapped) == BIG  # untouched under the consumer
    del mapped  # let go: the retired file may be written again now
    third = share(folder, BIG[::-1])
    assert inode(folder, third) == was
    assert bytes(folder.open(third, len(BIG))) == BIG[::-1]


def test_a_mid_size_frame_read_by_its_consumer_is_written_again_at_once(folder):
    # Read, not mapped (under 1 MiB): the consumer holds nothing once it has its copy.
    mid = BIG[:MIN_MAPPED_BYTES // 4]
    first = share(folder, mid)
    was = inode(folder, first)
    copy = folder.open(first, len(mid))
    assert folder.retire(first)
    second = share(folder, mid[::-1])
    assert inode(folder, second) == was  # written again in place while the copy lives
    assert bytes(copy) == mid


def test_a_file_nobody_holds_is_removed_not_retired(folder):
    writer = SharedFolder(folder.path, "")
    writer.release()  # a producer that keeps nothing (an older gpumesh, a full pool)
    name = share(writer, BIG)
    assert holds(folder.path / name) is False
    assert not folder.retire(name)
    assert listing(folder) == set()
    assert holds(folder.path / name) is None  # gone


def test_retired_files_nobody_claims_go_after_a_while_and_at_close(folder, monkeypatch):
    monkeypatch.setattr(sharedmem, "RETIRE_SECONDS", 0.2)
    folder.retire_soon([share(folder, BIG)])
    wait_for(lambda: listing(folder) == set(), what="the unclaimed retired file removed")
    kept = share(folder, OTHER)
    monkeypatch.setattr(sharedmem, "RETIRE_SECONDS", 600.0)
    folder.retire_soon([kept])
    wait_for(lambda: listing(folder) == {RETIRED + kept}, what="the file retired")
    folder.settle()  # the coordinator stops: nobody will claim from it any more
    assert listing(folder) == set()


def test_a_consumer_that_opened_a_name_since_reused_is_told_it_is_gone(folder, tmp_path):
    name = share(folder, BIG)
    path = folder.path / name
    fd = os.open(path, os.O_RDONLY)
    try:
        opened = os.fstat(fd)
        assert _still_named(path, opened)
        os.rename(path, folder.path / (RETIRED + name))  # retired, then claimed under another
        assert not _still_named(path, opened)
        path.write_bytes(b"another file of the same name")
        assert not _still_named(path, opened)
    finally:
        os.close(fd)


def test_a_forked_child_keeps_nothing_and_leaves_the_parents_lock(folder):
    name = share(folder, BIG)
    pid = os.fork()
    if pid == 0:  # the child: it must not write into, nor unlock, what its parent keeps
        pool = folder._pool
        os._exit(0 if pool is not None and pool._closed and not pool._kept else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert holds(folder.path / name) is True  # the parent still keeps it
    was = inode(folder, name)
    assert folder.retire(name)
    assert inode(folder, share(folder, OTHER)) == was  # and still writes it again


def test_kept_files_are_bounded_in_count_and_bytes(folder, monkeypatch):
    monkeypatch.setattr(shmpool, "KEEP_MAX_FILES", 2)
    names = [share(folder, BIG + bytes(n)) for n in range(3)]
    # Let go of at once, or as soon as the pool's thread is done mapping it ahead.
    wait_for(lambda: [holds(folder.path / n) for n in names] == [False, True, True],
             what="the oldest let go")
    monkeypatch.setattr(shmpool, "KEEP_MAX_BYTES", 2 * len(BIG) + 5)  # the two newest fit
    share(folder, BIG + bytes(3))
    wait_for(lambda: [holds(folder.path / n) for n in names] == [False, False, True],
             what="the two oldest let go")


def test_more_frames_of_one_size_in_flight_than_kept_keep_the_first_ones(folder, monkeypatch):
    # A .map of big arguments: frames of one size, many in flight. A new one taking a kept
    # one's place would be mapped, then let go unused before its frame was ever retired.
    monkeypatch.setattr(shmpool, "KEEP_MAX_FILES", 2)
    names = [share(folder, BIG) for _ in range(4)]
    assert [holds(folder.path / n) for n in names] == [True, True, False, False]
    was = inode(folder, names[0])
    assert folder.retire(names[0])
    assert inode(folder, share(folder, OTHER)) == was  # written again in turn
    # A frame of another size still takes the place of the least recently written.
    other = share(folder, BIG + b"x")
    assert holds(folder.path / other) is True
    assert [holds(folder.path / n) for n in names[1:]] == [False, False, False]


def test_a_file_held_long_by_its_task_does_not_keep_younger_ones_from_being_written_again(
        folder, monkeypatch):
    monkeypatch.setattr(shmpool, "IN_ORDER_SECONDS", 1e9)  # however slow this machine is now
    held = share(folder, BIG)  # its task runs on: the coordinator does not retire it
    younger = share(folder, BIG)
    was = inode(folder, younger)
    assert folder.retire(younger)
    # Written a moment ago and not retired: the younger ones are not looked at (frames are
    # retired about in the order they were written).
    assert inode(folder, share(folder, OTHER)) != was
    monkeypatch.setattr(shmpool, "IN_ORDER_SECONDS", 0.0)  # as if written long ago
    assert inode(folder, share(folder, OTHER)) == was
    assert bytes(folder.open(held, len(BIG))) == BIG


def test_an_oldest_file_whose_name_went_does_not_stop_the_look(folder, monkeypatch):
    monkeypatch.setattr(shmpool, "IN_ORDER_SECONDS", 1e9)
    gone = share(folder, BIG)
    younger = share(folder, BIG)
    was = inode(folder, younger)
    folder.remove([gone])  # an older coordinator removed it rather than retiring it
    assert folder.retire(younger)
    assert inode(folder, share(folder, OTHER)) == was


def test_kept_files_of_one_size_unwritten_for_long_make_room_for_a_new_one(folder, monkeypatch):
    # Held by tasks that wait (a parked submission, long tasks): a later stream of that size
    # would never be kept.
    monkeypatch.setattr(shmpool, "KEEP_MAX_FILES", 2)
    monkeypatch.setattr(shmpool, "STALE_SECONDS", 0.0)  # as if they had waited that long
    names = [share(folder, BIG) for _ in range(3)]
    assert [holds(folder.path / n) for n in names] == [False, True, True]


def test_a_file_is_kept_only_with_room_to_spare(folder, monkeypatch):
    monkeypatch.setattr(shmpool, "KEEP_FREE_FACTOR", 1 << 40)  # /dev/shm of a container, say
    name = share(folder, BIG)
    assert holds(folder.path / name) is False
    assert folder._pool is not None and folder._pool._kept == []


def test_a_kept_file_whose_name_went_is_let_go_soon(folder, monkeypatch):
    monkeypatch.setattr(shmpool, "CHECK_SECONDS", 0.05)
    name = share(folder, BIG)
    fd = os.open(folder.path / name, os.O_RDONLY)
    try:
        folder.remove([name])  # the coordinator removed it (an older one, say): nothing to claim
        wait_for(lambda: folder._pool is not None and folder._pool._kept == [],
                 what="the nameless file let go")
        # Its pages are free once the last holder goes: this reader's lock stands alone now.
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_a_frame_bigger_than_the_pool_is_not_kept_and_evicts_nothing(folder, monkeypatch):
    monkeypatch.setattr(shmpool, "KEEP_MAX_BYTES", 2 * len(BIG))
    small = share(folder, BIG)
    huge = share(folder, BIG * 3)
    assert holds(folder.path / huge) is False and holds(folder.path / small) is True


def test_kept_files_are_given_back_when_idle_or_released(folder, monkeypatch):
    monkeypatch.setattr(shmpool, "KEEP_IDLE_SECONDS", 0.2)
    monkeypatch.setattr(shmpool, "CHECK_SECONDS", 0.05)
    idle = share(folder, BIG)
    wait_for(lambda: holds(folder.path / idle) is False, what="the idle file given back")
    monkeypatch.setattr(shmpool, "KEEP_IDLE_SECONDS", 600.0)
    kept = share(folder, BIG)
    assert holds(folder.path / kept) is True
    folder.release()
    wait_for(lambda: holds(folder.path / kept) is False, what="the released file let go")
    assert not folder.retire(kept) and listing(folder) == {idle}


def test_a_file_no_producer_would_keep_is_removed_though_a_reader_maps_it(folder, monkeypatch):
    monkeypatch.setattr(sharedmem, "KEEP_MAX_BYTES", len(BIG) - 1)  # bigger than a pool keeps
    name = share(folder, BIG)
    mapped = folder.open(name, len(BIG))  # a caller keeping a big result
    assert not folder.retire(name) and listing(folder) == set()
    assert bytes(mapped) == BIG  # the reader keeps its pages; nobody holds them in the folder


def test_retired_bytes_are_bounded_the_oldest_going_first(folder, monkeypatch):
    monkeypatch.setattr(sharedmem, "RETIRED_MAX_BYTES", len(BIG) + len(BIG) // 2)
    older, newer = share(folder, BIG), share(folder, OTHER)
    folder.retire_soon([older])
    wait_for(lambda: listing(folder) == {RETIRED + older, newer}, what="the first retired")
    folder.retire_soon([newer])  # two files' bytes are over the cap: the older one goes
    wait_for(lambda: listing(folder) == {RETIRED + newer}, what="the oldest removed")
