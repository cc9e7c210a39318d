"""Fields a peer sends, checked where they are read (a hostile-input review of 2026-12-06): a
repeated seq in one SUBMIT, a job's id and name with escape codes, a RESULT's attempts the
client cannot read, lease ids that are not numbers (a WELCOME's NaN heartbeat: test_session). None may stop a
loop, leave a caller waiting, journal one thing and keep another, or reach a terminal."""

from __future__ import annotations

import socket
import time
from http.server import BaseHTTPRequestHandler

import pytest
from conftest import wait_for

from gpumesh.config import Endpoint, Limits, Settings, Timing
from gpumesh.coordinator.broker import Broker
from gpumesh.errors import ConfigError
from gpumesh.protocol import Command, Message, decode, encode, serialize
from gpumesh.store import Store

C = b"c1-routing"


def msg(command: Command, header: dict, payload: list | None = None) -> Message:
    return decode(encode(command, header, payload or []), Limits())


def sent(b: Broker, command: Command) -> list[dict]:
    return [m.header for m in (decode(f, Limits()) for _, f in b.outbox) if m.command is command]


@pytest.fixture
def broker() -> Broker:
    b = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0)
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1],
                                    "info": {"user": "ana", "host": "lab"}}), 0.0)
    b.outbox.clear()
    return b


def test_a_seq_used_twice_in_one_submit_is_refused_the_second_time_not_half_journaled(broker):
    tasks = [{"seq": 7, "nf": 1, "kind": "script"}, {"seq": 7, "nf": 1, "kind": "script"},
             {"seq": 8, "nf": 1, "kind": "script"}]
    broker.handle(C, msg(Command.SUBMIT, {"tasks": tasks, "job": "j1"}, [b"a", b"b", b"c"]), 0.0)
    answer = sent(broker, Command.ACCEPTED)[-1]
    assert [seq for seq, _ in answer["accepted"]] == [7, 8]
    assert [(seq, code) for seq, code, _ in answer["rejected"]] == [(7, "malformed")]
    assert "seq 7 is used twice in one SUBMIT" in answer["rejected"][0][2]
    broker.store.commit()
    journaled = sorted(row.task_id for row in broker.store.load())
    assert journaled == sorted(broker.tasks) == sorted(task_id for _, task_id in answer["accepted"])


def test_a_job_name_with_escape_codes_is_kept_printable_and_such_a_job_id_refused(broker):
    broker.handle(C, msg(Command.SUBMIT, {"tasks": [{"seq": 1, "nf": 1, "kind": "script"}],
                                          "job": "j1", "name": "\x1b]0;owned\x07\x1b[31mred\n"},
                         [b"a"]), 0.0)
    assert broker.jobs["j1"].name == "?]0;owned??[31mred?"
    assert [name for _, name, *_ in broker.store.load_jobs()] == ["?]0;owned??[31mred?"]
    broker.outbox.clear()
    broker.handle(C, msg(Command.SUBMIT, {"tasks": [{"seq": 2, "nf": 1, "kind": "script"}],
                                          "job": "\x1b[2Jj2"}, [b"b"]), 0.0)
    error = sent(broker, Command.ERROR)[-1]
    assert error["code"] == "malformed" and "'job' must be printable text" in error["message"]
    assert "\x1b[2Jj2" not in broker.jobs and sent(broker, Command.ACCEPTED) == []


def test_the_client_refuses_a_job_id_the_coordinator_would_refuse_before_it_sends(engine):
    for job in ("\x1b[2Jnightly", "j" * 65):
        with pytest.raises(ConfigError, match="must be printable text of at most 64 characters"):
            engine.submit([({"kind": "fn"}, [b"x"])], job)


@pytest.fixture
def engine(tmp_path):
    """A client engine whose coordinator never answers (a loopback port nobody listens on):
    its I/O thread files what is submitted and, unconnected, leaves it alone."""
    from gpumesh.client.engine import Engine

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    made = Engine(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}),
                  Endpoint("127.0.0.1", port), "a-token-for-nobody")
    yield made
    made.close()


def submitted(engine):
    """One task submitted, and its seq once the engine's thread has filed it (5 s at most)."""
    future, = engine.submit([({"kind": "fn"}, [b"x"])], "j1")
    deadline = time.monotonic() + 5
    while not engine._outstanding and time.monotonic() < deadline:
        engine._closing.wait(0.01)
    seq, = engine._outstanding
    return future, seq


@pytest.mark.parametrize("attempts", ["two", -1, 2.5, None, [3]])
def test_a_result_whose_attempts_the_client_cannot_read_still_settles_its_future(engine,
                                                                                attempts):
    future, seq = submitted(engine)
    engine._on_result(msg(Command.RESULT, {"task": "t1", "seq": seq, "status": "ok",
                                           "attempts": attempts}, serialize.dumps(42)), 1.0)
    assert future.result(timeout=5) == 42 and future.attempts == 0


def test_another_users_task_error_and_output_cannot_act_on_the_terminal_that_shows_them():
    from gpumesh.cli.jobs import job_summary
    from gpumesh.protocol.fields import for_terminal

    tasks = [{"id": "t1", "state": "failed", "cost": 1.0, "worker": "w",
              "error": "boom\x1b]0;owned\x07\x1b[2J"},
             {"id": "t2", "state": "done", "cost": 1.0, "worker": "w",
              "result": "line 1\n\x1b[31mred\tcell\r"}]
    status = {"job": "j1", "name": "n", "status": "finished", "counts": {"done": 1, "failed": 1},
              "total": 2, "tasks": tasks}
    summary = job_summary(status)
    assert "\x1b" not in summary and "\x07" not in summary and "\r" not in summary
    assert "error: boom\\x1b]0;owned\\x07\\x1b[2J" in summary
    assert "result: line 1\n\\x1b[31mred\tcell\\r" in summary  # newlines and tabs stay
    assert for_terminal("plain text, ünïcode") == "plain text, ünïcode"
    # Spaces Python calls unprintable (no-break, ideographic) act on nothing: kept as they are.
    assert for_terminal("prix\u00a0: 3\x1b, 東京\u3000駅") == "prix\u00a0: 3\\x1b, 東京\u3000駅"


def test_a_worker_id_with_escape_codes_is_refused_at_hello(broker):
    # Worker ids are printed: the coordinator's "[mesh] worker left" lines, the workers
    # table, the "[worker]" prefix of every client's task output.
    hello = {"role": "worker", "id": "\x1b]0;pwn\x07\x1b[2J", "slots": 1, "proto": [1, 1],
             "info": {"python": "3.11", "cores": 4}}
    broker.handle(b"w-routing", msg(Command.HELLO, hello), 0.0)
    error = sent(broker, Command.ERROR)[-1]
    assert error["code"] == "malformed" and "'id' must be printable text" in error["message"]
    assert broker.workers == {}
    broker.handle(b"w-routing", msg(Command.HELLO, {**hello, "id": "w1", "incarnation": "\x1b"}),
                  0.0)
    assert "'incarnation' must be printable text" in sent(broker, Command.ERROR)[-1]["message"]


def test_an_accepted_pair_the_client_cannot_read_is_left_out_alone(engine):
    # A pair whose task id was a list once set the future's task id, then raised: the
    # task's real RESULT was then taken for a duplicate, and the caller waited forever.
    future, seq = submitted(engine)
    engine._on_accepted(msg(Command.ACCEPTED, {
        "job": "j1", "accepted": [[seq, ["t1"]], "junk", [seq], [seq, "t1"]],
        "rejected": [[seq], 5, [seq, "malformed", "\x1b[2J", "extra"]]}), 1.0)
    assert future.task_id == "t1" and not future.done()
    engine._on_result(msg(Command.RESULT, {"task": "t1", "seq": seq, "status": "ok"},
                          serialize.dumps(7)), 1.0)
    assert future.result(timeout=5) == 7


def test_the_dashboards_request_log_writes_out_control_characters(caplog):
    # The request line is anybody's on the network, logged before any check (stderr, -v).
    import logging

    from gpumesh.dashboard.server import Handler

    handler = object.__new__(Handler)
    handler.client_address = ("127.0.0.1", 5)
    with caplog.at_level(logging.DEBUG, logger="gpumesh"):
        handler.log_message('"%s" %s', "GET /\x1b]0;pwned\x07\x1b[2J HTTP/1.1", "404")
    assert "\x1b" not in caplog.text and "\\x1b]0;pwned\\x07\\x1b[2J" in caplog.text


class _NoContent(BaseHTTPRequestHandler):
    """Answers every GET with 204: the dashboard server's connection handling, alone."""

    timeout = 10

    def do_GET(self):
        self.send_response(204)
        self.end_headers()

    def log_message(self, format, *args):
        pass


def test_one_address_cannot_hold_every_dashboard_connection(monkeypatch):
    # 128 trickling connections from one LAN host locked every browser out of the dashboard.
    # Connections are handed to the server as it accepts them, with the peer's address as the
    # kernel would give it (socket pairs: no other host's address is ever used).
    from gpumesh.dashboard import server as dashboard

    monkeypatch.setattr(dashboard, "MAX_CONNECTIONS", 8)
    monkeypatch.setattr(dashboard, "MAX_PER_ADDRESS", 2)

    httpd = dashboard._Server(("127.0.0.1", 0), _NoContent)
    ours: list[socket.socket] = []

    def connect(address: tuple) -> socket.socket:
        served, peer = socket.socketpair()
        peer.settimeout(5)
        ours.append(peer)
        httpd.process_request(served, address)
        return peer

    def answered(peer: socket.socket) -> bool:
        peer.sendall(b"GET / HTTP/1.0\r\n\r\n")
        return peer.recv(100).startswith(b"HTTP/1.0 204")

    try:
        connect(("192.0.2.7", 40001)), connect(("192.0.2.7", 40002))  # say nothing: held
        assert connect(("192.0.2.7", 40003)).recv(100) == b""  # closed at once, nothing read
        assert answered(connect(("192.0.2.8", 40001)))  # another host is served
        # An IPv6 address counts alone (a SLAAC LAN shares one /64); a dual-stack bind's IPv4
        # peer counts as its IPv4 address.
        connect(("2001:db8::1", 40001, 0, 0)), connect(("2001:db8::1", 40002, 0, 0))
        assert connect(("2001:db8::1", 40003, 0, 0)).recv(100) == b""
        assert answered(connect(("2001:db8::2", 40001, 0, 0)))
        assert connect(("::ffff:192.0.2.7", 40004, 0, 0)).recv(100) == b""
        # Loopback (SSH tunnels, a local proxy) is held to the overall bound only.
        assert all(answered(connect(("127.0.0.1", 40001 + n))) for n in range(3))
        for peer in ours:
            peer.close()
        assert wait_for(lambda: httpd._by_address == {}, what="slots given back")
        assert all(httpd.connections.acquire(blocking=False) for _ in range(8))
    finally:
        for peer in ours:
            peer.close()
        httpd.server_close()


def test_a_reply_in_pages_or_a_fetch_answer_of_the_wrong_shape_is_read_as_far_as_it_goes(engine):
    from gpumesh.client.engine import _joined

    assert _joined([5, [1], {"x": 1}], [2]) == [1, 2]  # a page that is not a list: left out
    assert _joined([[0], {"tasks": "no"}, {"tasks": [1]}], {"tasks": [2], "n": 3}) == {
        "tasks": [1, 2], "n": 3}
    engine._on_reply(msg(Command.REPLY, {"qid": 0, "data": {"missing": [["t1"], {}, "t2"]}}), 1.0)
    engine._on_reply(msg(Command.REPLY, {"qid": 0, "data": {"missing": "t1"}}), 1.0)


def test_the_dashboard_serves_so_many_connections_at_once_and_closes_the_next_unread(
        monkeypatch):
    # Each connection is a thread, and anybody on the network can open one before any check.
    import threading

    from gpumesh.dashboard import server as dashboard

    monkeypatch.setattr(dashboard, "MAX_CONNECTIONS", 1)

    httpd = dashboard._Server(("127.0.0.1", 0), _NoContent)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                     daemon=True).start()
    try:
        address = httpd.server_address
        silent = socket.create_connection(address)  # holds the one thread: says nothing
        silent.settimeout(5)
        extra = socket.create_connection(address)
        extra.settimeout(5)
        assert extra.recv(100) == b""  # closed at once, nothing read
        extra.close()
        silent.close()
        assert httpd.connections.acquire(timeout=5)  # its thread gave the slot back
        httpd.connections.release()
        with socket.create_connection(address) as asking:
            asking.settimeout(5)
            asking.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert asking.recv(100).startswith(b"HTTP/1.0 204")
    finally:
        httpd.shutdown()
        httpd.server_close()


def submitted_calls(engine, count):
    """``count`` tasks submitted at once, and their seqs once the engine has filed them."""
    futures = engine.submit([({"kind": "fn"}, [b"x"])] * count, "j1")
    deadline = time.monotonic() + 5
    while len(engine._outstanding) < count and time.monotonic() < deadline:
        engine._closing.wait(0.01)
    return futures, [f.seq for f in futures]


def test_one_task_id_named_for_two_calls_settles_one_call_only(engine):
    # The second call once took the first one's result, and the first then waited forever.
    (first, second), (seq1, seq2) = submitted_calls(engine, 2)
    engine._on_accepted(msg(Command.ACCEPTED, {"job": "j1", "accepted": [[seq1, "t1"]]}), 1.0)
    engine._on_accepted(msg(Command.ACCEPTED, {"job": "j1", "accepted": [[seq2, "t1"]]}), 1.0)
    assert first.task_id == "t1" and second.task_id == ""  # the second goes again
    # The task of one call with the seq of the other: neither takes it, nor is it acknowledged.
    engine._on_result(msg(Command.RESULT, {"task": "t1", "seq": seq2, "status": "ok"},
                          serialize.dumps("wrong")), 1.0)
    assert not first.done() and not second.done() and engine._acks == []
    engine._on_result(msg(Command.RESULT, {"task": "t1", "seq": seq1, "status": "ok"},
                          serialize.dumps("right")), 1.0)
    assert first.result(timeout=5) == "right" and not second.done()
    assert engine._acks == ["t1"]


@pytest.mark.parametrize("task", [7, ["t1"], "", "t" * 65, None])
def test_a_result_whose_task_id_the_client_cannot_read_is_dropped_unacknowledged(engine, task):
    future, seq = submitted(engine)
    engine._on_result(msg(Command.RESULT, {"task": task, "seq": seq, "status": "ok"},
                          serialize.dumps(1)), 1.0)
    assert not future.done() and engine._acks == []
    engine._on_result(msg(Command.RESULT, {"task": "t1", "seq": seq, "status": "ok"},
                          serialize.dumps(2)), 1.0)
    assert future.result(timeout=5) == 2


def test_a_result_asked_for_again_leaves_no_second_key_for_a_stale_one_to_use(engine,
                                                                              monkeypatch):
    # Matched by its seq and not readable yet (short of descriptors), a result was filed
    # again under its header's id; its real id came later, and a RESULT under the first id
    # then changed the settled future's worker and unpickled its payload once more.
    from gpumesh.client import engine as engine_module
    from gpumesh.sharedmem import SharedFrameBusy

    future, seq = submitted(engine)
    real, decoded = engine_module.decode_result, []

    def short_once(*args, **kwargs):
        decoded.append(args[0]["task"])
        if len(decoded) == 1:
            raise SharedFrameBusy(24, "too many open files")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "decode_result", short_once)
    engine._on_result(msg(Command.RESULT, {"task": "t1", "seq": seq, "status": "ok",
                                           "worker": "w1"}, serialize.dumps("first")), 1.0)
    assert not future.done() and engine._outstanding[seq].task_id == "t1"
    engine._on_accepted(msg(Command.ACCEPTED, {"job": "j1", "accepted": [[seq, "t2"]]}), 1.0)
    engine._on_result(msg(Command.RESULT, {"task": "t1", "seq": seq, "status": "ok",
                                           "worker": "w2"}, serialize.dumps("again")), 1.0)
    assert future.result(timeout=5) == "again" and future.worker == "w2"
    engine._on_result(msg(Command.RESULT, {"task": "t1", "seq": seq, "status": "ok",
                                           "worker": "EVIL", "attempts": 99},
                          serialize.dumps("stale")), 1.0)
    assert future.worker == "w2" and future.attempts == 0 and decoded == ["t1", "t1"]


def test_a_welcome_whose_shared_folder_path_holds_a_nul_is_a_welcome_without_one():
    # os.lstat raises ValueError for it, which escaped: the client was welcomed, never
    # connected, and every later WELCOME failed the same way.
    from gpumesh.sharedmem import SharedFolder

    assert SharedFolder.join({"path": "/dev/shm/x\x00y", "check": "0" * 32}) is None


def test_output_relayed_with_a_worker_id_that_acts_on_the_terminal_is_made_printable(engine):
    printed = []
    engine.on_output = lambda *args: printed.append(args)
    worker = "\x1b]0;owned\x07\x1b[2J" + "w" * 100
    engine._on_output(msg(Command.OUTPUT, {"worker": worker, "stream": "\x1b", "task": "t1"},
                          [b"hello\n"]), 1.0)
    engine._on_output(msg(Command.OUTPUT, {"worker": ["w"], "task": "t1"}, [b"x\n"]), 1.0)
    ((shown, stream, data, task),) = printed
    assert "\x1b" not in shown and "\x07" not in shown and len(shown) <= 4 * 64
    assert shown.startswith("\\x1b]0;owned") and stream == "out"
    assert data == b"hello\n" and task == "t1"


def test_tasks_that_end_mid_line_cannot_grow_the_open_lines_for_good(capsys):
    from gpumesh.client import api

    api._OPEN_LINES.clear()
    for n in range(3 * api.MAX_OPEN_LINES):
        api._print_output("w1", "out", b"no newline", f"t{n}")
    assert len(api._OPEN_LINES) <= api.MAX_OPEN_LINES
    api._print_output("w1", "out", b" continued\n", f"t{3 * api.MAX_OPEN_LINES - 1}")
    assert capsys.readouterr().out.endswith("[w1] no newline continued\n")
    api._OPEN_LINES.clear()


@pytest.mark.parametrize("limits", [{"max_message_bytes": 1}, {"max_frames": 1},
                                    {"max_message_bytes": 1024, "max_frames": 3}])
def test_a_welcome_whose_limits_leave_no_room_for_a_task_keeps_the_clients_own(engine, limits):
    engine.welcome = limits
    assert engine._message_room() == engine.settings.limits.message_room


def test_a_welcomes_limits_give_the_room_its_limits_would(engine):
    from dataclasses import replace

    engine.welcome = {"max_message_bytes": 64 << 20, "max_frames": 500}
    expected = replace(engine.settings.limits, max_message_bytes=64 << 20,
                       max_frames=500).message_room
    assert engine._message_room() == expected


def test_a_message_of_task_ids_fits_the_coordinators_header_at_the_longest_ids():
    # ACCEPTED may name ids up to ID_CHARS long; a RESULT_ACK of a full message of them went
    # over the coordinator's header limit, and every acknowledgement in it was dropped.
    from gpumesh.client.engine import IDS_PER_MESSAGE
    from gpumesh.protocol.headers import ID_CHARS

    frames = encode(Command.RESULT_ACK, {"tasks": ["t" * ID_CHARS] * IDS_PER_MESSAGE})
    assert len(frames[2]) <= Limits().max_header_bytes


def test_a_task_error_is_printed_with_its_escape_codes_written_out_and_its_size_bounded():
    # The worker's text went into the exception the user's terminal prints as it came: an
    # escape code in it (a hostile worker's, or bytes in the task's own message) acted on the
    # terminal (title, colours, OSC 52 clipboard writes). Ids and texts are also cut to what
    # the coordinator keeps of them.
    from gpumesh.client.engine import decode_result
    from gpumesh.errors import RemoteError, RunnerCrashed, TaskTimeout
    from gpumesh.protocol.headers import MAX_ERROR_MESSAGE

    esc = "\x1b]52;c;ZXZpbA==\x07\x1b[2J"
    header = {"status": "error", "task": "t1" + esc, "worker": "w" * 500,
              "error": {"type": "Boom" + esc, "message": esc + "x" * (2 * MAX_ERROR_MESSAGE),
                        "traceback": "Traceback:\n  line\n" + esc}}
    with pytest.raises(RemoteError) as caught:
        decode_result(header, [])
    shown = str(caught.value)
    assert "\x1b" not in shown and "\x07" not in shown and "\\x1b" in shown
    assert "Traceback:\n  line\n" in shown  # newlines stay: a traceback reads as one
    assert len(caught.value.args[0]) <= MAX_ERROR_MESSAGE + 64
    assert "\x1b" not in caught.value.task_id and len(caught.value.worker) <= 64
    # A progress bar's line, rewritten with carriage returns, reads as a terminal showed it.
    with pytest.raises(RemoteError) as progress:
        decode_result({"status": "error", "error": {
            "type": "X", "message": "m",
            "traceback": "epoch 1:  10%\repoch 1:  50%\repoch 1: 100%\r\nTraceback:\r\n  boom"}},
            [])
    assert progress.value.remote_traceback == "epoch 1: 100%\nTraceback:\n  boom"
    with pytest.raises(TaskTimeout) as timed_out:
        decode_result({"status": "timeout", "error": {"message": "late" + esc}}, [])
    assert "\x1b" not in str(timed_out.value)
    with pytest.raises(RunnerCrashed) as crashed:
        decode_result({"status": "crashed", "diagnosis": "gone" + esc}, [])
    assert "\x1b" not in str(crashed.value)


def _raises_deep(x):
    return 1 / x


def test_a_task_error_shows_the_callers_frames_then_the_tasks_not_the_engines(engine):
    # result() raised through concurrent.futures' frames and the engine thread's
    # decode_result; each call added its frames to the same exception, so a retry loop
    # printed a traceback that grew by three frames a call.
    import traceback

    from gpumesh.runner.execute import run_function

    header, payload = run_function({"task": "t1"}, [*serialize.dumps(_raises_deep),
                                                    *serialize.dumps(((0,), {}))])
    future, seq = submitted(engine)
    engine._on_result(msg(Command.RESULT, {**header, "task": "t1", "seq": seq,
                                           "worker": "w1"}, payload), 1.0)
    assert future.exception(timeout=5).__traceback__ is None  # no engine-thread frames
    for _ in range(3):
        with pytest.raises(ZeroDivisionError) as raised:
            future.result(timeout=5)
        files = [frame.filename for frame in traceback.extract_tb(raised.value.__traceback__)]
        assert files == [__file__, engine_module_file()]  # this test's line, then result()'s
    remote = raised.value.remote_traceback
    assert "_raises_deep" in remote and "run_function" not in remote


def engine_module_file() -> str:
    from gpumesh.client import engine as engine_module

    return engine_module.__file__


def test_a_call_that_ran_here_keeps_its_own_frames_once_however_often_it_is_read():
    # Raised with no traceback at all, a call run in this process (GPUMESH_LOCAL, or a task's
    # nested call) showed the caller's line and result()'s, none of the code that failed.
    import traceback

    from gpumesh.client.engine import TaskFuture

    future = TaskFuture()
    try:
        _raises_deep(0)
    except ZeroDivisionError as exc:
        future.set_exception(exc)
    for _ in range(3):
        with pytest.raises(ZeroDivisionError) as raised:
            future.result()
        names = [frame.name for frame in traceback.extract_tb(raised.value.__traceback__)]
        assert names == [
            "test_a_call_that_ran_here_keeps_its_own_frames_once_however_often_it_is_read",
            "result", "test_a_call_that_ran_here_keeps_its_own_frames_once_however_often_it_is_read",
            "_raises_deep"]
