"""Big messages from the coordinator in pieces, paced by the receiver (since protocol 1.8).

A ZeroMQ message is atomic: the sender's libzmq holds all of it until the last byte is on the
wire, and the receiver's until the last byte has come. For a 1 GiB task sent to a worker on
another machine that is 1 GiB more in the coordinator for as long as the network takes (nine
seconds on a gigabit LAN), read back from its journal file whole first. So a message of
``STREAM_BYTES`` or more, and one whose frames wait in a file (``FileSpan``), goes to a peer
that said it reads them (HELLO ``pieces``) as PIECE messages of at most ``piece_bytes`` each:
the message's frames end to end, cut into slices. The first PIECE says how long the whole is
and how long each frame; the receiver puts the slices into one buffer, acknowledges each with
PIECE_ACK, and hands on the message it makes up as if it had come whole. The sender keeps at
most ``window`` bytes unacknowledged, and reads a frame in a file only when its slice goes.

Messages to one peer keep their order: what comes after a message in pieces waits behind it.
Nothing here is journaled or retried: a session that ends mid-way drops what it was sending
and receiving, as ZeroMQ drops a message to a peer that has gone, and the protocol's own
re-sends (a lease not re-claimed, a result fetched again) recover. No I/O here besides the
files' reads; the coordinator's loop sends what ``Outflow.take`` gives it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import Limits
from ..fileio import FileSpan
from .messages import Command, Message, ProtocolError, decode, encode, frame_size

log = logging.getLogger("gpumesh.protocol")

STREAM_BYTES = 8 * 1024 * 1024  # a message this big or bigger goes in pieces
WINDOW_PIECES = 16  # pieces sent and not yet acknowledged, per peer
# A frame (or what is left of it) this big goes in pieces of its own, without a copy; smaller
# ones share a piece. The slices of a split buffer are the size of a piece, or nearly.
ALONE_BYTES = 64 * 1024
STALL_SECONDS = 60.0  # no acknowledgement for this long: the peer is gone, drop what it was sent
# What tasks print, held behind a message in pieces to one peer, at most (then dropped, with a
# line saying so): over a slow link a chatty task would otherwise grow the queue without end.
OUTPUT_HELD_BYTES = 4 * 1024 * 1024
OUTPUT_CUT_NOTICE = (b"\n[gpumesh] output dropped here: it came faster than the link carried it "
                     b"while a big message went over it\n")
_OUTPUT = bytes([Command.OUTPUT])
MAX_CUT_NOTICES = 256  # tasks told their output was cut, per peer and big message


def streams(frames: Sequence[Any]) -> bool:
    """Whether ``frames`` (a message as ``encode`` made it) go in pieces to a peer that reads
    them: a frame in a file always does (nothing else reads it), a big message too."""
    total = 0
    for frame in frames:
        if isinstance(frame, FileSpan):
            return True
        total += frame_size(frame)
    return total >= STREAM_BYTES


@dataclass
class _Transfer:
    xid: int
    frames: list[Any]
    lengths: list[int]
    total: int
    sent: int = 0  # bytes put into PIECEs
    frame: int = 0  # the frame the next piece starts in
    offset: int = 0  # ... and where in it

    def next_piece(self, size: int) -> Any:
        """The next piece of at most ``size`` bytes. A piece ends where a big frame does, so
        each piece of a big frame is a view of it (no copy); small frames (the head ones, and
        the small frames of a task) are joined into one piece (one copy). A frame in a file is
        read here, and only here."""
        frame, length = self.frames[self.frame], self.lengths[self.frame]
        left = length - self.offset
        if left >= ALONE_BYTES or isinstance(frame, FileSpan):
            n = min(left, size)
            piece = self._slice(frame, length, n)
            self._advance(n)
            return piece
        parts: list[Any] = []
        room = size
        while self.sent < self.total and room:
            frame, length = self.frames[self.frame], self.lengths[self.frame]
            left = length - self.offset
            if parts and (left >= ALONE_BYTES or isinstance(frame, FileSpan)):
                break  # a big one starts a piece of its own
            n = min(left, room)
            parts.append(self._slice(frame, length, n))
            room -= n
            self._advance(n)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _slice(self, frame: Any, length: int, n: int) -> Any:
        if isinstance(frame, FileSpan):
            return frame.read(self.offset, n)
        if n == length:
            return frame  # a whole frame: as it is
        return memoryview(frame).cast("B")[self.offset:self.offset + n]

    def _advance(self, n: int) -> None:
        self.sent += n
        self.offset += n
        while self.frame < len(self.lengths) and self.offset == self.lengths[self.frame]:
            self.frame += 1
            self.offset = 0


@dataclass
class _Peer:
    queue: deque[list[Any]] = field(default_factory=deque)  # messages waiting, in order
    transfer: _Transfer | None = None
    sent: int = 0  # bytes of PIECEs sent to this peer, all transfers
    acked: int = 0  # ... and acknowledged
    # Transfers not wholly acknowledged: xid -> (bytes sent to the peer before it, its size).
    # PIECE_ACK ``got`` counts a transfer's own bytes.
    open: dict[int, tuple[int, int]] = field(default_factory=dict)
    progress_at: float = 0.0
    output_held: int = 0  # bytes of OUTPUT queued since the transfer under way began
    output_cut: set[bytes] = field(default_factory=set)  # OUTPUT headers whose rest was dropped


class Outflow:
    """The coordinator's messages in pieces, per peer (by routing id). Owned by its loop."""

    def __init__(self, limits: Limits) -> None:
        self.piece_bytes = limits.chunk_bytes
        self.window = WINDOW_PIECES * self.piece_bytes
        self._peers: dict[bytes, _Peer] = {}
        self._next_xid = 0

    @property
    def sending(self) -> int:
        """Transfers under way, all peers."""
        return sum(peer.transfer is not None for peer in self._peers.values())

    def busy(self, routing: bytes) -> bool:
        """Whether messages to this peer wait behind one in pieces (so a new one must too)."""
        return routing in self._peers

    def add(self, routing: bytes, messages: Sequence[list[Any]], now: float) -> None:
        """Queue ``messages`` for this peer, behind what waits already; ``take`` gives them."""
        peer = self._peers.get(routing)
        if peer is None:
            peer = self._peers[routing] = _Peer(progress_at=now)
        elif not peer.open:
            peer.progress_at = now  # the stall clock runs only while pieces are unacknowledged
        peer.queue.extend(messages)

    def admit_output(self, messages: list[list[Any]], routing: bytes) -> list[list[Any]]:
        """``messages`` to a peer, less the OUTPUT that would take what waits behind pieces
        to it past ``OUTPUT_HELD_BYTES``: the first one cut for each task and stream is
        replaced by a line saying so, the rest dropped. All of them while it is not busy."""
        peer = self._peers.get(routing)
        if peer is None:
            return messages
        kept: list[list[Any]] = []
        for frames in messages:
            if frames[1] != _OUTPUT:
                kept.append(frames)
                continue
            size = sum(frame_size(f) for f in frames[3:])
            if peer.output_held + size <= OUTPUT_HELD_BYTES:
                peer.output_held += size
                kept.append(frames)
                continue
            said = bytes(frames[2])  # its header: the task and stream (and worker)
            if said not in peer.output_cut and len(peer.output_cut) < MAX_CUT_NOTICES:
                peer.output_cut.add(said)
                kept.append([*frames[:3], OUTPUT_CUT_NOTICE])
        return kept

    def take(self, routing: bytes) -> list[list[Any]]:
        """What may go to this peer now, in order: the messages before the next one in pieces
        as they are, then that one's pieces while the window lets them go."""
        peer = self._peers.get(routing)
        if peer is None:
            return []
        out: list[list[Any]] = []
        while True:
            transfer = peer.transfer
            if transfer is None:
                if not peer.queue:
                    if not peer.open:
                        # Nothing waits or is unacknowledged: the peer's messages go direct.
                        del self._peers[routing]
                    return out
                frames = peer.queue.popleft()
                if not streams(frames):
                    out.append(frames)
                    continue
                transfer = peer.transfer = self._start(frames)
                peer.open[transfer.xid] = (peer.sent, transfer.total)
                # What was queued before it has gone: the OUTPUT held counts afresh behind it.
                peer.output_held, peer.output_cut = 0, set()
            while transfer.sent < transfer.total and peer.sent - peer.acked < self.window:
                header: dict[str, Any] = {"x": transfer.xid, "at": transfer.sent}
                if transfer.sent == 0:
                    header.update(total=transfer.total, lengths=transfer.lengths)
                piece = transfer.next_piece(self.piece_bytes)
                peer.sent += frame_size(piece)
                out.append(encode(Command.PIECE, header, [piece]))
            if transfer.sent < transfer.total:
                return out  # the window is full: an acknowledgement lets more go
            peer.transfer = None  # its frames go: a file it read is closed with the last

    def _start(self, frames: list[Any]) -> _Transfer:
        self._next_xid += 1
        lengths = [frame_size(f) for f in frames]
        return _Transfer(self._next_xid, frames, lengths, sum(lengths))

    def acked(self, routing: bytes, xid: Any, got: Any, now: float) -> bool:
        """A PIECE_ACK: the peer has had ``got`` bytes of transfer ``xid``. True when it moved
        the window (the loop then ``take``s); anything else (a repeat, more than was sent, an
        unknown transfer, garbage) is ignored."""
        peer = self._peers.get(routing)
        if peer is None or type(xid) is not int or type(got) is not int:
            return False
        base, total = peer.open.get(xid, (0, -1))
        if not 0 < got <= total or base + got > peer.sent or base + got <= peer.acked:
            return False
        peer.acked = base + got
        peer.progress_at = now
        if got == total:
            for done in [x for x in peer.open if x <= xid]:
                del peer.open[done]
        return True

    def routings(self) -> list[bytes]:
        return list(self._peers)

    def drop(self, routing: bytes) -> list[list[Any]]:
        """Stop sending this peer pieces (its session ended, a send failed, a file could not be
        read): the transfer under way and the messages waiting to go in pieces are dropped.
        Returns the other messages that waited behind them, in order, for the loop to send as
        they are (a DISCONNECT among them still tells a worker it was removed); the peer
        drops a half-received message when something other than its next piece comes."""
        peer = self._peers.pop(routing, None)
        if peer is None:
            return []
        return [frames for frames in peer.queue if not streams(frames)]

    def stalled(self, now: float, limit: float = STALL_SECONDS) -> list[bytes]:
        """Peers that acknowledged nothing for ``limit`` seconds while pieces waited on them."""
        return [routing for routing, peer in self._peers.items()
                if peer.open and now - peer.progress_at > limit]


def memory_buffer(size: int) -> memoryview:
    return memoryview(bytearray(size))


class Assembler:
    """The receiving side of one connection: one message in pieces at a time, into one buffer
    that ``make_buffer`` gives (memory by default; the coordinator's is a file it maps)."""

    def __init__(self, limits: Limits, make_buffer: Callable[[int], memoryview] = memory_buffer,
                 source: str = "the coordinator", join_split: bool = True) -> None:
        self.limits = limits
        self._make_buffer = make_buffer
        self.source = source
        # A peer joins split frames as it would have (as views); the coordinator forwards
        # them, as slices within the frame limit, and never joins them.
        self.join_split = join_split
        self._xid: int | None = None
        self._buffer: memoryview | None = None
        self._lengths: list[int] = []
        self._got = 0

    def reset(self) -> None:
        self._xid, self._buffer, self._lengths, self._got = None, None, [], 0

    def feed(self, header: dict[str, Any], payload: list[Any]) -> tuple[dict[str, Any] | None,
                                                                          Message | None]:
        """One PIECE: the PIECE_ACK header to send (None for a piece that fits nothing under
        way, which is dropped) and, with the last piece, the message they make up."""
        xid, at = header.get("x"), header.get("at")
        if type(xid) is not int or type(at) is not int or len(payload) != 1:
            log.warning("dropped a malformed PIECE from %s", self.source)
            return None, None
        piece = memoryview(payload[0].buffer if hasattr(payload[0], "buffer") else payload[0])
        if at == 0 and "total" in header:
            if not self._begin(xid, header):
                return None, None
        elif xid != self._xid or at != self._got:
            # A piece of a message whose start was lost (a new session began mid-way): the
            # sender drops it too; what mattered in it comes again through the protocol.
            log.debug("dropped a PIECE out of order (transfer %s at %s)", xid, at)
            self.reset()
            return None, None
        assert self._buffer is not None
        size = piece.nbytes
        if size == 0 or size > self.limits.max_frame_bytes or self._got + size > len(self._buffer):
            log.warning("dropped a PIECE that does not fit its message")
            self.reset()
            return None, None
        self._buffer[self._got:self._got + size] = piece.cast("B")
        self._got += size
        ack = {"x": xid, "got": self._got}
        if self._got < len(self._buffer):
            return ack, None
        buffer, lengths = self._buffer, self._lengths
        self.reset()
        try:
            return ack, _decoded(buffer, lengths, self.limits, self.join_split)
        except ProtocolError as exc:
            log.warning("dropped a malformed message from %s: %s", self.source, exc.detail)
            return ack, None

    def _begin(self, xid: int, header: dict[str, Any]) -> bool:
        total, lengths = header.get("total"), header.get("lengths")
        limits = self.limits
        if not (type(total) is int and 0 < total <= limits.max_message_bytes
                and isinstance(lengths, list) and 3 <= len(lengths) <= limits.max_frames
                and all(type(n) is int and 0 <= n <= limits.max_frame_bytes for n in lengths)
                and sum(lengths) == total):
            log.warning("dropped a PIECE announcing a message this side does not take")
            self.reset()
            return False
        self._xid, self._lengths, self._got = xid, lengths, 0
        self._buffer = self._make_buffer(total)
        return True

    @property
    def receiving(self) -> bool:
        return self._buffer is not None

    @property
    def reserved(self) -> int:
        """Bytes of the buffer the message under way fills (0 when none is)."""
        return 0 if self._buffer is None else len(self._buffer)


class Inflow:
    """The coordinator's side of messages its peers send in pieces: an assembler per peer,
    whose buffers ``make_buffer`` gives (files it maps, so a big SUBMIT or RESULT waits in the
    page cache, which the kernel may write out, instead of in the process's memory).

    A buffer is the whole message's size from its first piece on (disk space, or memory when
    the disk is full), so what peers may have on the way at once is bounded: ``budget`` bytes
    (two of the biggest messages by default) for each pool of peers, and ``total_budget``
    (three of them) for all pools together. The coordinator puts its workers in one pool and
    its clients in another, so clients uploading slowly never keep out a worker's result of the
    biggest size, nor the other way round. A message begun beyond either bound is dropped
    unacknowledged; its sender starts a new session and sends it again (gpumesh/session.py).
    One that takes no piece for STALL_SECONDS is dropped, so a peer that stops halfway does not
    hold its share."""

    def __init__(self, limits: Limits, make_buffer: Callable[[int], memoryview],
                 budget: int | None = None, total_budget: int | None = None) -> None:
        self.limits = limits
        self._make_buffer = make_buffer
        self.budget = 2 * limits.max_message_bytes if budget is None else budget
        # Room for a pool holding its whole budget and one more message of the biggest size.
        self.total_budget = (self.budget + limits.max_message_bytes if total_budget is None
                             else total_budget)
        self._by_peer: dict[bytes, Assembler] = {}
        self._pool_of: dict[bytes, str] = {}
        self._moved_at: dict[bytes, float] = {}
        self._reserved: dict[str, int] = {}  # bytes of the buffers held, by pool

    @property
    def reserved(self) -> int:
        """Bytes of the buffers held, all pools together."""
        return sum(self._reserved.values())

    def reserved_by(self, pool: str) -> int:
        return self._reserved.get(pool, 0)

    def feed(self, routing: bytes, header: dict[str, Any], payload: list[Any], now: float,
             pool: str = "") -> tuple[dict[str, Any] | None, Message | None]:
        """A piece from ``routing``, a peer of ``pool``: the acknowledgement to send (or None)
        and the whole message once its last piece is in (or None)."""
        if routing in self._by_peer and self._pool_of[routing] != pool:
            self.drop(routing)  # a new session's peer under an old routing: start afresh
        assembler = self._by_peer.get(routing)
        held = 0 if assembler is None else assembler.reserved
        total = header.get("total")
        in_pool = self._reserved.get(pool, 0)
        if header.get("at") == 0 and type(total) is int and (
                in_pool - held + total > self.budget
                or self.reserved - held + total > self.total_budget):
            log.warning("dropped a big message a %s began (%s): %s of big messages from its "
                        "kind of peer (%s in all) are on their way in already, and at most %s "
                        "(%s) may be; it comes again later", pool or "peer", _size(total),
                        _size(in_pool - held), _size(self.reserved - held),
                        _size(self.budget), _size(self.total_budget))
            self.drop(routing)
            return None, None
        if assembler is None:
            assembler = self._by_peer[routing] = Assembler(self.limits, self._make_buffer,
                                                           source="a peer", join_split=False)
            self._pool_of[routing] = pool
        try:
            ack, whole = assembler.feed(header, payload)
        finally:  # counted whatever happened, or the budget would leak
            self._reserved[pool] = in_pool + assembler.reserved - held
            self._moved_at[routing] = now
        if not assembler.receiving:
            self.drop(routing)  # done, or dropped: nothing held for this peer
        return ack, whole

    def routings(self) -> list[bytes]:
        return list(self._by_peer)

    def drop(self, routing: bytes) -> None:
        """The peer's session ended (or its message was dropped): what it was sending goes."""
        assembler = self._by_peer.pop(routing, None)
        pool = self._pool_of.pop(routing, "")
        self._moved_at.pop(routing, None)
        if assembler is not None:
            self._reserved[pool] -= assembler.reserved
            assembler.reset()

    def expire(self, now: float, limit: float = STALL_SECONDS) -> list[bytes]:
        """Drop the messages that took no piece for ``limit`` seconds; their peers."""
        idle = [routing for routing, at in self._moved_at.items() if now - at > limit]
        for routing in idle:
            log.warning("dropped a big message a peer stopped sending %.0f s ago", now -
                        self._moved_at[routing])
            self.drop(routing)
        return idle


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.0f} MiB"


def _decoded(buffer: memoryview, lengths: list[int], limits: Limits, join_split: bool
             ) -> Message:
    """The message a transfer's buffer holds, checked as one that came whole. Frames that were
    split are joined as views: their slices lie side by side in the buffer, so the copy that
    joining costs a whole message is not made again (its ``split`` goes with it)."""
    frames: list[Any] = []
    starts: list[int] = []
    start = 0
    for index, length in enumerate(lengths):
        view = buffer[start:start + length]
        frames.append(bytes(view) if index < 3 else view)  # the codec reads the head as bytes
        starts.append(start)
        start += length
    msg = decode(frames, limits)
    layout = msg.header.get("split")
    if join_split and isinstance(layout, list) and all(type(n) is int and n >= 1 for n in layout) \
            and sum(layout) == len(msg.payload):
        joined, first = [], 3
        for count in layout:
            end = starts[first + count - 1] + lengths[first + count - 1]
            joined.append(buffer[starts[first]:end])
            first += count
        msg.payload = joined
        del msg.header["split"]
    return msg
