"""Where a single call's time goes, stage by stage, across gpumesh's processes.

    python -m bench.timeline [--calls 400] [--out DIR]

It starts a mesh as ``python -m bench`` does (``serve --no-self-worker``, 2 x ``join --slots
1``, a client in this process) with bench/trace.py loaded into every process, warms it up with
300 calls, times calls one after another untraced, then records each message sent and
received, by whom and with how much of that thread's CPU, over the same number of traced calls.
The table lists the calls' stages in order: when (µs since the call began), in which process
and thread, the wall and CPU time that thread spent since its previous event of the call (for
its first event: nothing), and the share of calls that had it. Each figure is a median of its
own, over the calls with that stage: a row's times need not add up to the next row's. py-spy
cannot tell these apart: it charges a thread's wake-up to the poll it woke in.

A ``wake`` is a loop's ``zmq.Poller.poll`` returning with a socket ready, named by what its
thread did next, so each ZeroMQ hop splits into the way there (a send to the other side's wake:
both sides' ZeroMQ I/O threads, CURVE, the kernel) and what the woken thread does before its
``recv`` event is recorded.

Beside it go three references measured in the same sitting: what a wake-up costs on this
machine (two processes passing a byte back and forth through pipes, each sleeping in
``select`` until it comes; the floor's single call is twelve such wake-ups, four ZeroMQ hops of
three threads each), a bare pyzmq round trip over CURVE (two hops with nothing else on them),
and the coordinator's own work for a call back to back, after a sleep and spinning
(``broker_cycle``)."""

from __future__ import annotations

import argparse
import os
import select
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .params import positive_int
from .trace import EVENTS, SWITCH, install

TRACEHOOK = Path(__file__).resolve().parent / "tracehook"
WARM_CALLS = 300
SHOWN_IN = 0.5  # a stage is shown when at least this share of the calls has it
GAP = 0.002  # s between calls for broker_cycle's sleeping figure: about a single call's time


@dataclass(frozen=True)
class Event:
    at_ns: int
    pid: int
    role: str
    thread: str  # its name, as shown
    tid: int  # its id: two threads of a process may share a name
    cpu_ns: int
    what: str


@dataclass(frozen=True)
class Stage:
    label: str  # "process thread: event command"
    at_us: float  # median, since the call began
    wall_us: float | None  # median, since that thread's previous event of the call
    cpu_us: float | None
    calls: int  # how many calls had it


def read_events(path: Path, roles: Mapping[int, str]) -> list[Event]:
    """The recorded lines in time order, each process named by its role (pids not in
    ``roles`` keep their number)."""
    events = []
    for line in path.read_text().splitlines():
        at, pid, tid, thread, cpu, event, command = line.split(" ")
        what = event if command == "-" else f"{event} {command}"
        events.append(Event(int(at), int(pid), roles.get(int(pid), pid), thread, int(tid),
                            int(cpu), what))
    events.sort(key=lambda e: e.at_ns)
    return events


def split_calls(events: Iterable[Event]) -> list[list[Event]]:
    """The events from each ``call`` mark to its ``done`` mark, marks included."""
    calls, current = [], None
    for event in events:
        if event.what == "call":
            current = [event]
        elif current is not None:
            current.append(event)
            if event.what == "done":
                calls.append(current)
                current = None
    return calls


def stages(calls: list[list[Event]]) -> list[Stage]:
    """The calls' stages in order: a stage is one event of one process and thread (the n-th of
    its kind in a call counted apart), shown if at least SHOWN_IN of the calls had it. Each
    figure is its own median over the calls that had the stage, so a row's times need not add
    up to the next row's."""
    at: dict[str, list[float]] = defaultdict(list)
    wall: dict[str, list[float]] = defaultdict(list)
    cpu: dict[str, list[float]] = defaultdict(list)
    for call in calls:
        start = call[0].at_ns
        seen: Counter[str] = Counter()
        previous: dict[tuple[int, int], Event] = {}  # by process: both agents are "agent"
        following = _next_of_thread(call)
        for index, event in enumerate(call):
            what = event.what
            if what == "wake" and index in following:  # named by what it woke for
                what = f"wake, then {call[following[index]].what}"
            label = f"{event.role} {event.thread}: {what}"
            seen[label] += 1
            if seen[label] > 1:
                label += f" (#{seen[label]})"
            at[label].append((event.at_ns - start) / 1000)
            before = previous.get((event.pid, event.tid))
            if before is not None:
                wall[label].append((event.at_ns - before.at_ns) / 1000)
                cpu[label].append((event.cpu_ns - before.cpu_ns) / 1000)
            previous[(event.pid, event.tid)] = event
    def median_if_usual(samples: list[float], times: list[float]) -> float | None:
        # A thread's first event of a call has no time since its previous one, except in the
        # odd call where a straggler of the call before came first: those are not its stage.
        return statistics.median(samples) if len(samples) >= SHOWN_IN * len(times) else None

    out = [Stage(label, statistics.median(times), median_if_usual(wall[label], times),
                 median_if_usual(cpu[label], times), len(times))
           for label, times in at.items() if len(times) >= SHOWN_IN * len(calls)]
    return sorted(out, key=lambda s: s.at_us)


def _next_of_thread(call: list[Event]) -> dict[int, int]:
    """For each event of the call, the index of the next event of the same process and
    thread, where there is one."""
    following: dict[int, int] = {}
    last: dict[tuple[int, int], int] = {}
    for index, event in enumerate(call):
        key = (event.pid, event.tid)
        if key in last:
            following[last[key]] = index
        last[key] = index
    return following


REFERENCE_TIMEOUT = 10.0  # s a reference's other process may take to answer before we give up


def _stop_child(pid: int, failed: bool) -> None:
    """Reap a reference's forked child; on a failure first kill it (it may wait forever)."""
    if failed:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def wakeup_cost(rounds: int = 5000) -> tuple[float, float]:
    """(µs a round trip, µs of this side's CPU per round trip) of two processes passing a byte
    through pipes, each sleeping in ``select`` until it comes: two wake-ups a round trip."""
    from_parent, to_child = os.pipe()
    from_child, to_parent = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:  # only its own ends open: a parent gone is an end of file, not a wait forever
            os.close(to_child)
            os.close(from_child)
            for _ in range(rounds):
                ready, _, _ = select.select([from_parent], [], [], REFERENCE_TIMEOUT)
                if not ready or os.read(from_parent, 1) != b"x":
                    break
                os.write(to_parent, b"x")
        finally:
            os._exit(0)
    os.close(from_parent)
    os.close(to_parent)
    failed = True
    try:
        started, cpu = time.perf_counter(), time.thread_time()
        for _ in range(rounds):
            os.write(to_child, b"x")
            # Asleep in select, as a loop is; bounded, so a child gone cannot hang the bench.
            ready, _, _ = select.select([from_child], [], [], REFERENCE_TIMEOUT)
            if not ready or os.read(from_child, 1) != b"x":
                raise RuntimeError("the pipe reference's other process stopped answering")
        wall, cpu = time.perf_counter() - started, time.thread_time() - cpu
        failed = False
    finally:
        os.close(to_child)
        os.close(from_child)
        _stop_child(pid, failed)
    return wall / rounds * 1e6, cpu / rounds * 1e6


def zmq_round_trip(rounds: int = 3000) -> float:
    """µs of a round trip (two hops) of a small message between a ROUTER in this process and a
    DEALER in a forked one, over CURVE on loopback TCP, each side sleeping in ``poll`` as
    gpumesh's loops do: what a hop of gpumesh's would cost with nothing else on it."""
    import zmq

    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.curve_server, router.curve_secretkey = True, server_secret
    port = router.bind_to_random_port("tcp://127.0.0.1")
    wait_ms = int(REFERENCE_TIMEOUT * 1000)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: echo until told to stop or left alone
        try:
            dealer = zmq.Context().socket(zmq.DEALER)
            dealer.curve_serverkey, dealer.curve_publickey = server_public, client_public
            dealer.curve_secretkey = client_secret
            dealer.connect(f"tcp://127.0.0.1:{port}")
            dealer.send(b"hello")
            while dealer.poll(wait_ms):
                frames = dealer.recv_multipart(copy=False)
                if len(frames) == 1:
                    break
                dealer.send_multipart(frames)
        finally:
            os._exit(0)
    failed = True
    try:
        if not router.poll(wait_ms):
            raise RuntimeError("the ZeroMQ reference's other process did not connect")
        identity, _ = router.recv_multipart()
        message = [identity, b"GM", b"\x04", b"x" * 40]
        times = []
        for _ in range(rounds):
            started = time.perf_counter()
            router.send_multipart(message)
            if not router.poll(wait_ms):
                raise RuntimeError("the ZeroMQ reference's other process stopped answering")
            router.recv_multipart(copy=False)
            times.append(time.perf_counter() - started)
        router.send_multipart([identity, b"stop"])
        failed = False
    finally:
        _stop_child(pid, failed)
        context.destroy(linger=0)
    return statistics.median(times[rounds // 10:]) * 1e6


def broker_cycle(gap_s: float, cycles: int = 1500, spin: bool = False) -> float:
    """µs of the coordinator's own work for one call, in this process, no sockets: a SUBMIT
    handled and dispatched, the worker's RESULT, the client's RESULT_ACK, the two commits of an
    on-disk journal. With ``gap_s`` this thread sleeps that long between calls, as a loop does
    between the messages of single calls one after another: on a VM the same code then runs
    at a fraction of its back-to-back speed (its caches are cold when the thread wakes).
    With ``spin`` it spins through the gap instead of sleeping: the same time passes, the CPU
    does not go idle."""
    from gpumesh.config import Limits, Timing
    from gpumesh.coordinator.broker import Broker
    from gpumesh.protocol import Command, decode, encode
    from gpumesh.store import Store

    limits = Limits()
    worker, client = b"worker", b"client"

    def message(command: Command, header: dict[str, object], payload: Sequence[bytes] = ()) -> Any:
        return decode(encode(command, header, payload), limits)

    with tempfile.TemporaryDirectory(prefix="gpumesh-timeline-") as folder:
        store = Store(os.path.join(folder, "journal.db"))
        broker = Broker(store, Timing(), limits, epoch=1, now=0.0)
        broker.handle(worker, message(Command.HELLO, {
            "role": "worker", "id": "w1", "slots": 1, "credit": 1, "proto": [1, 1],
            "info": {"python": f"{sys.version_info[0]}.{sys.version_info[1]}"}}), 0.0)
        broker.handle(client, message(Command.HELLO, {"role": "client", "id": "c1",
                                                      "proto": [1, 1]}), 0.0)
        times = []
        for seq in range(1, cycles + 1):
            now = float(seq)
            started = time.perf_counter()
            broker.handle(client, message(Command.SUBMIT, {"tasks": [
                {"seq": seq, "nf": 2, "kind": "fn"}]}, [b"f" * 300, b"a" * 60]), now)
            broker.dispatch(now)
            ((lease, task),) = broker.workers["w1"].leases.items()
            broker.handle(worker, message(Command.RESULT, {
                "task": task, "lease": lease, "status": "ok", "encoding": "pickle",
                "granted": seq + 1}, [b"r" * 40]), now)
            store.commit()
            broker.handle(client, message(Command.RESULT_ACK, {"tasks": [task]}), now)
            store.commit()
            broker.outbox = []
            times.append(time.perf_counter() - started)
            if gap_s and spin:
                until = time.perf_counter() + gap_s
                while time.perf_counter() < until:
                    pass
            elif gap_s:
                time.sleep(gap_s)
        store.close()
    return statistics.median(times[cycles // 10:]) * 1e6


def table(rows: list[Stage], calls: int) -> str:
    lines = ["| µs since the call began | process thread: event | wall µs since that thread's "
             "previous event | its CPU µs in that time | calls with it |",
             "| ---: | --- | ---: | ---: | ---: |"]
    for row in rows:
        wall = "" if row.wall_us is None else f"{row.wall_us:.0f}"
        cpu = "" if row.cpu_us is None else f"{row.cpu_us:.0f}"
        lines.append(f"| {row.at_us:.0f} | {row.label} | {wall} | {cpu} | "
                     f"{row.calls * 100 // calls}% |")
    return "\n".join(lines)


ROLES = ("client", "coordinator", "agent", "runner")


def missing_roles(calls: list[list[Event]]) -> list[str]:
    """The processes of a call that recorded nothing in any call: ``mesh`` for no call at all.
    A process whose hook did not load would leave its rows out of the table without a word."""
    if not calls:
        return ["mesh"]
    heard = {event.role for call in calls for event in call}
    return [role for role in ROLES if role not in heard]


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--calls", type=positive_int, default=400, help="calls timed, then traced")
    parser.add_argument("--out", type=Path, default=None,
                        help="also write the report to DIR/timeline.md")
    args = parser.parse_args()
    # The references first, before the hook wraps zmq.Poller.poll in this process.
    round_trip, side_cpu = wakeup_cost()
    zmq_hops = zmq_round_trip()
    folder = Path(tempfile.mkdtemp(prefix="gpumesh-timeline-"))
    try:
        report = _traced_run(folder, args.calls)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    # Its gpumesh imports come after install(): nothing here binds a wrapped name early.
    back_to_back, sleeping = broker_cycle(0.0), broker_cycle(GAP)
    spinning = broker_cycle(GAP, spin=True)
    report += "\n".join([
        "", "",
        f"This machine: a pipe round trip between two processes that sleep until the byte "
        f"comes takes {round_trip:.0f} µs and {side_cpu:.0f} µs of one side's CPU (two "
        "wake-ups). A small message's round trip between a ROUTER and a DEALER of two "
        f"processes over CURVE on loopback TCP, each waiting in poll: {zmq_hops:.0f} µs (two "
        "hops, each from a send to the other side's recv).",
        "",
        "The coordinator's own work for one call (bench.timeline.broker_cycle: SUBMIT, "
        "dispatch, RESULT, RESULT_ACK, two commits; no sockets) in this process: "
        f"{back_to_back:.0f} µs back to back, {sleeping:.0f} µs with a {GAP * 1000:.0f} ms "
        f"sleep between calls ({sleeping / back_to_back:.1f}x), {spinning:.0f} µs spinning "
        "through the same gap instead: what a thread does after it wakes costs that much more "
        "than a hot-loop profile says.",
    ])
    print(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "timeline.md").write_text(report + "\n")


def _traced_run(folder: Path, calls: int) -> str:
    """The mesh's calls, untraced then traced into ``folder``: the report's table and the
    lines above it."""
    # Before gpumesh is imported here, and into every process the mesh starts.
    recorder = install(str(folder))
    os.environ["GPUMESH_BENCH_TRACE"] = str(folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(TRACEHOOK), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    from .procs import descendants, install_teardown
    from .systems.gpumesh_system import CALL_TIMEOUT, Mesh, wait_for_workers
    from .tasks import noop

    install_teardown()
    mesh = Mesh.fresh()
    try:
        mesh.start_coordinator()
        for _ in range(2):  # runners get PYTHON* (so the hook loads) and what join passes them
            mesh.add_worker(join_args=("--pass-env", "GPUMESH_BENCH_TRACE"))
        mesh.wait_listening()
        with mesh.client() as client:
            try:
                wait_for_workers(client, 2)
            except TimeoutError as exc:
                raise TimeoutError(f"{exc}; the processes' log ends:\n{mesh.tail_log()}") from None
            for i in range(WARM_CALLS):
                client.submit(noop, i).result(timeout=CALL_TIMEOUT)
            untraced = []
            for i in range(calls):
                started = time.perf_counter()
                client.submit(noop, i).result(timeout=CALL_TIMEOUT)
                untraced.append((time.perf_counter() - started) * 1e6)
            roles = {mesh.coordinator.pid: "coordinator", os.getpid(): "client"}
            (folder / SWITCH).touch()
            try:
                for i in range(calls):
                    # Through the hook's own open file: a mark costs the call one write(2).
                    recorder.write("call", "-")
                    client.submit(noop, i).result(timeout=CALL_TIMEOUT)
                    recorder.write("done", "-")
            finally:
                (folder / SWITCH).unlink()
            for worker in mesh.workers:  # runners as they are now (a crashed one is replaced)
                roles[worker.pid] = "agent"
                roles.update({pid: "runner" for pid in descendants(worker.pid)})
    finally:
        mesh.stop()
    traced_calls = split_calls(read_events(folder / EVENTS, roles))
    missing = missing_roles(traced_calls)
    if missing:
        # A sitecustomize that fails to import is only a line on that process's stderr.
        raise SystemExit(f"bench.timeline: no events from the {', '.join(missing)}: its trace "
                         "hook did not load, or its process was not found")
    traced = statistics.median((c[-1].at_ns - c[0].at_ns) / 1000 for c in traced_calls)
    untraced_p50 = statistics.median(untraced)
    per_call = statistics.median(len(c) - 2 for c in traced_calls)  # less the two marks
    return "\n".join([
        f"{len(traced_calls)} single calls of a no-op, one after another (after "
        f"{WARM_CALLS} to warm up): median {traced:.0f} µs traced, {untraced_p50:.0f} µs "
        f"untraced (the p50 of {calls} calls just before). A call records {per_call:.0f} "
        f"events, so each costs the call about {(traced - untraced_p50) / per_call:.0f} µs; "
        "the CPU figures include each thread's own.",
        "", table(stages(traced_calls), len(traced_calls)),
    ])


if __name__ == "__main__":
    main()
