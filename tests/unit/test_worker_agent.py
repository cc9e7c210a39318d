"""The worker agent's bookkeeping and its local control channel, without a coordinator.

The agent is built for real (its runners are never started); what it would send is captured.
"""

from __future__ import annotations

import msgpack
import pytest
import zmq

from gpumesh.config import Limits, Settings, parse_url
from gpumesh.protocol import Command, decode, encode
from gpumesh.worker.agent import WorkerAgent
from gpumesh.worker.control import ControlServer
from gpumesh.worker.runners import RunningTask


@pytest.fixture
def agent(tmp_path):
    a = WorkerAgent(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}),
                    parse_url("tcp://127.0.0.1:9"), "t" * 32, slots=1, info={},
                    local_control=False)
    a.sent = []
    a.link.send = lambda frames: a.sent.append(decode(frames, Limits())) or True
    yield a
    a.link.close()
    a._ctx.term()


def sent(a, command):
    return [m.header for m in a.sent if m.command is command]


def test_a_lease_aborted_at_welcome_whose_task_finished_meanwhile_is_not_credited_twice(agent):
    agent.runners[0].task = RunningTask("T", 77, 0.0, None, {})
    agent._hello()
    assert sent(agent, Command.HELLO)[-1]["credit"] == 0
    task, agent.runners[0].task = agent.runners[0].task, None
    agent._report(task, {"status": "ok"}, [b"x"], 1.0)  # finishes before WELCOME: +1
    agent._on_welcome(decode(encode(Command.WELCOME, {"abort": [77]}), Limits()))
    assert agent.granted == 1  # one slot, nothing running: one grant, not two
    assert sent(agent, Command.CREDIT) == []


def test_tasks_handed_back_while_disconnected_travel_in_the_next_hello(agent):
    agent.welcomed = True
    agent._on_task(decode(encode(Command.TASK, {"task": "T", "lease": 5, "kind": "fn"}),
                          Limits()), 0.0)
    agent.welcomed = False  # the link dropped
    answer = agent._on_control("pause", 1.0)
    assert answer["handed_back"] == 1 and sent(agent, Command.CREDIT) == []
    agent._hello()
    hello = sent(agent, Command.HELLO)[-1]
    assert hello["release"] == [5] and hello["mode"] == "paused" and hello["held"] == []
    agent._on_welcome(decode(encode(Command.WELCOME, {}), Limits()))
    agent._hello()
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
