"""Where the per-task microseconds go: py-spy on gpumesh's processes during a ``.map`` of no-op
tasks, or during single calls one after another (coordinator, one worker agent, its runner, the
client).

    python -m bench.profile [--tasks 20000 | --calls 3000] [--top 8] [--out DIR]

Each sample is charged to the innermost gpumesh function on its stack (the library it was in
at the leaf is kept beside it), and turned into µs per task: samples / rate / tasks. py-spy
leaves out idle threads, so waiting in a poll costs nothing here; its own sampling runs
``--nonblocking`` and slows the processes only a little.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from .measure import filled
from .procs import REPO_ROOT, descendants, install_teardown
from .systems.gpumesh_system import Mesh, wait_for_workers
from .tasks import first_element, noop

RATE = 200
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")
LIBRARIES = [("zmq/", "pyzmq"), ("msgpack", "msgpack"), ("sqlite3", "sqlite3"),
             ("cloudpickle", "pickle"), ("pickle.py", "pickle"), ("concurrent/futures", "futures"),
             ("threading.py", "threading"), ("selectors.py", "selectors")]


def component(stack: str) -> tuple[str, str]:
    """("thread: innermost gpumesh function", library at the leaf) of one collapsed stack."""
    thread, *rest = stack.split(";")
    thread = thread.split(": ", 1)[-1]
    frames = [_FRAME.match(f) for f in rest]
    parsed = [(m["func"], m["file"]) for m in frames if m is not None]
    leaf_library = "python"
    if parsed:
        leaf_file = parsed[-1][1]
        leaf_library = next((name for key, name in LIBRARIES if key in leaf_file), "python")
    for func, file in reversed(parsed):
        if file.startswith("gpumesh/") or "/gpumesh/" in file:
            module = file.rsplit("gpumesh/", 1)[1].removesuffix(".py").replace("/", ".")
            return f"{thread}: {module}.{func}", leaf_library
    leaf = parsed[-1][0] if parsed else "?"
    return f"{thread}: {leaf} (outside gpumesh)", leaf_library


def summarize(raw: Path, runs: int, top: int = 8) -> list[tuple[str, float]]:
    """Top components of a py-spy raw (collapsed) file, in µs per task (or call) of ``runs``."""
    counts: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack:
            continue
        func, library = component(stack)
        counts[f"{func} [{library}]"] += int(samples)
    per_task = 1e6 / RATE / runs
    total = sum(counts.values()) * per_task
    return [("total (sampled, not idle)", total)] + [
        (name, n * per_task) for name, n in counts.most_common(top)]


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--tasks", type=int, default=20_000, help="the map's no-op tasks")
    mode.add_argument("--calls", type=int, default=0,
                      help="profile this many single calls, one after another, instead of a map")
    parser.add_argument("--payload", type=int, default=0, metavar="BYTES",
                        help="each task of the map takes an array of this many bytes and returns "
                             "its first element (the bench's mid-size map), instead of a no-op")
    parser.add_argument("--top", type=int, default=8, help="components shown per process")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args()
    if shutil.which("py-spy") is None:
        sys.exit("py-spy is not installed: pip install py-spy")
    install_teardown()
    args.out.mkdir(parents=True, exist_ok=True)
    mesh = Mesh.fresh()
    try:
        mesh.start_coordinator()
        for _ in range(2):
            mesh.add_worker()
        mesh.wait_listening()
        with mesh.client() as client:
            wait_for_workers(client, 2)
            function, items = noop, list(range(args.tasks))
            if args.payload:  # eight arrays' data, each item an object of its own (a view)
                arrays = [filled(args.payload, value) for value in range(8)]
                function, items = first_element, [arrays[i % 8][:] for i in range(args.tasks)]
            client.map(function, items[:500])
            agent = mesh.workers[0].pid
            targets = {"coordinator": mesh.coordinator.pid, "worker agent": agent,
                       "runner": descendants(agent)[0], "client": os.getpid()}
            spies = {role: subprocess.Popen(
                ["py-spy", "record", "--pid", str(pid), "--rate", str(RATE), "--nonblocking",
                 "--threads", "--format", "raw", "--output", str(args.out / f"profile-{role}.txt")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for role, pid in targets.items()}
            time.sleep(1.0)  # py-spy attaches
            started = time.perf_counter()
            if args.calls:
                for i in range(args.calls):
                    client.submit(noop, i).result(timeout=60)
            else:
                client.map(function, items, timeout=600)
            elapsed = time.perf_counter() - started
            for spy in spies.values():
                spy.send_signal(signal.SIGINT)
            for spy in spies.values():
                spy.wait(30)
    finally:
        mesh.stop()
    count, unit = (args.calls, "call") if args.calls else (args.tasks, "task")
    what = "single calls one after another" if args.calls else "tasks of a map"
    print(f"{count} {what} in {elapsed:.1f}s ({count / elapsed:.0f}/s, under py-spy)\n")
    for role in targets:
        print(f"### {role}\n\n| component [library at the leaf] | µs per {unit} |\n| --- | ---: |")
        for name, micros in summarize(args.out / f"profile-{role}.txt", count, args.top):
            print(f"| {name} | {micros:.0f} |")
        print()


if __name__ == "__main__":
    main()
