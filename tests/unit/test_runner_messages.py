"""What a runner writes is not trusted (gpumesh/worker/runners.py): it runs the task's code,
which can write to the runner's control socket too. A message the agent cannot read, or one
that stops halfway, costs that task its runner (reported crashed, with the reason), never the
agent's loop; and a result's fields are checked and cut to the protocol's limits before they
go into a RESULT.

The agent tests run real runner processes under an agent that is never connected. Their
``live_agent`` fixture is imported: pytest finds it here, and ruff takes the parameters of
that name for redefinitions (F811)."""

from __future__ import annotations

import math
import socket

import pytest
from test_runner_hand_ahead import _give, _pump, _results, live_agent  # noqa: F401 (fixture)

from gpumesh.protocol import Command
from gpumesh.protocol.headers import MAX_DIAGNOSIS, MAX_ERROR_MESSAGE, MAX_TRACEBACK
from gpumesh.runner.pipe import recv_message, send_message
from gpumesh.worker import runners
from gpumesh.worker.runners import checked_result


def writing_on_the_runners_socket(raw: bytes):
    """A task that writes ``raw`` on its runner's control socket (the runner's first
    argument is its descriptor), then returns."""
    def task(i):
        import os as system
        import socket as sockets
        import sys as interpreter
        sock = sockets.socket(fileno=system.dup(int(interpreter.argv[1])))
        sock.sendall(raw)
        sock.close()
        return i
    return task


def framed(*frames: bytes) -> bytes:
    """``frames`` as one message of the runner pipe's format."""
    a, b = socket.socketpair()
    with a, b:
        send_message(a, list(frames))
        a.shutdown(socket.SHUT_WR)
        return b.recv(1 << 20)


GARBAGE = {
    "no frames": framed(),
    "a header that is not msgpack": framed(b"\xc1"),
    "a header that is not a map": framed(b"\x05"),
    "a head announcing frames it cannot have": b"\xff\xff\xff\xff" + b"\x00" * 8,
}


@pytest.mark.parametrize("what", list(GARBAGE))
def test_garbage_on_the_runners_socket_crashes_its_task_and_the_next_task_runs(
        live_agent, what):  # noqa: F811
    agent, runner = live_agent, live_agent.runners[0]
    first_pid = runner.proc.pid
    _give(agent, 1, fn=writing_on_the_runners_socket(GARBAGE[what]))
    _pump(agent, lambda: "task-1" in _results(agent), "the first task's result")
    assert _results(agent) == {"task-1": "crashed"}
    result = next(m.header for m in agent.sent if m.command is Command.RESULT)
    assert "unreadable message on its control socket" in result["diagnosis"]
    assert runner.proc.pid != first_pid and runner.proc.poll() is None  # a new one, running
    _pump(agent, lambda: runner.ready, "the new runner")
    _give(agent, 2)
    _pump(agent, lambda: "task-2" in _results(agent), "the next task's result")
    assert _results(agent)["task-2"] == "ok"


def test_a_runner_that_stops_in_the_middle_of_a_message_does_not_hold_the_agent(
        live_agent, monkeypatch):  # noqa: F811
    monkeypatch.setattr(runners, "READ_STALL", 0.3)
    agent = live_agent
    half = GARBAGE["a header that is not a map"][:7]  # 7 of the head's 12 bytes

    write = writing_on_the_runners_socket(half)  # a closure: it travels with the task

    def stall(i):
        write(i)
        import time as clock
        clock.sleep(60)  # the rest never comes
        return i

    first_pid = agent.runners[0].proc.pid
    _give(agent, 1, fn=stall)
    # Well inside the task's minute: waiting it out would fail here.
    _pump(agent, lambda: "task-1" in _results(agent), "the stalled task's result", timeout=50)
    assert agent.runners[0].proc.pid != first_pid  # the stalled runner killed, not waited for
    result = next(m.header for m in agent.sent if m.command is Command.RESULT)
    assert result["status"] == "crashed"
    assert "did not come whole within 0.3 s" in result["diagnosis"]


def test_a_read_with_a_stall_limit_takes_a_whole_message_and_refuses_half_of_one():
    a, b = socket.socketpair()
    with a, b:
        send_message(a, [b"header", b"x" * 100_000])  # more than one read's worth
        assert [bytes(f) for f in recv_message(b, 1 << 20, stall=0.2)] == [b"header", b"x" * 100_000]
        whole = framed(b"header", b"frame")
        a.sendall(whole[:-3])
        with pytest.raises(ValueError, match="did not come whole within 0.2 s"):
            recv_message(b, 1 << 20, stall=0.2)


def test_a_message_trickled_a_byte_at_a_time_is_refused_when_its_time_is_up():
    # The limit is the message's, not each read's: a byte every 0.1 s would otherwise hold
    # the reader as long as the writer liked.
    import threading

    a, b = socket.socketpair()
    whole = framed(b"header", b"frame")
    stop = threading.Event()
    sent = [0]

    def trickle():
        for byte in whole:
            if stop.wait(0.1):
                return
            a.send(bytes([byte]))
            sent[0] += 1

    writer = threading.Thread(target=trickle, daemon=True)
    with a, b:
        writer.start()
        with pytest.raises(ValueError, match="did not come whole within 0.3 s"):
            recv_message(b, 1 << 20, stall=0.3)
        assert sent[0] < len(whole)  # refused while the trickle went on, not after it
        stop.set()
        writer.join(5)


def test_a_result_keeps_only_the_fields_a_result_carries_with_its_text_cut():
    header = {"status": "error", "ran": 0.5, "granted": 10**6, "task": "someone else's",
              "error": {"type": "ValueError", "message": "m" * 600_000, "traceback": "t" * 600_000,
                        "extra": 1}}
    result = checked_result(header)
    assert result == {"status": "error", "ran": 0.5, "error": {
        "type": "ValueError", "message": "m" * MAX_ERROR_MESSAGE, "traceback": "t" * MAX_TRACEBACK}}
    assert checked_result({"status": "crashed", "diagnosis": "d" * 100_000}) == {
        "status": "crashed", "diagnosis": "d" * MAX_DIAGNOSIS}
    assert checked_result({"status": "ok", "encoding": "json", "shm": [[0, "ab", 3]]}) == {
        "status": "ok", "encoding": "json", "shm": [[0, "ab", 3]]}
    wide = checked_result({"status": "error", "error": {"message": "\U0001f525" * 300_000,
                                                        "traceback": "é" * 300_000}})
    assert len(wide["error"]["message"].encode()) <= MAX_ERROR_MESSAGE  # bytes, not characters
    assert wide["error"]["message"] == "\U0001f525" * (MAX_ERROR_MESSAGE // 4)
    assert len(wide["error"]["traceback"].encode()) <= MAX_TRACEBACK
    for ran in (math.nan, -1.0, math.inf, "0.5", 1):
        assert "ran" not in checked_result({"status": "ok", "ran": ran})
    assert checked_result({"status": "error", "error": {"message": 5}})["error"] == {
        "type": "Exception", "message": "", "traceback": ""}


@pytest.mark.parametrize("header, why", [
    ({}, "its status is None"),
    ({"status": "unschedulable"}, "its status is 'unschedulable'"),
    ({"status": ["ok"]}, "its status is ['ok']"),
    ({"status": "ok", "encoding": "yaml"}, "its encoding is 'yaml'"),
    ({"status": "error", "error": "boom"}, "its error is 'boom'"),
    ({"status": "ok", "shm": "a file"}, "its shared frames are 'a file'"),
    ({"status": "ok", "shm": [[0]] * 5000}, "its shared frames are"),
])
def test_a_result_the_worker_cannot_read_makes_its_task_crashed_with_the_reason(header, why):
    result = checked_result(header)
    assert result["status"] == "crashed" and set(result) == {"status", "diagnosis"}
    assert result["diagnosis"].startswith("the runner reported a result the worker cannot read: "
                                          + why)
    assert len(result["diagnosis"]) < 300


def test_a_task_that_closes_its_runners_socket_costs_that_runner_not_the_agents_loop(
        live_agent, monkeypatch):  # noqa: F811
    # Its end of the socket closed, the runner ran on: the agent waited 5 s to reap it, then
    # started a new runner and left this one running beside it.
    agent, runner = live_agent, live_agent.runners[0]
    old = runner.proc

    def close_and_linger(i):
        import os as system
        import sys as interpreter
        import time as clock
        system.close(int(interpreter.argv[1]))
        clock.sleep(60)
        return i

    from gpumesh.worker.agent import DYING_GRACE

    waits: list[float] = []
    reap = runners.Runner.reap
    monkeypatch.setattr(runners.Runner, "reap", lambda self, timeout=5.0: (
        waits.append(timeout), reap(self, timeout))[1])
    _give(agent, 1, fn=close_and_linger)
    _pump(agent, lambda: "task-1" in _results(agent), "the task's result", timeout=10)
    # The live runner was given its grace (before: a reap's 5 s), then killed; the reap that
    # follows SIGKILL returns as the process dies.
    assert waits[0] == DYING_GRACE and len(waits) == 2
    result = next(m.header for m in agent.sent if m.command is Command.RESULT)
    assert result["status"] == "crashed"
    assert result["diagnosis"].startswith("the runner's control socket closed, and the runner "
                                          "had not exited 1 s later (killed)")
    assert old.poll() is not None  # killed, not left running
    assert runner.proc is not old and runner.proc.poll() is None


def test_a_killed_runner_slow_to_go_is_reaped_later_not_waited_for(
        live_agent, monkeypatch):  # noqa: F811
    # Four GPU slots timing out together: each kill waited up to 5 s for its CUDA process to
    # go, one after another, past the heartbeat, and the worker was declared lost.
    import subprocess
    import time

    agent, runner = live_agent, live_agent.runners[0]
    old = runner.proc
    real_wait = old.wait
    slow = [1]  # its first wait times out, as a process still releasing a GPU would

    def slow_wait(timeout=None):
        if slow[0]:
            slow[0] -= 1
            raise subprocess.TimeoutExpired(old.args, timeout)
        return real_wait(timeout)

    monkeypatch.setattr(old, "wait", slow_wait)
    began = time.monotonic()
    agent._restart(runner)
    assert time.monotonic() - began < 2.0
    assert runner.dying == [old] and runner.proc is not old
    _pump(agent, lambda: runner.ready, "the new runner")
    assert not runner.dying  # the agent's turn collected it once it went
    assert old.poll() is not None
    _give(agent, 1)
    _pump(agent, lambda: "task-1" in _results(agent), "a task on the new runner")


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text")


@pytest.mark.parametrize("raised", [ValueError("bad \udc80 byte"), _Unprintable()])
def test_an_exception_whose_text_msgpack_cannot_take_still_comes_back(raised):
    # Lone surrogates in its text once made the runner's header unpackable (the runner
    # exited and the task was reported crashed); a __str__ that raises did much the same.
    import msgpack

    from gpumesh.runner.execute import _error

    header, frames = _error(raised)
    msgpack.packb(header, use_bin_type=True)  # the runner can send it
    assert header["status"] == "error" and frames  # and the exception itself, pickled
    if isinstance(raised, ValueError):
        assert header["error"]["message"] == "bad \\udc80 byte"
    else:
        assert header["error"]["message"] == "(its text could not be made: RuntimeError)"


class _ExitsOnLoad:
    """An argument whose unpickling calls sys.exit(), as a module with a top-level
    ``argparse.parse_args()`` or version check does when the function's pickle imports it."""

    def __reduce__(self):
        import sys as system
        return (system.exit, ("needs another version",))


class _ExitsOnStr(Exception):
    def __str__(self):
        raise SystemExit(3)


def test_a_sys_exit_while_loading_the_task_or_reading_its_error_is_an_error_result():
    # It ended the runner: the task came back crashed, and was retried on every worker,
    # each time killing a runner and the tasks handed ahead to it.
    from gpumesh.protocol import serialize
    from gpumesh.runner.execute import _error, run_function

    frames = [*serialize.dumps(len), *serialize.dumps(((_ExitsOnLoad(),), {}))]
    header, _ = run_function({"task": "t"}, frames)
    assert header["status"] == "error" and header["error"]["type"] == "builtins.SystemExit"
    assert "could not be unpickled" in header["error"]["message"]
    header, _ = _error(_ExitsOnStr())
    assert header["error"]["message"] == "(its text could not be made: SystemExit)"


class _Carries(Exception):
    def __init__(self, blob):
        super().__init__("the batch was bad")
        self.blob = blob


def test_an_error_keeps_its_type_and_text_when_the_exception_is_too_big_to_send(monkeypatch):
    # A result over the room was made ResultTooLarge, whatever the task raised; and a message
    # of hundreds of MB made a header over the agent's read limit (the runner taken for broken).
    from gpumesh.runner import execute

    monkeypatch.setattr(execute.fit_to_send, "__defaults__", (100_000, 4093))
    header, frames = execute._error(_Carries(b"x" * 200_000))
    assert frames == [] and header["error"]["type"].endswith("_Carries")
    assert header["error"]["message"] == ("(the exception itself was too large to send: "
                                          "raised as RemoteError) the batch was bad")
    header, frames = execute._error(ValueError("v" * (3 * MAX_ERROR_MESSAGE)))
    assert len(header["error"]["message"]) == MAX_ERROR_MESSAGE and frames  # small pickled
    assert len(header["error"]["traceback"]) <= MAX_TRACEBACK


def test_what_is_handed_ahead_counts_its_header_and_env_against_the_socket():
    from gpumesh.worker.runners import QueuedTask, RunningTask

    env = {f"VAR_{i}": "v" * 100 for i in range(50)}  # about 5 KiB, as a submitter may send
    task = RunningTask("t", 1, started=0.0, deadline=None, header={"env": env})
    queued = QueuedTask(task, {"task": "t", "shm": [["n" * 40, 0, 1 << 20]] * 20}, [b"x" * 10])
    assert queued.socket_bytes > 5000 + 20 * 40



def test_a_failed_scripts_last_error_line_is_kept_while_the_agent_reads_slowly(monkeypatch):
    # The relay, blocked writing to an agent not reading, was left after OUTPUT_GRACE: the end
    # of stderr (the traceback's last line) was lost from the error. Here the agent starts
    # reading ten graces after the script began (the script itself exits at once).
    import os
    import threading

    from gpumesh.runner import execute

    monkeypatch.setattr(execute, "OUTPUT_GRACE", 0.1)
    read_end, write_end = os.pipe()
    saved = os.dup(2)
    drained: list[bytes] = []

    def agent_reads() -> None:
        while chunk := os.read(read_end, 65536):
            drained.append(chunk)

    late_reader = threading.Timer(1.0, agent_reads)
    late_reader.start()
    script = (b"import sys\nsys.stderr.write('x' * 90000 + '\\n')\n"
              b"raise SystemExit('the last line')\n")
    try:
        os.dup2(write_end, 2)
        header, _ = execute.run_script({"kind": "script", "name": "slow"}, [script, b"{}"],
                                       dict(os.environ))
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(write_end)
    late_reader.join(10)
    os.close(read_end)
    assert header["status"] == "error"
    assert header["error"]["message"].endswith("the last line")


def _calls_a_helper(x):
    return _helper_that_raises(x)


def _helper_that_raises(x):
    raise KeyError(x)


def test_a_tasks_traceback_starts_at_its_own_function_not_the_runner():
    from gpumesh.protocol import serialize
    from gpumesh.runner.execute import run_function

    fn = serialize.dumps(_calls_a_helper)
    header, _ = run_function({"task": "t"}, [*fn, *serialize.dumps(((1,), {}))])
    text = header["error"]["traceback"]
    first = text.splitlines()[1]  # after "Traceback (most recent call last):"
    assert "_calls_a_helper" in first and "_helper_that_raises" in text
    assert "execute.py" not in text
    # Nothing of the task ran (its arguments do not fit it): the runner's line is all there is.
    header, _ = run_function({"task": "t"}, [*fn, *serialize.dumps(((1, 2), {}))])
    assert header["error"]["type"] == "builtins.TypeError"
    assert "run_function" in header["error"]["traceback"]
