"""Socket plumbing shared by every role: option sets, send/receive of protocol messages, and the
DEALER link that workers and clients keep to the coordinator (with handshake diagnosis).

One thread owns each socket; nothing here starts threads.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import parse_monitor_message

from . import clock
from ._version import __version__
from .config import Endpoint, Limits
from .errors import AuthenticationError, ProtocolMismatch
from .protocol import (
    MAJOR,
    Command,
    ErrorCode,
    Message,
    ProtocolError,
    batches,
    decode,
    encode,
    unbundle,
)
from .protocol.messages import MAGIC
from .protocol.pieces import Assembler, Outflow, streams
from .security import MeshKeys, configure_client
from .session import coordinator_version, install_advice

log = logging.getLogger("gpumesh.transport")
HANDSHAKE_FAILURES_TOLD = 20  # failed handshakes in a row, at an address that admitted us, per warning

# Frames below this are copied by pyzmq anyway; copy=False only pays for big ones.
ZERO_COPY_THRESHOLD = 64 * 1024
# An ERROR version header is a few short fields; a bigger frame of another major is not read.
MAX_VERSION_ERROR_HEADER = 4096
_COORDINATOR = b""  # the outflow's key for the one peer a DEALER has
_HEARTBEAT = bytes([Command.HEARTBEAT])
AUTH_FAILED_MESSAGE = "authentication failed: the token does not match this coordinator"


def apply_common_options(sock: zmq.Socket[bytes], limits: Limits) -> None:
    sock.linger = 0
    sock.maxmsgsize = limits.max_frame_bytes
    # ZMTP heartbeats catch dead TCP links even in the middle of a long transfer.
    sock.heartbeat_ivl = 2000
    sock.heartbeat_timeout = 10000
    sock.heartbeat_ttl = 10000


# Plain ints: pyzmq's flags are enum.IntFlag, and combining those per frame (as send_multipart
# does) costs more than the send itself for small messages.
_LAST = int(zmq.NOBLOCK)
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)


def send_frames(sock: zmq.Socket[bytes], frames: Sequence[Any]) -> bool:
    """Send without ever blocking the loop. False when the peer's queue is full or it is gone.

    A multipart message is atomic: only its first frame can meet a full queue.
    """
    last = len(frames) - 1
    try:
        for index, frame in enumerate(frames):
            # Small bytes are copied (cheaper than pyzmq's zero-copy bookkeeping); received
            # zmq.Frames and large buffers go as they are.
            sock.send(frame, _LAST if index == last else _MORE, copy=_small(frame))
    except zmq.Again:
        return False
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EHOSTUNREACH:
            return False
        raise
    return True


def _small(frame: Any) -> bool:
    if isinstance(frame, (bytes, bytearray)):
        return len(frame) < ZERO_COPY_THRESHOLD
    if isinstance(frame, memoryview):
        return frame.nbytes < ZERO_COPY_THRESHOLD
    return False


def receive(frames: list[zmq.Frame], limits: Limits, offset: int = 0) -> Message:
    """Decode frames received with ``copy=False``; small control frames become bytes."""
    head = [frame.bytes for frame in frames[offset : offset + 3]]
    return decode([*head, *frames[offset + 3 :]], limits)


class LinkEvent(enum.Enum):
    CONNECTED = "connected"  # CURVE handshake completed
    REFUSED = "refused"  # TCP connection refused or failed, libzmq is retrying
    DROPPED = "dropped"  # an established connection closed


class DealerLink:
    """The one DEALER connection from a worker or client to the coordinator.

    ``reset()`` replaces the socket (a fresh routing id) after the peer went silent. The
    monitor turns the silent failure modes of CURVE into answers: a ZAP denial or a repeated
    handshake failure means the token is wrong, and is raised as AuthenticationError.
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: Endpoint, keys: MeshKeys,
                 limits: Limits) -> None:
        self._ctx = ctx
        self.endpoint = endpoint
        self._keys = keys
        self.limits = limits
        self.sock: zmq.Socket[bytes] | None = None
        self.monitor: zmq.Socket[bytes] | None = None
        self._generation = 0
        self._handshake_failures = 0
        self.refusals = 0
        self.handshakes = 0
        # Addresses whose coordinator completed a handshake with this link: one that fails there
        # later is the network (libzmq reports a drop mid-handshake as NO_DETAIL), not the token.
        self._admitted: set[str] = set()
        # The messages of a BATCH not yet handed out by recv(), and those post()ed for flush().
        self._inbox: deque[Message] = deque()
        self._outbox: list[list[Any]] = []
        self.batching = False  # the coordinator reads BATCH: set from its WELCOME
        self._assembler = Assembler(limits)
        # Big messages to the coordinator in pieces, once its WELCOME said it reads them.
        self._outflow = Outflow(limits)
        self._pieces_broken = False
        self.sends_pieces = False

    @property
    def generation(self) -> int:
        """Which socket this is: one more for each open (a reset opens a new one)."""
        return self._generation

    @property
    def backlog(self) -> bool:
        """Messages already received and not yet handed out: poll with no wait."""
        return bool(self._inbox)

    def open(self) -> None:
        self._generation += 1
        sock = self._ctx.socket(zmq.DEALER)
        apply_common_options(sock, self.limits)
        sock.reconnect_ivl = 100
        sock.reconnect_ivl_max = 5000
        sock.sndhwm = 10000
        sock.rcvhwm = 10000
        configure_client(sock, self._keys)
        self.monitor = sock.get_monitor_socket(
            events=zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_CONNECT_RETRIED
            | zmq.EVENT_DISCONNECTED,
            addr=f"inproc://gpumesh-monitor-{id(self):x}-{self._generation}",
        )
        sock.connect(self.endpoint.zmq)
        self.sock = sock
        self._handshake_failures = 0
        self.refusals = 0

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket. ``linger_ms`` > 0 gives what is still queued (a goodbye) that
        long to go out: the context's ``term`` waits for it, no longer."""
        if self.sock is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self.sock.close(linger=linger_ms)
            self.sock = None
        if self.monitor is not None:
            self.monitor.close(linger=0)
            self.monitor = None

    def reset(self) -> None:
        self.close()
        self._inbox.clear()
        self._outbox.clear()  # a new session re-sends what matters (HELLO, unacked results)
        self.forget_pieces()  # the rest of a message in pieces never comes to a new socket
        self.sends_pieces = False  # until this coordinator's WELCOME says it reads them
        self.batching = False
        self.open()

    def send(self, frames: Sequence[Any]) -> bool:
        """Send at once, or in pieces behind what already goes in pieces (a big SUBMIT or
        RESULT to a coordinator whose WELCOME said it reads them): True then, as it goes
        unless the session ends (and a new session sends again what matters). A HEARTBEAT
        never waits behind pieces: it only says we are here, and earlier is no harm. False
        when it could not go."""
        if self.sends_pieces and frames[1] != _HEARTBEAT \
                and (self._outflow.busy(_COORDINATOR) or streams(frames)):
            self._outflow.add(_COORDINATOR, [list(frames)], clock.now())
            self._send_pieces()
            return True
        return self._send_now(frames)

    @property
    def sending_pieces(self) -> bool:
        """A message is still going to the coordinator in pieces (or waits behind one)."""
        return self._outflow.busy(_COORDINATOR)

    def pieces_stalled(self, now: float, limit: float) -> bool:
        """The coordinator acknowledged none of our pieces for ``limit`` seconds, or one could
        not be sent: the transfer cannot finish in this session."""
        return self._pieces_broken or bool(self._outflow.stalled(now, limit))

    def forget_pieces(self) -> None:
        """A new session: what was coming or going in pieces belongs to the old one (the
        coordinator forgets it too when it reads HELLO), and what mattered in it is sent
        again in the new one."""
        self._assembler.reset()
        self._outflow = Outflow(self.limits)
        self._pieces_broken = False

    def _send_now(self, frames: Sequence[Any]) -> bool:
        return self.sock is not None and send_frames(self.sock, frames)

    def _send_pieces(self) -> None:
        for frames in self._outflow.take(_COORDINATOR):
            if not self._send_now(frames):
                self._pieces_broken = True  # a piece is missing: the session starts over
                return

    @property
    def posted(self) -> int:
        """Messages posted and not yet flushed."""
        return len(self._outbox)

    def post(self, frames: list[Any]) -> None:
        """Queue a message for ``flush()``: what one turn posts goes out as one BATCH."""
        self._outbox.append(frames)

    def flush(self) -> bool:
        """Send what was posted, in order. False if some of it could not be sent."""
        if not self._outbox:
            return True
        out, self._outbox = self._outbox, []
        if self.sending_pieces:  # heartbeats go now; the rest waits its turn behind the pieces
            for frames in [f for f in out if f[1] == _HEARTBEAT]:
                self._send_now(frames)
            out = self._outflow.admit_output([f for f in out if f[1] != _HEARTBEAT], _COORDINATOR)
        if len(out) > 1 and self.batching:
            out = batches(out, self.limits)
        sent = True
        for frames in out:
            sent = self.send(frames) and sent
        return sent

    def recv(self) -> Message | None:
        """One decoded message if one is waiting; malformed input is logged and dropped. The
        messages of a BATCH come out one by one, in order. A PIECE of a big message is
        acknowledged here and handed out as it is (it shows the coordinator is there), and the
        message its last piece completes comes out after it (protocol/pieces.py)."""
        if self._inbox:
            return self._with_pieces(self._inbox.popleft())
        assert self.sock is not None
        try:
            frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        try:
            msg = receive(frames, self.limits)
            if msg.command is not Command.BATCH:
                return self._with_pieces(msg)
            for item in unbundle(msg, self.limits):
                if isinstance(item, ProtocolError):
                    log.warning("dropped a message from the coordinator: %s", item.detail)
                else:
                    self._inbox.append(item)
        except ProtocolError as exc:
            other = _other_major(frames)
            if other is not None:
                # The coordinator passed the CURVE handshake, so it holds the token: it really
                # runs another gpumesh. Waiting would only mean silence and retries forever.
                version = _other_version(frames)
                advice = ("install the coordinator's gpumesh version here, or upgrade every "
                          "machine together ('gpumesh discover' shows each coordinator's "
                          "version)") if version is None else install_advice(version)
                what = (f"speaks gpumesh protocol {other}" if version is None
                        else f"runs gpumesh {version} (protocol {other})")
                raise ProtocolMismatch(
                    f"the coordinator at {self.endpoint} {what} and this gpumesh ({__version__}) "
                    f"speaks {MAJOR}: {advice}") from None
            log.warning("dropped a malformed message from the coordinator: %s", exc.detail)
            return None
        return self._with_pieces(self._inbox.popleft()) if self._inbox else None

    def _with_pieces(self, msg: Message) -> Message:
        if msg.command is Command.PIECE_ACK:
            if self._outflow.acked(_COORDINATOR, msg.header.get("x"), msg.header.get("got"),
                                   clock.now()):
                self._send_pieces()
            return msg
        if msg.command is not Command.PIECE:
            return msg
        ack, whole = self._assembler.feed(msg.header, msg.payload)
        if ack is not None:
            self._send_now(encode(Command.PIECE_ACK, ack))  # never behind our own pieces
        if whole is not None:
            self._inbox.appendleft(whole)  # next out: it came before anything still waiting
        return msg

    def monitor_events(self) -> list[LinkEvent]:
        """Drain the monitor. Raises AuthenticationError when the token is wrong."""
        events: list[LinkEvent] = []
        while self.monitor is not None and self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshake_failures = 0
                self.refusals = 0
                self.handshakes += 1
                self._admitted.add(self.endpoint.zmq)
                events.append(LinkEvent.CONNECTED)
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise AuthenticationError(AUTH_FAILED_MESSAGE)
            elif event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                # A server key derived from another token makes the coordinator drop us mid-
                # handshake; twice in a row, with no success in between, is not a network blip.
                self._handshake_failures += 1
                if self.endpoint.zmq in self._admitted:
                    # It admitted us before: a coordinator restarting behind a proxy, a lossy
                    # Wi-Fi link, one killed mid-handshake. Exiting lost what a worker held;
                    # it retries, and says so now and then (a new token is the other cause).
                    if self._handshake_failures % HANDSHAKE_FAILURES_TOLD == 0:
                        log.warning(
                            "the handshake with %s failed %d times in a row since it last "
                            "succeeded: the network drops it, or that coordinator now runs "
                            "with another token (then restart this with the new one); "
                            "still trying", self.endpoint, self._handshake_failures)
                elif self._handshake_failures >= 2:
                    raise AuthenticationError(
                        f"{AUTH_FAILED_MESSAGE} (or {self.endpoint} is not a gpumesh coordinator)"
                    )
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self.refusals += 1
                events.append(LinkEvent.REFUSED)
            elif event == zmq.EVENT_DISCONNECTED:
                events.append(LinkEvent.DROPPED)
        return events


def _other_version(frames: Sequence[Any]) -> str | None:
    """The gpumesh version named by an ``ERROR version`` of another major, read as every major
    frames that one message (docs/protocol.md, ERROR): signature, command byte, msgpack map.
    None for any other message, or one that does not name it."""
    if len(frames) < 3 or bytes(frames[1]) != bytes([Command.ERROR]) \
            or len(frames[2]) > MAX_VERSION_ERROR_HEADER:
        return None
    try:
        header = msgpack.unpackb(bytes(frames[2]), raw=False)
    except Exception:  # msgpack raises several unrelated types on garbage
        return None
    if not isinstance(header, dict) or header.get("code") != ErrorCode.VERSION.value:
        return None
    return coordinator_version(header)


def _other_major(frames: Sequence[Any]) -> int | None:
    """The protocol major of a gpumesh message of another major, else None."""
    if not frames:
        return None
    signature = bytes(frames[0])[:8]
    if len(signature) == 4 and signature[:3] == MAGIC and signature[3] != MAJOR:
        return signature[3]
    return None
