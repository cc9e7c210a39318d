"""The peer's session cycle (gpumesh.session), driven by hand: no socket, no clock.

A list stands in for the socket and a recording role for the client or worker, so each rule of
the cycle (HELLO until WELCOME, heartbeats, silence → backoff → new socket → HELLO, the answers
every role gives alike) is checked at exact times.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpumesh.config import Limits, Timing, parse_url
from gpumesh.errors import MeshError, ProtocolMismatch
from gpumesh.protocol import MAJOR, Command, ErrorCode, Message, Role, decode, encode
from gpumesh.session import Session

TIMING = Timing(heartbeat=1.0, liveness=5, backoff_min=1.0, backoff_max=4.0)


class FakeLink:
    def __init__(self) -> None:
        self.batching = False
        self.sends_pieces = False
        self.stalled = False
        self.forgotten = 0
        self.posted: list[list[Any]] = []
        self.sent: list[Message] = []
        self.resets = 0

    def post(self, frames: list[Any]) -> None:
        self.posted.append(frames)

    def flush(self) -> bool:
        self.sent += [decode(frames, Limits()) for frames in self.posted]
        self.posted = []
        return True

    def reset(self) -> None:
        self.resets += 1
        self.posted = []
        self.batching = False

    def forget_pieces(self) -> None:
        self.forgotten += 1
        self.stalled = False

    def pieces_stalled(self, now: float, limit: float) -> bool:
        return self.stalled

    def commands(self) -> list[Command]:
        self.flush()
        return [m.command for m in self.sent]


class RecordingRole:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.handled_disconnect = False
        self.fail_with: BaseException | None = None

    def on_hello(self) -> dict[str, Any]:
        self.calls.append(("hello",))
        return {"slots": 2}

    def on_welcome(self, header: dict[str, Any], now: float) -> None:
        self.calls.append(("welcome", now))

    def on_message(self, msg: Message, now: float) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        self.calls.append(("message", msg.command, now))

    def heartbeat_header(self) -> dict[str, Any]:
        return {"leases": [7]}

    def on_lost(self, now: float, delay: float, was_welcomed: bool) -> None:
        self.calls.append(("lost", now, delay, was_welcomed))

    def on_disconnect(self, header: dict[str, Any], now: float) -> bool:
        self.calls.append(("disconnect", header.get("reason")))
        return self.handled_disconnect


@pytest.fixture
def session() -> tuple[Session, FakeLink, RecordingRole]:
    link, role = FakeLink(), RecordingRole()
    return Session(Role.WORKER, "w1", parse_url("tcp://127.0.0.1:9"), TIMING, link, role), link, role


def message(command: Command, header: dict[str, Any] | None = None) -> Message:
    return decode(encode(command, header or {}), Limits())


def test_hello_carries_the_sessions_fields_and_the_roles(session):
    s, link, role = session
    s.start(0.0)
    hello = link.sent[-1]
    assert hello.command is Command.HELLO and not s.welcomed
    assert hello.header == {"role": "worker", "id": "w1", "proto": [MAJOR, MAJOR], "batch": True,
                            "shmlock": True, "pieces": True, "slots": 2}
    assert role.calls == [("hello",)]


def test_welcome_sets_the_coordinators_timing_within_bounds_and_batching(session):
    s, link, role = session
    s.start(0.0)
    assert link.forgotten == 1  # a HELLO forgets what went or came in pieces
    s.on_message(message(Command.WELCOME, {"heartbeat": 0.5, "liveness": 3, "batch": True,
                                           "pieces": True}), 0.1)
    assert s.welcomed and link.batching and link.sends_pieces
    assert role.calls[-1] == ("welcome", 0.1)
    assert (s.heartbeat, s.silence_limit) == (0.5, 1.5)
    # A hostile or broken WELCOME cannot make the loop spin or never notice silence.
    s.on_message(message(Command.WELCOME, {"heartbeat": 0.0, "liveness": 10**9}), 0.2)
    assert (s.heartbeat, s.silence_limit) == (0.05, 5.0)
    s.on_message(message(Command.WELCOME, {"heartbeat": "soon", "liveness": [1]}), 0.3)
    assert (s.heartbeat, s.silence_limit) == (0.05, 0.25)


def test_heartbeats_go_out_once_per_interval_while_welcomed(session):
    s, link, _ = session
    s.start(0.0)
    s.tick(0.5)
    assert link.commands() == [Command.HELLO]  # not welcomed: no heartbeat
    s.on_message(message(Command.WELCOME), 0.6)
    for now in (0.7, 0.8, 1.6, 1.7, 2.6):
        s.on_message(message(Command.HEARTBEAT), now)  # the coordinator keeps talking
        s.tick(now)
    link.flush()
    beats = [m for m in link.sent if m.command is Command.HEARTBEAT]
    assert [b.header for b in beats] == [{"leases": [7]}] * 2  # at 1.6 and 2.6
    assert s.next_timer(2.6) == pytest.approx(1.0)


def test_silence_backs_off_replaces_the_socket_and_says_hello_again(session, monkeypatch):
    monkeypatch.setattr("gpumesh.session._jitter.uniform", lambda a, b: 1.0)  # no jitter
    s, link, role = session
    s.start(0.0)
    s.on_message(message(Command.WELCOME), 0.0)
    s.tick(5.0)
    assert s.welcomed  # exactly at the limit: not yet
    s.tick(5.01)
    assert not s.welcomed and role.calls[-1] == ("lost", 5.01, 1.0, True)
    assert s.next_timer(5.5) == pytest.approx(0.51)
    s.tick(5.5)
    assert link.resets == 0  # waits out the backoff
    s.tick(6.01)
    assert link.resets == 1 and link.commands()[-1] is Command.HELLO
    # Still nobody: the delay doubles up to the maximum, and the role hears it was not welcomed.
    delays = []
    now = 6.01
    for _ in range(4):
        now += 5.01
        s.tick(now)
        delays.append(role.calls[-1][2])
        assert role.calls[-1][3] is False
        now += role.calls[-1][2]
        s.tick(now)
    assert delays == [2.0, 4.0, 4.0, 4.0] and link.resets == 5
    s.on_message(message(Command.WELCOME), now)
    assert s.backoff.current == 1.0  # a good session starts the backoff over


def test_the_backoff_jitter_leaves_the_users_random_state_alone():
    # The client's session runs in its engine's thread while the user's script runs: a script
    # that seeded random must draw the same numbers whether or not a reconnect happened.
    import random

    from gpumesh.session import Backoff

    state = random.getstate()
    backoff = Backoff(1.0, 32.0)
    delays = [backoff.next_delay() for _ in range(6)]
    assert random.getstate() == state
    assert all(0.75 * 2 ** i <= d <= 1.25 * 2 ** i for i, d in enumerate(delays[:5]))


def test_no_session_means_hello_again_and_another_major_is_fatal(session):
    s, link, role = session
    s.start(0.0)
    s.on_message(message(Command.WELCOME), 0.0)
    s.on_message(message(Command.ERROR, {"code": ErrorCode.NO_SESSION.value}), 1.0)
    assert link.commands() == [Command.HELLO, Command.HELLO] and not s.welcomed
    with pytest.raises(ProtocolMismatch, match="refused this worker: speaks 9"):
        s.on_message(message(Command.ERROR, {"code": ErrorCode.VERSION.value,
                                             "message": "speaks 9"}), 1.0)
    with pytest.raises(ProtocolMismatch, match="another gpumesh protocol version"):
        s.on_message(message(Command.DISCONNECT, {"reason": "version"}), 1.0)
    # Other errors are the role's to judge.
    s.on_message(message(Command.ERROR, {"code": ErrorCode.MALFORMED.value}), 2.0)
    assert role.calls[-1] == ("message", Command.ERROR, 2.0)


def test_disconnect_is_the_roles_first_then_a_new_session(session):
    s, link, role = session
    s.start(0.0)
    s.on_message(message(Command.DISCONNECT, {"reason": "restart"}), 1.0)
    assert role.calls[-1] == ("hello",) and link.commands().count(Command.HELLO) == 2
    role.handled_disconnect = True
    s.on_message(message(Command.DISCONNECT, {"reason": "kill"}), 2.0)
    assert role.calls[-1] == ("disconnect", "kill") and link.commands().count(Command.HELLO) == 2


def test_a_message_the_role_cannot_handle_is_dropped_but_a_fatal_one_is_not(session, caplog):
    s, _, role = session
    s.start(0.0)
    role.fail_with = KeyError("lease")
    s.on_message(message(Command.TASK), 3.0)  # logged, dropped: the session goes on
    assert s.last_heard == 3.0 and "dropped a TASK" in caplog.text
    role.fail_with = MeshError("the coordinator refused this worker")
    with pytest.raises(MeshError):
        s.on_message(message(Command.TASK), 4.0)


def test_what_was_posted_before_hello_goes_out_before_it(session):
    s, link, _ = session
    s.start(0.0)
    s.on_message(message(Command.WELCOME, {"batch": True}), 0.0)
    link.post(encode(Command.RESULT, {"task": "T"}))
    s.hello()
    assert link.commands()[-2:] == [Command.RESULT, Command.HELLO]
    assert not link.batching  # until the next WELCOME says so


def test_a_no_session_answer_while_our_hello_is_on_its_way_makes_no_other(session):
    # Each piece of a big message still on its way when the coordinator restarted could be
    # answered NO_SESSION: a HELLO for each would make it forget what the first one started.
    s, link, role = session
    s.start(0.0)
    for at in (0.1, 0.2, 0.3):
        s.on_message(message(Command.ERROR, {"code": ErrorCode.NO_SESSION.value}), at)
    assert link.commands() == [Command.HELLO]


def test_pieces_the_coordinator_takes_no_more_of_start_a_new_session(session):
    s, link, role = session
    s.start(0.0)
    s.on_message(message(Command.WELCOME), 0.0)
    s.tick(0.5)
    assert link.commands() == [Command.HELLO]
    link.stalled = True  # nothing of a big message acknowledged for the silence limit
    s.tick(1.0)
    assert link.commands() == [Command.HELLO, Command.HELLO] and not s.welcomed
    assert link.forgotten == 2 and not link.stalled


def test_a_coordinator_back_while_we_wait_out_the_backoff_gets_our_hello_at_once(session):
    # Restarted after a kill -9: what the worker held comes back only if its HELLO claims it
    # within the restore grace; the backoff (up to its maximum) would let that pass.
    s, link, role = session
    s.start(0.0)
    s.on_message(message(Command.WELCOME), 0.0)
    s.tick(5.01)  # silence: a HELLO is due after the backoff, on a new socket
    assert s.reconnect_at is not None
    link.commands()
    link.sent.clear()
    for at in (5.2, 5.21, 5.22):  # the old socket's queued messages reach the new coordinator
        s.on_message(message(Command.ERROR, {"code": ErrorCode.NO_SESSION.value}), at)
    assert link.commands() == [Command.HELLO]  # one, now, on the socket that answered
    assert s.reconnect_at is None and link.resets == 0
    s.tick(7.0)  # the backoff's end makes no second session
    assert link.commands() == [Command.HELLO] and link.resets == 0


def test_a_welcome_while_we_wait_out_the_backoff_keeps_that_session(session, monkeypatch):
    # The HELLO said on the new socket after the first backoff is answered during the next
    # one: that session stands, with heartbeats, and the backoff's end starts no other.
    monkeypatch.setattr("gpumesh.session._jitter.uniform", lambda a, b: 1.0)  # no jitter
    s, link, role = session
    s.start(0.0)
    s.tick(5.01)  # no answer: a backoff, then a HELLO on a new socket
    s.tick(6.01)
    s.tick(11.02)  # none again: another backoff
    assert s.reconnect_at is not None and link.resets == 1
    s.on_message(message(Command.WELCOME), 11.5)
    assert s.welcomed and s.reconnect_at is None
    link.commands()
    link.sent.clear()
    s.tick(13.1)
    assert link.commands() == [Command.HEARTBEAT] and link.resets == 1


@pytest.mark.parametrize("field, value", [("heartbeat", float("nan")), ("heartbeat", float("inf")),
                                          ("heartbeat", float("-inf")), ("liveness", float("nan"))])
def test_a_welcome_whose_timing_is_not_a_number_keeps_the_defaults(session, field, value):
    # min(max(nan, low), high) is nan: a NaN heartbeat once went through the clamp, and the
    # loops' int(wait * 1000) raised (the worker exited), or silence was never noticed.
    s, link, role = session
    s.start(0.0)
    s.on_message(message(Command.WELCOME, {field: value}), 0.5)
    assert s.welcomed and ("welcome", 0.5) in role.calls
    assert s.heartbeat == 1.0 and s.silence_limit == 5.0
