"""Big messages from the coordinator in pieces (gpumesh/protocol/pieces.py): the outflow cuts a
message into PIECEs paced by PIECE_ACKs and keeps each peer's order, and the assembler puts
them back together, refusing whatever does not fit what it was told."""

from __future__ import annotations

import os

import pytest

from gpumesh.config import Limits
from gpumesh.fileio import SharedFd
from gpumesh.protocol import Command, Message, decode, encode
from gpumesh.protocol.pieces import (
    OUTPUT_CUT_NOTICE,
    OUTPUT_HELD_BYTES,
    STALL_SECONDS,
    STREAM_BYTES,
    WINDOW_PIECES,
    Assembler,
    Inflow,
    Outflow,
    streams,
)

LIMITS = Limits()
PIECE = LIMITS.chunk_bytes
PEER = b"peer-1"


def big(size: int, seed: int = 1) -> bytes:
    return bytes((seed + i) % 251 for i in range(256)) * (size // 256) + b"x" * (size % 256)


def frames_of(count: int, seed: int = 1) -> list[bytes]:
    """``count`` payload frames of a piece each: as a sender splits a big buffer (``split``)."""
    return [big(PIECE, seed + n) for n in range(count)]


ENOUGH = STREAM_BYTES // PIECE + 1  # frames that make a message go in pieces


def messages(wire: list[list]) -> list[Message]:
    return [decode(frames, LIMITS) for frames in wire]


def deliver(outflow: Outflow, assembler: Assembler, now: float = 0.0) -> list[Message]:
    """Run the exchange to its end: what the peer's side makes of everything sent."""
    out: list[Message] = []
    while True:
        wire = outflow.take(PEER)
        if not wire:
            return out
        for msg in messages(wire):
            if msg.command is not Command.PIECE:
                out.append(msg)
                continue
            ack, whole = assembler.feed(msg.header, msg.payload)
            assert ack is not None
            if whole is not None:
                out.append(whole)
            outflow.acked(PEER, ack["x"], ack["got"], now)


def test_a_big_message_comes_out_whole_and_in_order_with_the_small_ones_around_it():
    payload = [*frames_of(ENOUGH), b"tail", big(PIECE // 2 + 123, seed=7)]
    outflow = Outflow(LIMITS)
    outflow.add(PEER, [encode(Command.HEARTBEAT, {"n": 1}),
                       encode(Command.TASK, {"task": "t1"}, payload),
                       encode(Command.HEARTBEAT, {"n": 2})], 0.0)
    out = deliver(outflow, Assembler(LIMITS))
    assert [m.command for m in out] == [Command.HEARTBEAT, Command.TASK, Command.HEARTBEAT]
    assert [m.header for m in out] == [{"n": 1}, {"task": "t1"}, {"n": 2}]
    assert [bytes(f) for f in out[1].payload] == payload
    assert not outflow.busy(PEER)  # all acknowledged: the next message goes direct


def test_the_window_holds_back_pieces_until_they_are_acknowledged():
    outflow = Outflow(LIMITS)
    outflow.add(PEER, [encode(Command.TASK, {}, frames_of(WINDOW_PIECES + 5))], 0.0)
    first = messages(outflow.take(PEER))
    in_flight = sum(len(m.payload[0]) for m in first)
    # The head frames make a small piece of their own; then whole slices of the big frames.
    assert len(first[0].payload[0]) < 100 and len(first) == WINDOW_PIECES + 1
    assert WINDOW_PIECES * PIECE <= in_flight < (WINDOW_PIECES + 1) * PIECE
    assert outflow.take(PEER) == []
    assert first[0].header["total"] > (WINDOW_PIECES + 5) * PIECE  # the head frames count too
    assert outflow.busy(PEER)
    # A repeat, a count past what was sent, an unknown transfer, garbage: nothing moves.
    xid = first[0].header["x"]
    for bad in [(xid, 0), (xid, in_flight + 1), (xid + 1, PIECE), ("x", PIECE),
                (xid, True)]:
        assert not outflow.acked(PEER, *bad, 0.0)
    assert outflow.acked(PEER, xid, 2 * PIECE, 0.0)
    assert not outflow.acked(PEER, xid, 2 * PIECE, 0.0)  # the same again
    assert len(outflow.take(PEER)) == 2


def test_a_message_of_stream_size_streams_and_a_smaller_one_does_not():
    assert not streams(encode(Command.TASK, {}, [b"x" * 1000]))
    assert streams(encode(Command.TASK, {}, [b"x" * STREAM_BYTES]))


def test_frames_in_a_file_are_read_only_as_their_pieces_go(tmp_path):
    data = big(PIECE + 77, seed=3)
    path = tmp_path / "blob"
    path.write_bytes(data)
    fd = SharedFd(os.open(path, os.O_RDONLY))
    spans = [fd.span(0, PIECE), fd.span(PIECE, 77)]
    assert streams(encode(Command.TASK, {}, [b"fn", *spans]))  # a file's frame always does
    outflow = Outflow(LIMITS)
    outflow.add(PEER, [encode(Command.TASK, {"task": "t"}, [b"fn", *spans])], 0.0)
    raw = fd.fd
    del spans
    [task] = deliver(outflow, Assembler(LIMITS))
    assert [bytes(f) for f in task.payload] == [b"fn", data[:PIECE], data[PIECE:]]
    del fd
    with pytest.raises(OSError):  # sent: the descriptor went with the last span
        os.fstat(raw)


def test_a_file_that_shrank_raises_for_the_loop_to_drop_the_peer(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(b"y" * (3 * PIECE))
    fd = SharedFd(os.open(path, os.O_RDONLY))
    outflow = Outflow(LIMITS)
    outflow.add(PEER, [encode(Command.TASK, {}, [fd.span(0, 3 * PIECE)])], 0.0)
    os.truncate(path, PIECE)
    with pytest.raises(EOFError):
        outflow.take(PEER)
    outflow.drop(PEER)
    assert not outflow.busy(PEER) and outflow.sending == 0


def test_a_peer_that_acknowledges_nothing_stalls_and_a_dropped_one_is_forgotten():
    outflow = Outflow(LIMITS)
    outflow.add(PEER, [encode(Command.TASK, {}, frames_of(ENOUGH))], 100.0)
    outflow.take(PEER)
    assert outflow.stalled(130.0) == []
    assert outflow.stalled(161.0) == [PEER]
    outflow.drop(PEER)
    assert outflow.routings() == [] and outflow.sending == 0
    assert not outflow.acked(PEER, 1, PIECE, 162.0)


def pieces_of(payload: list[bytes]) -> list[Message]:
    outflow = Outflow(LIMITS)
    outflow.add(PEER, [encode(Command.RESULT, {"task": "t"}, payload)], 0.0)
    out = messages(outflow.take(PEER))
    while True:  # acknowledge everything, as a peer would
        xid = out[0].header["x"]
        outflow.acked(PEER, xid, sum(len(m.payload[0]) for m in out), 0.0)
        more = messages(outflow.take(PEER))
        if not more:
            return out
        out += more


def test_the_assembler_refuses_pieces_that_do_not_fit_and_starts_over():
    good = pieces_of(frames_of(ENOUGH))
    assembler = Assembler(LIMITS)
    assert assembler.feed(good[1].header, good[1].payload) == (None, None)  # no start seen
    first = good[0]
    for bad_header in [{**first.header, "total": 0},
                       {**first.header, "total": LIMITS.max_message_bytes + 1},
                       {**first.header, "lengths": [1, 2]},
                       {**first.header, "lengths": [*first.header["lengths"][:-1], 1]},
                       {**first.header, "lengths": "many"},
                       {**first.header, "x": "one"},
                       {**first.header, "lengths": [LIMITS.max_frame_bytes + 1, 1, 1]}]:
        assert assembler.feed(bad_header, first.payload) == (None, None)
    assert assembler.feed(first.header, [b""]) == (None, None)  # an empty piece
    assert assembler.feed(first.header, []) == (None, None)  # no frame at all
    # Started, then a piece out of place: dropped, and the whole starts over.
    assert assembler.feed(first.header, first.payload)[0] is not None
    assert assembler.feed(good[2].header, good[2].payload) == (None, None)
    results = [assembler.feed(m.header, m.payload) for m in good]
    assert all(ack is not None for ack, _ in results)
    whole = results[-1][1]
    assert whole is not None and whole.command is Command.RESULT


def test_a_piece_that_overflows_its_announced_message_is_dropped():
    good = pieces_of(frames_of(ENOUGH))
    assembler = Assembler(LIMITS)
    for msg in good[:-1]:
        assert assembler.feed(msg.header, msg.payload)[1] is None
    last = good[-1]
    overflowing = bytes(last.payload[0]) + b"!"
    assert assembler.feed(last.header, [overflowing]) == (None, None)
    assert assembler.feed(last.header, last.payload) == (None, None)  # started over


def test_a_dropped_peer_gives_back_the_small_messages_that_waited_in_order():
    outflow = Outflow(LIMITS)
    outflow.add(PEER, [encode(Command.TASK, {"n": 1}, frames_of(WINDOW_PIECES + 5)),
                       encode(Command.HEARTBEAT, {"n": 2}),
                       encode(Command.TASK, {"n": 3}, frames_of(ENOUGH)),
                       encode(Command.DISCONNECT, {"reason": "kill"})], 0.0)
    outflow.take(PEER)
    left = messages(outflow.drop(PEER))
    assert [(m.command, m.header) for m in left] == [
        (Command.HEARTBEAT, {"n": 2}), (Command.DISCONNECT, {"reason": "kill"})]
    assert not outflow.busy(PEER) and outflow.drop(PEER) == []


def test_the_coordinators_inflow_fills_a_mapped_file_and_passes_split_frames_on_as_they_came(
        tmp_path):
    import mmap

    from gpumesh.blobs import BlobFolder
    from gpumesh.protocol import serialize

    folder = BlobFolder(tmp_path / "blobs", sync=False)
    made: list[memoryview] = []

    def scratch(size: int) -> memoryview:
        made.append(folder.scratch(size))
        return made[-1]

    data = big(ENOUGH * PIECE + 3)
    wire, layout = serialize.split_frames([b"fn", data], LIMITS.chunk_bytes)
    outflow = Outflow(LIMITS)
    outflow.add(PEER, [encode(Command.SUBMIT, {"split": layout}, wire)], 0.0)
    inflow = Inflow(LIMITS, scratch)
    whole = None
    while (pieces := messages(outflow.take(PEER))):
        for piece in pieces:
            ack, done = inflow.feed(PEER, piece.header, piece.payload, 0.0)
            outflow.acked(PEER, ack["x"], ack["got"], 0.0)
            whole = done or whole
    assert whole is not None and whole.header == {"split": layout}  # not joined: forwarded
    assert [bytes(f) for f in whole.payload] == [bytes(f) for f in wire]
    assert isinstance(made[0].obj, mmap.mmap) and inflow.routings() == []
    assert list((tmp_path / "blobs").iterdir()) == []  # the file has no name


def test_a_transfer_cut_off_by_a_new_session_is_forgotten():
    inflow = Inflow(LIMITS, lambda size: memoryview(bytearray(size)))
    first = pieces_of(frames_of(ENOUGH))[0]
    assert inflow.feed(PEER, first.header, first.payload, 0.0)[0] is not None
    assert inflow.routings() == [PEER]
    inflow.drop(PEER)
    assert inflow.routings() == []


def test_big_messages_on_their_way_in_are_bounded_all_peers_together():
    # Each message in pieces holds a buffer of its whole size from its first piece: disk, or
    # memory when the disk is full. Many peers each beginning a 1 GiB message could fill
    # both; what is beyond the budget is dropped unacknowledged, and comes again later.
    pieces = pieces_of(frames_of(ENOUGH))
    total = pieces[0].header["total"]
    inflow = Inflow(LIMITS, lambda size: memoryview(bytearray(size)), budget=total * 3 // 2)
    assert inflow.feed(b"a", pieces[0].header, pieces[0].payload, 0.0)[0] is not None
    assert inflow.reserved == total
    assert inflow.feed(b"b", pieces[0].header, pieces[0].payload, 0.0) == (None, None)
    assert inflow.routings() == [b"a"]
    whole = None
    for piece in pieces[1:]:
        whole = inflow.feed(b"a", piece.header, piece.payload, 1.0)[1] or whole
    assert whole is not None and inflow.reserved == 0 and inflow.routings() == []
    # The room is back; a peer that then stops sending gives it back after STALL_SECONDS.
    assert inflow.feed(b"b", pieces[0].header, pieces[0].payload, 2.0)[0] is not None
    assert inflow.expire(2.0 + STALL_SECONDS - 1) == [] and inflow.reserved == total
    assert inflow.expire(2.0 + STALL_SECONDS + 1) == [b"b"]
    assert inflow.reserved == 0 and inflow.routings() == []
    assert Inflow(LIMITS, bytearray).budget == 2 * LIMITS.max_message_bytes  # the default


def test_clients_filling_their_budget_do_not_keep_a_workers_result_out():
    # Two clients uploading big inputs slowly (a laptop on Wi-Fi) once held the one budget all
    # peers shared, and a worker's big result was dropped each time it began, for as long as
    # the uploads took. Each kind of peer has a budget of its own now.
    pieces = pieces_of(frames_of(ENOUGH))
    total = pieces[0].header["total"]
    inflow = Inflow(LIMITS, lambda size: memoryview(bytearray(size)), budget=total * 3 // 2)
    assert inflow.feed(b"c1", pieces[0].header, pieces[0].payload, 0.0, "client")[0] is not None
    assert inflow.feed(b"c2", pieces[0].header, pieces[0].payload, 0.0, "client") == (None, None)
    assert inflow.reserved_by("client") == total
    assert inflow.feed(b"w1", pieces[0].header, pieces[0].payload, 0.0, "worker")[0] is not None
    assert inflow.reserved_by("worker") == total and inflow.reserved == 2 * total
    whole = None
    for piece in pieces[1:]:
        whole = inflow.feed(b"w1", piece.header, piece.payload, 1.0, "worker")[1] or whole
    assert whole is not None and inflow.reserved_by("worker") == 0
    assert inflow.reserved_by("client") == total and inflow.routings() == [b"c1"]
    # A second worker is bounded by the workers' budget alone, as before.
    assert inflow.feed(b"w2", pieces[0].header, pieces[0].payload, 2.0, "worker")[0] is not None
    assert inflow.feed(b"w3", pieces[0].header, pieces[0].payload, 2.0, "worker") == (None, None)
    inflow.drop(b"c1")
    inflow.drop(b"w2")
    assert inflow.reserved == 0 and inflow.routings() == []
    # All pools together hold at most a pool's budget and one biggest message more.
    assert Inflow(LIMITS, bytearray).total_budget == 3 * LIMITS.max_message_bytes
    inflow = Inflow(LIMITS, lambda size: memoryview(bytearray(size)), budget=total * 2,
                    total_budget=total * 3)
    for routing, pool in ((b"c1", "client"), (b"c2", "client"), (b"w1", "worker")):
        assert inflow.feed(routing, pieces[0].header, pieces[0].payload, 3.0, pool)[0]
    assert inflow.feed(b"w2", pieces[0].header, pieces[0].payload, 3.0, "worker") == (None, None)
    assert inflow.reserved == 3 * total


def test_the_coordinator_counts_a_piece_against_its_senders_kind_of_peer(tmp_path, monkeypatch):
    from gpumesh.config import Settings
    from gpumesh.coordinator import server
    from gpumesh.tokens import new_token

    acks: list[bytes] = []
    monkeypatch.setattr(server, "send_frames", lambda socket, frames: acks.append(frames[0]))
    coordinator = server.Coordinator(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}),
                                     new_token(), host="127.0.0.1", port=0,
                                     db_path=tmp_path / "journal.db")
    try:
        hello = {"proto": [1, 1], "pieces": True}
        coordinator.broker.handle(b"w", decode(encode(Command.HELLO, {
            **hello, "role": "worker", "id": "w1", "slots": 1, "credit": 1,
            "info": {"python": "3.11"}}), LIMITS), 1.0)
        for routing in (b"c1", b"c2"):
            coordinator.broker.handle(routing, decode(encode(Command.HELLO, {
                **hello, "role": "client", "id": routing.decode()}), LIMITS), 1.0)
        first = pieces_of(frames_of(ENOUGH))[0]
        coordinator._inflow.budget = first.header["total"] * 3 // 2
        for routing in (b"c1", b"c2", b"w"):
            coordinator._take_piece(routing, first, 2.0)
        assert acks == [b"c1", b"w"]  # the second client's waits; the worker's does not
        assert coordinator._inflow.reserved_by("client") == first.header["total"]
        assert coordinator._inflow.reserved_by("worker") == first.header["total"]
    finally:
        coordinator.close()


def test_a_full_disk_makes_the_coordinator_receive_in_memory_not_die(tmp_path, monkeypatch):
    import errno

    from gpumesh.store import Store

    store = Store(tmp_path / "journal.db")
    try:
        assert not isinstance(store.scratch_buffer(4096).obj, bytearray)  # a mapped file

        def full(fd: int, offset: int, size: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        # A sparse file would map, then kill the process (SIGBUS) at the first write past
        # the disk's end: the space is allocated first, and a full disk says so at once.
        monkeypatch.setattr(os, "posix_fallocate", full)
        buffer = store.scratch_buffer(4096)
        assert isinstance(buffer.obj, bytearray) and len(buffer) == 4096
    finally:
        store.close()


def _printed(task: str, size: int, worker: str | None = None) -> list:
    header = {"task": task, "stream": "out", **({"worker": worker} if worker else {})}
    return encode(Command.OUTPUT, header, [b"p" * size])


def test_what_tasks_print_behind_a_message_in_pieces_is_bounded_and_the_cut_is_said():
    """Over a slow link a task printing without pause queued its output behind a big result
    in pieces without end: the queue now stops at OUTPUT_HELD_BYTES, each task cut is told."""
    outflow = Outflow(LIMITS)
    chunk = 512 * 1024
    before = [_printed("a", chunk)]
    assert outflow.admit_output(before, PEER) is before  # nothing in pieces: all goes
    outflow.add(PEER, [encode(Command.RESULT, {"task": "big"}, frames_of(ENOUGH))], 0.0)
    assert outflow.busy(PEER)
    wanted = encode(Command.RESULT, {"task": "r"}, [b"ok"])
    messages_in = [_printed("a", chunk) for _ in range(12)] + [wanted] \
        + [_printed("b", chunk) for _ in range(12)] + [_printed("a", chunk)]
    kept = outflow.admit_output(messages_in, PEER)
    assert wanted in kept  # only what tasks print is ever cut
    out = [decode(f, LIMITS) for f in kept if f is not wanted]
    printed = sum(len(m.payload[0]) for m in out if bytes(m.payload[0]) != OUTPUT_CUT_NOTICE)
    assert printed == OUTPUT_HELD_BYTES
    notices = [m.header["task"] for m in out if bytes(m.payload[0]) == OUTPUT_CUT_NOTICE]
    assert notices == ["a", "b"] and all(m.header["task"] == "a" for m in out[:8])
    later = [decode(f, LIMITS) for f in outflow.admit_output(
        [_printed("a", 10), _printed("c", 10)], PEER)]  # "a" was told once already
    assert [(m.header["task"], bytes(m.payload[0])) for m in later] == [("c", OUTPUT_CUT_NOTICE)]



def test_the_output_held_counts_afresh_behind_each_big_message():
    # The count only grew while big messages followed one another (a .map of 10 MiB results
    # over a slow link): after 4 MiB in all, every later print was dropped, though the output
    # before had long gone.
    outflow = Outflow(LIMITS)
    outflow.add(PEER, [encode(Command.RESULT, {"task": "big1"}, frames_of(ENOUGH))], 0.0)
    chunk = 512 * 1024
    first = outflow.admit_output([_printed("a", chunk) for _ in range(8)], PEER)
    assert len(first) == 8  # 4 MiB: all of it waits behind big1
    outflow.add(PEER, [*first, encode(Command.RESULT, {"task": "big2"}, frames_of(ENOUGH, 9))],
                0.0)
    assembler = Assembler(LIMITS)
    while outflow._peers[PEER].transfer is None or outflow._peers[PEER].transfer.xid == 1:
        for msg in messages(outflow.take(PEER)):
            if msg.command is Command.PIECE:
                ack, _ = assembler.feed(msg.header, msg.payload)
                outflow.acked(PEER, ack["x"], ack["got"], 0.0)
    # big1 went, and the output behind it; big2 goes now: what is printed waits behind it.
    later = outflow.admit_output([_printed("a", chunk)], PEER)
    assert [bytes(decode(f, LIMITS).payload[0]) for f in later] == [b"p" * chunk]
