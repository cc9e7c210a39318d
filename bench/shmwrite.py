"""What writing one frame into the shared-memory folder costs its producer, by frame size and
by how many frames are in flight at once.

    python -m bench.shmwrite [--sizes 65536,262144,1048576,16777216] [--depths 1,8,128]
                             [--frames 400] [--rounds 5]

A producer (a client sending arguments, a runner returning results) writes each big frame into
a file of the coordinator's folder; the coordinator retires the file once its task is done with
it, and the producer may write a later frame into it again (gpumesh/shmpool.py), or into a
spare file made ahead (gpumesh/shmspares.py). Both pay only while frames are few in flight; with
many (a ``.map`` of big arguments) most writes go into new files. Here a coordinator in a
process of its own retires each frame once ``depth`` newer ones are written, as a mesh does
when that many tasks are in flight, and the table gives the producer's µs per frame (the median
of the rounds): the time ``SharedFolder.share`` takes, nothing else. ``--no-pool`` and
``--no-spares`` turn either off, to see what each is worth.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import multiprocessing
import os
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from .params import positive_int


def _numbers(text: str) -> list[int]:
    """Comma-separated positive integers."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: positive integers, comma-separated") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text}: positive integers, comma-separated")
    return values


def _coordinator(conn: Connection, parents_end: Connection, key: str) -> None:
    """The folder's coordinator: retires the names it is sent, as after a task's end, until it
    is sent None or the producer is gone; then it removes what is left and the folder."""
    from gpumesh.sharedmem import SharedFolder

    parents_end.close()  # so that the producer's end going reads as the end here
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C: the producer says when to stop
    # journal="": no journal names these frames, so a later coordinator may remove the folder
    # if this one is killed before it removes it itself.
    folder = SharedFolder.create(key, journal="")
    conn.send(None if folder is None else folder.offer())
    if folder is None:
        return
    try:
        while (names := conn.recv()) is not None:
            folder.retire_soon(names)
    except EOFError:
        pass
    finally:
        folder.settle()
        folder.remove(name for name in os.listdir(folder.path))  # the producer's last frames
        folder.close()
    with contextlib.suppress(OSError):
        conn.send("done")


@contextlib.contextmanager
def _switched_off(pool: bool, spares: bool) -> Iterator[None]:
    """The pool's and the spares' methods replaced by ones that do nothing, while inside."""
    from gpumesh import shmpool, shmspares

    replaced: list[tuple[type, str, Any]] = []
    if not pool:
        replaced += [(shmpool.Pool, "refill", lambda self, pieces, name: False),
                     (shmpool.Pool, "keep", lambda self, fd, name, size: os.close(fd))]
    if not spares:
        replaced += [(shmspares.Spares, "take", lambda self, size: None),
                     (shmspares.Spares, "want", lambda self, size: None)]
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in replaced]
    try:
        for owner, name, stand_in in replaced:
            setattr(owner, name, stand_in)
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def measure(size: int, depth: int, frames: int, rounds: int) -> list[float]:
    """The producer's µs per frame in each round: ``frames`` frames of ``size`` bytes, each
    retired by a coordinator process once ``depth`` newer ones are written."""
    from gpumesh.sharedmem import SharedFolder

    ours, theirs = multiprocessing.Pipe()
    coordinator = multiprocessing.get_context("fork").Process(
        target=_coordinator, args=(theirs, ours, f"shmwrite-{os.getpid()}-{size}-{depth}"))
    coordinator.start()
    theirs.close()
    in_flight: collections.deque[str] = collections.deque()
    folder = None
    try:
        offer = ours.recv()
        folder = SharedFolder.join(offer) if offer is not None else None
        if folder is None:
            raise RuntimeError("no shared-memory folder here (/dev/shm missing or not private)")
        frame = os.urandom(size)
        per_round = []
        for _ in range(rounds):
            spent = 0.0
            for _ in range(frames):
                started = time.perf_counter()
                _, refs = folder.share([frame])
                spent += time.perf_counter() - started
                if not refs:
                    raise RuntimeError(f"a {size}-byte frame did not go into the folder (full?)")
                in_flight.append(refs[0][1])
                if len(in_flight) >= depth:
                    ours.send([in_flight.popleft()])
            per_round.append(spent / frames * 1e6)
    finally:
        if folder is not None:
            folder.release()
        with contextlib.suppress(OSError, EOFError):
            ours.send(list(in_flight))
            ours.send(None)
            ours.recv()
        ours.close()
        coordinator.join(30)
        if coordinator.is_alive():
            coordinator.kill()
    return per_round


def room_for(size: int, depth: int) -> bool:
    """Whether /dev/shm has room for ``depth`` + 1 frames of ``size`` four times over (a
    container's is 64 MiB): the run must not fill it for everyone else."""
    try:
        info = os.statvfs("/dev/shm")
    except OSError:
        return False
    return info.f_bavail * info.f_frsize >= 4 * (depth + 1) * size


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| frame | in flight | producer µs per frame (median) | rounds |",
             "| ---: | ---: | ---: | --- |"]
    for row in rows:
        size = row["size"]
        shown = f"{size >> 20} MiB" if size >= 1 << 20 and size % (1 << 20) == 0 else \
            f"{size >> 10} KiB" if size % 1024 == 0 else f"{size} B"
        rounds = ", ".join(f"{v:.0f}" for v in row["rounds"])
        lines.append(f"| {shown} | {row['depth']} | {row['median']:.1f} | {rounds} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--sizes", type=_numbers, default=[65536, 262144, 1048576, 16777216],
                        help="frame sizes in bytes, comma-separated")
    parser.add_argument("--depths", type=_numbers, default=[1, 8, 128],
                        help="frames in flight, comma-separated")
    parser.add_argument("--frames", type=positive_int, default=400,
                        help="frames a round (a tenth of it for frames of 16 MiB or more)")
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--no-pool", action="store_true", help="never write a frame's file again")
    parser.add_argument("--no-spares", action="store_true", help="make no spare files ahead")
    args = parser.parse_args(argv)
    if not hasattr(os, "fork"):
        sys.exit("bench.shmwrite needs fork and a shared-memory folder (Linux)")
    rows = []
    with _switched_off(pool=not args.no_pool, spares=not args.no_spares):
        for size in args.sizes:
            for depth in args.depths:
                frames = max(1, args.frames // 10) if size >= 16 << 20 else args.frames
                if not room_for(size, depth):
                    print(f"[shmwrite] {size} bytes, {depth} in flight: skipped, too little "
                          "room in /dev/shm", file=sys.stderr)
                    continue
                per_round = measure(size, depth, frames, args.rounds)
                rows.append({"size": size, "depth": depth, "rounds": per_round,
                             "median": statistics.median(per_round)})
                print(f"[shmwrite] {size} bytes, {depth} in flight: "
                      f"{rows[-1]['median']:.1f} µs a frame", file=sys.stderr)
    off = [what for what, flag in (("pool", args.no_pool), ("spares", args.no_spares)) if flag]
    print(f"Producer's cost of writing a frame{' (off: ' + ', '.join(off) + ')' if off else ''}:"
          f"\n\n{table(rows)}")


if __name__ == "__main__":
    main()
