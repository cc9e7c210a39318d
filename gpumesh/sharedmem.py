"""Big buffers between the processes of one machine, through files in a private shared-memory
folder instead of through the encrypted sockets.

The coordinator owns one folder per journal (``/dev/shm/gpumesh-UID-KEY``, mode 0700; the
temporary folder where there is no /dev/shm) and offers it in WELCOME with a proof: a random
value it wrote to ``probe`` there. A client or worker that reads the same value from that path
shares the coordinator's file system and user, so it may put big payload frames there and send
only their names; it says so by echoing the value (HEARTBEAT ``shm``). A peer on another machine
cannot read the probe and keeps sending bytes; the coordinator turns names back into bytes for
it. File permissions are the authentication here: only this user (and root) can open the folder,
the same people who can read the token in ``~/.gpumesh``.

A frame is written by its producer and mapped copy-on-write by its consumer, so a 64 MiB array
crosses from the client to the runner without passing through any socket, and stays writable
for the code that receives it (a frame under 1 MiB is read into the consumer's own memory
instead: as fast, and it holds no descriptor). A consumer holds a shared lock on a file while
it maps or reads it, and the producer writes a later frame of that size into the same file only
once the coordinator has retired it and nobody holds it any more (gpumesh/shmpool.py).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import hashlib
import hmac
import logging
import mmap
import os
import queue
import re
import secrets
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .fileio import read_into, replace_private, write_all
from .protocol.refs import NAME_PATTERN, Ref
from .shmowners import (
    ANONYMOUS,
    OWN_PREFIX,
    PREFIX_CHARS,
    alive,
    frame_name,
    is_name_start,
    is_owner_file,
    prefix_in,
)
from .shmpool import KEEP_MAX_BYTES, NONBLOCK, RETIRED, Pool, holds
from .shmspares import Spares

try:
    import fcntl
except ImportError:  # Windows: no folder is ever made (create), so no lock is ever taken
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("gpumesh.sharedmem")

# Frames this big or bigger go through the folder. Below it the socket is as fast; from it up
# the frame, sent over a socket, also costs the journal a file of its own (a task's input of
# blobs.BLOB_THRESHOLD, 64 KiB, or more in all), which made a .map of 64 KiB-1 MB arrays on the
# test machine 1.6-3.7 times slower than through the folder (bench/README.md, "Mid-size
# arguments").
MIN_SHARED_BYTES = 64 * 1024
# A frame under MIN_MAPPED_BYTES goes into the folder only while its file system keeps a quarter
# of its size (at most 1 GiB) free after it: /dev/shm is memory (64 MiB in a Docker container)
# that other programs use too (a PyTorch DataLoader, NCCL), and such a frame may as well go
# through the socket. A bigger frame may fill it, as before: some can go no other way (over one
# message's room).
MID_SIZE_FREE_SHARE = 0.25
MID_SIZE_FREE_MAX = 1 << 30
# A consumer maps a frame this big or bigger; a smaller one it reads into memory of its own (one
# copy of at most 1 MiB): CPython's mmap keeps a descriptor open per mapping, and a client holding
# thousands of mid-size results would run out of them.
MIN_MAPPED_BYTES = 1024 * 1024
# ... and at most this many at once in one process: past it, a frame is read into anonymous
# memory (one copy) instead. A client holding 2,000 results of 1 MiB, or a coordinator sending
# many to a peer that does not read them, ran out of descriptors (1,024 on many desktops) and
# called the next frame "gone". Anonymous memory holds no descriptor.
MAX_MAPPED = 256
# Errors of opening or mapping a frame that is there: the process is short of descriptors or
# memory for now. Never reported as the frame being gone (SharedFrameBusy). (EINTR never
# reaches here: Python retries the call.)
_SHORT_OF = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN})
PROBE = "probe"
JOURNAL = "journal"  # the path of the journal that names the folder's frames
_NAME = NAME_PATTERN
# A frame nothing refers to whose producer is gone (gpumesh/shmowners.py) is removed once it is
# this old: a SUBMIT its producer sent just before it died may still be on its way.
ORPHAN_GRACE = 60.0
# A writer looks for its own lock file at most this often (two system calls, on every frame
# otherwise), and makes it again in a folder made again in its place.
OWNER_RECHECK_SECONDS = 1.0
# One whose producer is unknown (an older gpumesh's) only after a restart, once this old: a
# client may have written it a moment ago and be about to send the SUBMIT that names it.
ORPHAN_AGE = 600.0
LOCK_TAKE_SECONDS = 2.0  # a coordinator waits this long for its folder's lock at start
# A retired file its producer has not claimed back in this long is removed, and the oldest go
# first beyond RETIRED_MAX_BYTES: a file is retired while anyone maps it, and a reader (a
# caller keeping a result) may hold one its producer let go of.
RETIRE_SECONDS = 10.0
RETIRED_MAX_BYTES = 1024**3
# How long a reader waits for a file's producer to finish writing it: only a reader that opened
# a name since retired can meet the writer's exclusive lock, and it is then told the frame is gone.
LOCK_WAIT_SECONDS = 0.5


def _base() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


class SharedFrameBusy(OSError):
    """A shared frame that is there cannot be opened, mapped or read now: this process is short
    of descriptors or memory. Try again later; the frame is not lost."""


# The mappings ``SharedFolder.open`` made that are alive, all folders together: a weak set, so
# a mapping leaves it when its last user lets go, in whatever thread (no count to drift).
_MAPPINGS: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()


def mapped() -> int:
    """How many frames this process holds mapped (MAX_MAPPED at most)."""
    return len(_MAPPINGS)


class SharedFolder:
    """One private folder of shared frames. Every method checks names: a peer's reference can
    only ever name a file inside this folder."""

    def __init__(self, path: Path, proof: str, lock: int | None = None) -> None:
        self.path = path
        self.proof = proof
        self._lock = lock  # the coordinator's: held while it runs (see _sweep_abandoned)
        self._remover: _Remover | None = None
        self._spares: Spares | None = None  # made at the first frame this process writes
        self._pool: Pool | None = None  # the files this process wrote, to write again
        self._released = False
        # Whose the frames this object writes are (gpumesh/shmowners.py): OWN_PREFIX, this
        # process's; a prefix, another process's (a runner's results are its agent's); or
        # ANONYMOUS, nobody's (named at random: the coordinator's own, which its journal names).
        self.owner: str = OWN_PREFIX
        # This process's prefix here, once its lock file is made: (the pid that made it, a
        # forked child's frames being its own; the prefix; when its lock file was last seen).
        # Asked on every frame written, it looks for the lock file again only after
        # OWNER_RECHECK_SECONDS: the folder may have been removed and made again by a restarted
        # coordinator before the new WELCOME is handled.
        self._own_prefix: tuple[int, str, float] | None = None

    # ----------------------------------------------------------------- making and joining

    @classmethod
    def create(cls, key: str, journal: str | None = None) -> SharedFolder | None:
        """The coordinator's folder for journal ``key`` (kept across restarts, so journaled
        references stay good); None, with a log line, where it cannot be made private.
        ``journal`` is the journal's path ("" for one in memory; None: not said): once the
        coordinator is gone and that file too, nobody can need the folder's frames any more."""
        if not hasattr(os, "getuid"):
            return None  # Windows: no /dev/shm; the sockets carry everything
        path = _base() / f"gpumesh-{os.getuid()}-{key}"
        _sweep_abandoned(path)
        lock = None
        try:
            path.mkdir(mode=0o700, exist_ok=True)
            info = os.lstat(path)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                log.warning("not sharing memory: %s is not a folder of this user", path)
                return None
            if stat.S_IMODE(info.st_mode) & 0o077:
                os.chmod(path, 0o700)
            lock = _lock_folder(path)
            _remove_retired(path)  # a crashed coordinator's: its producers claim nothing now
            proof = _new_probe(path)
            if journal is not None:
                _note_journal(path, journal)
        except OSError as exc:
            log.warning("not sharing memory: cannot use %s (%s)", path, exc.strerror)
            if lock is not None:
                os.close(lock)
            return None
        made = cls(path, proof, lock)
        # What the coordinator writes here (a remote client's input, for a worker of this
        # machine) its tasks name until they end, and a restarted coordinator removes once 10
        # minutes old if none does: no owner, whose death would make them go a minute on.
        made.owner = ANONYMOUS
        return made

    def close(self) -> None:
        """The coordinator stops: the folder goes when no frame is left in it (journaled
        references keep it, and its files, for the next start)."""
        self.settle()
        self.release()
        try:
            _remove_if_empty(self.path)
        finally:
            if self._lock is not None:
                os.close(self._lock)
                self._lock = None

    def offer(self) -> dict[str, str]:
        """What WELCOME carries: where the folder is, and the proof's hash (never the proof: a
        peer must read it from the folder itself)."""
        return {"path": str(self.path), "check": _hash(self.proof)}

    @classmethod
    def join(cls, offer: Any) -> SharedFolder | None:
        """A client's or worker's side: the folder, when this process can read the proof."""
        if not isinstance(offer, Mapping) or not hasattr(os, "getuid"):
            return None
        path, check = offer.get("path"), offer.get("check")
        if not (isinstance(path, str) and isinstance(check, str) and len(path) < 4096
                and "\0" not in path and os.path.isabs(path) and _hash_shape(check)):
            return None  # a NUL makes every os call raise ValueError, not OSError
        folder = Path(path)
        try:
            info = os.lstat(folder)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() \
                    or stat.S_IMODE(info.st_mode) & 0o077:
                return None
            fd = os.open(folder / PROBE, os.O_RDONLY | os.O_NOFOLLOW | NONBLOCK)
            with os.fdopen(fd) as src:
                proof = src.read(64)
        except (OSError, UnicodeDecodeError):
            return None
        if not hmac.compare_digest(_hash(proof), check):
            return None
        return cls(folder, proof)

    def verifies(self, proof: Any) -> bool:
        """Whether a peer's echoed proof is this folder's."""
        # compare_digest takes str of ASCII only: any other text raised TypeError.
        return isinstance(proof, str) and proof.isascii() and hmac.compare_digest(proof,
                                                                                   self.proof)

    # ----------------------------------------------------------------- frames

    def share(self, frames: Sequence[Any], start: int = 0) -> tuple[list[Any], list[Ref]]:
        """Frames to send, with the big ones from ``start`` on written here and left as empty
        placeholders, and the references to them. A frame that cannot be written (folder full)
        goes as it is."""
        out: list[Any] = list(frames[:start])
        refs: list[Ref] = []
        for index, frame in enumerate(frames[start:], start):
            if big_enough_to_share(frame):
                view = _view(frame)
                name = self.write([view])
                if name is not None:
                    out.append(b"")
                    refs.append((index, name, view.nbytes))
                    continue
            out.append(frame)  # a small pickle (the common case), or no room in the folder
        return out, refs

    def owner_prefix(self) -> str | None:
        """How the names of the frames written here begin: an owner's prefix, and a task's tag
        for a runner (gpumesh/shmowners.py); None where they are named at random."""
        if self.owner == OWN_PREFIX:
            pid, known, seen = self._own_prefix or (0, None, 0.0)
            now = time.monotonic()
            if pid != os.getpid() or now - seen > OWNER_RECHECK_SECONDS:
                # None yet, none could be made, a parent's, or not looked at for a while.
                known = prefix_in(self.path)
                self._own_prefix = None if known is None else (os.getpid(), known, now)
            return known
        return self.owner if is_name_start(self.owner) else None

    def write(self, frames: Sequence[Any]) -> str | None:
        """Write one frame, given as the buffers it arrived in (a frame split for the wire is
        written without joining it first), to a new file here; its name, or None when it
        cannot be written (the folder is full: send the bytes instead)."""
        pieces = [_view(frame) for frame in frames]
        size = sum(piece.nbytes for piece in pieces)
        name = frame_name(self.owner_prefix())
        target = self.path / name
        if self._spares is None and not self._released:
            self._spares = Spares(self.path)
            self._pool = Pool(self.path)
        pool = self._pool
        if pool is not None and pool.refill(pieces, name):
            return name  # into pages that exist and are mapped: a plain memory copy
        if size < MIN_MAPPED_BYTES and not self._room_for(size):
            return None
        spares = self._spares
        fd = spares.take(size) if spares is not None else None
        if fd is not None and spares is not None and not spares.name(fd, target):
            os.close(fd)  # named before a byte is written, or not used at all
            fd = None
        if fd is None:
            try:
                fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except OSError as exc:
                log.debug("cannot share a frame: %s", exc)
                return None
        try:
            write_all(fd, pieces)
        except OSError as exc:  # ENOSPC: /dev/shm is small in containers
            log.debug("cannot share a %d-byte frame: %s", size, exc)
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(target)
            return None
        if pool is not None:
            pool.keep(fd, name, size)  # to write again once nobody needs it
        else:
            os.close(fd)
        if spares is not None:
            spares.want(size)  # the next frame of this size goes into pages made meanwhile
        return name

    def _room_for(self, size: int) -> bool:
        """Whether a mid-size frame leaves the free space the others need (MID_SIZE_FREE_*)."""
        try:
            fs = os.statvfs(self.path)
        except OSError:
            return True  # no figure: the write says whether it fits
        keep = min(fs.f_blocks * fs.f_frsize * MID_SIZE_FREE_SHARE, MID_SIZE_FREE_MAX)
        return fs.f_bavail * fs.f_frsize - size >= keep

    def release(self) -> None:
        """This process is done with the folder: give back the spare file it holds, and make
        no more (a frame written after this goes into a new file)."""
        self._released = True
        if self._spares is not None:
            self._spares.close()
            self._spares = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def resolve(self, frames: Sequence[Any], refs: Iterable[Ref]) -> list[Any]:
        """``frames`` with each referenced placeholder replaced by its file, mapped copy-on-
        write (no copy until written) or, under MIN_MAPPED_BYTES, read. Raises ValueError for a
        bad or missing reference."""
        out = list(frames)
        for index, name, size in refs:
            if not 0 <= index < len(out):
                raise ValueError(f"a shared frame at index {index} of {len(out)}")
            out[index] = self.open(name, size)
        return out

    def missing(self, refs: Iterable[Ref]) -> str:
        """Why some referenced frame is not here as named (gone, or not its size); empty when
        every one is. A look, not a read: for a result as it arrives, while its worker may
        still be asked to run the task again."""
        for _, name, size in refs:
            if not _NAME.fullmatch(name):
                return f"{name!r} is not a shared frame's name"
            try:
                info = os.stat(self.path / name, follow_symlinks=False)
            except FileNotFoundError:
                return f"shared frame {name} is gone"
            except OSError:
                continue  # cannot tell now: its reader says, as before
            if not stat.S_ISREG(info.st_mode) or info.st_size != size:
                return f"shared frame {name} is not the {size} bytes it should be"
        return ""

    def open(self, name: str, size: int) -> Any:
        """The frame ``name`` of ``size`` bytes: mapped copy-on-write, or read into memory of
        its own under MIN_MAPPED_BYTES or past MAX_MAPPED mappings (a view of an anonymous
        ``mmap`` then, whose end a weak reference can tell). Raises ValueError when it is gone
        or not what it should be, SharedFrameBusy (an OSError) when this process is short of
        descriptors or memory for now."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a shared frame's name")
        path = self.path / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | NONBLOCK)
        except OSError as exc:
            if exc.errno in _SHORT_OF:
                raise SharedFrameBusy(exc.errno, f"shared frame {name} cannot be opened now "
                                                 f"({exc.strerror})") from None
            raise ValueError(f"shared frame {name} is gone ({exc.strerror}): was the machine "
                             "restarted, or the folder cleaned?") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != size:
                raise ValueError(f"shared frame {name} is not the {size} bytes it should be")
            if size == 0:
                return b""
            if fcntl is not None and not (_lock_shared(fd) and _still_named(path, info)):
                raise ValueError(f"shared frame {name} is gone: it was removed, or retired and "
                                 "written again, while this process opened it")
            copy: bytearray | mmap.mmap | None = None
            if size < MIN_MAPPED_BYTES:
                copy = bytearray(size)
            elif len(_MAPPINGS) >= MAX_MAPPED:
                # Private, as a copy-on-write mapping is: a forked child's writes stay its own.
                # No memory for a copy (a huge frame under a memory limit): mapped after all,
                # past the bound, rather than waiting for memory that may never come.
                with contextlib.suppress(OSError):
                    copy = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
            if copy is not None:
                # Read under the lock, which goes with the descriptor: the producer may write
                # into the file again at once.
                view = memoryview(copy)
                if read_into(fd, view) < size:
                    raise ValueError(f"shared frame {name} is shorter than its {size} bytes")
                return view
            # The lock lives as long as the mapping, which keeps a duplicate of this descriptor
            # (CPython's mmap does): the producer writes into the file only once it is let go.
            mapping = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
            _MAPPINGS.add(mapping)
            return memoryview(mapping)
        except OSError as exc:
            if exc.errno in _SHORT_OF:
                raise SharedFrameBusy(exc.errno, f"shared frame {name} cannot be mapped or read "
                                                 f"now ({exc.strerror})") from None
            raise
        finally:
            os.close(fd)

    def retire(self, name: str) -> int:
        """Retire the file ``name`` if someone holds it and a producer could keep it (it is no
        bigger than a producer keeps), else remove it; the bytes retired (0: removed)."""
        path = self.path / name
        try:
            size = os.stat(path, follow_symlinks=False).st_size
        except OSError:
            return 0
        if size <= KEEP_MAX_BYTES and holds(path):
            with contextlib.suppress(OSError):
                os.rename(path, self.path / (RETIRED + name))
                return max(size, 1)
        _unlink(path)
        return 0

    def remove_starting(self, starts: Iterable[str]) -> int:
        """Remove every frame whose name begins with one of ``starts``, each an owner's prefix
        and a task's tag (shmowners.tagged): what a runner wrote for tasks whose results will
        never be sent. Returns how many went."""
        if isinstance(starts, str):
            starts = [starts]  # one start, not its characters
        # Never a bare prefix: that would be all of an owner's frames.
        wanted = tuple(s for s in starts if len(s) > PREFIX_CHARS and is_name_start(s))
        if not wanted:
            return 0
        removed = 0
        with contextlib.suppress(OSError), os.scandir(self.path) as entries:
            for entry in entries:
                if entry.name.startswith(wanted) and _NAME.fullmatch(entry.name):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                        removed += 1
        return removed

    def remove(self, names: Iterable[str]) -> None:
        for name in names:
            if isinstance(name, str) and _NAME.fullmatch(name):
                with contextlib.suppress(OSError):
                    os.unlink(self.path / name)

    def retire_soon(self, names: Iterable[str]) -> None:
        """The coordinator is done with these frames' files. Each is removed, unless someone
        holds it and a producer could keep it (``retire``): then it is renamed RETIRED + name
        for its producer to claim, and removed RETIRE_SECONDS later (sooner past
        RETIRED_MAX_BYTES) if nobody did (gpumesh/shmpool.py). Off the loop's thread: freeing
        a file's pages is the kernel's slowest step here (about 8 ms for 64 MiB on the test
        machine), and the coordinator's loop, which decides when a file goes, should not wait."""
        names = list(names)
        if not names:
            return
        if self._remover is None:
            self._remover = _Remover(self)
        self._remover.put(names)

    def settle(self) -> None:
        """Wait until every removal asked of ``retire_soon`` is done, retired files included."""
        if self._remover is not None:
            self._remover.stop()
            self._remover = None

    def sweep(self, keep: Collection[str] | Callable[[], Collection[str]],
              now: float | None = None, unknown_after: float | None = ORPHAN_AGE) -> int:
        """Remove the frames nothing refers to whose producer is gone (gpumesh/shmowners.py)
        once they are ORPHAN_GRACE old, and those whose producer is unknown (an older
        gpumesh's) once ``unknown_after`` old; None: never, as while the coordinator runs, since
        such a frame may be a parked SUBMIT's. ``keep``: the names something refers to, or a
        function giving them, asked only when some frame may go. The lock files of producers
        that are gone go too once no frame bears their prefix. Returns the frames removed.
        ``now``: the wall clock (``time.time()``, the default), which files' times are on."""
        now = time.time() if now is None else now
        try:
            with os.scandir(self.path) as listing:
                entries = list(listing)
        except OSError:
            return 0
        producers: dict[str, bool | None] = {}

        def producer(prefix: str) -> bool | None:
            if prefix not in producers:
                producers[prefix] = alive(self.path, prefix)
            return producers[prefix]

        left: set[str] = set()  # the prefixes of the frames that stay
        maybe: list[os.DirEntry[str]] = []
        for entry in entries:
            if not _NAME.fullmatch(entry.name):
                continue
            prefix = entry.name[:PREFIX_CHARS]
            there = producer(prefix)
            limit = unknown_after if there is None else None if there else ORPHAN_GRACE
            if limit is not None and _age(entry, now) > limit:
                maybe.append(entry)
            else:
                left.add(prefix)
        removed = 0
        referenced = (keep() if callable(keep) else keep) if maybe else ()
        for entry in maybe:
            if entry.name in referenced:
                left.add(entry.name[:PREFIX_CHARS])
                continue
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                removed += 1
        for entry in entries:
            if not is_owner_file(entry.name):
                continue
            prefix = entry.name.rsplit("-", 1)[-1]
            if entry.name.startswith("."):  # never renamed: its maker died making it
                if _age(entry, now) > ORPHAN_GRACE and holds(Path(entry.path)) is False:
                    _unlink(Path(entry.path))
            elif prefix not in left and producer(prefix) is False:
                _unlink(Path(entry.path))
        return removed


def _age(entry: os.DirEntry[str], now: float) -> float:
    try:
        return now - entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return 0.0  # gone meanwhile, or unknown: never old enough to remove


class _Remover:
    """The thread behind ``retire_soon``: started at the first retirement, ended by ``stop``,
    which waits for those asked before it and removes every file still retired."""

    def __init__(self, folder: SharedFolder) -> None:
        self._names: queue.SimpleQueue[list[str] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(folder,),
                                        name="gpumesh-shm-remover", daemon=True)
        self._thread.start()

    def put(self, names: list[str]) -> None:
        self._names.put(names)

    def stop(self) -> None:
        self._names.put(None)
        self._thread.join()

    def _run(self, folder: SharedFolder) -> None:
        retired: collections.deque[tuple[float, str, int]] = collections.deque()  # until, name
        held = 0  # bytes retired and not yet removed (or claimed: those count until then)
        while True:
            wait = max(0.0, retired[0][0] - time.monotonic()) if retired else None
            try:
                names = self._names.get(timeout=wait)
            except queue.Empty:
                names = []
            if names is None:
                break
            for name in names:
                if isinstance(name, str) and _NAME.fullmatch(name):
                    size = folder.retire(name)
                    if size:
                        retired.append((time.monotonic() + RETIRE_SECONDS, RETIRED + name, size))
                        held += size
            while retired and (retired[0][0] <= time.monotonic() or held > RETIRED_MAX_BYTES):
                _, name, size = retired.popleft()
                _unlink(folder.path / name)
                held -= size
        for _, name, _ in retired:
            _unlink(folder.path / name)


_LOCK = ".lock"


def _note_journal(path: Path, journal: str) -> None:
    """Name the journal in the folder; one that names it already will do when the folder is
    full (ENOSPC), as after a restart on the same journal."""
    try:
        replace_private(path / JOURNAL, journal.encode())
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        try:
            kept = (path / JOURNAL).read_bytes()
        except OSError:
            raise exc from None
        if kept != journal.encode():
            raise


def _new_probe(path: Path) -> str:
    """Write this run's proof into the folder's probe (what a peer reads to show it can read
    the folder); with the folder full (ENOSPC: its frames may have filled /dev/shm), the proof
    the probe already holds, which is as secret: without the folder a restarted coordinator
    could not hand out the journaled tasks whose frames are in it."""
    proof = secrets.token_hex(16)
    probe = path / PROBE
    tmp = path / f".{PROBE}.{proof}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(proof)
        os.replace(tmp, probe)
    except OSError as exc:
        _unlink(tmp)
        if exc.errno != errno.ENOSPC:
            raise
        fd = os.open(probe, os.O_RDONLY | os.O_NOFOLLOW)  # raises if there is none
        with os.fdopen(fd) as kept:
            old = kept.read(64)
        if not re.fullmatch(r"[0-9a-f]{32}", old):
            raise
        log.warning("the shared-memory folder %s is full: keeping its proof of access", path)
        return old
    return proof


def _lock_folder(path: Path) -> int | None:
    """Lock the folder for as long as this coordinator runs: a folder whose lock nobody holds
    belongs to a coordinator that is gone (kill -9 skips close). Another coordinator's sweep
    takes the lock for a moment to see that (``_sweep_abandoned``): it is tried again for
    LOCK_TAKE_SECONDS before this run gives up sharing memory."""
    if fcntl is None:
        return None
    fd = os.open(path / _LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        if _flock_within(fd, fcntl.LOCK_EX, LOCK_TAKE_SECONDS, 0.02):
            return fd
        raise BlockingIOError(errno.EWOULDBLOCK, "another coordinator holds its lock")
    except OSError:
        os.close(fd)
        raise


def _flock_within(fd: int, kind: int, seconds: float, step: float) -> bool:
    """``flock(kind)`` on ``fd``, tried again every ``step`` while another holds it, for
    ``seconds``; False when it still does. Other failures raise."""
    assert fcntl is not None
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(step)


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _lock_shared(fd: int) -> bool:
    """A shared lock on ``fd``; False if a writer held it longer than LOCK_WAIT_SECONDS (a
    stopped process, say: a loop must not wait on it) or locks fail here."""
    try:
        return _flock_within(fd, fcntl.LOCK_SH, LOCK_WAIT_SECONDS, 0.001)
    except OSError:
        return False


def _still_named(path: Path, opened: os.stat_result) -> bool:
    """Whether ``path`` still names the file opened: a retired file reused meanwhile has
    another name, and bytes that are not this frame's."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino)


def _remove_retired(path: Path) -> None:
    """Retired files of a coordinator that is gone: nobody claims them from it any more."""
    with contextlib.suppress(OSError), os.scandir(path) as entries:
        for entry in entries:
            if entry.name.startswith(RETIRED):
                _unlink(Path(entry.path))


def _journal_gone(folder: Path) -> bool:
    """Whether the journal that named this (abandoned) folder's frames is gone: one in memory,
    or a file since removed (a temporary mesh's home). Unknown (an older gpumesh's folder,
    unreadable): not gone."""
    try:
        fd = os.open(folder / JOURNAL, os.O_RDONLY | os.O_NOFOLLOW | NONBLOCK)
        with os.fdopen(fd, "rb") as src:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            journal = src.read(8192).decode()
    except (OSError, UnicodeDecodeError):
        return False
    if not journal:
        return True
    # Gone only when the system says it does not exist: one behind a permission, or on a disk
    # that errs (EIO, ESTALE), is not gone (os.path.exists said so), and its coordinator's
    # frames must stay for when it runs again.
    try:
        os.stat(journal)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False
    return False


def _remove_frames(folder: Path) -> None:
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            if _NAME.fullmatch(entry.name):
                _unlink(Path(entry.path))


def _remove_if_empty(path: Path) -> bool:
    """Remove a folder that holds no frame (only its probe, lock, producers' lock files and
    retired files); False if it holds one. A producer still running makes a new lock file in a
    folder made again in its place (shmowners.prefix_in)."""
    with contextlib.suppress(OSError):
        with os.scandir(path) as listing:
            entries = list(listing)
        if any(_NAME.fullmatch(entry.name) for entry in entries):
            return False
        _remove_retired(path)
        for entry in entries:
            if is_owner_file(entry.name):
                _unlink(Path(entry.path))
        for name in (PROBE, JOURNAL, _LOCK):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path / name)
        path.rmdir()
    return True


def _sweep_abandoned(mine: Path) -> None:
    """Remove this user's folders of coordinators that are gone and left no frame behind: a
    coordinator killed with SIGKILL (tests do it all the time) never removes its own. A folder
    that still holds frames is kept: its journal may start again and need them."""
    if fcntl is None:
        return
    prefix = f"gpumesh-{os.getuid()}-"
    try:
        with os.scandir(mine.parent) as entries:
            others = [Path(e.path) for e in entries if e.name.startswith(prefix)
                      and e.path != str(mine) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for folder in others:
        try:
            if os.lstat(folder).st_uid != os.getuid():
                continue
            fd = os.open(folder / _LOCK, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # no lock file: an older gpumesh's, or one being made right now
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its coordinator is running
        try:
            if _journal_gone(folder):
                _remove_frames(folder)  # nothing can ever name them again: RAM back
            _remove_if_empty(folder)
        finally:
            os.close(fd)


@dataclasses.dataclass(frozen=True)
class FolderUsage:
    """One coordinator's folder as ``survey`` found it: its frames, their bytes, and the
    journal that names them ("" where unknown)."""

    path: Path
    frames: int
    nbytes: int
    journal: str


def survey() -> tuple[Path, list[FolderUsage]]:
    """Where this user's shared frames live, and each coordinator folder there with what its
    frames take, biggest first: read only, nothing opened but ``journal`` (gpumesh doctor)."""
    base = _base()
    found: list[FolderUsage] = []
    if not hasattr(os, "getuid"):
        return base, found
    prefix = f"gpumesh-{os.getuid()}-"
    try:
        with os.scandir(base) as entries:
            folders = [Path(e.path) for e in entries
                       if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return base, found
    for folder in folders:
        frames = nbytes = 0
        with contextlib.suppress(OSError), os.scandir(folder) as entries:
            for entry in entries:
                if _NAME.fullmatch(entry.name) or entry.name.startswith(RETIRED):
                    with contextlib.suppress(OSError):
                        nbytes += entry.stat(follow_symlinks=False).st_blocks * 512
                        frames += 1
        journal = ""
        with contextlib.suppress(OSError, UnicodeDecodeError):
            fd = os.open(folder / JOURNAL, os.O_RDONLY | os.O_NOFOLLOW | NONBLOCK)
            with os.fdopen(fd, "rb") as src:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    journal = src.read(4096).decode()
        found.append(FolderUsage(folder, frames, nbytes, journal))
    found.sort(key=lambda usage: -usage.nbytes)
    return base, found


def big_enough_to_share(frame: Any) -> bool:
    """Whether ``SharedFolder.share`` puts this frame in the folder (when there is room)."""
    if isinstance(frame, bytes):  # a small pickle, the common case: no view to make
        return len(frame) >= MIN_SHARED_BYTES
    return _view(frame).nbytes >= MIN_SHARED_BYTES


def materialize(frames: Sequence[Any], refs: Iterable[Ref], folder: SharedFolder | None) -> list[Any]:
    """Frames with their references read back in, for a peer that cannot open the folder."""
    refs = list(refs)
    if not refs:
        return list(frames)
    if folder is None:
        raise ValueError("the frames are in shared memory, and this side has no folder")
    return folder.resolve(frames, refs)


def _view(frame: Any) -> memoryview:
    buffer = getattr(frame, "buffer", None)  # a zmq.Frame
    return memoryview(buffer if buffer is not None else frame).cast("B")


def _hash(proof: str) -> str:
    return hashlib.blake2b(proof.encode(), digest_size=16, person=b"gpumesh-shm").hexdigest()


def _hash_shape(check: str) -> bool:
    return len(check) == 32 and all(c in "0123456789abcdef" for c in check)
