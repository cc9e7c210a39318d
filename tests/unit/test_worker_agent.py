"""The worker agent's bookkeeping and its local control channel, without a coordinator.

The agent is built for real (its runners are never started); what it would send is captured.
"""

from __future__ import annotations

import os
import time

import msgpack
import pytest
import zmq

from gpumesh import clock
from gpumesh.config import Limits, Settings, parse_url
from gpumesh.protocol import Command, decode, encode
from gpumesh.worker.agent import COALESCE_WINDOW, WorkerAgent
from gpumesh.worker.control import ControlServer
from gpumesh.worker.runners import QueuedTask, RunningTask


def recording_agent(tmp_path, slots=1, info=None, **options):
    """A one-slot agent whose messages land, decoded, in ``agent.sent`` (never started)."""
    a = WorkerAgent(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}),
                    parse_url("tcp://127.0.0.1:9"), "t" * 32, slots=slots, info=info or {},
                    local_control=False, **options)
    a.sent = []
    a.link.send = lambda frames: a.sent.append(decode(frames, Limits())) or True
    a.link.post = lambda frames: a.sent.append(decode(frames, Limits()))  # flushed at once
    yield a
    a.link.close()
    a._ctx.term()


@pytest.fixture
def agent(tmp_path):
    yield from recording_agent(tmp_path)


def sent(a, command):
    return [m.header for m in a.sent if m.command is command]


def test_a_lease_aborted_at_welcome_whose_task_finished_meanwhile_is_not_credited_twice(agent):
    agent.runners[0].task = RunningTask("T", 77, 0.0, None, {})
    agent.session.hello()
    assert sent(agent, Command.HELLO)[-1]["credit"] == 0
    task, agent.runners[0].task = agent.runners[0].task, None
    agent._report(task, {"status": "ok"}, [b"x"], 1.0)  # finishes before WELCOME: +1
    agent.session.on_message(decode(encode(Command.WELCOME, {"abort": [77]}), Limits()), 1.0)
    assert agent.granted == 1  # one slot, nothing running: one grant, not two
    assert sent(agent, Command.CREDIT) == []


def test_tasks_handed_back_while_disconnected_travel_in_the_next_hello(agent):
    agent.session.welcomed = True
    agent._on_task(decode(encode(Command.TASK, {"task": "T", "lease": 5, "kind": "fn"}),
                          Limits()), 0.0)
    agent.session.welcomed = False  # the link dropped
    answer = agent.owner.on_control("pause", 1.0)
    assert answer["handed_back"] == 1 and sent(agent, Command.CREDIT) == []
    agent.session.hello()
    hello = sent(agent, Command.HELLO)[-1]
    assert hello["release"] == [5] and hello["mode"] == "paused" and hello["held"] == []
    agent.session.on_message(decode(encode(Command.WELCOME, {}), Limits()), 1.0)
    agent.session.hello()
    assert sent(agent, Command.HELLO)[-1]["release"] == []


@pytest.fixture
def control(tmp_path):
    ctx = zmq.Context()
    server = ControlServer(ctx, tmp_path, "w1", "tcp://127.0.0.1:9")
    client = ctx.socket(zmq.DEALER)  # DEALER: free to send anything, as a hostile local user
    client.linger = 0
    client.connect(f"tcp://127.0.0.1:{server.sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(':', 1)[1]}")
    yield server, client
    client.close()
    server.close()
    ctx.term()


def ask(server, client, *parts):
    client.send_multipart([b"", *parts])
    assert server.sock.poll(2000)
    server.serve(lambda action: {"done": action})
    assert client.poll(2000)
    return msgpack.unpackb(client.recv_multipart()[-1])


def test_the_control_channel_answers_garbage_without_falling_over(control):
    server, client = control
    good = msgpack.packb({"secret": server.secret, "action": "status"})
    assert "wrong secret" in ask(server, client, msgpack.packb({"secret": "\u00e9" * 32,
                                                                "action": "pause"}))["error"]
    assert "unreadable" in ask(server, client, good, b"extra part")["error"]
    assert "unreadable" in ask(server, client, b"\xc1 not msgpack")["error"]
    assert "unknown action" in ask(server, client, msgpack.packb(
        {"secret": server.secret, "action": "explode"}))["error"]
    assert ask(server, client, good) == {"done": "status"}
    assert oct(server.path.stat().st_mode & 0o777) == "0o600"


def test_a_flood_on_the_control_channel_is_answered_a_turn_at_a_time(control, monkeypatch):
    # Any local user can send requests; the agent's loop answers a bounded number a turn and
    # goes back to its coordinator and runners in between. Every request is still answered.
    from gpumesh.worker import control as control_module

    monkeypatch.setattr(control_module, "MAX_REQUESTS_PER_TURN", 5)
    server, client = control
    request = msgpack.packb({"secret": server.secret, "action": "status"})
    for _ in range(20):
        client.send_multipart([b"", request])
    handled: list[str] = []
    per_turn: list[int] = []
    while len(handled) < 20 and server.sock.poll(2000):
        before = len(handled)
        server.serve(lambda action: handled.append(action) or {"done": action})
        per_turn.append(len(handled) - before)
    assert len(handled) == 20 and max(per_turn) <= 5 and len(per_turn) >= 4
    answers = 0
    while answers < 20 and client.poll(2000):
        client.recv_multipart()
        answers += 1
    assert answers == 20  # each request its one reply


def test_each_slot_is_pinned_to_its_gpu_as_the_owner_numbered_them(tmp_path, monkeypatch):
    # torch numbers the GPUs this process sees: under the owner's CUDA_VISIBLE_DEVICES=2,3 its
    # 0 and 1 are physical 2 and 3, and the runners were pinned to 0 and 1, which the owner
    # had kept out.
    from gpumesh.worker.agent import visible_device

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, GPU-8f3a,MIG-1/2/3")
    a = WorkerAgent(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}),
                    parse_url("tcp://127.0.0.1:9"), "t" * 32, slots=3, info={},
                    gpu_indices=[0, 1, 2], local_control=False)
    try:
        pinned = [runner._env["CUDA_VISIBLE_DEVICES"] for runner in a.runners]
        assert pinned == ["2", "GPU-8f3a", "MIG-1/2/3"]
    finally:
        a.link.close()
        a._ctx.term()
    assert visible_device({}, 1) == "1"  # no list of the owner's: torch's index is the GPU's
    assert visible_device({"CUDA_VISIBLE_DEVICES": "5"}, 3) == "3"  # out of its list: as is


def test_a_task_no_slot_can_run_goes_back_as_crashed_instead_of_waiting_for_good(tmp_path):
    # --max-slots 1 on a two-GPU machine: the coordinator matched the worker as a whole (the
    # A100 it lists), but its one slot is pinned to the T4.
    gpus = [{"index": 0, "name": "NVIDIA T4", "vram": 16 * 10**9, "backend": "cuda"},
            {"index": 1, "name": "NVIDIA A100", "vram": 80 * 10**9, "backend": "cuda"}]
    gen = recording_agent(tmp_path, info={"gpus": gpus}, gpu_indices=[0, 1])
    a = next(gen)
    try:
        a.session.welcomed = True
        header = {"task": "big", "lease": 1, "kind": "fn", "need": {"vram": 40 * 10**9}}
        a._on_task(decode(encode(Command.TASK, header), Limits()), 0.0)
        (result,) = sent(a, Command.RESULT)
        assert result["status"] == "crashed" and not a.queue
        assert "no slot of this worker has a GPU" in result["diagnosis"]
        assert "vram=40.0GB" in result["diagnosis"]
        # And the coordinator is told only of the T4, so it sends no such task here at all.
        assert [g["name"] for g in a.info["gpus"]] == ["NVIDIA T4"]
    finally:
        next(gen, None)


def test_a_task_that_needs_a_gpu_model_starts_only_in_the_slot_pinned_to_it(tmp_path):
    gpus = [{"index": 0, "name": "NVIDIA T4", "vram": 16 * 10**9, "backend": "cuda"},
            {"index": 1, "name": "NVIDIA A100", "vram": 80 * 10**9, "backend": "cuda"}]
    a = WorkerAgent(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}),
                    parse_url("tcp://127.0.0.1:9"), "t" * 32, slots=2, info={"gpus": gpus},
                    gpu_indices=[0, 1], local_control=False)
    try:
        started = {}
        for runner in a.runners:
            runner.ready = True
            runner.send = (lambda r: lambda task, header, frames: (
                started.__setitem__(task.task_id, r.slot), setattr(r, "task", task)))(runner)
        a.session.welcomed = True
        for task_id, need in (("a100", {"gpu": "A100"}), ("big", {"vram": 40 * 10**9}),
                              ("any", None)):
            header = {"task": task_id, "lease": len(started) + 1, "kind": "fn"}
            if need:
                header["need"] = need
            a._on_task(decode(encode(Command.TASK, header), Limits()), 0.0)
        # Slot 1 (the A100) takes the A100 task; the 40 GB task waits for it; "any" takes slot 0.
        assert started == {"a100": 1, "any": 0}
        assert [q.task.task_id for q in a.queue] == ["big"]
        a.runners[1].task = None
        a._start_queued(1.0)
        assert started["big"] == 1
    finally:
        a.link.close()
        a._ctx.term()


def test_pass_env_reaches_every_runner_and_a_tasks_env_reaches_its_runner(tmp_path, monkeypatch):
    import socket

    from gpumesh.runner.pipe import recv_message

    monkeypatch.setenv("GM_OWNER_PASSES", "yes")
    monkeypatch.setenv("GM_OWNER_KEEPS", "no")
    a = WorkerAgent(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}),
                    parse_url("tcp://127.0.0.1:9"), "t" * 32, slots=2, info={},
                    local_control=False, pass_env=["GM_OWNER_PASSES"])
    try:
        for runner in a.runners:
            assert runner._env["GM_OWNER_PASSES"] == "yes"
            assert "GM_OWNER_KEEPS" not in runner._env and "GPUMESH_TOKEN" not in runner._env
        runner = a.runners[0]
        runner.control, theirs = socket.socketpair()
        task = RunningTask("T", 1, 0.0, None, {"task": "T", "env": {"GM_X": "1"}})
        runner.send(task, {"kind": "fn", "fn": "", "name": ""}, [b"f", b"a"])
        header, *_ = recv_message(theirs, 1 << 20)
        assert msgpack.unpackb(header)["env"] == {"GM_X": "1"}
        theirs.close()
        runner.control.close()
    finally:
        a.link.close()
        a._ctx.term()


def test_an_outage_is_said_once_when_it_starts_and_once_when_it_ends(agent):
    lines: list[str] = []
    agent.say = lines.append
    agent.joined_once = True
    for now, delay in ((10.0, 1.0), (12.0, 2.0), (15.0, 4.0), (20.0, 8.0)):
        agent.on_lost(now, delay, was_welcomed=now == 10.0)
    agent.session.on_message(decode(encode(Command.WELCOME, {}), Limits()), 22.0)
    # The coordinator restarting without a silence (NO_SESSION, then WELCOME) says nothing.
    agent.session.on_message(decode(encode(Command.ERROR, {"code": "no_session"}), Limits()), 23.0)
    agent.session.on_message(decode(encode(Command.WELCOME, {}), Limits()), 23.1)
    assert lines == ["[worker] lost the coordinator at tcp://127.0.0.1:9; retrying until it is "
                     "back (Ctrl+C to stop)",
                     "[worker] back: reconnected to tcp://127.0.0.1:9 after 12s away"]


def test_a_worker_that_never_joined_says_so_once_then_hints_after_a_minute(agent):
    lines: list[str] = []
    agent.say = lines.append
    agent._started_at = 0.0
    for now in (1.0, 3.0, 7.0, 15.0, 31.0, 63.0, 95.0):
        agent.on_lost(now, 1.0, was_welcomed=False)
    assert len(lines) == 2
    assert lines[0].startswith("[worker] cannot reach a coordinator at tcp://127.0.0.1:9 yet")
    assert lines[1].startswith("[worker] still no coordinator after 63s")


def test_a_discovered_worker_dials_its_coordinators_new_address(tmp_path):
    asked = []
    a = WorkerAgent(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}),
                    parse_url("tcp://127.0.0.1:9"), "t" * 32, slots=1, info={},
                    local_control=False, rediscover=lambda: asked.append(1) or "127.0.0.1:19")
    try:
        lines: list[str] = []
        a.say = lines.append
        a.on_lost(1.0, 1.0, was_welcomed=True)
        assert a._browsing is not None
        a._browsing.join(5)
        a.session.reconnect_at = time.time() + 30  # waiting out a long back-off
        a._follow_move()
        assert a.endpoint == a.link.endpoint == a.session.endpoint == parse_url("tcp://127.0.0.1:19")
        assert a.session.reconnect_at <= time.time()  # it dials the new address at once
        assert lines[-1] == "[worker] found the coordinator again on the LAN, now at tcp://127.0.0.1:19"
        a.on_lost(2.0, 2.0, was_welcomed=False)
        a._browsing.join(5)
        a._follow_move()  # found where it already dials: nothing to say
        assert len(asked) == 2 and lines[-1].endswith("now at tcp://127.0.0.1:19")
        assert sum("found the coordinator again" in line for line in lines) == 1
    finally:
        a.link.close()
        a._ctx.term()


def test_a_worker_the_lan_sent_where_nobody_welcomes_it_alternates_with_the_address_that_did(
        tmp_path):
    # Anyone on the LAN can advertise the mesh's fingerprint at an address that accepts TCP
    # and stays silent: a worker that followed it after an outage stayed there for good.
    a = WorkerAgent(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}),
                    parse_url("tcp://127.0.0.1:9"), "t" * 32, slots=1, info={},
                    local_control=False, rediscover=lambda: "127.0.0.1:19")
    welcomed_at, suggested = parse_url("tcp://127.0.0.1:9"), parse_url("tcp://127.0.0.1:19")
    try:
        a.say = lambda line: None
        a._trusted = welcomed_at  # its coordinator welcomed it there once
        a.on_hello()  # a try at that address, under way when the LAN's suggestion comes
        a.on_lost(1.0, 1.0, was_welcomed=False)
        a._browsing.join(5)
        a._follow_move()
        assert a.endpoint == suggested
        a.on_lost(2.0, 1.0, was_welcomed=False)  # never dialled: it keeps its turn
        assert a.endpoint == suggested
        for now in (3.0, 5.0):
            a.on_hello()  # dialled, and silent
            a.on_lost(now, 1.0, was_welcomed=False)
            assert a.endpoint == a.link.endpoint == a.session.endpoint == welcomed_at
            a._browsing.join(5)
            a._follow_move()
            assert a.endpoint == suggested  # the LAN's suggestion is still tried, in turn
    finally:
        a.link.close()
        a._ctx.term()


def test_a_worker_started_while_its_saved_coordinator_is_down_is_not_diverted_for_good(
        tmp_path):
    # It has never been welcomed anywhere: the saved (or given) address is where it goes back
    # to, whether the LAN's suggestion stays silent or fails the handshake.
    from gpumesh.errors import AuthenticationError

    saved, impostor = parse_url("tcp://127.0.0.1:9"), parse_url("tcp://127.0.0.1:19")
    a = WorkerAgent(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}), saved, "t" * 32,
                    slots=1, info={}, local_control=False, rediscover=lambda: "127.0.0.1:19")
    try:
        lines: list[str] = []
        a.say = lines.append
        a.on_hello()
        a.on_lost(1.0, 1.0, was_welcomed=False)
        a._browsing.join(5)
        a._follow_move()
        assert a.endpoint == impostor
        a.on_hello()  # dialled, and silent
        a.on_lost(2.0, 1.0, was_welcomed=False)
        assert a.endpoint == a.link.endpoint == a.session.endpoint == saved
        a._browsing.join(5)
        a._follow_move()
        assert a.endpoint == impostor

        def refuse():
            raise AuthenticationError("authentication failed")

        a.link.monitor_events = refuse  # this one answers, with another mesh's keys
        assert a._link_events() == []
        assert a.endpoint == saved and "failed the handshake" in lines[-1]
    finally:
        a.link.close()
        a._ctx.term()


def test_an_address_found_on_the_lan_that_fails_the_handshake_says_to_pass_the_url(tmp_path):
    from gpumesh.errors import AuthenticationError

    a = WorkerAgent(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}),
                    parse_url("tcp://127.0.0.1:19"), "t" * 32, slots=1, info={},
                    local_control=False, rediscover=lambda: None, found_on_lan=True)
    try:
        def refuse():
            raise AuthenticationError("authentication failed: the token does not match")

        a.link.monitor_events = refuse
        with pytest.raises(AuthenticationError) as info:
            a._link_events()
        assert "found on the LAN, failed the handshake" in str(info.value)
        assert "gpumesh join tcp://HOST:PORT" in str(info.value)
    finally:
        a.link.close()
        a._ctx.term()


def test_a_joining_worker_hears_how_it_differs_from_its_coordinator():
    from gpumesh._version import __version__
    from gpumesh.worker.agent import version_notes

    assert version_notes({"python": "3.11"}, {"python": "3.11", "gpumesh": __version__}) == []
    (python,) = version_notes({"python": "3.12"}, {"python": "3.11", "gpumesh": __version__})
    assert "runs Python 3.12 and the coordinator Python 3.11" in python
    (version,) = version_notes({"python": "3.11"}, {"python": "3.11", "gpumesh": "9.9.9"})
    assert "install gpumesh 9.9.9 here" in version
    # Whatever a coordinator sends, nothing odd is echoed to the owner's terminal.
    assert version_notes({"python": "3.11"}, {"python": "\x1b[2J3.1", "gpumesh": "x" * 500}) == []
    assert version_notes({"python": "3.11"}, {"python": 3.12, "gpumesh": ["1"]}) == []


def test_an_impostor_found_on_the_lan_sends_the_worker_back_not_out(agent):
    from gpumesh.errors import AuthenticationError

    lines: list[str] = []
    agent.say = lines.append
    home, impostor = parse_url("tcp://127.0.0.1:9"), parse_url("tcp://127.0.0.1:19")
    agent.session.on_message(decode(encode(Command.WELCOME, {}), Limits()), 1.0)  # home admits us

    def refuse():
        raise AuthenticationError("authentication failed")

    agent.endpoint = agent.link.endpoint = agent.session.endpoint = impostor  # moved by a browse
    agent.link.monitor_events = refuse
    assert agent._link_events() == []
    assert agent.endpoint == agent.link.endpoint == agent.session.endpoint == home
    assert "failed the handshake: it is not this mesh's coordinator" in lines[-1]
    assert agent.sent[-1].command is Command.HELLO
    with pytest.raises(AuthenticationError):  # at the address that admitted us: a real refusal
        agent._link_events()


def test_results_of_tiny_tasks_wait_a_moment_for_those_after_them_and_a_lone_one_does_not(agent):
    agent.link._outbox.append(encode(Command.RESULT, {"task": "T1"}))  # posted this turn
    agent._mean_run = 0.0001
    assert not agent._coalescing(10.0), "nothing queued behind it: a single call's result waits"
    agent.queue.extend(QueuedTask(RunningTask(f"Q{i}", i, 0.0, None, {}), {}, []) for i in range(4))
    assert agent._coalescing(10.0)
    assert agent._coalescing(10.0 + COALESCE_WINDOW / 2)
    assert not agent._coalescing(10.0 + COALESCE_WINDOW), "held no longer than the window"
    agent._posted_at = None
    agent._mean_run = 0.05
    assert not agent._coalescing(11.0), "tasks this long: every result goes at once"


def test_a_leaving_worker_says_so_and_lingers_for_it_to_go_out(agent):
    from gpumesh.worker.agent import GOODBYE_LINGER_MS

    agent.session.welcomed = True
    assert agent._goodbye_linger == 0  # a worker that never said goodbye closes at once
    agent._leave()
    assert sent(agent, Command.DISCONNECT) == [{"reason": "left"}]
    # A coordinator before 1.6 (no WELCOME `goodbye`): run() closes its socket with this
    # linger, so a goodbye queued behind a slow I/O thread is not dropped (a fixed 50 ms nap
    # lost it on a loaded machine; test_json_logs saw it).
    assert agent._goodbye_linger == GOODBYE_LINGER_MS


def test_a_worker_whose_coordinator_answers_goodbyes_waits_for_the_answer_not_the_linger(
        agent, monkeypatch):
    agent.session.on_message(decode(encode(Command.WELCOME, {"goodbye": True}), Limits()), 1.0)
    assert agent._goodbye_answered and agent.session.welcomed
    waits = []
    monkeypatch.setattr(agent, "_await_goodbye", waits.append)
    agent._leave()
    assert sent(agent, Command.DISCONNECT) == [{"reason": "left"}]
    assert len(waits) == 1 and agent._goodbye_linger == 0
    agent.session.on_message(decode(encode(Command.WELCOME, {}), Limits()), 2.0)
    assert not agent._goodbye_answered  # a coordinator that does not say so: no waiting


class _Replies:
    """A coordinator's side of the link for ``_await_goodbye``: what arrives, and the polls."""

    def __init__(self, agent, monkeypatch, replies):
        self.replies, self.polls = list(replies), []
        monkeypatch.setattr(agent.link, "sock", self)
        monkeypatch.setattr(agent.link, "recv",
                            lambda: self.replies.pop(0) if self.replies else None)

    def poll(self, timeout_ms):
        self.polls.append(timeout_ms)
        return 0


def test_a_leaving_worker_exits_once_the_coordinator_answered_its_goodbye(agent, monkeypatch):
    import time

    late_task = decode(encode(Command.TASK, {"task": "T", "lease": 1}), Limits())
    answer = decode(encode(Command.DISCONNECT, {"reason": "left"}), Limits())
    link = _Replies(agent, monkeypatch, [late_task, answer, late_task])
    agent._await_goodbye(time.monotonic() + 60)
    # The task sent before the coordinator read the goodbye is passed over (it was requeued);
    # the answer ends the wait at once, with no poll, and what follows it is not read.
    assert link.polls == [] and link.replies == [late_task]


def test_a_goodbye_nobody_answers_is_waited_for_until_its_deadline_and_no_longer(agent,
                                                                                monkeypatch):
    import time

    link = _Replies(agent, monkeypatch, [])
    agent._await_goodbye(time.monotonic() + 0.5)
    assert len(link.polls) == 1 and 0 < link.polls[0] <= 501  # one poll for what was left
    link.polls.clear()
    agent._await_goodbye(time.monotonic() - 1)  # already past: not even a poll
    assert link.polls == []


def test_a_result_whose_shared_files_went_with_their_folder_makes_the_task_run_again(agent,
                                                                                      tmp_path):
    # Held unacknowledged across a reconnect to a coordinator with another folder; the old
    # folder is gone (a cleaned /dev/shm): the result cannot be sent, so it must not stop the
    # re-sending of the others, and the task runs again.
    gone = {"task": "T1", "lease": 5, "status": "ok", "elapsed": 0.1,
            "shm": [[0, "a" * 32, 10]], "_shm_dir": str(tmp_path / "gone")}
    kept = {"task": "T2", "lease": 6, "status": "ok", "elapsed": 0.1}
    agent.unacked = {5: (gone, [b""]), 6: (kept, [b"x"])}
    agent.session.on_message(decode(encode(Command.WELCOME, {}), Limits()), 1.0)
    results = {r["task"]: r for r in sent(agent, Command.RESULT)}
    assert results["T1"]["status"] == "crashed" and "lost" in results["T1"]["diagnosis"]
    assert "shm" not in results["T1"] and results["T2"]["status"] == "ok"


def test_a_result_the_agent_put_in_shared_memory_names_the_same_file_each_time_it_is_sent(
        agent, folder):
    # A copy of its own at each reconnect stayed in /dev/shm for as long as the agent ran: its
    # files bear the agent's owner prefix, and a live owner's files are never swept.
    from gpumesh.protocol.refs import NAME_PATTERN

    big = bytes(4 * 1024 * 1024)
    agent.unacked = {5: ({"task": "T1", "lease": 5, "status": "ok", "elapsed": 0.1}, [big])}
    for _ in range(2):
        agent.session.on_message(decode(encode(Command.WELCOME, {"shm": folder.offer()}),
                                        Limits()), 1.0)
    first, second = (r["shm"] for r in sent(agent, Command.RESULT))
    assert first == second
    assert [n for n in os.listdir(folder.path) if NAME_PATTERN.fullmatch(n)] == [first[0][1]]


@pytest.mark.parametrize("how", ["cancelled", "runner died"])
def test_what_a_runner_wrote_for_a_task_stopped_before_it_said_so_goes(agent, folder,
                                                                       monkeypatch, how):
    # Its file bears this agent's prefix: the coordinator keeps a live owner's files, so
    # nothing else would remove it while the agent runs.
    from gpumesh.shmowners import tagged

    runner = agent.runners[0]
    monkeypatch.setattr(runner, "kill", lambda: None)
    monkeypatch.setattr(runner, "start", lambda: None)
    monkeypatch.setattr(runner, "reap", lambda timeout: -9)
    agent.session.on_message(decode(encode(Command.WELCOME, {"shm": folder.offer()}),
                                    Limits()), 1.0)
    start = tagged(agent._shm_owner, 1)
    unsent = start + "0" * 8  # as its runner names a result of that task (runner/__main__.py)
    other = tagged(agent._shm_owner, 2) + "0" * 8  # another task's, waiting to be acknowledged
    own = agent._shm_owner + "1" + "0" * 15  # one the agent wrote itself
    for name in (unsent, other, own):
        (folder.path / name).write_bytes(b"result")
    runner.task = RunningTask("T", 77, 0.0, None, {"_shm_dir": str(folder.path),
                                                   "_shm_start": start})
    if how == "cancelled":
        assert agent._cancel(77, 1.0, report=True)
    else:
        agent._runner_died(runner, 1.0, what="killed by the OOM killer")
    assert not (folder.path / unsent).exists()
    assert (folder.path / other).exists() and (folder.path / own).exists()


def test_tasks_a_runner_gives_back_go_back_under_new_tags_and_the_old_ones_files_go(
        agent, folder):
    # The runner may have started one after all (a drop it read too late) and written its
    # result: under the old tag, removed once that runner starts again, while the task runs
    # elsewhere under a new tag, which nothing removes by mistake.
    from gpumesh.shmowners import tagged

    agent.session.on_message(decode(encode(Command.WELCOME, {"shm": folder.offer()}),
                                    Limits()), 1.0)
    for lease in (5, 6):
        agent._on_task(decode(encode(Command.TASK, {"task": f"T{lease}", "lease": lease,
                                                     "kind": "fn"}, [b"fn", b"args"]),
                              Limits()), 1.0)
    runner = agent.runners[0]
    given = list(agent.queue)
    agent.queue.clear()
    runner.ahead.extend((queued, f"nonce-{i}") for i, queued in enumerate(given))
    old = [q.header["shm_owner"] for q in given]
    written = old[0] + "0" * 8  # what the runner wrote for T5 before it saw the drop
    (folder.path / written).write_bytes(b"result")
    agent._requeue_front(runner.take_back())
    new = [q.header["shm_owner"] for q in agent.queue]
    assert [q.task.task_id for q in agent.queue] == ["T5", "T6"]
    assert set(new).isdisjoint(old) and [q.task.header["_shm_start"] for q in agent.queue] == new
    assert new[0] == tagged(agent._shm_owner, 3)
    runs_elsewhere = new[0] + "0" * 8  # T5 again, on another runner, before this one restarts
    (folder.path / runs_elsewhere).write_bytes(b"result")
    assert (folder.path / written).exists()  # nothing goes while the old process may write
    try:
        runner.start()  # the process given them is gone: what it wrote for them goes
        assert not (folder.path / written).exists() and (folder.path / runs_elsewhere).exists()
    finally:
        runner.kill()


def test_each_task_gets_a_tag_of_its_own_though_leases_repeat_across_coordinator_runs(agent,
                                                                                      folder):
    # Lease ids are (epoch << 40) | a count that starts again with each coordinator run: a tag
    # made of the lease would let stopping one task remove another's finished result.
    from gpumesh.protocol.refs import NAME_PATTERN
    from gpumesh.shmowners import frame_name

    agent.session.on_message(decode(encode(Command.WELCOME, {"shm": folder.offer()}),
                                    Limits()), 1.0)
    for epoch in (1, 2):
        agent._on_task(decode(encode(Command.TASK, {"task": f"T{epoch}", "lease": epoch << 40 | 5,
                                                     "kind": "fn"}, [b"fn", b"args"]),
                              Limits()), 1.0)
    starts = [q.header["shm_owner"] for q in agent.queue]
    assert len(set(starts)) == 2 and all(s.startswith(agent._shm_owner) for s in starts)
    assert [q.task.header["_shm_start"] for q in agent.queue] == starts
    for start in starts:
        assert NAME_PATTERN.fullmatch(frame_name(start))
        assert not frame_name(agent._shm_owner).startswith(start)  # the agent's own never match


def test_lease_ids_that_are_not_numbers_are_left_out_and_the_rest_of_the_message_is_done(agent):
    # One bad item once raised out of on_welcome, after the session was welcomed: results
    # waiting for acknowledgement were not sent again, and the worker never said it joined.
    agent.unacked[5] = ({"task": "old", "lease": 5, "status": "ok"}, [])
    agent.session.hello()
    agent.session.on_message(decode(encode(Command.WELCOME, {
        "abort": ["x", None, True, -1, 1.0, [3]]}), Limits()), 1.0)
    assert agent.joined_once and agent.welcomed
    assert [h["task"] for h in sent(agent, Command.RESULT)] == ["old"]
    agent.session.on_message(decode(encode(Command.CANCEL, {"leases": ["x", 9]}), Limits()), 2.0)
    agent.session.on_message(decode(encode(Command.RESULT_ACK, {"lease": "5"}), Limits()), 2.0)
    assert 5 in agent.unacked  # not a lease id: acknowledges nothing
    agent.session.on_message(decode(encode(Command.RESULT_ACK, {"lease": 5}), Limits()), 2.0)
    assert agent.unacked == {}
    agent.session.on_message(decode(encode(Command.TASK, {"task": "T", "lease": "seven",
                                                          "kind": "fn"}), Limits()), 3.0)
    agent.session.on_message(decode(encode(Command.TASK, {"task": 7, "lease": 7,
                                                          "kind": "fn"}), Limits()), 3.0)
    assert not agent.queue and agent.runners[0].task is None  # neither could be reported


@pytest.fixture
def auto_agent(tmp_path):
    """As ``agent``, with join's own prefetch (auto)."""
    yield from recording_agent(tmp_path, prefetch=None)


def test_the_depth_the_coordinator_bounds_sends_by_rises_with_the_agent_s_own(auto_agent):
    agent = auto_agent
    agent.session.hello()
    assert sent(agent, Command.HELLO)[-1]["prefetch"] == 64  # the bound until a CREDIT lowers it
    agent.session.on_message(decode(encode(Command.WELCOME, {}), Limits()), 0.0)
    agent._note_run_time(0.004)  # short: a depth of 3 (0.01 s of them), within HELLO's bound
    assert agent._granted_depth == 3 and sent(agent, Command.CREDIT) == []
    agent.send_credit()  # any CREDIT says the depth: the coordinator's bound is now 3
    assert sent(agent, Command.CREDIT)[-1]["depth"] == 3
    for _ in range(30):
        agent._note_run_time(0.00005)  # shorter still: the depth rises to 64, and is said
    depths = [c["depth"] for c in sent(agent, Command.CREDIT)]
    assert depths[-1] == agent._granted_depth == 64 and depths == sorted(depths)
    agent.session.hello()  # a new session: HELLO's prefetch bounds it again, nothing more said
    before = len(sent(agent, Command.CREDIT))
    agent._note_run_time(0.00005)
    assert len(sent(agent, Command.CREDIT)) == before


def test_queued_tasks_go_back_once_every_slot_runs_a_long_task(auto_agent):
    from gpumesh.worker.agent import AHEAD_HAND_BACK

    agent = auto_agent
    agent.session.hello()
    agent.session.on_message(decode(encode(Command.WELCOME, {}), Limits()), 0.0)
    for _ in range(10):
        agent._note_run_time(0.00005)
    runner = agent.runners[0]
    runner.task = RunningTask("running", 1, 10.0, None, {})
    agent.queue.extend(QueuedTask(RunningTask(f"t{i}", 2 + i, 10.0, None, {}), {}, [])
                       for i in range(3))
    runner.ahead.append((QueuedTask(RunningTask("ahead", 9, 10.0, None, {}), {}, []), "n1"))
    assert agent._poll_timeout() <= 200  # it wakes when the running task has run 0.2 s
    agent._hand_back_waiting(10.1)  # the running task is 0.1 s old: it may yet be short
    assert len(agent.queue) == 3
    agent._hand_back_waiting(10.3)
    assert not agent.queue and agent._granted_depth == 0
    credit = sent(agent, Command.CREDIT)[-1]
    assert credit["release"] == [2, 3, 4] and credit["depth"] == 0
    # The one handed ahead stays with its runner (dropping it restarts the runner) until its
    # task has run AHEAD_HAND_BACK: an occasional slow task keeps its runner warm.
    assert runner.ahead and not runner.restart_after_task
    agent._hand_back_waiting(10.0 + AHEAD_HAND_BACK + 0.1)
    assert not runner.ahead and sent(agent, Command.CREDIT)[-1]["release"] == [9]
    # A task that arrives after the hand-back goes back too; then nothing is due.
    agent.queue.append(QueuedTask(RunningTask("late", 11, 13.0, None, {}), {}, []))
    agent._hand_back_waiting(13.0)
    assert not agent.queue and sent(agent, Command.CREDIT)[-1]["release"] == [11]
    assert agent._hand_back_due(13.0) is None
    agent._note_run_time(0.00005)  # short tasks again: the depth rises, and is said
    assert sent(agent, Command.CREDIT)[-1]["depth"] > 0


def _long_task_just_ended(runner, monkeypatch, agent):
    """``runner`` runs a long task with one handed ahead; reading what it wrote (as the agent
    does first) finds that task ended and the one ahead started."""
    runner.task = RunningTask("long", 1, 10.0, None, {})
    runner.ahead.append((QueuedTask(RunningTask("ahead", 9, 10.0, None, {}), {}, []), "n1"))
    runner.control = object()  # a live runner (what it wrote is read by the stand-in below)

    def wrote(r, now, *, dead):
        r.ahead.popleft()
        r.task = RunningTask("ahead", 9, now, None, {})
        return True

    monkeypatch.setattr(agent, "_read_written", wrote)


@pytest.mark.parametrize("slots", [1, 2])
def test_a_task_handed_ahead_that_started_meanwhile_is_not_handed_back_or_moved(tmp_path,
                                                                               monkeypatch,
                                                                               slots):
    # Dropped without reading what the runner wrote, a task that had started (or finished)
    # went back to the coordinator or to another slot, and ran twice, side effects and all.
    from gpumesh.worker.agent import AHEAD_HAND_BACK

    for agent in recording_agent(tmp_path, slots=slots, prefetch=None):
        agent.session.hello()
        agent.session.on_message(decode(encode(Command.WELCOME, {}), Limits()), 0.0)
        runner = agent.runners[0]
        _long_task_just_ended(runner, monkeypatch, agent)
        try:
            now = 10.0 + AHEAD_HAND_BACK + 0.1
            if slots == 1:
                agent._hand_back_waiting(now)  # every slot runs a long task: hand back
            else:
                agent._move_stuck_ahead([agent.runners[1]], now)  # a free slot: move it there
            assert runner.task.task_id == "ahead" and not runner.restart_after_task
            assert not any(9 in c.get("release", []) for c in sent(agent, Command.CREDIT))
            assert all(q.task.task_id != "ahead" for q in agent.queue)
        finally:
            runner.control = None


def test_a_fixed_prefetch_keeps_its_queue_and_the_agent_does_not_spin(tmp_path):
    for agent in recording_agent(tmp_path, prefetch=2):
        agent.session.hello()
        agent.session.on_message(decode(encode(Command.WELCOME, {}), Limits()), time.time())
        runner = agent.runners[0]
        runner.task = RunningTask("running", 1, time.time() - 5.0, None, {})
        agent.queue.append(QueuedTask(RunningTask("t", 2, 0.0, None, {}), {}, []))
        agent._hand_back_waiting(time.time())
        assert len(agent.queue) == 1 and sent(agent, Command.CREDIT) == []
        agent.session.last_heard = agent.session.last_heartbeat = time.time()
        assert agent._poll_timeout() > 100  # no wake-up due for it: the loop sleeps


def test_a_hand_back_made_between_hello_and_welcome_is_not_lost(auto_agent):
    agent = auto_agent
    agent.session.hello()
    agent.send_credit(release=[5])  # before the WELCOME: pending, not in the HELLO sent
    assert sent(agent, Command.HELLO)[-1]["release"] == []
    agent.session.on_message(decode(encode(Command.WELCOME, {}), Limits()), 0.0)
    assert sent(agent, Command.CREDIT)[-1]["release"] == [5]


def test_leases_a_credit_handed_back_go_again_in_the_next_hello(agent):
    """A CREDIT handing leases back, posted as the link silently died, was never read; the
    next HELLO neither held nor released them, and the coordinator charged each an attempt
    (a pause, meant to cost nothing, failed a task on its last attempt)."""
    agent.session.hello()
    agent.session.on_message(decode(encode(Command.WELCOME, {}), Limits()), 0.0)
    agent.send_credit(release=[5, 6])
    assert sent(agent, Command.CREDIT)[-1]["release"] == [5, 6]
    agent.link.reset()  # silence: a new socket, what was posted gone
    agent.session.hello()
    assert sent(agent, Command.HELLO)[-1]["release"] == [5, 6]
    agent.session.on_message(decode(encode(Command.WELCOME, {}), Limits()), 1.0)
    agent.session.hello()  # the one after carries them no more
    assert sent(agent, Command.HELLO)[-1]["release"] == []


def test_a_worker_drained_while_the_coordinator_is_away_waits_to_hand_over(agent):
    """Drained during an outage, it left at once: the hand-backs waiting for the next HELLO
    and the results waiting to be re-sent were lost, every task run again and charged."""
    from gpumesh.worker import owner as owner_module

    stopped = []
    agent.stop = lambda: stopped.append(True)
    agent.session.welcomed = True
    agent._on_task(decode(encode(Command.TASK, {"task": "T", "lease": 5, "kind": "fn"}),
                          Limits()), 0.0)
    agent.session.welcomed = False  # the link dropped
    agent.owner.on_control("drain", 1.0)
    assert agent._pending_release == [5]
    agent.owner.finish_drain(2.0)
    agent.owner.finish_drain(2.0 + owner_module.ACK_WAIT_ON_DRAIN + 1)
    assert not stopped  # it waits for the coordinator
    agent.owner.finish_drain(2.0 + owner_module.DRAIN_OFFLINE_WAIT + 1)
    assert stopped  # not for ever


def test_a_runner_no_process_can_be_made_for_waits_instead_of_failing_the_agent(agent, monkeypatch):
    """Popen raising (out of descriptors or processes, as right after the kernel killed a
    runner for its memory) went up through the agent's turn: every runner killed, the
    unacknowledged results lost, the worker gone."""
    import errno

    from gpumesh.worker import runners

    def no_process(*args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(runners.subprocess, "Popen", no_process)
    runner = agent.runners[0]
    before = time.monotonic()
    runner.start()
    assert runner.proc is None and runner.control is None and not runner.ready
    assert runner.start_at is not None and runner.start_at >= before
    assert agent._runners_down()  # what waits for it goes back, unstarted


def test_a_task_ahead_that_fits_no_idle_slot_does_not_make_the_loop_spin(tmp_path, monkeypatch):
    """On a worker with two GPUs, a task handed ahead that needs the busy slot's GPU can
    never move to the idle one: its past-due move made every poll 1 ms long for the whole of
    the long task before it, a core's worth of wake-ups."""
    for agent in recording_agent(tmp_path, slots=2):  # closed after the one pass
        busy, free = agent.runners
        free.ready = True
        busy.ready = True
        busy.task = RunningTask("running", 1, clock.now() - 60.0, None, {})
        busy.ahead.append((QueuedTask(RunningTask("ahead", 2, clock.now(), None,
                                                  {"need": {"gpu": "A100"}}), {}, []), "n1"))
        agent.session.hello()
        agent.session.on_message(decode(encode(Command.WELCOME, {}), Limits()), clock.now())
        agent.session.last_heartbeat = clock.now()  # none due either
        monkeypatch.setattr(agent, "_slot_fits", lambda slot, header, mine=busy.slot: slot == mine)
        assert agent._poll_timeout() > 100
        monkeypatch.setattr(agent, "_slot_fits", lambda slot, header: True)
        assert agent._poll_timeout() <= 1  # one that could move: at once


def test_a_task_cannot_name_the_agents_own_bookkeeping_keys(agent):
    # They say which folder's files a timeout or cancel removes (drop_unsent): a TASK that
    # set them chose a folder of the worker's machine.
    from gpumesh.worker.agent import _SHM_DIR, _SHM_START

    header = {"task": "T", "lease": 5, "kind": "script", "name": "s.py",
              _SHM_DIR: "/home/someone/data", _SHM_START: "0" * 24}
    agent._on_task(decode(encode(Command.TASK, header, [b"print(1)"]), Limits()), 0.0)
    held = [q.task for q in agent.queue] + [r.task for r in agent.runners if r.task]
    assert held and all(_SHM_DIR not in t.header and _SHM_START not in t.header for t in held)


def test_a_local_workers_liveness_never_signals_it_on_windows(monkeypatch):
    """os.kill(pid, 0) is a Ctrl+C to the whole console on Windows (signal 0 is
    CTRL_C_EVENT there): pause/resume/drain must ask the process table instead."""
    from gpumesh import processes as local

    def no_signals(pid: int, sig: int) -> None:
        raise AssertionError(f"os.kill({pid}, {sig}) on Windows")

    asked: list[int] = []
    monkeypatch.setattr(local.os, "kill", no_signals)
    monkeypatch.setattr(local.os, "name", "nt")
    monkeypatch.setattr(local, "_alive_on_windows", lambda pid: asked.append(pid) or True)
    assert local.is_alive(4242) and asked == [4242]


def test_a_result_that_asks_for_a_restart_counts_and_the_tasks_handed_ahead_go_back(agent,
                                                                                  monkeypatch):
    agent.session.hello()
    agent.session.on_message(decode(encode(Command.WELCOME, {}), Limits()), 0.0)
    runner = agent.runners[0]
    runner.task = RunningTask("pinned", 1, 0.0, None, {})
    ahead = QueuedTask(RunningTask("next", 2, 0.0, None, {}), {}, [])
    runner.ahead.append((ahead, "n1"))
    restarted: list[str] = []
    monkeypatch.setattr(runner, "kill", lambda: restarted.append("kill"))
    monkeypatch.setattr(runner, "start", lambda: restarted.append("start"))
    agent._on_runner_header(runner, {"status": "ok", "restart": "it set CUDA_VISIBLE_DEVICES"},
                            [b"r"], 1.0)
    (result,) = sent(agent, Command.RESULT)
    assert result["task"] == "pinned" and result["status"] == "ok" and "restart" not in result
    assert restarted == ["kill", "start"] and list(agent.queue) == [ahead]
    assert runner.task is None and not runner.ahead


def test_windows_is_told_where_a_worker_runs_instead_of_crashing(tmp_path, monkeypatch, capsys):
    # Popen(pass_fds=...) raised an AssertionError there: join ended in a traceback, and
    # serve restarted its self-worker twice a second for good.
    import types

    from gpumesh.cli import demo, join
    from gpumesh.worker import runners

    assert runners.why_no_runners() is None  # here (Linux or macOS)
    monkeypatch.setattr(runners, "os", types.SimpleNamespace(name="nt"))
    reason = runners.why_no_runners()
    assert reason is not None and "WSL" in reason
    with pytest.raises(SystemExit) as stopped:
        join.join(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}), url="tcp://127.0.0.1:9",
                  token="t" * 32, slots=1, benchmark=False, save=False, ready_fd=None)
    assert stopped.value.code == 1 and "WSL" in capsys.readouterr().err
    assert demo.run_demo(1, 2) == 1 and "WSL" in capsys.readouterr().err
