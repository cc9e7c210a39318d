"""Hostile peers for the fault suite: well-framed, ill-typed messages from authenticated sockets.

The frames are built here with msgpack, straight from docs/protocol.md (``[b"GPM\\x01"]
[command byte][msgpack header][payload...]``), not with ``gpumesh.protocol``: the suite checks
the wire contract, whatever the package's own codec accepts or refuses to produce.

``hostile_messages()`` is a hypothesis strategy: a command (every one in the protocol, including
those only the coordinator may send), a sender (the hostile worker, the hostile client, or a fresh
connection for HELLO), a header made from the documented field set and then mutated (wrong types,
huge sizes, deep nesting, missing and extra fields, nested fields of task specs and worker
inventories), and a payload-frame count off by a few. Ids the coordinator handed out (task ids in
ACCEPTED, leases in TASK) are filled in when the message is sent, so results, cancels and fetches
can name real tasks and made-up leases.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
from hypothesis import strategies as st

SIGNATURE = b"GPM\x01"
COMMANDS = {
    "HELLO": 0x01, "WELCOME": 0x02, "CREDIT": 0x03, "TASK": 0x04, "HEARTBEAT": 0x05,
    "OUTPUT": 0x06, "RESULT": 0x07, "RESULT_ACK": 0x08, "CANCEL": 0x09, "SUBMIT": 0x0B,
    "ACCEPTED": 0x0C, "QUERY": 0x0D, "REPLY": 0x0E, "FETCH": 0x0F, "DISCONNECT": 0x10,
    "ERROR": 0x11, "CONTROL": 0x12, "BATCH": 0x13,
}
NAMES = {byte: name for name, byte in COMMANDS.items()}
SENT_BY = {kind: "worker" for kind in ("CREDIT", "OUTPUT", "RESULT")} | {
    kind: "client" for kind in ("SUBMIT", "RESULT_ACK", "FETCH", "CANCEL", "QUERY", "CONTROL")}
# An unknown command byte is answered with ERROR unsupported every time, session kept: once its
# answer is back, the coordinator has read everything sent before it on that connection.
SENTINEL = [SIGNATURE, b"\x7f", b"\x80"]

# Payload frames: never a pickle that does anything, never a script that does anything. Accepted
# tasks run on the suite's real worker: a pickled None, bytes that do not unpickle, an empty
# script. The second frame of a message is big enough to travel without a copy; the others are
# small, so that thousands of frames stay a small message (memory is measured, not flooded).
SAFE_FRAMES = [b"\x80\x05N.", b"\xff not a pickle", b"pass\n", b"{}", b""]
BIG_FRAME = b"\x00" * 70_000

HOSTILE_HOST = "hostile-host"
INVENTORY = {
    "hostname": HOSTILE_HOST, "device": "GPU", "device_name": "A100", "cores": 8,
    "memory": 64 * 10**9, "gpus": [{"index": 0, "name": "A100", "vram": 40 * 10**9,
                                    "backend": "fake"}],
    "python": f"{sys.version_info.major}.{sys.version_info.minor}", "python_full": "3.11.2",
    "platform": "Linux", "cloudpickle": "3.0.0", "gpumesh": "0.1.0", "torch": None,
    "score": 1.0, "gflops": 100.0, "bandwidth_gbps": 10.0,
}


@dataclass(frozen=True)
class Known:
    """Filled in at send time from what the coordinator told the hostile peers."""

    what: str  # task | lease | job | seq | worker


@dataclass(frozen=True)
class Deep:
    """A list or map nested ``depth`` deep: spliced into the packed header (msgpack-python
    refuses to pack past 511 levels, and the receiver's limit is what is tested)."""

    depth: int
    kind: str = "list"

    def packed(self) -> bytes:
        if self.kind == "list":
            return b"\x91" * self.depth + b"\xc0"  # fixarray of one, ... , nil
        return b"\x81\xa1k" * self.depth + b"\xc0"  # fixmap {"k": ...}


def _nested(path: tuple[Any, ...]) -> str:
    return "/".join(str(p) for p in path)


# ----------------------------------------------------------------- the documented field set

def template(kind: str, role: str) -> dict[str, Any]:
    """A well-formed header of ``kind`` as docs/protocol.md describes it (some sent the wrong
    way round on purpose): the starting point of every mutation."""
    task, lease, job, seq = Known("task"), Known("lease"), Known("job"), Known("seq")
    error = {"type": "builtins.ValueError", "message": "boom", "traceback": "Traceback ..."}
    spec_fn = {"seq": seq, "nf": 2, "kind": "fn", "fn": "0" * 24, "max_attempts": 3,
               "timeout": 30.0, "priority": 0, "cost": 1.0, "req": {"python": INVENTORY["python"]}}
    shared = [[1, "a" * 32, 2**20]]  # a frame left in the shared-memory folder (protocol 1.3)
    spec_script = {"seq": seq, "nf": 2, "kind": "script", "name": "hostile.py", "max_attempts": 2,
                   "req": {"cores": 1, "memory": "1MB"}}
    headers: dict[str, dict[str, Any]] = {
        "HELLO": hello_header(role, "placeholder"),
        "WELCOME": {"session": "a" * 12, "epoch": 1, "heartbeat": 1.0, "liveness": 5,
                    "lease_ttl": 10.0, "max_frame_bytes": 1 << 29, "max_message_bytes": 1 << 30,
                    "max_frames": 4096, "safe_mode": False, "abort": [lease]},
        "CREDIT": {"granted": 4, "draining": False, "mode": "active", "release": []},
        "TASK": {"task": task, "lease": lease, "attempt": 1, "need": {"gpu": "A100", "vram": 1},
                 "kind": "fn", "max_attempts": 3, "fn": "0" * 24, "timeout": 5.0, "priority": 0,
                 "cost": 1.0},
        "HEARTBEAT": {"leases": [lease]},
        "OUTPUT": {"task": task, "stream": "out"},
        "RESULT": {"task": task, "lease": lease, "status": "ok", "elapsed": 0.01, "granted": 3,
                   "error": error, "diagnosis": "runner died", "encoding": "json"},
        "RESULT_ACK": {"tasks": [task], "task": task, "lease": lease, "disposition": "accepted"},
        "CANCEL": {"tasks": [task], "leases": [lease]},
        "SUBMIT": {"job": job, "name": "hostile", "tasks": [spec_fn, spec_script]},
        "ACCEPTED": {"job": job, "accepted": [[1, task]], "rejected": [[2, "busy", "m"]]},
        "QUERY": {"what": "status", "qid": 7, "job": job, "since": 0, "tasks": True},
        "REPLY": {"qid": 7, "data": {"missing": []}},
        "FETCH": {"tasks": [task], "qid": 0},
        "DISCONNECT": {"reason": "left" if role == "worker" else "closed"},
        "ERROR": {"code": "malformed", "message": "m", "qid": 7},
        "CONTROL": {"action": "cancel", "target": job, "qid": 9},
        # Several messages in one (protocol 1.3): a heartbeat, a query, a result with frames.
        "BATCH": {"m": [[COMMANDS["HEARTBEAT"], msgpack.packb({"leases": []}), []],
                        [COMMANDS["QUERY"], msgpack.packb({"what": "workers", "qid": 3}), []],
                        [COMMANDS["RESULT"], msgpack.packb({"task": "0" * 12, "lease": 1,
                                                            "status": "ok"}), [b"v"]]]},
    }
    if kind == "SUBMIT":
        # A third task whose frame is "in shared memory": refused, as the peer never proved
        # it can read the coordinator's folder.
        headers["SUBMIT"]["tasks"].append({**spec_fn, "shm": shared})
    if kind == "RESULT":
        headers["RESULT"]["shm"] = shared
    return headers[kind]


def hello_header(role: str, peer_id: str) -> dict[str, Any]:
    """The HELLO a real peer sends (gpumesh/worker/agent.py, gpumesh/client/engine.py)."""
    if role == "worker":
        return {"role": "worker", "id": peer_id, "incarnation": "0badc0de", "proto": [1, 1],
                "slots": 2, "credit": 2, "held": [], "info": dict(INVENTORY), "draining": False,
                "mode": "active", "release": []}
    return {"role": "client", "id": peer_id, "proto": [1, 1],
            "info": {"pid": 4242, "host": HOSTILE_HOST}}


# Every path a mutation may touch, per command: documented fields, present or not.
_SPEC = ["seq", "nf", "kind", "fn", "name", "max_attempts", "timeout", "priority", "cost", "src",
         "py", "req", ("req", "python"), ("req", "gpu"), ("req", "cores"), ("req", "memory"),
         ("req", "vram"), "shm", ("shm", 0), ("shm", 0, 0), ("shm", 0, 1), ("shm", 0, 2)]
_INFO = ["hostname", "device", "device_name", "cores", "memory", "gpus", "python", "python_full",
         "platform", "cloudpickle", "gpumesh", "torch", "score", "gflops", "bandwidth_gbps",
         "pid", "host", ("gpus", 0), ("gpus", 0, "name"), ("gpus", 0, "vram"),
         ("gpus", 0, "index"), ("gpus", 0, "backend")]


def _paths(*fields: Any, under: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    return [under + (f if isinstance(f, tuple) else (f,)) for f in fields]


PATHS: dict[str, list[tuple[Any, ...]]] = {
    "HELLO": _paths("role", "id", "proto", "info", "slots", "credit", "held", "incarnation",
                    "draining", "mode", "release", ("held", 0), ("proto", 0))
    + _paths(*_INFO, under=("info",)),
    "WELCOME": _paths("session", "epoch", "heartbeat", "liveness", "lease_ttl", "max_frame_bytes",
                      "max_message_bytes", "max_frames", "safe_mode", "abort"),
    "CREDIT": _paths("granted", "draining", "mode", "release", ("release", 0)),
    "TASK": _paths("task", "lease", "attempt", "need", ("need", "gpu"), ("need", "vram"), "kind",
                   "max_attempts", "fn", "name", "timeout", "priority", "cost", "src", "py"),
    "HEARTBEAT": _paths("leases", ("leases", 0), "shm", "pythons"),
    "OUTPUT": _paths("task", "stream", "worker"),
    "RESULT": _paths("task", "lease", "status", "elapsed", "granted", "error", "diagnosis",
                     "encoding", "seq", "worker", "attempts", "shm", ("shm", 0), ("shm", 0, 1),
                     ("error", "type"),
                     ("error", "message"), ("error", "traceback")),
    "RESULT_ACK": _paths("tasks", ("tasks", 0), "task", "lease", "disposition"),
    "CANCEL": _paths("tasks", ("tasks", 0), "leases", ("leases", 0)),
    "SUBMIT": _paths("job", "name", "tasks", ("tasks", 0), ("tasks", 1), ("tasks", 2))
    + _paths(*_SPEC, under=("tasks", 0)) + _paths(*_SPEC, under=("tasks", 1))
    + _paths(*_SPEC, under=("tasks", 2)),
    "ACCEPTED": _paths("job", "accepted", "rejected"),
    "QUERY": _paths("what", "qid", "job", "since", "tasks"),
    "REPLY": _paths("qid", "data"),
    "FETCH": _paths("tasks", ("tasks", 0), "qid"),
    "DISCONNECT": _paths("reason"),
    "ERROR": _paths("code", "message", "qid"),
    "CONTROL": _paths("action", "target", "qid"),
    "BATCH": _paths("m", ("m", 0), ("m", 0, 0), ("m", 0, 1), ("m", 0, 2), ("m", 1, 1),
                    ("m", 2, 2), ("m", 2, 2, 0), ("m", 3)),
}

# Values that mean something to one field (a size where a number is expected, the README's size
# syntax in an inventory, a status that does not exist, ...), tried beside the generic ones.
SPECIAL: dict[str, list[Any]] = {
    "python": ["3.11", ["3.11"], 3.11, {"v": 3}, "3.99"],
    "gpu": [5, "A100", True, ["A100"], {"name": "A100"}, 1.5],
    "memory": ["40GB", "lots", "1e999", "-5GB", [1], float("nan"), -1],
    "vram": ["40GB", [1], "x", float("inf"), {"gb": 40}],
    "cores": ["many", 0, -3, 1e308, [8], 2**64 - 1],
    "gpus": ["x", [{"name": "A100", "vram": "40GB"}], [{"name": 5, "vram": [1]}], [1, 2], {},
             [{"vram": float("nan")}], [{"name": "A100"}] * 2000],
    "score": ["fast", float("nan"), float("inf"), [1], 10**30],
    "status": ["ok", "error", "crashed", "cancelled", "timeout", "exploded", ""],
    "kind": ["fn", "script", "evil", ""],
    "role": ["worker", "client", "coordinator", ""],
    "mode": ["active", "paused", "draining", "sleepy"],
    "what": ["workers", "status", "events", "secrets"],
    "action": ["cancel", "retry", "kill", "explode"],
    "lease": [Known("lease"), 2**62, 1, 0, -1, (1 << 40) | 1, 2**63 - 1, 2**64 - 1],
    "task": [Known("task"), "0" * 12, "", "x" * 64],
    "slots": [0, 100_000, 100_001, -1],
    "credit": [0, 100_000, 100_001, -1],
    "nf": [0, 1, 3, 4096, 4097, -1],
    "held": [[[Known("task"), Known("lease")]], [["0" * 12, 2**62]], [[1, 2]], [[]]],
    "proto": [[1, 1], [0, 9], [2, 2], [1], [], [1, 1, 1]],
    "timeout": [1e-9, 0, -1, 1e9, float("nan")],
    "cost": [0, 1e11, float("nan"), -1],
    "priority": [2**63 - 1, -(2**63)],
    "target": [Known("job"), Known("worker"), "", "zz"],
}


# ----------------------------------------------------------------- hostile values

def _big_map(n: int) -> dict[str, int]:
    return {f"k{i}": i for i in range(n)}


_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what msgpack can carry
_scalars = st.one_of(
    st.none(), st.booleans(),
    st.sampled_from([2**64 - 1, 2**63, -(2**63), -1, 0, 2**53 + 1]),
    _ints,
    st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -0.0]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=24), st.binary(max_size=24),
    st.sampled_from(["", "\x00", "../../x", "🙂" * 3, "16GB", "3.11", "A100", "many", "fast"]),
)
_huge = st.one_of(
    st.integers(10_000, 1_000_000).map(lambda n: "x" * n),  # long strings, up to the limit
    st.integers(10_000, 900_000).map(lambda n: b"\x00" * n),
    st.integers(1_000, 200_000).map(lambda n: [0] * n),  # long lists
    st.integers(1_000, 60_000).map(_big_map),  # big maps
    st.sampled_from([100, 510, 600, 1000, 1023, 1100, 5000]).flatmap(
        lambda d: st.sampled_from([Deep(d, "list"), Deep(d, "map")])),  # deep nesting
)
BAD_VALUES = st.one_of(
    _scalars,
    st.recursive(_scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4),
        st.dictionaries(_ints, inner, max_size=2)), max_leaves=8),
    _huge,
)


def _value_for(path: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    leaf = next((p for p in reversed(path) if isinstance(p, str)), "")
    special = SPECIAL.get(leaf)
    if special is None:
        return BAD_VALUES
    return st.one_of(st.sampled_from(special), BAD_VALUES)


@dataclass(frozen=True)
class Mutation:
    op: str  # set | delete | extra
    path: tuple[Any, ...]
    value: Any = None

    def __repr__(self) -> str:
        shown = _short(self.value)
        return f"{self.op} {_nested(self.path)}" + (f"={shown}" if self.op != "delete" else "")

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


@st.composite
def _mutation(draw: st.DrawFn, kind: str) -> Mutation:
    op = draw(st.sampled_from(["set", "set", "set", "delete", "extra"]))
    path = draw(st.sampled_from(PATHS[kind]))
    if op == "delete":
        return Mutation(op, path)
    if op == "extra":
        key = draw(st.one_of(st.sampled_from(["zzz", "__class__", "", "nf", "seq"]),
                             st.text(max_size=12), _ints))
        return Mutation(op, path[:-1] + (key,), draw(BAD_VALUES))
    return Mutation(op, path, draw(_value_for(path)))


@dataclass(frozen=True)
class Hostile:
    """One message to send: ``kind`` from ``sender`` with ``mutations`` applied to its
    template, and ``frames_off`` payload frames more (or fewer) than the header announces."""

    kind: str
    sender: str  # worker | client | fresh-worker | fresh-client (a new connection: HELLO only)
    mutations: tuple[Mutation, ...]
    frames_off: int = 0

    def __repr__(self) -> str:
        muts = ", ".join(repr(m) for m in self.mutations) or "unmutated"
        off = f", frames {self.frames_off:+d}" if self.frames_off else ""
        return f"{self.kind} from {self.sender}: {muts}{off}"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))  # hypothesis would print every field, megabytes included


@st.composite
def hostile_messages(draw: st.DrawFn) -> Hostile:
    kind = draw(st.sampled_from([*COMMANDS, "SUBMIT", "RESULT", "HELLO"]))  # deeper ones twice
    # Mostly from the role that may send it, so the header reaches its handler; sometimes from
    # the other one (refused as unexpected), and HELLO also on new connections.
    senders = {"worker": ["worker"] * 4 + ["client"], "client": ["client"] * 4 + ["worker"],
               "HELLO": ["worker", "client", "fresh-worker", "fresh-client"]}.get(
        SENT_BY.get(kind, kind), ["worker", "client"])
    sender = draw(st.sampled_from(senders))
    # Now and then a well-formed one, so real tasks, leases and results keep flowing.
    mutations = draw(st.lists(_mutation(kind), min_size=0, max_size=3))
    frames_off = draw(st.sampled_from([0, 0, 0, -1, 1, -2, 3]))
    return Hostile(kind, sender, tuple(mutations), frames_off)


def _short(value: Any, limit: int = 80) -> str:
    if isinstance(value, (str, bytes, list, dict)) and len(value) > 64:
        return f"<{type(value).__name__} of {len(value)}>"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ----------------------------------------------------------------- building the frames

def apply(header: dict[str, Any], mutation: Mutation) -> dict[str, Any]:
    """``header`` with ``mutation`` applied; containers along the path are copied (or made)."""
    return _apply(header, list(mutation.path), mutation)


def _apply(node: Any, path: list[Any], mutation: Mutation) -> Any:
    key, rest = path[0], path[1:]
    if isinstance(node, list) and isinstance(key, int):
        node = list(node)
        if not 0 <= key < len(node):  # past the end (an extra field's random int): append
            node.append({})
            key = len(node) - 1
    elif isinstance(node, dict):
        node = dict(node)
    else:
        node = {}  # the path goes through a scalar, or names a field of a list: make a map
    if rest:
        child = node[key] if isinstance(node, list) or key in node else {}
        node[key] = _apply(child, rest, mutation)
    elif mutation.op == "delete":
        if isinstance(node, dict):
            node.pop(key, None)
        else:
            del node[key]
    else:
        node[key] = mutation.value
    return node


def pack(header: Any) -> bytes | None:
    """msgpack as peers pack headers; ``Deep`` values are spliced in. None if it cannot pack."""
    deep: dict[bytes, bytes] = {}

    def swap(value: Any) -> Any:
        if isinstance(value, Deep):
            marker = f"\x00deep{len(deep)}\x00"
            deep[msgpack.packb(marker, use_bin_type=True)] = value.packed()
            return marker
        if isinstance(value, dict):
            return {swap(k): swap(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [swap(v) for v in value]
        return value

    try:
        data = msgpack.packb(swap(header), use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return None
    for marker, packed in deep.items():
        data = data.replace(marker, packed, 1)
    return data


def natural_frames(kind: str, header: Any) -> int:
    """How many payload frames a well-formed message of ``kind`` with this header carries."""
    if not isinstance(header, dict):
        return 0
    if kind == "SUBMIT":
        specs = header.get("tasks")
        nfs = [s.get("nf") for s in specs if isinstance(s, dict)] if isinstance(specs, list) else []
        return min(sum(n for n in nfs if isinstance(n, int) and not isinstance(n, bool) and n > 0),
                   4096)
    return 1 if kind in ("OUTPUT", "RESULT") else 0


# ----------------------------------------------------------------- the peers

@dataclass
class World:
    """What the hostile peers learnt from the coordinator: ids to name in later messages."""

    tasks: list[str] = field(default_factory=list)
    leases: list[int] = field(default_factory=list)
    jobs: list[str] = field(default_factory=lambda: ["hostile-job-1", "hostile-job-2"])
    workers: list[str] = field(default_factory=list)
    replies: int = 0
    accepted: int = 0
    leased: int = 0
    seq: itertools.count = field(default_factory=lambda: itertools.count(1))
    picks: itertools.count = field(default_factory=lambda: itertools.count())
    # Names that must never be targeted by CONTROL kill: the suite's real worker serves the
    # normal task after each batch (any client may remove any worker today, by design).
    protected: set[str] = field(default_factory=set)

    def resolve(self, value: Any) -> Any:
        if isinstance(value, Known):
            return self._known(value.what)
        if isinstance(value, dict):
            return {self.resolve(k): self.resolve(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        return value

    def _known(self, what: str) -> Any:
        pick = next(self.picks)
        if what == "seq":
            return next(self.seq)
        if what == "task":
            return self.tasks[pick % len(self.tasks)] if self.tasks else "0" * 12
        if what == "lease":
            return self.leases[pick % len(self.leases)] if self.leases else 2**62
        if what == "job":
            return self.jobs[pick % len(self.jobs)]
        return self.workers[pick % len(self.workers)] if self.workers else "nobody"

    def guard(self, kind: str, header: Any) -> Any:
        if kind == "CONTROL" and isinstance(header, dict) and header.get("action") == "kill":
            target = header.get("target")
            if isinstance(target, str) and any(
                    target == p or (len(target) >= 4 and p.startswith(target))
                    for p in self.protected):
                return {**header, "target": "zz-not-a-worker"}
        return header


class Peer:
    """A raw DEALER that passed the CURVE handshake with the mesh's keys, as a real peer does."""

    def __init__(self, ctx: zmq.Context, url: str, keys: Any, hello: dict[str, Any] | None,
                 world: World) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.sndtimeo = 10_000
        self.sock.curve_serverkey = keys.server_public
        self.sock.curve_publickey = keys.client_public
        self.sock.curve_secretkey = keys.client_secret
        self.sock.connect(url)
        self.hello = hello
        self.world = world
        self.sent = 0
        if hello is not None:
            self.say_hello()

    def say_hello(self) -> None:
        assert self.hello is not None
        self.send_raw([SIGNATURE, bytes([COMMANDS["HELLO"]]), pack(self.hello) or b"\x80"])

    def send_raw(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames, copy=len(frames[-1]) < 65536)
        self.sent += 1

    def send(self, message: Hostile, header: dict[str, Any]) -> bool:
        """Send ``message`` built on ``header``; False if it cannot be packed at all."""
        for mutation in message.mutations:
            header = apply(header, mutation)
        header = self.world.guard(message.kind, self.world.resolve(header))
        packed = pack(header)
        if packed is None:
            return False
        count = max(natural_frames(message.kind, header) + message.frames_off, 0)
        payload = [BIG_FRAME if i == 1 else SAFE_FRAMES[i % len(SAFE_FRAMES)]
                   for i in range(count)]
        self.send_raw([SIGNATURE, bytes([COMMANDS[message.kind]]), packed, *payload])
        self.pump()
        return True

    def heartbeat(self) -> None:
        leases = self.world.leases[-8:] if self.hello and self.hello["role"] == "worker" else []
        header = {"leases": leases} if leases else {}
        self.send_raw([SIGNATURE, bytes([COMMANDS["HEARTBEAT"]]), pack(header) or b"\x80"])
        self.pump()

    def pump(self) -> None:
        """Read what arrived; learn ids; say HELLO again when the session is gone."""
        while True:
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._learn(frames)

    def _learn(self, frames: list[bytes]) -> dict[str, Any] | None:
        self.world.replies += 1
        if len(frames) < 3 or frames[0] != SIGNATURE:
            return None
        try:
            header = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
        except ValueError:
            return None
        if not isinstance(header, dict):
            return None
        command = NAMES.get(frames[1][0]) if len(frames[1]) == 1 else None
        if command == "ACCEPTED":
            for item in header.get("accepted") or []:
                if isinstance(item, list) and len(item) == 2 and isinstance(item[1], str):
                    self.world.tasks.append(item[1])
                    self.world.accepted += 1
            if isinstance(header.get("job"), str) and header["job"] not in self.world.jobs:
                self.world.jobs.append(header["job"])
        elif command == "TASK":
            if isinstance(header.get("lease"), int):
                self.world.leases.append(header["lease"])
                self.world.leased += 1
            if isinstance(header.get("task"), str):
                self.world.tasks.append(header["task"])
        gone = (command == "ERROR" and header.get("code") == "no_session") or (
            command == "DISCONNECT" and header.get("reason") != "version")
        if gone and self.hello is not None:
            self.say_hello()
        del self.world.tasks[:-64], self.world.leases[:-64]
        return header if command == "ERROR" else None

    def sync(self, timeout: float, alive: Callable[[], bool]) -> bool:
        """True once the coordinator has read everything this peer sent (see SENTINEL); False
        at the deadline, or as soon as ``alive()`` says the coordinator is gone."""
        self.send_raw(SENTINEL)
        deadline = time.time() + timeout
        while time.time() < deadline and alive():
            if not self.sock.poll(100):
                continue
            error = self._learn(self.sock.recv_multipart())
            if error is not None and error.get("code") == "unsupported" and "qid" not in error:
                return True
        return False

    def close(self) -> None:
        self.sock.close(linger=0)
