"""The measurements, the same for every system: cold start, tiny-task throughput (with CPU per
task by process), single-call round trips, a 64 MiB round trip, sleep efficiency, and a map of
mid-size (256 KiB) arrays."""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from .params import Params
from .procs import cpu_seconds
from .systems.base import System
from .tasks import echo, first_element, nap, noop

Result = dict[str, Any]


def run_system(system_type: type[System], params: Params, log: Callable[[str], None]) -> Result:
    """Every measurement of one system; a failing measurement is recorded, the rest still run."""
    result: Result = {"name": system_type.name, "key": system_type.key}
    reason = system_type.missing()
    if reason is not None:
        log(f"{system_type.name}: skipped ({reason})")
        return {**result, "status": "skipped", "reason": reason}
    system = system_type(params)
    errors: dict[str, str] = {}
    # What one system leaves in this process's environment must not reach the next one's
    # processes: Dask's LocalCluster sets MALLOC_TRIM_THRESHOLD_=65536 (and OMP_NUM_THREADS,
    # PYTHONHASHSEED, ...) in os.environ, and a coordinator started after it with glibc
    # trimming that eagerly spent 1.7x the CPU per task.
    environ = dict(os.environ)
    try:
        log(f"{system.name}: starting")
        result["cold_start_s"] = cold_start(system)
        system.wait_ready()
        system.map(noop, list(range(params.warmup_tasks)))  # runners, imports, caches warm
        # And the array type's own module in every worker (numpy takes 55-70 ms to import
        # here): without this the 64 MiB column's first call, all --quick times, measured a
        # fresh gpumesh runner importing numpy, which Ray's workers do as they start.
        system.map(first_element, [filled(64, i % 8) for i in range(params.warmup_tasks)])
        steps: list[tuple[str, Callable[[System, Params], Result]]] = [
            ("throughput", throughput), ("round trip", round_trips),
            ("64 MiB", big_round_trip), ("sleep", sleep_efficiency),
            # Last: what it leaves behind (files to free, objects to collect) must not land in
            # the CPU read around the calls of the earlier columns.
            ("mid-size map", mid_size_map)]
        for label, step in steps:
            gc.collect()
            try:
                result.update(step(system, params))
                log(f"{system.name}: {label} done")
            except Exception as exc:  # one broken measurement must not cost the others
                errors[label] = describe(exc)
                log(f"{system.name}: {label} FAILED: {errors[label]}")
    except Exception as exc:
        errors["start"] = describe(exc)
        log(f"{system.name}: FAILED to start: {errors['start']}")
        traceback.print_exc(file=sys.stderr)
        context = getattr(system, "failure_context", lambda: "")()
        if context:
            log(f"{system.name}: its processes said:\n{context}")
    finally:
        try:
            system.stop()
        except Exception as exc:
            log(f"{system.name}: stopping failed: {type(exc).__name__}: {exc}")
        if dict(os.environ) != environ:
            changed = sorted(k for k in {*environ, *os.environ} if environ.get(k) != os.environ.get(k))
            log(f"{system.name}: put back the environment it changed ({', '.join(changed)})")
            os.environ.clear()
            os.environ.update(environ)
    status = "ok" if not errors else ("failed" if "start" in errors else "partial")
    return {**result, "status": status, "errors": errors}


def describe(exc: BaseException) -> str:
    """One line for the table: the exception's type, and its message when it has one."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def cold_start(system: System) -> float:
    """Seconds from nothing running to the first result in hand."""
    started = time.perf_counter()
    system.start()
    system.call(noop, 0)
    return time.perf_counter() - started


def throughput(system: System, params: Params) -> Result:
    """N no-op tasks as one map, and the CPU every process of the system spent on them."""
    items = list(range(params.tiny_tasks))
    before = _cpu_by_pid(system.processes())
    started = time.perf_counter()
    results = system.map(noop, items)
    elapsed = time.perf_counter() - started
    after = _cpu_by_pid(system.processes())
    if results != items:
        raise RuntimeError("the map returned wrong results")
    split = _cpu_split(before, after)
    per_task = {role: seconds * 1e6 / len(items) for role, seconds in split.items()}
    total = sum(split.values())
    return {"tasks_per_s": len(items) / elapsed, "throughput_seconds": elapsed,
            "cpu_us_per_task": total * 1e6 / len(items), "cpu_split_us_per_task": per_task,
            "cpu_cores_busy": total / elapsed}


def _cpu_by_pid(roles: dict[int, str]) -> dict[int, tuple[str, float]]:
    found = {}
    for pid, role in roles.items():
        seconds = cpu_seconds(pid)
        if seconds is not None:
            found[pid] = (role, seconds)
    return found


def _cpu_split(before: dict[int, tuple[str, float]],
               after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per role between two snapshots; a process new in ``after`` counts whole."""
    split: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        spent = seconds - before.get(pid, (role, 0.0))[1]
        split[role] = split.get(role, 0.0) + max(spent, 0.0)
    return dict(sorted(split.items()))


def round_trips(system: System, params: Params) -> Result:
    """Sequential single calls: each waits for the previous result. The CPU every process
    spent on them, per call, says where a call's time goes: on a machine with few cores
    nearly all of it lies on the call's path."""
    latencies = []
    before = _cpu_by_pid(system.processes())
    for index in range(params.round_trips):
        started = time.perf_counter()
        system.call(noop, index)
        latencies.append((time.perf_counter() - started) * 1000)
    split = _cpu_split(before, _cpu_by_pid(system.processes()))
    centiles = statistics.quantiles(latencies, n=100, method="inclusive")
    calls = params.round_trips
    return {"p50_ms": statistics.median(latencies), "p99_ms": centiles[98],
            "latencies_ms": [round(v, 4) for v in latencies],
            "cpu_us_per_call": sum(split.values()) * 1e6 / calls,
            "cpu_split_us_per_call": {role: seconds * 1e6 / calls
                                      for role, seconds in split.items()}}


def filled(size: int, value: int) -> Any:
    """``size`` bytes of ``value``: a numpy array, or a bytearray without numpy (its slices are
    copies, objects of their own too)."""
    try:
        import numpy as np
    except ImportError:
        return bytearray([value]) * size
    return np.full(size, value, dtype=np.uint8)


def mid_size_map(system: System, params: Params) -> Result:
    """One map of ``mid_tasks`` tasks, each taking a ``mid_bytes`` array and returning its first
    element: data preprocessing's shape. Eight arrays' data, but each item is an object of its
    own (a view), so no system sends one array once for many items (a pickle's memo would: Dask
    pickles a whole map's arguments in one go)."""
    arrays = [filled(params.mid_bytes, value) for value in range(8)]
    system.map(first_element, [a[:] for a in arrays])  # untimed: the function and the first
    # frames of this size find their way
    items = [arrays[i % 8][:] for i in range(params.mid_tasks)]
    started = time.perf_counter()
    got = system.map(first_element, items)
    seconds = time.perf_counter() - started
    if got != [i % 8 for i in range(params.mid_tasks)]:
        raise RuntimeError("the mid-size map returned wrong results")
    return {"mid_tasks_per_s": params.mid_tasks / seconds, "mid_seconds": seconds}


def big_round_trip(system: System, params: Params) -> Result:
    """A task that receives ``big_bytes`` and returns them; MB/s counts both directions. Once as
    an array (``filled``: what GPU work moves), once as ``bytes`` (a file's contents, an encoded
    image), which every system here pickles apart from arrays."""
    result: Result = {}
    for key, payload in (("big", filled(params.big_bytes, 1)),
                         ("big_bytes", bytes([1]) * params.big_bytes)):
        timings = []
        for _ in range(params.big_repeats):
            started = time.perf_counter()
            back = system.call(echo, payload)
            timings.append(time.perf_counter() - started)
            if len(back) != params.big_bytes or type(back) is not type(payload):
                raise RuntimeError(f"the echo returned {len(back)} bytes as "
                                   f"{type(back).__name__}, not {params.big_bytes} as "
                                   f"{type(payload).__name__}")
            del back
        result[f"{key}_mb_s"] = 2 * params.big_bytes / min(timings) / 1e6
        result[f"{key}_seconds"] = timings
        del payload
    return result


def sleep_efficiency(system: System, params: Params) -> Result:
    """Sleeping tasks on all workers: ideal time over actual time (1.0 is perfect packing)."""
    started = time.perf_counter()
    system.map(nap, [params.sleep_seconds] * params.sleep_tasks)
    elapsed = time.perf_counter() - started
    return {"sleep_efficiency": params.ideal_sleep_seconds / elapsed, "sleep_seconds": elapsed}
