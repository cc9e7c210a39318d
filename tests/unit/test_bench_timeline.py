"""bench.timeline and bench.trace: message events recorded by a hook gpumesh does not know of,
turned into a call's stages."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.params import positive_int as _positive
from bench.timeline import (
    TRACEHOOK,
    Event,
    broker_cycle,
    missing_roles,
    read_events,
    split_calls,
    stages,
    table,
    wakeup_cost,
    zmq_round_trip,
)
from bench.trace import EVENTS, SWITCH, command_name

REPO = Path(__file__).resolve().parents[2]


def ev(at_ns: int, pid: int, role: str, thread: str, cpu_ns: int, what: str,
       tid: int | None = None) -> Event:
    return Event(at_ns, pid, role, thread, pid * 100 if tid is None else tid, cpu_ns, what)


def _call(start: int, agent_pid: int, wake_cpu: int) -> list[Event]:
    """One call: the client sends, an agent (one of two, told apart only by pid) receives and
    replies, the client is done. Times in ns from ``start``; CPU clocks per thread."""
    return [ev(start, 1, "client", "MainThread", 0, "call", tid=1),
            ev(start + 100_000, 1, "client", "io", 5_000_000, "send SUBMIT", tid=2),
            ev(start + 300_000, agent_pid, "agent", "MainThread", wake_cpu, "recv TASK"),
            ev(start + 350_000, agent_pid, "agent", "MainThread", wake_cpu + 40_000,
               "send RESULT"),
            ev(start + 600_000, 1, "client", "io", 5_200_000, "recv RESULT", tid=2),
            ev(start + 650_000, 1, "client", "MainThread", 30_000, "done", tid=1)]


def test_the_stages_list_the_time_each_thread_spent_on_them() -> None:
    calls = [_call(i * 10_000_000, 10 + i % 2, 1_000_000 * i) for i in range(5)]
    rows = {row.label: row for row in stages(calls)}
    assert [row.label for row in stages(calls)] == [
        "client MainThread: call", "client io: send SUBMIT", "agent MainThread: recv TASK",
        "agent MainThread: send RESULT", "client io: recv RESULT", "client MainThread: done"]
    assert rows["agent MainThread: recv TASK"].at_us == 300
    # A thread's first event of a call has nothing before it in the call...
    assert rows["agent MainThread: recv TASK"].wall_us is None
    # ...and the next is measured from it, in the same process (the two agents alternate).
    assert rows["agent MainThread: send RESULT"].wall_us == 50
    assert rows["agent MainThread: send RESULT"].cpu_us == 40
    assert rows["client io: recv RESULT"].wall_us == 500
    assert rows["client io: recv RESULT"].cpu_us == 200
    assert "| 300 | agent MainThread: recv TASK |  |  | 100% |" in table(stages(calls), 5)


def test_two_threads_of_one_name_are_measured_apart() -> None:
    calls = []
    for i in range(3):
        call = _call(i * 10_000_000, 10, 0)
        # Another thread named "io" in the client, with a CPU clock of its own.
        call.insert(3, ev(call[2].at_ns + 1, 1, "client", "io", 900_000_000, "send PING", tid=3))
        calls.append(call)
    rows = {row.label: row for row in stages(calls)}
    assert rows["client io: recv RESULT"].cpu_us == 200
    assert rows["client io: send PING"].cpu_us is None


def test_a_stage_few_calls_have_is_left_out_and_repeats_are_counted_apart() -> None:
    calls = [_call(i * 10_000_000, 10, 0) for i in range(4)]
    calls[0].insert(3, ev(calls[0][2].at_ns + 1, 10, "agent", "MainThread", 0, "recv PING"))
    for call in calls[:3]:
        call.insert(-1, ev(call[-1].at_ns - 1, 1, "client", "io", 5_300_000, "recv RESULT",
                           tid=2))
    rows = {row.label: row for row in stages(calls)}
    assert "agent MainThread: recv PING" not in rows
    assert rows["client io: recv RESULT (#2)"].calls == 3


def test_a_wake_is_named_by_what_its_thread_did_next() -> None:
    calls = []
    for i in range(3):
        call = _call(i * 10_000_000, 10, 0)
        call.insert(2, ev(call[2].at_ns - 50_000, 10, "agent", "MainThread", 0, "wake"))
        call.insert(5, ev(call[5].at_ns - 1, 1, "client", "io", 5_100_000, "wake", tid=2))
        calls.append(call)
    labels = [row.label for row in stages(calls)]
    assert "agent MainThread: wake, then recv TASK" in labels
    assert "client io: wake, then recv RESULT" in labels
    assert not any(label.endswith(": wake") for label in labels)


def test_a_process_that_recorded_nothing_is_named_so_the_run_can_fail() -> None:
    calls = [_call(0, 10, 0)]
    assert missing_roles(calls) == ["coordinator", "runner"]
    calls[0].insert(1, ev(1, 5, "coordinator", "loop", 0, "recv SUBMIT"))
    calls[0].insert(1, ev(2, 6, "runner", "MainThread", 0, "pipe-recv"))
    assert missing_roles(calls) == []
    assert missing_roles([]) == ["mesh"]


def test_calls_must_be_at_least_one() -> None:
    assert _positive("3") == 3
    with pytest.raises(argparse.ArgumentTypeError):
        _positive("0")


def test_events_are_read_in_time_order_and_split_into_calls(tmp_path: Path) -> None:
    events = tmp_path / EVENTS
    events.write_text("300 7 70 MainThread 9 done -\n"
                      "100 7 70 MainThread 5 call -\n"
                      "200 8 80 loop 1 send TASK\n"
                      "50 8 80 loop 1 recv HEARTBEAT\n")
    read = read_events(events, {7: "client"})
    assert [(e.role, e.tid, e.what) for e in read] == [
        ("8", 80, "recv HEARTBEAT"), ("client", 70, "call"), ("8", 80, "send TASK"),
        ("client", 70, "done")]
    assert [[e.what for e in call] for call in split_calls(read)] == [
        ["call", "send TASK", "done"]]


def test_a_command_is_named_from_its_frames_and_anything_else_is_a_question_mark() -> None:
    from gpumesh.protocol.messages import SIGNATURE, Command, encode

    heartbeat = encode(Command.HEARTBEAT, {})
    assert command_name(heartbeat) == "HEARTBEAT"
    assert command_name([b"worker-7", *heartbeat]) == "HEARTBEAT"
    batch = encode(Command.BATCH, {"m": [[Command.TASK, {}, []], [Command.RESULT_ACK, {}, []]]})
    assert command_name([b"worker-7", *batch]) == "BATCH[TASK,RESULT_ACK]"
    # In gpumesh's send path: what it cannot name must not raise there.
    assert command_name([b"not a message"]) == "?"
    assert command_name([SIGNATURE, b"\xfe", b"\x80"]) == "?"
    assert command_name(encode(Command.BATCH, {"m": [[254, {}, []]]})) == "BATCH[?]"
    assert command_name(encode(Command.BATCH, {})) == "BATCH[?]"


def test_the_hook_records_what_the_coordinator_module_sends_and_nothing_when_off(
        tmp_path: Path) -> None:
    """The coordinator binds ``send_frames`` by name at import: the hook must wrap it before."""
    script = (
        "import zmq\n"
        "from bench.trace import install\n"
        f"install({str(tmp_path)!r})\n"
        "from gpumesh.coordinator import server\n"
        "from gpumesh.protocol.messages import Command, encode\n"
        "a, b = zmq.Context.instance().socket(zmq.PAIR), zmq.Context.instance().socket(zmq.PAIR)\n"
        "a.bind('inproc://t'); b.connect('inproc://t')\n"
        "frames = encode(Command.HEARTBEAT, {})\n"
        "server.send_frames(a, frames)\n"  # off: not recorded
        f"open({str(tmp_path / SWITCH)!r}, 'w').close()\n"
        "server.send_frames(a, frames)\n"
        "assert server.send_frames.__wrapped__\n")
    subprocess.run([sys.executable, "-c", script], cwd=REPO, check=True, timeout=60,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = (tmp_path / EVENTS).read_text().splitlines()
    assert len(lines) == 1
    _at, pid, tid, thread, _cpu, event, command = lines[0].split(" ")
    assert (thread, event, command) == ("MainThread", "send", "HEARTBEAT")
    assert int(pid) > 0 and int(tid) > 0
    assert (tmp_path / EVENTS).stat().st_mode & 0o777 == 0o600


def test_the_hook_passes_on_every_argument_each_wrapped_function_takes(tmp_path: Path) -> None:
    """A wrapped function that grows a parameter (the runner pipe's ``stall``) must not make
    the traced processes fail: ``bench.timeline``'s workers once died of that on joining."""
    import importlib
    import inspect

    from bench.trace import _WRAPPED, Recorder, _recording

    recorder = Recorder(str(tmp_path))  # no switch file: off, so nothing reads the outcome
    for module_name, names in _WRAPPED.items():
        module = importlib.import_module(module_name)
        for name in names:
            original = getattr(module, name)
            original = getattr(original, "__wrapped__", original)
            positional, keywords = [], {}
            for parameter in inspect.signature(original).parameters.values():
                if parameter.default is inspect.Parameter.empty:
                    positional.append(object())
                else:
                    keywords[parameter.name] = object()
            seen: list[tuple[tuple[object, ...], dict[str, object]]] = []

            def fake(*args: object, **kwargs: object) -> None:
                seen.append((args, kwargs))  # noqa: B023 - called at once, within the loop

            _recording(name, fake, recorder)(*positional, **keywords)
            assert seen == [(tuple(positional), keywords)], f"{module_name}.{name}"


def test_a_process_started_as_the_mesh_starts_them_loads_the_hook(tmp_path: Path) -> None:
    """Children get it from sitecustomize on PYTHONPATH, whose failures Python only prints."""
    script = ("import zmq\n"
              "from gpumesh import transport\n"
              "assert transport.send_frames.__wrapped__\n"
              "assert zmq.Poller.poll.__wrapped__\n")
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True, timeout=60,
                   env={**os.environ, "GPUMESH_BENCH_TRACE": str(tmp_path),
                        "PYTHONPATH": os.pathsep.join([str(TRACEHOOK), str(REPO)])})


def test_the_references_a_call_is_read_against_are_timed() -> None:
    round_trip_us, side_cpu_us = wakeup_cost(rounds=50)
    assert round_trip_us > 0 and side_cpu_us > 0
    assert zmq_round_trip(rounds=50) > 0
    # The coordinator's work for a call, run through the broker itself: a change to its
    # messages or its API that the bench no longer follows fails here, not in a bench run.
    assert broker_cycle(0.0, cycles=30) > 0
