"""ACCEPTED and RESULT_ACK wait for the turn's commit, then a short while for the next message to
their peer, and travel in its BATCH (gpumesh/coordinator/server.py): fewer messages per call,
nothing held for long, the order to each peer kept. Everything else goes before the commit."""

from __future__ import annotations

import threading

import pytest

from gpumesh.config import Limits, Settings
from gpumesh.coordinator.server import DEFER_WINDOW, Coordinator
from gpumesh.protocol import Command, decode, encode, unbundle
from gpumesh.tokens import new_token


@pytest.fixture
def coordinator(tmp_path):
    made = Coordinator(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}), new_token(),
                       host="127.0.0.1", port=0, db_path=tmp_path / "journal.db")
    sent: list[tuple[bytes, list[Command]]] = []

    def record(routing, messages, now):
        commands = []
        for frames in messages:
            msg = decode(frames, Limits())
            inner = unbundle(msg, Limits()) if msg.command is Command.BATCH else [msg]
            commands += [m.command for m in inner]
        sent.append((routing, commands))

    made._send = record  # type: ignore[method-assign]
    made.broker.ledger.reads_batches = lambda routing: routing != b"old"  # type: ignore[method-assign]
    made.sent = sent
    yield made
    made.close()


def _post(coordinator, routing: bytes, command: Command) -> None:
    coordinator.broker.outbox.append((routing, encode(command, {})))


def test_an_ack_waits_for_the_next_task_to_its_worker_and_goes_before_it(coordinator):
    _post(coordinator, b"w", Command.RESULT_ACK)
    coordinator._flush(100.0)
    assert coordinator.sent == []
    _post(coordinator, b"w", Command.TASK)
    coordinator._flush(100.0 + DEFER_WINDOW / 2)
    assert coordinator.sent == [(b"w", [Command.RESULT_ACK, Command.TASK])]


def test_a_held_message_goes_alone_once_the_window_has_passed(coordinator):
    _post(coordinator, b"c", Command.ACCEPTED)
    coordinator._flush(100.0)
    _post(coordinator, b"c", Command.ACCEPTED)
    coordinator._flush(100.0 + DEFER_WINDOW / 2)  # held from the first one's time on
    assert coordinator.sent == []
    assert coordinator._poll_timeout(1000) <= DEFER_WINDOW * 1000 + 1  # the loop wakes for it
    coordinator._flush(100.0 + DEFER_WINDOW)
    assert coordinator.sent == [(b"c", [Command.ACCEPTED, Command.ACCEPTED])]
    assert coordinator._deferred == {}


def test_nothing_is_held_for_a_peer_that_does_not_read_batch_nor_past_stopping(coordinator):
    _post(coordinator, b"old", Command.RESULT_ACK)
    coordinator._flush(100.0)
    assert coordinator.sent == [(b"old", [Command.RESULT_ACK])]
    _post(coordinator, b"w", Command.RESULT_ACK)
    coordinator._flush(101.0)
    coordinator._flush(101.0, everything=True)  # what run() does as it ends
    assert coordinator.sent[-1] == (b"w", [Command.RESULT_ACK])


def test_a_result_goes_at_once_with_what_was_held_for_its_client(coordinator):
    _post(coordinator, b"c", Command.ACCEPTED)
    _post(coordinator, b"w", Command.TASK)
    coordinator._flush(100.0)
    assert coordinator.sent == [(b"w", [Command.TASK])]
    _post(coordinator, b"c", Command.RESULT)
    coordinator._flush(100.001)
    assert coordinator.sent[-1] == (b"c", [Command.ACCEPTED, Command.RESULT])


def test_a_task_and_a_result_go_before_the_commit_and_the_acknowledgements_after(coordinator):
    # A worker starts (a client has its result) while the journal is written; only what
    # promises something is in the journal waits for it.
    events = coordinator.sent
    commit = coordinator.store.commit

    def committing():
        events.append((b"", ["commit"]))
        commit()

    coordinator.store.commit = committing
    _post(coordinator, b"c", Command.ACCEPTED)
    _post(coordinator, b"w", Command.TASK)
    _post(coordinator, b"old", Command.ACCEPTED)
    _post(coordinator, b"c2", Command.RESULT)
    coordinator._end_turn(100.0)
    assert events == [(b"w", [Command.TASK]), (b"c2", [Command.RESULT]), (b"", ["commit"]),
                      (b"old", [Command.ACCEPTED])]
    assert coordinator.broker.outbox == []
    _post(coordinator, b"w", Command.RESULT_ACK)
    _post(coordinator, b"c", Command.RESULT)
    coordinator._end_turn(100.001)
    # What was held for the client (committed a turn ago) leads its result; the worker's
    # RESULT_ACK waits for this turn's commit and then for the window.
    assert events[-2:] == [(b"c", [Command.ACCEPTED, Command.RESULT]), (b"", ["commit"])]
    assert list(coordinator._deferred) == [b"w"]


def test_files_dropped_in_a_turn_are_removed_after_its_commit(coordinator):
    # A crash between the two restarts from a journal that may still name them.
    events: list[str] = []
    commit = coordinator.store.commit

    def committing():
        events.append("commit")
        commit()

    class Folder:
        def retire_soon(self, names, retire=True):
            events.append(f"remove {' '.join(names)}")

    coordinator.store.commit = committing
    real, coordinator.ledger.shm = coordinator.ledger.shm, Folder()
    try:
        coordinator.ledger.drop_shared({"shm": [[1, "a" * 32, 5]]})
        assert events == []
        coordinator._end_turn(100.0)
        assert events == ["commit", f"remove {'a' * 32}"]
    finally:
        coordinator.ledger.shm = real  # closed with the coordinator, its folder removed


def test_a_journal_that_cannot_be_written_stops_the_loop_with_what_to_do(coordinator):
    # A full disk raised out of the loop's commit: serve said only "stopped unexpectedly".
    import sqlite3

    def full(*args):
        raise sqlite3.OperationalError("database or disk is full")

    coordinator.store.commit = full
    loop = threading.Thread(target=coordinator.run, daemon=True)
    loop.start()
    loop.join(10)
    assert not loop.is_alive()
    said = coordinator.stopped_because or ""
    assert "could not be written (database or disk is full)" in said
    assert "Free disk space" in said and "start serve again" in said
    assert coordinator.sent == []  # nothing acknowledged that is not in the journal


def test_a_write_that_fails_mid_turn_acknowledges_nothing_of_that_turn(coordinator):
    # A status query flushed the turn's writes and one failed (a full disk): the query's
    # error was contained, and the turn's commit then committed what was applied before it.
    import sqlite3

    store = coordinator.store
    store.add_job("j", "job", "c", 1.0)
    _post(coordinator, b"c", Command.ACCEPTED)  # the acknowledgement of that write
    store._write("INSERT INTO no_such_table VALUES (?)", (1,))  # fails as a full disk would
    with pytest.raises(sqlite3.Error):
        store.job_tasks("j", 10)  # inside Broker.handle, which contains it
    with pytest.raises(sqlite3.Error):
        coordinator._end_turn(100.0)  # the loop stops on it (run() says what to do)
    assert coordinator.sent == []
    assert store._db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 0


def test_a_bind_address_this_machine_lacks_is_named_as_such(tmp_path):
    # It said "Is another coordinator running? Pick another port": no port would do.
    from gpumesh.errors import ConfigError

    with pytest.raises(ConfigError, match="192.0.2.1 is not an address of this machine"):
        Coordinator(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}), new_token(),
                    host="192.0.2.1", port=0, db_path=tmp_path / "journal.db")
