"""The peer's side of a coordinator session, without sockets or clocks.

The client engine and the worker agent both keep one DEALER session to the coordinator, and
both keep it the same way (Paranoid Pirate from the peer's side): HELLO until WELCOME; every
message heard renews the session; silence past the limit means the coordinator is gone, so wait
a backoff delay (1 s doubling to 32 s, with jitter), replace the socket (a fresh routing id)
and say HELLO again. ``Session`` owns that cycle, the heartbeat timer and the answers every role
gives alike: NO_SESSION → HELLO, another protocol major → ProtocolMismatch. What a role does
with its own messages it decides in its ``SessionRole`` hooks.

No I/O happens here: the loop hands in each message and the time (``on_message``, ``tick``),
and the session writes to the ``Link`` it was given, so the whole cycle is testable with a
list standing in for the socket, as the coordinator's broker is.
"""

from __future__ import annotations

import logging
import math
import random
from typing import Any, Protocol

from ._version import __version__
from .config import Endpoint, Timing
from .errors import MeshError, ProtocolMismatch
from .protocol import MAJOR, Command, ErrorCode, Message, Role, encode
from .protocol.fields import VERSION_TEXT, for_terminal

log = logging.getLogger("gpumesh.session")

# The jitter draws from the OS, not from the module-level generator: the client's session runs
# in its engine's background thread, and a draw there would move the state of a user's
# random.seed(...) in the middle of their script. Not a private random.Random() either: unlike
# the module's, it is not reseeded in a forked child, and the clients of a pool forked from one
# process would then all reconnect at the same moments, which is what the jitter is against.
_jitter = random.SystemRandom()

# What a WELCOME may set, whatever a coordinator sends: a heartbeat too fast would spin the
# loop, one too slow would leave a lost coordinator unnoticed for hours.
HEARTBEAT_RANGE = (0.05, 60.0)
LIVENESS_RANGE = (1, 100)


class Link(Protocol):
    """What the session needs of the socket it speaks through (transport.DealerLink)."""

    batching: bool
    sends_pieces: bool

    def post(self, frames: list[Any]) -> None: ...

    def flush(self) -> bool: ...

    def reset(self) -> None: ...

    def forget_pieces(self) -> None: ...

    def pieces_stalled(self, now: float, limit: float) -> bool: ...


class SessionRole(Protocol):
    """The hooks a role (client, worker) gives the session."""

    def on_hello(self) -> dict[str, Any]:
        """A new session begins: reset what is per session; return the HELLO's own fields."""
        ...

    def on_welcome(self, header: dict[str, Any], now: float) -> None:
        """The coordinator admitted us: send again what the last session may have lost."""
        ...

    def on_message(self, msg: Message, now: float) -> None:
        """Any message the session does not answer itself (ERRORs it does not know included)."""
        ...

    def heartbeat_header(self) -> dict[str, Any]: ...

    def on_lost(self, now: float, delay: float, was_welcomed: bool) -> None:
        """The coordinator went silent; the session says HELLO again in ``delay`` seconds."""
        ...

    def on_disconnect(self, header: dict[str, Any], now: float) -> bool:
        """The coordinator said goodbye; True when the role handled it (no new HELLO)."""
        ...


class Backoff:
    """1 s doubling to 32 s, with jitter, as Paranoid Pirate does; reset after a good session."""

    def __init__(self, minimum: float, maximum: float) -> None:
        self.minimum = minimum
        self.maximum = maximum
        self.current = minimum

    def next_delay(self) -> float:
        delay = self.current * _jitter.uniform(0.75, 1.25)
        self.current = min(self.current * 2, self.maximum)
        return delay

    def reset(self) -> None:
        self.current = self.minimum


class Session:
    """One role's session with the coordinator at ``endpoint``; ``welcomed`` while it is up."""

    def __init__(self, role: Role, peer_id: str, endpoint: Endpoint, timing: Timing,
                 link: Link, hooks: SessionRole) -> None:
        self.role = role
        self.peer_id = peer_id
        self.endpoint = endpoint
        self.link = link
        self.hooks = hooks
        self.welcomed = False
        self.heartbeat = timing.heartbeat
        self.silence_limit = timing.silence_limit
        self.backoff = Backoff(timing.backoff_min, timing.backoff_max)
        self.last_heard = 0.0
        self.last_heartbeat = 0.0
        self.reconnect_at: float | None = None
        # HELLOs said on the link's current socket since its last WELCOME, and which socket
        # that is (the link's generation). Any WELCOME clears it: a HELLO lost with a dropped
        # connection is never answered, and waiting for its WELCOME would drop every TASK.
        self.awaiting_welcome = 0
        self._hello_socket: Any = None

    def start(self, now: float) -> None:
        self.last_heard = now
        self.hello()

    def hello(self) -> None:
        """Say HELLO (again): after what was already posted, which goes first, in order."""
        self.welcomed = False
        socket = getattr(self.link, "generation", None)
        if socket != self._hello_socket:  # a new socket: what the old one said is moot
            self._hello_socket, self.awaiting_welcome = socket, 0
        self.awaiting_welcome += 1
        fields = self.hooks.on_hello()
        header = {"role": self.role.value, "id": self.peer_id, "proto": [MAJOR, MAJOR],
                  "batch": True, "shmlock": True, "pieces": True, **fields}
        self.link.forget_pieces()
        self.link.sends_pieces = False  # until this coordinator's WELCOME says it reads PIECEs
        self.link.flush()
        self.link.batching = False  # ... and BATCH
        self.link.post(encode(Command.HELLO, header))
        self.link.flush()

    def on_message(self, msg: Message, now: float) -> None:
        """One message from the coordinator. A role's fatal MeshError goes up; anything else a
        message makes go wrong is logged and the message dropped: the session goes on."""
        self.last_heard = now
        try:
            if msg.command is Command.WELCOME:
                self._on_welcome(msg.header, now)
            elif msg.command is Command.ERROR:
                self._on_error(msg, now)
            elif msg.command is Command.DISCONNECT:
                self._on_disconnect(msg.header, now)
            elif msg.command in (Command.PIECE, Command.PIECE_ACK):
                pass  # the link took it in (transport.py); hearing it is what counts here
            else:
                self.hooks.on_message(msg, now)
        except MeshError:
            raise  # fatal by design: refused, removed, or another protocol version
        except Exception:  # one bad message (or a bug of ours) must not end the session
            log.exception("dropped a %s from the coordinator that could not be handled",
                          msg.command.name)

    def tick(self, now: float) -> None:
        """Timers: HELLO again after a backoff, notice silence, heartbeat when due."""
        if self.reconnect_at is not None:
            if now >= self.reconnect_at:
                self.reconnect_at = None
                self.link.reset()
                self.last_heard = now
                self.hello()
            return
        if now - self.last_heard > self.silence_limit:
            was_welcomed, self.welcomed = self.welcomed, False
            delay = self.backoff.next_delay()
            self.reconnect_at = now + delay
            self.hooks.on_lost(now, delay, was_welcomed)
            return
        if self.welcomed and self.link.pieces_stalled(now, self.silence_limit):
            # The coordinator takes none of what we send in pieces, and everything but our
            # heartbeats waits behind it: a new session sends again what matters.
            log.warning("the coordinator at %s took no piece of a big message for %.0fs: "
                        "starting a new session", self.endpoint, self.silence_limit)
            self.hello()
            return
        if self.welcomed and now - self.last_heartbeat >= self.heartbeat:
            self.last_heartbeat = now
            self.link.post(encode(Command.HEARTBEAT, self.hooks.heartbeat_header()))

    def next_timer(self, now: float) -> float:
        """Seconds until ``tick`` has something to do (the loop's longest wait)."""
        if self.reconnect_at is not None:
            return max(self.reconnect_at - now, 0.0)
        due = self.last_heard + self.silence_limit
        if self.welcomed:
            due = min(due, self.last_heartbeat + self.heartbeat)
        return max(due - now, 0.0)

    # ----------------------------------------------------------------- what every role answers alike

    def _on_welcome(self, header: dict[str, Any], now: float) -> None:
        self.awaiting_welcome = 0
        self.welcomed = True
        # A HELLO from before a silence can be answered while we wait out the backoff: this
        # session stands, and the backoff's end must not start another over it.
        self.reconnect_at = None
        self.link.batching = header.get("batch") is True
        self.link.sends_pieces = header.get("pieces") is True
        self.heartbeat = _bounded(header.get("heartbeat"), HEARTBEAT_RANGE, self.heartbeat)
        liveness = _bounded(header.get("liveness"), LIVENESS_RANGE, 5)
        self.silence_limit = self.heartbeat * int(liveness)
        self.backoff.reset()
        self.hooks.on_welcome(header, now)

    def _on_error(self, msg: Message, now: float) -> None:
        code = msg.header.get("code")
        if code == ErrorCode.NO_SESSION.value:
            if self.welcomed or self.reconnect_at is not None:
                # The coordinator restarted or forgot us; or, while we wait out the backoff
                # after its silence, it answers what we had sent before: it is back, and a new
                # session starts now. Waiting out the backoff could cost what a worker holds (a
                # restarted coordinator re-queues unclaimed work after its restore grace).
                self.reconnect_at = None
                self.hello()
            # Otherwise our HELLO is on its way (or the silence timer catches it if lost):
            # another would only have the coordinator forget what this one started.
        elif code == ErrorCode.VERSION.value:
            version = coordinator_version(msg.header)
            advice = "" if version is None else \
                f"; this is gpumesh {__version__}: {install_advice(version)}"
            raise ProtocolMismatch(f"the coordinator at {self.endpoint} refused this "
                                   f"{self.role.value}: "
                                   f"{for_terminal(str(msg.header.get('message', ''))[:500])}"
                                   f"{advice}")
        else:
            self.hooks.on_message(msg, now)

    def _on_disconnect(self, header: dict[str, Any], now: float) -> None:
        if header.get("reason") == "version":
            raise ProtocolMismatch(f"the coordinator at {self.endpoint} speaks another gpumesh "
                                   "protocol version: install the same gpumesh version on both")
        if not self.hooks.on_disconnect(header, now):
            self.hello()


def coordinator_version(header: dict[str, Any]) -> str | None:
    """The gpumesh version an ``ERROR version`` names (``gpumesh``), when it looks like one;
    None from a coordinator older than the field, or one that sent something else."""
    value = header.get("gpumesh")
    if isinstance(value, str) and VERSION_TEXT.fullmatch(value):
        return value
    return None


def install_advice(version: str) -> str:
    """What to do about a coordinator of gpumesh ``version``, for a ProtocolMismatch."""
    return (f"install gpumesh {version} here ('pip install gpumesh=={version}'), or upgrade "
            "every machine together")


def _bounded(value: Any, limits: tuple[float, float], default: float) -> float:
    """A number the coordinator sent, brought within ``limits``; ``default`` for anything
    else, NaN and infinity included (min and max pass NaN through)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return default
    low, high = limits
    return min(max(float(value), low), high)
