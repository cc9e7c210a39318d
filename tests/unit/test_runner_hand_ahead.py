"""A busy runner handed its next task ahead (gpumesh/worker/runners.py): what each task printed
stays its own, a dropped one never reports, and nothing is lost when the runner goes.

The stream tests feed a runner's pipes by hand; the agent tests run real runner processes
under an agent that is never connected (what it would send is captured).
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import cloudpickle
import msgpack
import pytest
from conftest import wait_for
from test_worker_agent import recording_agent

from gpumesh.config import Limits
from gpumesh.protocol import Command, encode, serialize
from gpumesh.runner.pipe import MARKER, send_message
from gpumesh.worker.runners import QueuedTask, Runner, RunningTask

# ----------------------------------------------------------------- output at the markers


@pytest.fixture
def piped_runner():
    """A Runner whose stdout/stderr are pipes this test writes to (no process)."""
    runner = Runner(0, {}, 1 << 20)
    ends = {}
    files = {}
    for stream in ("out", "err"):
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        files[stream] = os.fdopen(read_fd, "rb", buffering=0)
        ends[stream] = write_fd
    runner.proc = SimpleNamespace(stdout=files["out"], stderr=files["err"])
    runner.ready = True
    yield runner, ends
    for stream in ("out", "err"):
        os.close(ends[stream])
        files[stream].close()


def test_a_short_read_says_the_pipe_is_empty(piped_runner):
    # The agent reads a runner's pipes before each result until they are empty: a read that
    # came back short already emptied it, so no second (empty) read is needed.
    runner, ends = piped_runner
    os.write(ends["out"], b"a line\n")
    assert runner.read_stream("out") == [(None, b"a line\n")]
    assert runner.drained["out"]
    big = b"x" * 70000  # more than one read takes
    threading.Thread(target=os.write, args=(ends["out"], big)).start()
    deadline = time.monotonic() + 10
    got = b""
    while len(got) < len(big):
        assert time.monotonic() < deadline
        pieces = runner.read_stream("out")
        read = b"".join(chunk for _, chunk in pieces or ())
        got += read
        if pieces is not None:  # a full read may have left more; a short one did not
            assert runner.drained["out"] == (len(read) < 65536), len(read)
    assert got == big
    assert runner.read_stream("out") is None and runner.drained["out"]


def _task(name: str) -> RunningTask:
    return RunningTask(name, hash(name) & 0xFFFF, 0.0, None, {})


def _handed(runner: Runner, name: str) -> bytes:
    """Hand a task ahead without a socket; the marker its runner would write."""
    sent = []
    runner._write = lambda task, header, frames, **_: sent.append(header)  # type: ignore[method-assign]
    runner.hand_ahead(QueuedTask(_task(name), {"kind": "fn"}, []))
    return MARKER + sent[0]["pre"].encode() + b"\x00"


def _read(runner: Runner, stream: str = "out") -> list[tuple[str | None, bytes]]:
    pieces = runner.read_stream(stream) or []
    return [(owner.task_id if owner else None, chunk) for owner, chunk in pieces]


def test_output_after_the_marker_belongs_to_the_task_handed_ahead(piped_runner):
    runner, ends = piped_runner
    runner._write = lambda *args: None  # type: ignore[method-assign]
    runner.send(_task("A"), {}, [])
    marker = _handed(runner, "B")
    os.write(ends["out"], b"a's last line\n" + marker + b"b's first line\n")
    assert _read(runner) == [("A", b"a's last line\n"), ("B", b"b's first line\n")]
    # The result of A is read after B began: B runs on, and what it prints stays B's.
    assert runner.finished().task.task_id == "B" and runner.task.task_id == "B"
    os.write(ends["out"], b"b again\n")
    assert _read(runner) == [("B", b"b again\n")]
    assert [(task.task_id, line) for task, line in runner.tail] == [
        ("A", "a's last line"), ("B", "b's first line"), ("B", "b again")]  # no marker


def test_a_marker_cut_by_a_read_is_held_until_it_is_whole(piped_runner):
    runner, ends = piped_runner
    runner._write = lambda *args: None  # type: ignore[method-assign]
    runner.send(_task("A"), {}, [])
    marker = _handed(runner, "B")
    os.write(ends["out"], b"from a" + marker[:7])
    assert _read(runner) == [("A", b"from a")]
    os.write(ends["out"], marker[7:] + b"from b")
    assert _read(runner) == [("B", b"from b")]
    # A held end that turns out not to be a marker is passed on, to its task.
    assert runner.finished().task.task_id == "B"
    marker_c = _handed(runner, "C")
    os.write(ends["err"], b"b says " + marker_c[:5])
    assert _read(runner, "err") == [("A", b"b says ")]  # stderr has not seen B's marker yet
    os.write(ends["err"], b"!" + marker + b"more")
    assert _read(runner, "err") == [("A", marker_c[:5] + b"!"), ("B", b"more")]


def test_the_result_before_the_marker_keeps_the_old_task_until_it_comes(piped_runner):
    runner, ends = piped_runner
    runner._write = lambda *args: None  # type: ignore[method-assign]
    runner.send(_task("A"), {}, [])
    marker_b = _handed(runner, "B")
    runner.finished()  # A's result came first; B's marker is still on its way
    marker_c = _handed(runner, "C")  # and C is handed ahead behind B
    os.write(ends["out"], b"a late\n" + marker_b + b"b\n" + marker_c + b"c\n")
    assert _read(runner) == [("A", b"a late\n"), ("B", b"b\n"), ("C", b"c\n")]


def test_what_a_dropped_task_prints_goes_to_nobody(piped_runner):
    runner, ends = piped_runner
    runner._write = lambda *args: None  # type: ignore[method-assign]
    runner.send(_task("A"), {}, [])
    marker = _handed(runner, "B")
    assert [q.task.task_id for q in runner.drop_ahead()] == ["B"]
    assert runner.restart_after_task and not runner.takes_ahead
    os.write(ends["out"], b"a\n" + marker + b"b ran a little\n")
    assert _read(runner) == [("A", b"a\n"), (None, b"b ran a little\n")]
    assert runner.finished() is None and runner.task is None


# ----------------------------------------------------------------- real runners, one agent


# _alive reads /proc: without it (macOS) a test of what must end would pass unchecked.
NEEDS_PROC = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")


def _speak(i):
    import time as clock
    print(f"start {i}", flush=True)
    clock.sleep(0.02)
    print(f"end {i}", flush=True)
    return i


@pytest.fixture
def live_agent(tmp_path):
    gen = recording_agent(tmp_path)
    agent = next(gen)
    agent.session.welcomed = True
    runner = agent.runners[0]
    runner.start()
    _pump(agent, lambda: runner.ready, "the runner to start")
    agent._mean_run = 0.02  # tasks known to be short: hand-ahead is on
    yield agent
    for r in agent.runners:
        r.kill()
    next(gen, None)


def _pump(agent, until, what: str, timeout: float = 20.0) -> None:
    """The agent's loop, for its runners only, until ``until()``."""
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        owners = {fd: (runner, kind) for runner in agent.runners for fd, kind in runner.fds()}
        agent._flush_runners()
        ready, _, _ = select.select(list(owners), [], [], 0.1)
        now = time.time()
        for fd in ready:
            runner, kind = owners[fd]
            if kind == "control":
                agent._on_runner_message(runner, now)
            else:
                agent._on_runner_output(runner, kind)
        agent._check_runners(now)
        agent._start_queued(now)


def napping(seconds):
    """A task that sleeps ``seconds`` (its work) and returns its argument."""
    def nap(i):
        import time as clock
        clock.sleep(seconds)
        return i
    return nap


def waiting_for(path):
    """A task that returns its argument once ``path`` exists (the test's word), 20 s at most."""
    def wait(i):
        import os as system
        import time as clock
        deadline = clock.monotonic() + 20
        while not system.path.exists(str(path)) and clock.monotonic() < deadline:
            clock.sleep(0.01)
        return i
    return wait


def _give(agent, lease: int, fn=_speak, timeout: float | None = None) -> None:
    # This test module cannot be imported in the runner: its functions travel by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    frames = [*serialize.dumps(fn), *serialize.dumps(((lease,), {}))]
    header = {"task": f"task-{lease}", "lease": lease, "kind": "fn", "name": "speak"}
    if timeout is not None:
        header["timeout"] = timeout
    agent._on_task(_message(header, frames), time.time())
    agent._flush_runners()  # as the agent's turn does after the TASKs it read


def _message(header, frames):
    from gpumesh.protocol import decode
    return decode(encode(Command.TASK, header, frames), Limits())


def _results(agent) -> dict[str, str]:
    return {m.header["task"]: m.header["status"] for m in agent.sent if m.command is Command.RESULT}


def _output(agent) -> dict[str, bytes]:
    seen: dict[str, bytes] = {}
    for m in agent.sent:
        if m.command is Command.OUTPUT:
            seen[m.header["task"]] = seen.get(m.header["task"], b"") + bytes(m.payload[0])
    return seen


def test_each_task_handed_ahead_prints_as_itself_and_runs_in_turn(live_agent):
    agent, runner = live_agent, live_agent.runners[0]
    for lease in (1, 2, 3):
        _give(agent, lease)
    assert runner.task.task_id == "task-1" and runner.next.task.task_id == "task-2"
    assert [q.task.task_id for q in agent.queue] == ["task-3"]
    assert sorted(agent._held_leases()) == [1, 2, 3] and agent.free_slots() == 0
    _pump(agent, lambda: len(_results(agent)) == 3, "three results")
    assert _results(agent) == {f"task-{i}": "ok" for i in (1, 2, 3)}
    _pump(agent, lambda: all(b"end" in _output(agent).get(f"task-{i}", b"") for i in (1, 2, 3)),
          "their output")
    assert _output(agent) == {f"task-{i}": f"start {i}\nend {i}\n".encode() for i in (1, 2, 3)}
    assert runner.task is None and runner.next is None and not agent.queue


def test_a_cancelled_task_handed_ahead_reports_once_and_its_runner_starts_afresh(live_agent):
    agent, runner = live_agent, live_agent.runners[0]
    _give(agent, 1)
    _give(agent, 2)
    _give(agent, 3)
    first_pid = runner.proc.pid
    assert agent._cancel(2, time.time(), report=True)
    assert _results(agent) == {"task-2": "cancelled"}
    _pump(agent, lambda: len(_results(agent)) == 3, "the other two results")
    assert _results(agent) == {"task-1": "ok", "task-2": "cancelled", "task-3": "ok"}
    assert runner.proc.pid != first_pid  # task 2 could not be taken back: its runner went
    assert "task-2" not in _output(agent)


def test_a_task_handed_ahead_to_a_runner_that_dies_goes_back_to_the_queue(live_agent, tmp_path):
    agent, runner = live_agent, live_agent.runners[0]
    go = tmp_path / "go"
    wait = waiting_for(go)  # dies only once task 2 has been handed ahead

    def die(i):
        import os as system
        wait(i)
        system._exit(3)

    _give(agent, 1, fn=die)
    _give(agent, 2)
    assert runner.next.task.task_id == "task-2"
    go.touch()
    _pump(agent, lambda: len(_results(agent)) == 2, "both results")
    assert _results(agent) == {"task-1": "crashed", "task-2": "ok"}


def test_the_timeout_of_a_task_handed_ahead_counts_from_when_it_starts(live_agent):
    agent, runner = live_agent, live_agent.runners[0]

    nap = napping(0.5)

    _give(agent, 1, fn=nap)
    _give(agent, 2, fn=nap, timeout=0.8)  # waits ~0.5 s behind task 1: that does not count
    assert runner.next.task.deadline is None
    _pump(agent, lambda: len(_results(agent)) == 2, "both results")
    assert _results(agent) == {"task-1": "ok", "task-2": "ok"}


def test_pausing_hands_back_the_task_handed_ahead_and_it_never_reports(live_agent):
    agent, runner = live_agent, live_agent.runners[0]
    _give(agent, 1)
    _give(agent, 2)
    status = agent.owner.on_control("pause", time.time())
    assert status["handed_back"] == 1
    released = [m.header["release"] for m in agent.sent if m.command is Command.CREDIT]
    assert released == [[2]]
    _pump(agent, lambda: runner.ready and runner.task is None and "task-1" in _results(agent),
          "task 1 to finish and the runner to start again")
    assert _results(agent) == {"task-1": "ok"}
    assert "task-2" not in _output(agent)


def test_a_result_unread_when_the_task_handed_ahead_kills_its_runner_is_not_lost(live_agent):
    agent, runner = live_agent, live_agent.runners[0]

    def quick(i):
        return i

    def die(i):
        import os as system
        system._exit(3)

    _give(agent, 1, fn=quick)
    _give(agent, 2, fn=die)
    assert runner.next.task.task_id == "task-2"
    runner.proc.wait(timeout=20)  # task 1 wrote its result, task 2 began and killed the runner
    # The agent notices the death before it has read task 1's result from the socket.
    agent._check_runners(time.time())
    assert _results(agent) == {"task-1": "ok", "task-2": "crashed"}
    assert not agent.queue


def test_a_task_handed_ahead_behind_a_long_one_moves_to_a_free_slot_and_never_runs_twice(
        tmp_path):
    gen = recording_agent(tmp_path, slots=2)
    agent = next(gen)
    try:
        agent.session.welcomed = True
        for runner in agent.runners:
            runner.start()
        _pump(agent, lambda: all(r.ready for r in agent.runners), "the runners to start")
        agent._mean_run = 0.02  # tasks so far were short: hand-ahead is on
        first, second = agent.runners

        long_nap = napping(1.5)

        _give(agent, 1, fn=long_nap)
        _give(agent, 2)  # into the second slot
        _give(agent, 3)  # handed ahead: to whichever runner is busy first in the loop
        holder = first if first.next is not None else second
        assert holder.next.task.task_id == "task-3"
        # Task 2 ends at once; task 1 runs on: task 3 must not wait behind it.
        _pump(agent, lambda: "task-3" in _results(agent), "task 3's result")
        assert "task-1" not in _results(agent), "task 3 waited for the long task"
        _pump(agent, lambda: len(_results(agent)) == 3, "the long task's result")
        assert _results(agent) == {f"task-{i}": "ok" for i in (1, 2, 3)}
        assert _output(agent)["task-3"] == b"start 3\nend 3\n"  # it ran once, in one slot
    finally:
        for r in agent.runners:
            r.kill()
        next(gen, None)


def test_no_task_is_handed_ahead_to_a_runner_whose_task_runs_long(live_agent):
    agent, runner = live_agent, live_agent.runners[0]

    nap = napping(0.6)

    _give(agent, 1, fn=nap)
    _pump(agent, lambda: time.time() - runner.task.started > 0.3, "task 1 to run a while")
    _give(agent, 2)
    assert runner.next is None and [q.task.task_id for q in agent.queue] == ["task-2"]
    _pump(agent, lambda: len(_results(agent)) == 2, "both results")


def test_a_cancelled_task_handed_ahead_is_skipped_by_its_runner_not_started(live_agent, tmp_path):
    agent, runner = live_agent, live_agent.runners[0]
    marker, go = tmp_path / "ran", tmp_path / "go"
    wait_for_go = waiting_for(go)  # ends only once task 2 has been cancelled

    def touch(i):
        open(str(marker), "w").close()
        return i

    _give(agent, 1, fn=wait_for_go)
    _give(agent, 2, fn=touch)
    assert runner.next.task.task_id == "task-2"
    assert agent._cancel(2, time.time(), report=True)
    go.touch()
    # The agent stays out of it from here (no restart after task 1): after task 1, the runner
    # reads task 2, then the drop, then this last task, and answers what it ran, in order.
    send_message(runner.control, [msgpack.packb({"kind": "fn", "name": "last"}),
                                  *serialize.dumps(_speak), *serialize.dumps(((3,), {}))])
    answers = [runner.receive()[0]["status"] for _ in range(2)]
    assert answers == ["ok", "ok"]  # task 1 and the last task: nothing for task 2
    assert not marker.exists(), "the runner started a task the agent had taken back"
    assert not runner.has_message()


# ----------------------------------------------------------------- several handed ahead


@pytest.fixture
def tiny_tasks_agent(live_agent):
    """The live agent once its tasks are known to be tiny: it hands several ahead."""
    live_agent._mean_run = 0.0001
    return live_agent


def quick(i):
    print(f"quick {i}", flush=True)
    return i


def test_tiny_tasks_are_handed_ahead_several_at_once_and_each_prints_as_itself(tiny_tasks_agent):
    agent, runner = tiny_tasks_agent, tiny_tasks_agent.runners[0]
    for lease in range(1, 7):
        _give(agent, lease, fn=quick)
    assert runner.task.task_id == "task-1"
    assert [q.task.task_id for q, _ in runner.ahead] == [f"task-{i}" for i in range(2, 7)]
    assert not agent.queue and sorted(agent._held_leases()) == list(range(1, 7))
    _pump(agent, lambda: len(_results(agent)) == 6, "six results")
    assert _results(agent) == {f"task-{i}": "ok" for i in range(1, 7)}
    _pump(agent, lambda: len(_output(agent)) == 6, "their output")
    assert _output(agent) == {f"task-{i}": f"quick {i}\n".encode() for i in range(1, 7)}
    assert runner.task is None and not runner.ahead


def test_results_a_runner_wrote_while_unread_are_all_handled_in_one_read(tiny_tasks_agent,
                                                                        tmp_path):
    agent, runner = tiny_tasks_agent, tiny_tasks_agent.runners[0]
    go = tmp_path / "go"
    for lease in (1, 2, 3):
        _give(agent, lease, fn=quick)
    _give(agent, 4, fn=waiting_for(go))
    # Task 4 marks stdout as it starts, after the runner wrote the three results before it.
    deadline = time.monotonic() + 20
    while getattr(runner._owner["out"], "task_id", None) != "task-4":
        assert time.monotonic() < deadline, "task 4 never started"
        select.select([runner.proc.stdout], [], [], 0.1)
        runner.read_stream("out")
    agent._on_runner_message(runner, time.time())
    assert _results(agent) == {f"task-{i}": "ok" for i in (1, 2, 3)}
    assert runner.task.task_id == "task-4" and not runner.ahead
    go.touch()
    _pump(agent, lambda: len(_results(agent)) == 4, "task 4's result")


def test_pausing_reads_what_ran_before_handing_back_so_no_task_runs_twice(tiny_tasks_agent,
                                                                          tmp_path):
    agent, runner = tiny_tasks_agent, tiny_tasks_agent.runners[0]
    go = tmp_path / "go"
    _give(agent, 1, fn=quick)
    _give(agent, 2, fn=quick)
    _give(agent, 3, fn=waiting_for(go))
    deadline = time.monotonic() + 20
    while getattr(runner._owner["out"], "task_id", None) != "task-3":
        assert time.monotonic() < deadline, "task 3 never started"
        select.select([runner.proc.stdout], [], [], 0.1)
        runner.read_stream("out")
    # Tasks 1 and 2 ran and their results wait, unread: only task 3 is left, and it runs.
    status = agent.owner.on_control("pause", time.time())
    assert status["handed_back"] == 0
    assert not [m for m in agent.sent if m.command is Command.CREDIT and m.header.get("release")]
    assert _results(agent) == {"task-1": "ok", "task-2": "ok"}
    go.touch()
    _pump(agent, lambda: "task-3" in _results(agent), "task 3's result")
    assert _results(agent) == {f"task-{i}": "ok" for i in (1, 2, 3)}


def test_cancelling_one_of_several_handed_ahead_requeues_the_rest_and_it_never_runs(
        tiny_tasks_agent, tmp_path):
    agent, runner = tiny_tasks_agent, tiny_tasks_agent.runners[0]
    ran, go = tmp_path / "ran", tmp_path / "go"

    def touch(i):
        open(str(ran), "w").close()
        return i

    _give(agent, 1, fn=waiting_for(go))
    _give(agent, 2, fn=quick)
    _give(agent, 3, fn=touch)
    _give(agent, 4, fn=quick)
    assert agent._cancel(3, time.time(), report=True)
    assert [q.task.task_id for q in agent.queue] == ["task-2", "task-4"]  # in order
    assert not runner.ahead and runner.restart_after_task
    go.touch()
    _pump(agent, lambda: len(_results(agent)) == 4, "the other three results")
    assert _results(agent) == {"task-1": "ok", "task-2": "ok", "task-3": "cancelled",
                               "task-4": "ok"}
    assert not ran.exists(), "a cancelled task handed ahead ran"
    assert _output(agent)["task-2"] == b"quick 2\n" and _output(agent)["task-4"] == b"quick 4\n"


def test_a_runner_that_dies_with_several_handed_ahead_loses_none_and_blames_one(
        tiny_tasks_agent, tmp_path):
    agent, runner = tiny_tasks_agent, tiny_tasks_agent.runners[0]
    go = tmp_path / "go"

    def die(i):
        import os as system
        system._exit(3)

    # Task 1 waits for the word: a runner that finished it and died of task 2 before task 4
    # was handed over refused it, and only two were ahead (a loaded machine saw it).
    _give(agent, 1, fn=waiting_for(go))
    _give(agent, 2, fn=die)
    _give(agent, 3, fn=quick)
    _give(agent, 4, fn=quick)
    assert len(runner.ahead) == 3
    go.touch()
    runner.proc.wait(timeout=20)  # task 1 wrote its result, task 2 killed the runner
    agent._check_runners(time.time())
    assert _results(agent) == {"task-1": "ok", "task-2": "crashed"}
    assert [q.task.task_id for q in agent.queue] + [q.task.task_id for q, _ in runner.ahead] \
        + ([runner.task.task_id] if runner.task else []) == ["task-3", "task-4"]
    _pump(agent, lambda: len(_results(agent)) == 4, "the two that never started")
    assert _results(agent) == {"task-1": "ok", "task-2": "crashed", "task-3": "ok",
                               "task-4": "ok"}


def test_a_runner_busy_with_tiny_tasks_is_left_unpolled_for_a_moment_after_each_read(
        tiny_tasks_agent, tmp_path):
    from gpumesh.worker.agent import RUNNER_NAP

    agent, runner = tiny_tasks_agent, tiny_tasks_agent.runners[0]
    go = tmp_path / "go"
    poller, _ = agent._poller()
    polled = lambda: runner.control.fileno() in [fd for fd, _ in poller.sockets]  # noqa: E731
    now = time.time()
    _give(agent, 1, fn=waiting_for(go))
    runner.read_at = now
    agent._nap_runners(poller, now)
    assert polled(), "nothing handed ahead (a single call): its result is read at once"
    _give(agent, 2, fn=quick)
    agent._nap_runners(poller, now)
    assert not polled()
    assert agent._poll_timeout() <= RUNNER_NAP * 1000 + 1  # the loop wakes when the nap ends
    agent._nap_runners(poller, now + RUNNER_NAP)
    assert polled()
    go.touch()
    _pump(agent, lambda: len(_results(agent)) == 2, "both results")


def sized(i):
    return len(i)


def test_no_more_is_handed_ahead_than_the_runners_socket_holds_while_it_runs(tiny_tasks_agent,
                                                                             tmp_path):
    from gpumesh.worker.runners import AHEAD_BYTES

    agent, runner = tiny_tasks_agent, tiny_tasks_agent.runners[0]
    go = tmp_path / "go"
    _give(agent, 1, fn=waiting_for(go))  # runs until the test says: nothing is read meanwhile
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    for lease in range(2, 7):  # inline arguments of 2/5 of the budget each
        frames = [*serialize.dumps(sized), *serialize.dumps(((bytes(AHEAD_BYTES * 2 // 5),), {}))]
        agent._on_task(_message({"task": f"task-{lease}", "lease": lease, "kind": "fn"}, frames),
                       time.time())
    assert [q.task.task_id for q, _ in runner.ahead] == ["task-2", "task-3"]
    assert [q.task.task_id for q in agent.queue] == ["task-4", "task-5", "task-6"]
    assert runner.ahead_bytes <= AHEAD_BYTES
    go.touch()
    _pump(agent, lambda: len(_results(agent)) == 6, "all six results")
    assert set(_results(agent).values()) == {"ok"} and runner.ahead_bytes == 0


def test_a_result_left_unread_when_the_runner_dies_after_its_tasks_ahead_were_dropped_counts(
        tiny_tasks_agent, tmp_path):
    agent, runner = tiny_tasks_agent, tiny_tasks_agent.runners[0]
    go = tmp_path / "go"
    wait = waiting_for(go)

    def die_later(i):
        import os as system
        wait(i)
        system._exit(3)

    _give(agent, 1, fn=quick)
    _give(agent, 2, fn=die_later)
    _give(agent, 3, fn=quick)
    deadline = time.monotonic() + 20
    while getattr(runner._owner["out"], "task_id", None) != "task-2":  # task 1's result written
        assert time.monotonic() < deadline, "task 2 never started"
        select.select([runner.proc.stdout], [], [], 0.1)
        runner.read_stream("out")
    assert agent._cancel(3, time.time(), report=True)  # drops task 2 too, too late: it runs
    assert runner.next is None
    go.touch()
    runner.proc.wait(timeout=20)
    agent._check_runners(time.time())
    assert _results(agent)["task-1"] == "ok", "a task that finished was blamed for the death"
    _pump(agent, lambda: len(_results(agent)) == 3, "task 2, run again")
    assert _results(agent) == {"task-1": "ok", "task-2": "crashed", "task-3": "cancelled"}


def _closes_stdout(i):
    import sys as system
    print(f"before {i}", flush=True)
    system.stdout.close()
    system.stderr = None
    return i


def _then_the_next(agent, first, second, says: bytes) -> int:
    """Run ``first``, then ``second`` until its output holds ``says``: the runner's pid, to
    compare with the one before (nothing was restarted for the first task)."""
    _give(agent, 1, first)
    _pump(agent, lambda: "task-1" in _results(agent), "its result")
    _give(agent, 2, second)
    _pump(agent, lambda: "task-2" in _results(agent)
          and says in _output(agent).get("task-2", b""), "the next one's result and output")
    assert _results(agent) == {"task-1": "ok", "task-2": "ok"}
    return agent.runners[0].proc.pid


def test_a_task_that_closes_its_output_still_reports_and_the_next_prints(live_agent):
    # The flush after it raised: the runner exited, the result was lost, and the task was
    # retried elsewhere to the same end.
    agent, runner = live_agent, live_agent.runners[0]
    first_pid = runner.proc.pid
    assert _then_the_next(agent, _closes_stdout, _speak, b"end 2") == first_pid
    assert _output(agent)["task-1"] == b"before 1\n"


def _leaves_its_state(i):
    import io
    import os as system
    import sys as system_module
    import tempfile

    gone = tempfile.mkdtemp()
    system.chdir(gone)
    system.rmdir(gone)  # the next task's getcwd() would fail
    system_module.path.insert(0, "/gpumesh-test-nowhere")
    system_module.stdout, system_module.stderr = io.StringIO(), io.StringIO()
    system.close(1)  # and the descriptor under it: the next open() would take its number
    return i


def _says_where_it_runs(i):
    import os as system
    import sys as system_module

    print(f"cwd={system.getcwd()} nowhere={'/gpumesh-test-nowhere' in system_module.path}",
          flush=True)
    print("to stderr", file=system_module.stderr, flush=True)
    return i


def test_what_a_task_changes_in_its_runner_is_put_back_for_the_next(live_agent):
    # The README: a function task runs in the worker's start directory. A task's StringIO
    # took every later task's output, a deleted folder failed their getcwd(), its sys.path
    # steered their unpickling, and a closed fd 1 failed their prints as their own errors.
    agent, runner = live_agent, live_agent.runners[0]
    first_pid = runner.proc.pid
    # The same runner after: nothing was restarted for it.
    assert _then_the_next(agent, _leaves_its_state, _says_where_it_runs, b"to stderr") \
        == first_pid
    assert f"cwd={os.getcwd()} nowhere=False".encode() in _output(agent)["task-2"]


def _forks_and_returns(i):
    import os as system

    system.fork()  # both return into the runner's loop
    return i


def test_a_task_whose_fork_returns_into_the_runner_answers_once(live_agent):
    # Two processes answered the agent on one socket: the child's result was charged to the
    # next task, and then both read the same socket.
    agent = live_agent
    _give(agent, 1, _forks_and_returns)
    _give(agent, 2)
    _pump(agent, lambda: len(_results(agent)) == 2 and b"end 2" in _output(agent).get(
        "task-2", b""), "both results")
    _give(agent, 3)
    _pump(agent, lambda: len(_results(agent)) == 3, "a third")
    results = [m.header["task"] for m in agent.sent if m.command is Command.RESULT]
    assert results == ["task-1", "task-2", "task-3"]  # each once, in turn
    assert _live_children(agent.runners[0].proc.pid) == []  # the fork's child went


def _live_children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, zombies left out (/proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return found


def test_a_runner_that_cannot_start_is_retried_less_and_less_and_its_work_goes_elsewhere(
        tmp_path, monkeypatch):
    # join run from a folder holding a select.py: `python -m` puts that folder first on the
    # runner's path, its imports fail, and it was started again every turn (a core spent)
    # while the worker went on taking tasks that waited for it, their leases renewed.
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    (work / "select.py").write_text("raise SystemExit('a module of the folder shadows select')\n")
    monkeypatch.chdir(work)
    gen = recording_agent(home)
    agent = next(gen)
    lines: list[str] = []
    agent.say = lines.append
    agent.session.welcomed = True
    runner = agent.runners[0]
    started: list[float] = []
    real_start = runner.start

    def start():
        started.append(time.monotonic())
        real_start()

    runner.start = start
    try:
        runner.start()
        _give(agent, 1)  # waits for the runner

        def handed_back() -> list[int]:
            return [lease for m in agent.sent if m.command is Command.CREDIT
                    for lease in m.header.get("release", [])]

        _pump(agent, lambda: 1 in handed_back(), "the task to go back", timeout=20)
        assert _results(agent) == {}  # handed back unstarted: no attempt charged
        granted = agent.granted
        _give(agent, 2)  # sent meanwhile: back at once, its grant not renewed
        assert handed_back() == [1, 2] and agent.granted == granted and not agent.queue
        assert any("runner 0 cannot start" in line and "shadows select" in line
                   for line in lines), lines
        first_wait = runner.start_at
        assert first_wait is not None
        _pump(agent, lambda: runner.failed_starts >= 5, "more tries", timeout=20)
        gaps = [later - earlier for earlier, later in zip(started, started[1:], strict=False)]
        assert gaps[-1] >= 1.0 > gaps[0]  # at once at first, then less and less often
        assert len(started) <= 8
        # The module moved away: the runner starts, and the grant of the two handed back is
        # renewed (without it the coordinator would send this worker nothing more).
        (work / "select.py").unlink()
        _pump(agent, lambda: runner.ready, "the runner to start at last", timeout=40)
        credits = [m.header["granted"] for m in agent.sent if m.command is Command.CREDIT]
        assert credits[-1] == granted + 2
        assert any("runner 0 started again" in line for line in lines)
    finally:
        runner.start = real_start
        runner.kill()
        next(gen, None)


def _dies_leaving_a_chatty_child(i):
    import os as system
    import subprocess as processes
    import sys as system_module

    processes.Popen([system_module.executable, "-c",
                     "import sys\nwhile True: sys.stdout.write('x' * 4096)"])
    quiet = processes.Popen([system_module.executable, "-c",
                             "import select; select.select([], [], [], 60)"],
                            stdout=processes.DEVNULL, stderr=processes.DEVNULL)
    with open(f"/tmp/gpumesh-test-child-{system.getppid()}", "w") as told:
        told.write(str(quiet.pid))
    print("last words", flush=True)
    system._exit(3)


@NEEDS_PROC
def test_a_runner_that_dies_takes_its_tasks_children_with_it_and_the_agent_goes_on(
        live_agent):
    # The children lived on (holding memory, a GPU), and one printing without end held the
    # agent in its drain of the dead runner's pipes: no heartbeat, the worker lost.
    agent = live_agent
    told = f"/tmp/gpumesh-test-child-{os.getpid()}"
    try:
        _give(agent, 1, _dies_leaving_a_chatty_child)
        _pump(agent, lambda: "task-1" in _results(agent), "its crash", timeout=30)
        assert _results(agent) == {"task-1": "crashed"}
        assert b"last words" in _output(agent).get("task-1", b"")  # forwarded, not dropped
        child = int(Path(told).read_text())
        # The chatty one dies of its closed pipe either way; the quiet one only if killed.
        wait_for(lambda: not _alive(child), timeout=10,
                 what="the task's child to die with its runner")
        _give(agent, 2)
        _pump(agent, lambda: "task-2" in _results(agent), "a task on the new runner")
        assert _results(agent)["task-2"] == "ok"
    finally:
        if os.path.exists(told):
            os.unlink(told)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_cancel_of_a_task_whose_result_is_written_reports_it_done(live_agent):
    # With tasks handed ahead the runner may be past the one cancelled: it finished, and was
    # reported cancelled (and those behind it run again).
    agent, runner = live_agent, live_agent.runners[0]
    _give(agent, 1, napping(0.0))
    assert select.select([runner.control], [], [], 20)[0]  # its result is written, unread
    assert not agent._cancel(1, time.time(), report=True)
    assert _results(agent) == {"task-1": "ok"}


def _writes_without_end(i):
    import os as system
    import socket as sockets
    import sys as system_module
    import time as clock

    import msgpack as packer

    from gpumesh.runner.pipe import send_message as post

    here, there = sockets.socketpair()  # one message as the pipe frames it, written in runs
    post(here, [packer.packb({"ready": True})])
    one = there.recv(4096)
    deadline = clock.monotonic() + 30
    while clock.monotonic() < deadline:
        system.write(int(system_module.argv[1]), one * 64)
    return i


def test_a_late_task_that_writes_to_its_socket_without_end_is_still_stopped(live_agent):
    # Before it was stopped, the agent read every message waiting on the runner's socket: one
    # that never stopped writing held its loop (no heartbeat, no timeout) for good.
    agent = live_agent
    _give(agent, 1, _writes_without_end, timeout=0.5)
    _pump(agent, lambda: "task-1" in _results(agent), "its timeout", timeout=20)
    assert _results(agent) == {"task-1": "timeout"}


def test_a_line_that_never_ends_is_not_kept_whole(piped_runner):
    from gpumesh.worker.runners import PARTIAL_BYTES

    runner, ends = piped_runner
    for _ in range(8):
        os.write(ends["out"], b"x" * 60000)
        runner.read_stream("out")
    assert len(runner._partial["out"]) <= PARTIAL_BYTES
    os.write(ends["out"], b"y\n")
    runner.read_stream("out")
    assert runner.tail[-1][1] == "x" * PARTIAL_BYTES + "y"


def test_a_crash_quotes_only_what_its_own_task_printed(piped_runner):
    # The runner's last lines, whoever printed them, went into a crashed task's diagnosis:
    # one job's output reached another submitter's error (and `gpumesh status`).
    runner, ends = piped_runner
    runner._write = lambda *args: None  # type: ignore[method-assign]
    runner.send(_task("A"), {}, [])
    os.write(ends["err"], b"a secret of job A\n")
    _read(runner, "err")
    assert runner.finished() is None
    crashed = _task("B")
    runner.send(crashed, {}, [])
    os.write(ends["err"], b"B's last words\nB's unfinished li")
    _read(runner, "err")
    said = runner.diagnosis(-11, task=crashed)
    assert "B's last words" in said and "B's unfinished li" in said
    assert "secret" not in said and "SIGSEGV" in said


def test_what_a_broken_runner_left_unread_is_quoted_for_the_task_that_printed_it(piped_runner):
    # A task handed ahead started and broke its runner before the pipes were read: what was
    # left in them went to the task before it, marker and all, and the crash quoted nothing.
    runner, ends = piped_runner
    runner._write = lambda *args: None  # type: ignore[method-assign]
    first = _task("A")
    runner.send(first, {}, [])
    marker = _handed(runner, "B")
    crashed = runner.finished()
    assert crashed is not None and crashed.task.task_id == "B"
    os.write(ends["err"], b"A's end\n" + marker + b"B's last words")
    runner._close(keep_tail=True)
    said = runner.diagnosis(None, "it broke", task=crashed.task)
    assert said == "it broke; last output:\n    B's last words"


def test_what_is_handed_ahead_fits_the_socket_first_task_and_no_memfd_alike(monkeypatch):
    # The first task ahead went whatever its size, and frames of 64 KiB or more counted as
    # nothing even where memfd had failed and they went on the socket: the agent's write then
    # blocked while the runner's task ran, for good if that task filled its stdout meanwhile.
    from gpumesh.runner import pipe
    from gpumesh.worker.runners import AHEAD_BYTES

    runner = Runner(0, {}, 1 << 20)
    runner.ready, runner.task = True, _task("A")
    big = QueuedTask(_task("B"), {"kind": "fn"}, [b"f", b"a", bytes(256 * 1024)])
    small = QueuedTask(_task("C"), {"kind": "fn"}, [b"f", b"a" * 1000])
    assert big.socket_bytes < AHEAD_BYTES and runner.fits_ahead(big)  # its frame: a memfd
    inline = bytes(50 * 1024)  # frames under the memfd's threshold go on the socket
    first_only = QueuedTask(_task("D"), {"kind": "fn"}, [b"f", inline, inline])
    assert runner.fits_ahead(first_only) and runner.fits_ahead(small)
    too_big = QueuedTask(_task("F"), {"kind": "fn"}, [b"f", inline, inline, inline])
    assert not runner.fits_ahead(too_big)
    runner.ahead_bytes = small.socket_bytes
    runner.ahead.append((small, "nonce"))  # with one ahead, the rest share AHEAD_BYTES
    assert not runner.fits_ahead(first_only)
    runner.ahead.clear()
    runner.ahead_bytes = 0
    monkeypatch.setattr(pipe, "_memfd_ok", False)
    no_memfd = QueuedTask(_task("E"), {"kind": "fn"}, [b"f", b"a", bytes(256 * 1024)])
    assert no_memfd.socket_bytes > 256 * 1024 and not runner.fits_ahead(no_memfd)


def _fills_its_stdout_without_blocking(i):
    import os as system
    system.set_blocking(1, False)  # as node or asyncio leave a shared pipe
    try:
        while True:
            system.write(1, b"A" * 4096)  # until the pipe is full: the agent reads later
    except BlockingIOError:
        return i


def _prints_its_own(i):
    import os as system
    system.set_blocking(1, True)
    print(f"{i}'s own line", flush=True)
    return i


def test_a_start_marker_waits_for_room_in_a_pipe_a_task_left_full_and_non_blocking(
        live_agent):
    # The marker's write failed (EAGAIN) and was dropped: from then on everything the runner
    # printed, later tasks' output too, went out as the output of the task before.
    agent, runner = live_agent, live_agent.runners[0]
    _give(agent, 1, _fills_its_stdout_without_blocking)
    _give(agent, 2, _prints_its_own)
    assert [q.task.task_id for q, _ in runner.ahead] == ["task-2"]
    # Nothing of its output read until the first result is written: the pipe is full when
    # the runner marks the start of the task handed ahead.
    assert select.select([runner.control], [], [], 20)[0]
    # (print writes the line and its newline apart: the agent may read between the two)
    _pump(agent, lambda: len(_results(agent)) == 2
          and b"own line\n" in _output(agent).get("task-2", b""), "both results and the output")
    _give(agent, 3, _prints_its_own)  # straight to the idle runner
    _pump(agent, lambda: b"own line\n" in _output(agent).get("task-3", b""), "the third's output")
    output = _output(agent)
    assert output["task-1"] == b"A" * len(output["task-1"]) and len(output["task-1"]) >= 4096
    assert output["task-2"] == b"2's own line\n" and output["task-3"] == b"3's own line\n"


def _trickles_messages(i):
    import os as system
    import struct
    import sys as system_module
    import time as clock

    import msgpack as packer

    control = int(system_module.argv[1])
    body = packer.packb({"ready": True})
    for _ in range(3):  # each message's head, then its rest a while later (within READ_STALL)
        system.write(control, struct.pack("<III", 1, 2, 8 + len(body)))
        clock.sleep(0.8)
        system.write(control, struct.pack("<Q", len(body)) + body)
    clock.sleep(20)  # until the test stops it
    return i


def test_one_turn_begins_no_further_runner_message_after_a_slow_one(live_agent):
    # Each message may take READ_STALL to come whole, and the agent read up to RUNNER_READS
    # of them in one turn: a task that trickled messages into its socket held the loop past
    # the coordinator's patience (5 s of silence), its runner alive.
    agent, runner = live_agent, live_agent.runners[0]
    _give(agent, 1, _trickles_messages)
    assert select.select([runner.control], [], [], 20)[0]  # the first head is there
    read = []
    receive = runner.receive
    runner.receive = lambda: read.append(1) or receive()  # type: ignore[method-assign]
    agent._on_runner_message(runner, time.time())
    assert len(read) == 1  # one message's wait (0.8 s), not three


def _exits_at_once(i):
    import os as system
    system._exit(3)


def test_the_results_a_dead_runner_wrote_are_all_read_however_long_it_takes(live_agent,
                                                                            monkeypatch):
    # The read before a dead runner is ruled dead stopped after RUNNER_READ_TIME like a live
    # one's: a result it wrote before it died was left unread, and its task ran again.
    from gpumesh.worker import agent as agent_module

    agent, runner = live_agent, live_agent.runners[0]
    _give(agent, 1)
    _give(agent, 2, _exits_at_once)  # handed ahead: it runs once the first has written
    assert [q.task.task_id for q, _ in runner.ahead] == ["task-2"]
    runner.proc.wait(timeout=20)
    monkeypatch.setattr(agent_module, "RUNNER_READ_TIME", 0.0)  # no time at all to read
    agent._check_runners(time.time())
    assert _results(agent) == {"task-1": "ok", "task-2": "crashed"}


def test_the_output_streams_a_task_left_go_with_it_and_broken_ones_are_made_anew(
        monkeypatch):
    import io

    from gpumesh.runner.__main__ import _settle_output

    class Tee:  # a user's own, as often written: write and flush, no ``closed``
        def __init__(self):
            self.seen = []

        def write(self, text):
            self.seen.append(text)

        def flush(self):
            pass

    from gpumesh.runner.__main__ import _Start

    start = _Start()
    tee = Tee()
    monkeypatch.setattr(sys, "stdout", tee)  # a task's own: it goes with the task
    monkeypatch.setattr(sys, "stderr", start.streams["stderr"])
    start.streams["stderr"] = closed = io.StringIO()  # the runner's own, closed by a task
    closed.close()
    _settle_output(start)
    assert sys.stdout is start.streams["stdout"] is not tee
    assert sys.stderr is not closed and sys.stderr.fileno() == 2
    assert sys.stderr.write_through  # what it writes goes at once, as under -u
    assert start.streams["stderr"] is sys.stderr  # and it is the runner's own from now on
    for copy, _ in start.fds.values():
        os.close(copy)


def test_a_late_task_whose_result_waits_unread_is_read_before_it_is_ruled_late(live_agent,
                                                                              monkeypatch):
    # The read before a late task is stopped is cut short (RUNNER_READ_TIME): a result still
    # waiting may be the task's own, so it is read on for a while before the task times out.
    from gpumesh.worker import agent as agent_module

    agent, runner = live_agent, live_agent.runners[0]
    _give(agent, 1, napping(0.0), timeout=0.2)
    assert select.select([runner.control], [], [], 20)[0]  # its result is written, unread
    monkeypatch.setattr(agent_module, "RUNNER_READ_TIME", 0.0)  # no time at all to read
    later = runner.task.deadline + 0.5  # past its timeout, within LATE_GRACE
    agent._check_runners(later)
    assert _results(agent) == {}  # not ruled late yet
    agent._on_runner_message(runner, later)
    agent._check_runners(later)
    assert _results(agent) == {"task-1": "ok"}


def _changes_the_process(i):
    import os as system
    import signal as signals

    signals.signal(signals.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("alarm")))
    signals.setitimer(signals.ITIMER_REAL, 60)
    signals.signal(signals.SIGCHLD, signals.SIG_IGN)
    signals.pthread_sigmask(signals.SIG_BLOCK, {signals.SIGUSR2})
    system.umask(0o777)
    system.set_blocking(1, False)
    return i


def _reads_the_process(i):
    import os as system
    import signal as signals
    import sys as interpreter

    mask = system.umask(0o022)
    system.umask(mask)
    control = int(interpreter.argv[1])
    return (signals.getsignal(signals.SIGALRM) == signals.SIG_DFL,
            signals.getitimer(signals.ITIMER_REAL) == (0.0, 0.0),
            signals.getsignal(signals.SIGCHLD) == signals.SIG_DFL,
            signals.SIGUSR2 not in signals.pthread_sigmask(signals.SIG_BLOCK, []),
            mask != 0o777, system.get_blocking(1), not system.get_inheritable(control))


def _values_of(agent, *fns) -> list:
    """Run ``fns`` as the next tasks, in turn, on the agent's runner: each one's value (each
    must succeed)."""
    from gpumesh.protocol import serialize

    first = len(_results(agent)) + 1
    leases = range(first, first + len(fns))
    for lease, fn in zip(leases, fns, strict=True):
        _give(agent, lease, fn=fn)
    _pump(agent, lambda: len(_results(agent)) == leases[-1], "their results")
    values = []
    for lease in leases:
        (result,) = [m for m in agent.sent
                     if m.command is Command.RESULT and m.header["task"] == f"task-{lease}"]
        assert result.header["status"] == "ok", result.header
        values.append(serialize.loads(result.payload))
    return values


def test_what_a_task_sets_in_its_process_is_put_back_for_the_next(live_agent):
    # An alarm left set raised TimeoutError in the next task (another client's, maybe);
    # SIGCHLD ignored read every later failed script as exit 0; a non-blocking pipe lost
    # later output; the runner's socket was inherited by what a task started.
    _, seen = _values_of(live_agent, _changes_the_process, _reads_the_process)
    assert seen == (True,) * 7


def _lowers_its_limits(i):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 200), min(hard, 300)))
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    return i


def _raises_its_open_files(i):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # as some modules do at import
    return i


def _reads_its_limits(i):
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE), resource.getrlimit(resource.RLIMIT_CORE)


def test_resource_limits_a_task_lowered_are_not_the_next_tasks(live_agent):
    # A task that lowered its runner's open files or memory (code-evaluation guards set
    # RLIMIT_AS) left every later task of that runner, any client's, failing. Put back where
    # the runner may (here as root, or soft limits), or a fresh runner where it may not.
    import resource

    _, (nofile, core) = _values_of(live_agent, _lowers_its_limits, _reads_its_limits)
    assert tuple(nofile) == resource.getrlimit(resource.RLIMIT_NOFILE)  # the agent's, inherited
    assert tuple(core) == resource.getrlimit(resource.RLIMIT_CORE)
    # Raised stays raised: a module cached in the runner that lifted its open files at import
    # ran every later task with the limit it had lifted itself above.
    _, (nofile, _) = _values_of(live_agent, _raises_its_open_files, _reads_its_limits)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert tuple(nofile) == (hard, hard)


def test_a_hard_limit_the_runner_cannot_raise_again_restarts_it():
    # Not as root (who may raise it): the restore fails, and the runner's loop sends the
    # result with `restart` (as for any process state it cannot put back).
    import resource

    from gpumesh.runner.__main__ import _ResourceLimits

    limits = _ResourceLimits()
    soft, hard = limits.start[resource.RLIMIT_NOFILE]  # finite everywhere: a lower one is seen
    limits.start[resource.RLIMIT_NOFILE] = (soft, hard + 1)

    def refused(which, values):
        raise ValueError("not allowed to raise maximum limit")

    limits._set = refused
    limits.restore()  # nothing changed: nothing read
    limits.changed = True
    with pytest.raises(RuntimeError, match="lowered RLIMIT_NOFILE, which a process cannot raise"):
        limits.restore()


def test_a_script_that_leaves_a_child_holding_its_pipes_is_done_when_it_exits(tmp_path):
    # communicate() waited for the end of pipes a background child held: the slot hung (here
    # for the child's 300 s, past the test's timeout). A child in a session of its own (a
    # daemon) is not ended with the script's group, and may hold them.
    import json
    import os
    import signal

    from gpumesh.runner.execute import run_script

    script = (b"import json, subprocess, sys\n"
              b"child = subprocess.Popen([sys.executable, '-c',\n"
              b"                          'import select; select.select([], [], [], 300)'],\n"
              b"                         start_new_session=True)\n"
              b"print(json.dumps({'child': child.pid}))\n")
    header, frames = run_script({"kind": "script", "name": "leaves"}, [script, b"{}"],
                                dict(os.environ))
    child = json.loads(bytes(frames[0]))["child"]
    try:
        os.kill(child, 0)  # done while the child still holds the pipes, not when it exits
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    assert header == {"status": "ok", "encoding": "json"}


def _leaves_a_signal_pending(i):
    import signal as signals
    import threading as threads

    signals.pthread_sigmask(signals.SIG_BLOCK, {signals.SIGUSR1})
    # To this thread, which blocks it: pending, as the task never unblocks it.
    signals.pthread_kill(threads.get_ident(), signals.SIGUSR1)
    return i


def test_a_signal_a_task_left_pending_does_not_end_its_runner(live_agent):
    # Unblocked as the runner put its mask back, SIGUSR1 took its default action: the runner
    # died before it sent the result, and the task was retried as crashed.
    agent, runner = live_agent, live_agent.runners[0]
    process = runner.proc
    _give(agent, 1, fn=_leaves_a_signal_pending)
    _give(agent, 2, fn=quick)
    _pump(agent, lambda: len(_results(agent)) == 2, "both results")
    assert _results(agent) == {"task-1": "ok", "task-2": "ok"} and runner.proc is process


def test_what_a_scripts_background_child_prints_after_it_is_read_and_dropped(tmp_path,
                                                                               monkeypatch):
    # The script's stdout kept growing in the runner for as long as a child it left behind
    # printed (27 MB two seconds after the task; an out-of-memory kill blamed on a later task).
    # Now one in the script's group ends with it: this one left it, as a daemon does.
    import json
    import os

    from conftest import poll_until

    from gpumesh.processes import is_alive
    from gpumesh.runner import execute

    made: list = []
    real = execute._Stdout
    monkeypatch.setattr(execute, "_Stdout", lambda: made.append(real()) or made[-1])
    monkeypatch.setattr(execute, "OUTPUT_GRACE", 0.2)
    go = tmp_path / "go"  # the child prints only once the task is over (the test says when)
    script = (b"import json, os, subprocess, sys\n"
              b"child = subprocess.Popen([sys.executable, '-c', 'import os, select, sys\\n"
              b"while not os.path.exists(sys.argv[1]): select.select([], [], [], 0.01)\\n"
              b"for i in range(20000): print(\"x\" * 100, flush=True)', sys.argv[1]],\n"
              b"                         start_new_session=True)\n"
              b"print(json.dumps({'child': child.pid}))\n")
    script = script.replace(b"sys.argv[1]],", repr(str(go)).encode() + b"],")
    header, frames = execute.run_script({"kind": "script", "name": "leaves"}, [script, b"{}"],
                                        dict(os.environ))
    go.touch()
    child = json.loads(bytes(frames[0]))["child"]  # the script's own line, and nothing else
    assert header == {"status": "ok", "encoding": "json"}
    assert poll_until(lambda: not is_alive(child), 30), "the child did not finish printing"
    (out,) = made
    assert out.kept == out.written < 200  # 2 MB came after, and none of it was kept


@NEEDS_PROC
def test_what_a_script_leaves_running_ends_with_it_even_what_ignores_sigterm(tmp_path,
                                                                              monkeypatch):
    # A server or training process a script started in the background held its GPU and
    # memory until the runner restarted (and printed into later tasks' output).
    import json
    import os

    from gpumesh.runner import execute

    monkeypatch.setattr(execute, "GROUP_GRACE", 0.5)
    script = (b"import json, subprocess, sys\n"
              b"calm = subprocess.Popen([sys.executable, '-c', 'import select; "
              b"select.select([], [], [], 300)'])\n"
              b"stubborn = subprocess.Popen([sys.executable, '-c', 'import select, signal; "
              b"signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); "
              b"select.select([], [], [], 300)'], stdout=subprocess.PIPE)\n"
              b"stubborn.stdout.readline()  # it ignores SIGTERM from here\n"
              b"print(json.dumps([calm.pid, stubborn.pid]))\n")
    header, frames = execute.run_script({"kind": "script", "name": "leaves"}, [script, b"{}"],
                                        dict(os.environ), scratch=str(tmp_path))
    assert header == {"status": "ok", "encoding": "json"}
    calm, stubborn = json.loads(bytes(frames[0]))
    try:
        assert not _alive(calm)  # SIGTERM, as the script ended
        wait_for(lambda: not _alive(stubborn), timeout=10, what="SIGKILL after the grace")
    finally:
        for pid in (calm, stubborn):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
    assert os.listdir(tmp_path) == [] and not execute.script_groups  # the group's name is gone


def test_a_script_that_leaves_nothing_running_waits_for_nothing(tmp_path, monkeypatch):
    # Its own exited leader kept the group answering: every script waited out a look at
    # /proc (or, without one, the whole 2 s grace) before its result.
    import os

    from gpumesh.runner import execute

    def waited(seconds):
        raise AssertionError("the script's group was waited for, with nothing left in it")

    monkeypatch.setattr(execute.time, "sleep", waited)
    header, frames = execute.run_script({"kind": "script", "name": "quick"},
                                        [b"print(1)\n", b"{}"], dict(os.environ),
                                        scratch=str(tmp_path))
    assert header["status"] == "ok" and bytes(frames[0]) == b"1"


def _runs_a_script_in_the_background_of_a_script(tmp_path):
    """A script that writes its own pid and its child's into ``tmp_path/pids``, then waits."""
    pids = str(tmp_path / "pids")
    return (f"import os, subprocess, sys, select\n"
            f"child = subprocess.Popen([sys.executable, '-c', 'import select; "
            f"select.select([], [], [], 300)'])\n"
            f"open({pids + '.part'!r}, 'w').write('%d %d' % (os.getpid(), child.pid))\n"
            f"os.rename({pids + '.part'!r}, {pids!r})\n"
            f"select.select([], [], [], 300)\n").encode()


@NEEDS_PROC
def test_a_cancelled_script_ends_with_what_it_started_and_leaves_no_folder(live_agent,
                                                                           tmp_path):
    # In a group of its own the script outlived the runner the cancel killed, and each
    # killed script's folder was left in the temporary directory.
    agent, runner = live_agent, live_agent.runners[0]
    scratch = runner.scratch
    header = {"task": "task-1", "lease": 1, "kind": "script", "name": "waits"}
    agent._on_task(_message(header, [_runs_a_script_in_the_background_of_a_script(tmp_path),
                                     b"{}"]), time.time())
    agent._flush_runners()
    pids = tmp_path / "pids"
    _pump(agent, pids.exists, "the script to start its child")
    script, child = (int(pid) for pid in pids.read_text().split())
    assert any(name.startswith("gpumesh-script-") for name in os.listdir(scratch))
    try:
        assert agent._cancel(1, time.time(), report=True)
        wait_for(lambda: not _alive(script) and not _alive(child), timeout=10,
                 what="the script and its child to end with the cancel")
    finally:
        for pid in (script, child):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
    wait_for(lambda: not os.path.exists(scratch), timeout=10, what="its folder removed")
    assert runner.scratch is not None and runner.scratch != scratch  # the new runner's own


@NEEDS_PROC
def test_a_runner_whose_agent_is_killed_ends_its_running_script_with_itself(tmp_path):
    # The runner's watch of its parent killed its own process group: a script, in a group
    # of its own, ran on after a kill -9 of the worker.
    import signal
    import subprocess

    middle = (  # an agent's stand-in: starts a runner, hands it a script, then waits
        "import msgpack, os, signal, socket, subprocess, sys\n"
        "from gpumesh.runner.pipe import send_message\n"
        "mine, its = socket.socketpair()\n"
        "subprocess.Popen([sys.executable, '-m', 'gpumesh.runner', str(its.fileno()), "
        "sys.argv[1]], pass_fds=[its.fileno()], start_new_session=True)\n"
        "header = msgpack.packb({'kind': 'script', 'name': 'waits', 'task': 't'})\n"
        "send_message(mine, [header, open(sys.argv[2], 'rb').read(), b'{}'])\n"
        "signal.pause()\n")
    script = tmp_path / "waits.py"
    script.write_bytes(_runs_a_script_in_the_background_of_a_script(tmp_path))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    agent = subprocess.Popen([sys.executable, "-c", middle, str(scratch), str(script)])
    pids = tmp_path / "pids"
    try:
        wait_for(pids.exists, timeout=30, what="the script to start its child")
        started, child = (int(pid) for pid in pids.read_text().split())
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        wait_for(lambda: not _alive(started) and not _alive(child), timeout=10,
                 what="the script and its child to end with their runner")
        wait_for(lambda: not scratch.exists(), timeout=10, what="the runner's folder removed")
    finally:
        agent.kill()
        agent.wait()
        if pids.exists():
            for pid in (int(pid) for pid in pids.read_text().split()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_a_script_that_prints_more_than_a_result_carries_fails_once_saying_so(monkeypatch):
    import os

    from gpumesh.runner import execute

    monkeypatch.setattr(execute, "RESULT_ROOM_BYTES", 1000)
    script = b"print('y' * 5000)\n"
    header, frames = execute.run_script({"kind": "script", "name": "loud"}, [script, b"{}"],
                                        dict(os.environ))
    assert header["status"] == "error" and frames == []
    assert header["error"]["type"] == "gpumesh.ResultTooLarge"
    assert "printed" in header["error"]["message"] and "stderr" in header["error"]["message"]


def test_a_script_killed_by_a_signal_says_which_and_why():
    import os

    from gpumesh.runner.execute import run_script

    script = b"import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"
    header, _ = run_script({"kind": "script", "name": "oom"}, [script, b"{}"], dict(os.environ))
    assert header["error"]["message"].startswith(
        "script oom was killed by SIGKILL (out of memory, or killed by the system)")


def test_what_is_handed_ahead_stays_within_the_socket_the_system_granted():
    # macOS gives a socket pair 8 KiB: 64 tiny tasks handed ahead (12 KiB and more) blocked
    # the agent's write while the runner ran a long task, its heartbeats with it.
    import socket

    from gpumesh.worker.runners import (
        AHEAD_BYTES,
        FIRST_AHEAD_BYTES,
        QueuedTask,
        Runner,
        RunningTask,
        socket_room,
    )

    ours, theirs = socket.socketpair()
    with ours, theirs:
        small = socket_room(ours, theirs, wanted=4096)  # the system's minimum, about 4-8 KiB
        big = socket_room(ours, theirs)
    assert small <= 16 * 1024 and big >= small
    runner = Runner(0, {}, 1 << 20)

    def task(size: int) -> QueuedTask:
        return QueuedTask(RunningTask("t", 1, 0.0, None, {}), {}, [b"x" * size])

    runner.socket_room = small
    assert runner.fits_ahead(task(small // 4)) and not runner.fits_ahead(task(small))
    runner.ahead.append((task(10), "n"))
    runner.ahead_bytes = small // 3 - 100
    assert not runner.fits_ahead(task(200))
    runner.socket_room = 4 * 1024 * 1024  # room to spare: the limits as they always were
    runner.ahead_bytes = AHEAD_BYTES - 1000
    assert runner.fits_ahead(task(100)) and not runner.fits_ahead(task(1500))
    runner.ahead.clear()
    runner.ahead_bytes = 0
    assert runner.fits_ahead(task(FIRST_AHEAD_BYTES - 1000))


def test_join_says_what_it_gave_back_to_the_mesh_as_it_left(live_agent, tmp_path):
    # Ctrl+C on a busy join printed "left the mesh" and nothing of the tasks it stopped.
    from gpumesh.cli.join import left_line

    agent = live_agent
    _give(agent, 1, fn=waiting_for(tmp_path / "never"))
    _give(agent, 2)
    _pump(agent, lambda: agent.runners[0].task is not None, "the first task to start")
    agent.session.welcomed = False  # counted whether or not a goodbye can be sent
    agent._leave()
    assert (agent.left_running, agent.left_waiting) == (1, 1)
    line = left_line(True, agent.left_running, agent.left_waiting)
    assert "1 running task(s) stopped and 1 waiting" in line and "gpumesh drain" in line
    assert left_line(True, 0, 0) == "[worker] left the mesh"
    assert "never reached" in left_line(False, 0, 0)


def test_a_runner_starts_without_a_folder_of_its_own_where_none_can_be_made(monkeypatch):
    # A full or read-only temporary folder must not keep function tasks from running: the
    # runner starts without its folder (scripts then make theirs where they can).
    from gpumesh.runner.pipe import recv_message
    from gpumesh.worker import scratch

    def no_room(**_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(scratch.tempfile, "mkdtemp", no_room)
    runner = Runner(0, dict(os.environ), 1 << 20)
    runner.start()
    try:
        assert runner.proc is not None and runner.scratch is None
        assert select.select([runner.control], [], [], 20)[0], "the runner never said ready"
        assert msgpack.unpackb(recv_message(runner.control, 1 << 20)[0]) == {"ready": True}
    finally:
        runner.kill()
