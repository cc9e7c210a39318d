"""Whether the slow calls are the machine's or gpumesh's: every core idle while a call waits.

    python -m bench.stalls [--calls 2000] [--rounds 2] [--out DIR]

Single calls of a no-op run one after another on the floor (bench/systems/floor.py) and on
the bench's gpumesh mesh, in turns, while ``perf`` records every context switch on every core.
A window in which every core sat idle in the middle of a call loop is time nobody spent: a
message was on its way and the thread it was for had not run yet. On a VM that is mostly a
wake-up sent to a halted vCPU, waiting for the hypervisor to run it again. Both systems meet
those windows; the table says how many a second each met, and how many of each system's calls
were slow at all, so a p99 can be read as the machine's or the code's.

Needs ``perf`` with the scheduler tracepoints (root, or ``kernel.perf_event_paranoid`` at -1);
it stops with a message saying so otherwise. Nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .params import Params, positive_int
from .procs import install_teardown
from .systems.base import System
from .systems.floor import FloorSystem
from .systems.gpumesh_system import GpumeshSystem
from .tasks import noop

WARM_CALLS = 300
PERF_SETTLE = 0.5  # s for perf to open its buffers on every core before the calls start
SLOW_MS = 2.0  # a call over this is slow
WINDOW_MS = (1.0, 2.0)  # idle windows counted from these lengths on
_SWITCH = re.compile(r"\[(?P<cpu>\d+)\]\s+(?P<at>\d+\.\d+):\s+sched:sched_switch:.*"
                     r"next_pid=(?P<next>\d+)")


@dataclass(frozen=True)
class Sitting:
    system: str
    calls: int
    seconds: float
    p50_ms: float
    p99_ms: float
    slow_calls: int  # over SLOW_MS
    tail_calls: int  # the slowest 1% (at least one)
    tail_with_window: int  # of those, how many an idle window over WINDOW_MS[0] overlapped
    idle_windows: dict[str, int]  # "over 1 ms" -> count
    idle_ms: float  # all the windows over the first WINDOW_MS length, together


def idle_windows(lines: Iterable[str], start: float, end: float) -> list[tuple[float, float]]:
    """(when it began, seconds) of each window in which every core that switched was idle
    (switched to pid 0), for the windows that began between ``start`` and ``end``
    (CLOCK_MONOTONIC seconds), from
    ``perf script -F cpu,time,event,trace`` lines of sched_switch events. A core counts once
    it has switched at least once; a core not seen yet is taken as busy."""
    idle: dict[int, bool] = {}
    began: float | None = None
    windows = []
    for line in lines:
        match = _SWITCH.search(line)
        if match is None:
            continue
        cpu, at = int(match["cpu"]), float(match["at"])
        was_idle = bool(idle) and all(idle.values())
        idle[cpu] = match["next"] == "0"
        now_idle = all(idle.values())
        if now_idle and not was_idle:
            began = at
        elif was_idle and not now_idle and began is not None:
            if start <= began <= end:
                windows.append((began, at - began))
            began = None
    return windows


def sitting(system: str, calls: list[tuple[float, float]], seconds: float,
            windows: list[tuple[float, float]]) -> Sitting:
    """The figures of one system's calls, each (start, end) in CLOCK_MONOTONIC seconds."""
    durations = sorted(end - start for start, end in calls)
    tail = sorted(calls, key=lambda c: c[1] - c[0])[-max(1, len(calls) // 100):]
    long_windows = [(began, began + length) for began, length in windows
                    if length * 1e3 > WINDOW_MS[0]]
    return Sitting(
        system=system, calls=len(durations), seconds=seconds,
        p50_ms=statistics.median(durations) * 1e3,
        p99_ms=durations[min(len(durations) - 1, int(len(durations) * 0.99))] * 1e3,
        slow_calls=sum(1 for d in durations if d * 1e3 > SLOW_MS),
        tail_calls=len(tail),
        tail_with_window=sum(1 for start, end in tail
                             if any(w_start < end and start < w_end
                                    for w_start, w_end in long_windows)),
        idle_windows={f"over {ms:g} ms": sum(1 for _, length in windows if length * 1e3 > ms)
                      for ms in WINDOW_MS},
        idle_ms=sum(w_end - w_start for w_start, w_end in long_windows) * 1e3)


def table(sittings: list[Sitting]) -> str:
    heads = [f"idle windows over {ms:g} ms, a second" for ms in WINDOW_MS]
    lines = [f"| system | calls | p50 ms | p99 ms | calls over {SLOW_MS:g} ms | "
             + " | ".join(heads) + " | idle ms a second | slowest 1% with an idle window "
             f"over {WINDOW_MS[0]:g} ms |",
             "| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in heads)
             + " | ---: | ---: |"]
    for s in sittings:
        rates = [f"{count / s.seconds:.1f}" for count in s.idle_windows.values()]
        lines.append(f"| {s.system} | {s.calls:,} | {s.p50_ms:.3f} | {s.p99_ms:.3f} | "
                     f"{s.slow_calls:,} | " + " | ".join(rates)
                     + f" | {s.idle_ms / s.seconds:.1f} | "
                     f"{s.tail_with_window} of {s.tail_calls} |")
    return "\n".join(lines)


def progress(s: Sitting) -> str:
    windows = ", ".join(f"{count} {over}" for over, count in s.idle_windows.items())
    return (f"{s.system}: {s.calls:,} calls in {s.seconds:.1f} s, p50 {s.p50_ms:.3f} ms, "
            f"p99 {s.p99_ms:.3f} ms; idle windows: {windows}; slowest 1% with one: "
            f"{s.tail_with_window} of {s.tail_calls}")


def _recorded(system: str, call: Callable[[], Any], calls: int, folder: Path) -> Sitting:
    """Time ``calls`` calls while perf records context switches on every core."""
    for _ in range(WARM_CALLS):
        call()
    data = folder / f"{system}.data"
    perf = subprocess.Popen(
        ["perf", "record", "-q", "-a", "-k", "CLOCK_MONOTONIC", "-e", "sched:sched_switch",
         "-o", str(data)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        time.sleep(PERF_SETTLE)
        if perf.poll() is not None:
            raise SystemExit("bench.stalls: perf could not record the scheduler's switches: "
                             + _stderr(perf) + _PERF_HINT)
        timed = []
        start = time.monotonic()
        for _ in range(calls):
            began = time.monotonic()
            call()
            timed.append((began, time.monotonic()))
        end = time.monotonic()
    finally:
        if perf.poll() is None:
            perf.send_signal(signal.SIGINT)
        perf.wait()
    script = subprocess.run(["perf", "script", "-i", str(data), "-F", "cpu,time,event,trace"],
                            capture_output=True, text=True, check=False)
    if script.returncode != 0:
        raise SystemExit(f"bench.stalls: perf script failed: {script.stderr.strip()}")
    windows = idle_windows(script.stdout.splitlines(), start, end)
    return sitting(system, timed, end - start, windows)


_PERF_HINT = (" (run it as root, or set kernel.perf_event_paranoid to -1; install perf with "
              "the linux-tools package of your kernel)")


def _stderr(proc: subprocess.Popen[bytes]) -> str:
    assert proc.stderr is not None
    return proc.stderr.read().decode(errors="replace").strip() or f"exit {proc.returncode}"


def _round(system: System, calls: int, folder: Path) -> Sitting:
    """Start ``system``, time its single calls under perf, stop it."""
    try:
        system.start()
        system.wait_ready()
        return _recorded(system.key, lambda: system.call(noop, 1), calls, folder)
    finally:
        system.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--calls", type=positive_int, default=2000,
                        help="single calls per system per round (the floor runs 3x as many: "
                             "its calls are about 3x shorter, so both run a similar time)")
    parser.add_argument("--rounds", type=positive_int, default=2, help="floor then gpumesh, each")
    parser.add_argument("--out", type=Path, default=None,
                        help="also write stalls.md and stalls.json into DIR")
    args = parser.parse_args()
    if shutil.which("perf") is None:
        raise SystemExit("bench.stalls: needs perf" + _PERF_HINT)
    install_teardown()
    folder = Path(tempfile.mkdtemp(prefix="gpumesh-stalls-"))
    try:
        sittings = []
        for number in range(1, args.rounds + 1):
            for system, calls in ((FloorSystem(Params()), args.calls * 3),
                                  (GpumeshSystem(Params()), args.calls)):
                sittings.append(_round(system, calls, folder))
                print(f"[stalls] round {number}/{args.rounds}: {progress(sittings[-1])}",
                      flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report = (f"Single calls of a no-op, one after another ({os.cpu_count()} cores); an idle "
              "window is a time every core was idle during the calls (perf sched_switch).\n\n"
              + table(sittings))
    print("\n" + report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "stalls.md").write_text(report + "\n")
        (args.out / "stalls.json").write_text(
            json.dumps([asdict(s) for s in sittings], indent=2) + "\n")


if __name__ == "__main__":
    main()
