"""The headers the coordinator reads from peers, as frozen values parsed in one place.

Each ``from_header`` checks every field's type, range and size and raises a MALFORMED
ProtocolError naming the field; what it returns is safe to store, journal, schedule and show.
Unknown keys are dropped (a newer peer may send more), so nothing unchecked is kept.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import fields as f
from .messages import ErrorCode, ProtocolError, Role
from .refs import Ref, parse_refs
from .requirements import MAX_CORES, Gpu, Requirements, parse_python, parse_size
from .taskenv import check_script_name, check_task_env
from .telemetry import Telemetry, parse_stats
from .vocabulary import Departure, ResultEncoding, ResultStatus, TaskKind, WorkerMode

ID_CHARS = 64  # peer, task and job ids
MAX_FUNCTIONS = 64  # a SUBMIT's function table (fns)
NAME_CHARS = 200  # job names, hostnames, device names
VERSION_CHARS = 64  # version strings ("3.11.2", "2.2.1", "2.13.0+cpu")
MAX_GPUS = 64
MAX_SLOTS = 1024
SLOTS_PER_CORE = 4  # --slots beyond this many per core (or GPU) is not a machine, it is a lie
MAX_PREFETCH = 256  # docs/protocol.md, HELLO; what join --prefetch allows
MAX_IDS = 100_000  # task ids or leases in one message
MAX_SPECS = 10_000  # task specs in one SUBMIT (the client sends at most 500)
MAX_ERROR_TYPE = 256
MAX_ERROR_MESSAGE = 16 * 1024
MAX_TRACEBACK = 256 * 1024
MAX_DIAGNOSIS = 8 * 1024
MAX_PRIORITY = 2**62
MAX_COST = 1e12
MAX_SECONDS = 1e9


def _clip(value: Any, limit: int) -> Any:
    """A peer's free text, cut to ``limit`` characters: a real worker's long traceback is
    truncated rather than lost, but nothing longer is ever kept."""
    return value[:limit] if isinstance(value, str) else value


# ----------------------------------------------------------------- HELLO

@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    vram: int  # bytes
    backend: str

    def as_gpu(self) -> Gpu:
        return Gpu(self.name, self.vram)

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "vram": self.vram, "backend": self.backend}


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's inventory, as HELLO ``info`` describes it (docs/protocol.md, HELLO)."""

    hostname: str = ""
    device: str = "CPU"
    device_name: str = ""
    cores: int = 1
    memory: int = 0
    gpus: tuple[GpuInfo, ...] = ()
    python: str = ""
    python_full: str = ""
    platform: str = ""
    cloudpickle: str = ""
    gpumesh: str = ""
    torch: str | None = None
    score: float = 0.0
    gflops: float | None = None
    bandwidth_gbps: float | None = None

    @classmethod
    def from_mapping(cls, info: Mapping[str, Any]) -> WorkerInfo:
        gpus = tuple(_gpu(i, g) for i, g in enumerate(
            f.items(info, "gpus", max_items=MAX_GPUS, default=[])))
        python = f.text(info, "python", max_len=16, default="")
        if python:
            try:
                parse_python(python)
            except ValueError as exc:
                raise f.malformed(f"info: {exc}") from None
        return cls(
            hostname=_shown(info, "hostname"),
            device=_shown(info, "device", 16) or "CPU",
            device_name=_shown(info, "device_name"),
            cores=f.integer(info, "cores", low=1, high=MAX_CORES, default=1),
            memory=_size(info, "memory"),
            gpus=gpus,
            python=python,
            # Versions other users see (`gpumesh doctor`, `workers`): no escape codes.
            python_full=_version_text(info, "python_full") or "",
            platform=_version_text(info, "platform") or "",
            cloudpickle=_version_text(info, "cloudpickle") or "",
            gpumesh=_version_text(info, "gpumesh") or "",
            torch=_version_text(info, "torch", default=None),
            score=f.number(info, "score", low=0.0, high=1e12, default=0.0),
            gflops=f.number(info, "gflops", low=0.0, high=1e12, default=None),
            bandwidth_gbps=f.number(info, "bandwidth_gbps", low=0.0, high=1e12, default=None),
        )

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if v is not None}
        data["gpus"] = [g.to_dict() for g in self.gpus]
        return data


def _gpu(position: int, raw: Any) -> GpuInfo:
    if not isinstance(raw, dict):
        raise f.malformed("info 'gpus' must be a list of maps")
    return GpuInfo(
        index=f.integer(raw, "index", low=0, high=4095, default=position),
        name=_shown(raw, "name"),
        vram=_size(raw, "vram"),
        backend=_printable(f.text(raw, "backend", max_len=16, default="")),
    )


def _shown(data: Mapping[str, Any], name: str, max_len: int = NAME_CHARS) -> str:
    """A string other users will see in a terminal: printable, so no escape codes."""
    value = f.text(data, name, max_len=max_len, default="")
    if not value.isprintable():
        raise f.malformed(f"{name!r} must be printable text")
    return value


def _version_text(info: Mapping[str, Any], name: str, default: str | None = "") -> str | None:
    value = f.text(info, name, max_len=VERSION_CHARS, default=default)
    return value if value is None else _printable(value)


def _printable(label: str) -> str:
    """A label other users will see in a terminal, each character that is not printable (an
    escape code's ESC, a newline) shown as "?": kept, as a long name is cut, not refused."""
    if label.isprintable():
        return label
    return "".join(c if c.isprintable() else "?" for c in label)


def _size(data: Mapping[str, Any], name: str) -> int:
    value = data.get(name)
    if value is None:
        return 0
    try:
        return parse_size(value)
    except ValueError as exc:
        raise f.malformed(f"info {name!r}: {exc}") from None


@dataclass(frozen=True)
class ClientInfo:
    """What a client says of itself: enough to name it to other users, nothing more."""

    pid: int = 0
    host: str = ""
    user: str = ""

    @classmethod
    def from_mapping(cls, info: Mapping[str, Any]) -> ClientInfo:
        return cls(
            pid=f.integer(info, "pid", low=0, high=2**32, default=0),
            host=_shown(info, "host"),
            user=_shown(info, "user"),
        )

    def owner(self, client_id: str) -> str:
        """The name jobs are filed under: ``user@host``, or the client id for older clients."""
        if self.user or self.host:
            return f"{self.user or '?'}@{self.host or '?'}"
        return f"client {client_id[:8]}"

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "host": self.host, "user": self.user}


@dataclass(frozen=True)
class Hello:
    role: Role
    peer_id: str
    info: WorkerInfo | ClientInfo
    # A worker's session:
    slots: int = 0
    credit: int = 0
    prefetch: int = 0
    held: tuple[tuple[str, int], ...] = ()
    release: tuple[int, ...] = ()
    incarnation: str = ""
    mode: WorkerMode = WorkerMode.ACTIVE
    batch: bool = False  # the peer reads BATCH messages (since 1.3)
    pieces: bool = False  # the peer reads a big message in PIECEs (since 1.8)
    shmlock: bool = False  # the peer locks the shared-memory files it maps (since 1.7)
    fnref: bool = False  # the worker keeps functions and takes TASKs that name one (since 1.4)
    control: bool = False  # the worker takes CONTROL drain/pause/resume from the mesh (since 1.5)

    @property
    def draining(self) -> bool:
        return self.mode is not WorkerMode.ACTIVE

    @classmethod
    def from_header(cls, h: Mapping[str, Any]) -> Hello:
        role = f.choice(h, "role", Role)
        peer_id = f.text(h, "id", min_len=1, max_len=ID_CHARS)
        if not peer_id.isprintable():  # shown in terminals: the workers table, task output
            raise f.malformed("'id' must be printable text")
        raw_info = f.mapping(h, "info", max_items=64, default={})
        batch = bool(f.flag(h, "batch", default=False))
        shmlock = bool(f.flag(h, "shmlock", default=False))
        pieces = bool(f.flag(h, "pieces", default=False))
        if role is Role.CLIENT:
            return cls(role, peer_id, ClientInfo.from_mapping(raw_info), batch=batch,
                       shmlock=shmlock, pieces=pieces)
        info = WorkerInfo.from_mapping(raw_info)
        slots = f.integer(h, "slots", low=1, high=MAX_SLOTS)
        most = max(info.cores, len(info.gpus), 1) * SLOTS_PER_CORE
        if slots > most:
            raise f.malformed(
                f"{slots} slots on a machine with {info.cores} cores and {len(info.gpus)} GPUs: "
                f"at most {most} ({SLOTS_PER_CORE} per core or GPU) are accepted")
        prefetch = f.integer(h, "prefetch", low=0, high=MAX_PREFETCH, default=0)
        return cls(
            role, peer_id, info,
            slots=slots,
            credit=f.integer(h, "credit", low=0, high=f.INT64, default=slots),
            prefetch=prefetch,
            held=_held(f.items(h, "held", max_items=MAX_IDS, default=[])),
            release=f.int_list(h, "release", max_items=MAX_IDS, default=()),
            incarnation=_shown(h, "incarnation", max_len=ID_CHARS),
            mode=_mode(h, WorkerMode.ACTIVE),
            batch=batch,
            shmlock=shmlock,
            pieces=pieces,
            fnref=bool(f.flag(h, "fnref", default=False)),
            control=bool(f.flag(h, "control", default=False)),
        )


def _held(pairs: list[Any]) -> tuple[tuple[str, int], ...]:
    out = []
    for item in pairs:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                and len(item[0]) <= ID_CHARS and isinstance(item[1], int)
                and not isinstance(item[1], bool) and 0 <= item[1] <= f.INT64):
            raise f.malformed("held leases must be [task, lease] pairs")
        out.append((item[0], item[1]))
    return tuple(out)


def _mode(h: Mapping[str, Any], current: WorkerMode) -> WorkerMode:
    """``mode``, or the older ``draining`` flag alone: a draining worker takes no new tasks."""
    draining = f.flag(h, "draining", default=None)
    default = WorkerMode.DRAINING if draining else (
        WorkerMode.ACTIVE if draining is False else current)
    mode: WorkerMode = f.choice(h, "mode", WorkerMode, default=default)
    if draining and mode is WorkerMode.ACTIVE:
        return WorkerMode.DRAINING
    return mode


# ----------------------------------------------------------------- from workers

@dataclass(frozen=True)
class Credit:
    granted: int
    mode: WorkerMode
    release: tuple[int, ...]
    # How many tasks it holds queued beyond its slots from now on (since 1.9; None: as its
    # HELLO's prefetch said). Lowered when its tasks turned long, raised when short again.
    depth: int | None = None

    @classmethod
    def from_header(cls, h: Mapping[str, Any], current: WorkerMode) -> Credit:
        return cls(
            granted=f.integer(h, "granted", low=0, high=f.INT64),
            mode=_mode(h, current),
            release=f.int_list(h, "release", max_items=MAX_IDS, default=()),
            depth=f.integer(h, "depth", low=0, high=MAX_PREFETCH, default=None),
        )


@dataclass(frozen=True)
class Heartbeat:
    leases: tuple[int, ...]
    # The proof read from the coordinator's shared-memory folder (gpumesh.sharedmem), once
    # per session: this peer shares the machine and may pass big frames by reference.
    shm: str = ""
    stats: Telemetry | None = None  # a worker's load figures (since 1.5); dropped when malformed

    @classmethod
    def from_header(cls, h: Mapping[str, Any]) -> Heartbeat:
        return cls(f.int_list(h, "leases", max_items=MAX_IDS, default=()),
                   f.text(h, "shm", max_len=64, default=""), parse_stats(h))


@dataclass(frozen=True)
class Output:
    task: str
    stream: str

    @classmethod
    def from_header(cls, h: Mapping[str, Any]) -> Output:
        stream = f.text(h, "stream", max_len=8, default="out")
        if stream not in ("out", "err"):
            raise f.malformed(f"'stream' must be 'out' or 'err', not {stream!r}")
        return cls(f.text(h, "task", max_len=ID_CHARS), stream)


@dataclass(frozen=True)
class Result:
    """A worker's RESULT. ``error`` and ``diagnosis`` are cut to their limits, never refused:
    a real task's long traceback must not cost it its result."""

    task: str
    lease: int
    status: ResultStatus
    elapsed: float
    granted: int | None
    error: dict[str, str] | None
    diagnosis: str | None
    encoding: ResultEncoding
    split: tuple[int, ...] = ()  # wire frames per result frame, when big ones were split
    shared: tuple[Ref, ...] = ()  # ``shm``: result frames left in shared memory

    def check_frames(self, count: int) -> None:
        if self.split and sum(self.split) != count:
            raise f.malformed(f"'split' adds up to {sum(self.split)} frames, not {count}")
        frames = len(self.split) if self.split else count
        if any(index >= frames for index, _, _ in self.shared):
            raise f.malformed(f"'shm' names a frame beyond the {frames} that came")
        if self.shared and self.encoding is not ResultEncoding.PICKLE:
            raise f.malformed("only a pickled result can leave frames in shared memory")

    @classmethod
    def from_header(cls, h: Mapping[str, Any]) -> Result:
        plain = _plain_ok(h)
        if plain is not None:
            return plain
        status: ResultStatus = f.choice(h, "status", ResultStatus)
        if not status.from_worker:
            raise f.malformed(f"a worker cannot report {status.value!r}")
        raw_error = f.mapping(h, "error", max_items=16, default=None)
        error = None
        if raw_error is not None:
            error = {
                "type": _clip(f.text(raw_error, "type", max_len=f.INT64, default="Exception"),
                              MAX_ERROR_TYPE),
                "message": _clip(f.text(raw_error, "message", max_len=f.INT64, default=""),
                                 MAX_ERROR_MESSAGE),
                "traceback": _clip(f.text(raw_error, "traceback", max_len=f.INT64, default=""),
                                   MAX_TRACEBACK),
            }
        diagnosis = f.text(h, "diagnosis", max_len=f.INT64, default=None)
        return cls(
            task=f.text(h, "task", max_len=ID_CHARS),
            lease=f.integer(h, "lease", low=0, high=f.INT64),
            status=status,
            elapsed=_elapsed(h),
            granted=f.integer(h, "granted", low=0, high=f.INT64, default=None),
            error=error,
            diagnosis=_clip(diagnosis, MAX_DIAGNOSIS),
            encoding=f.choice(h, "encoding", ResultEncoding, default=ResultEncoding.PICKLE),
            split=f.int_list(h, "split", max_items=4096, low=1, high=4096, default=()),
            shared=_refs(h, 4096),
        )


_PLAIN_OK_KEYS = frozenset({"task", "lease", "status", "elapsed", "granted"})


def _plain_ok(h: Mapping[str, Any]) -> Result | None:
    """The common RESULT (a task that returned, its value among the frames) checked in one
    pass: what ``Result.from_header`` would make of it, or None to read it field by field.
    Every check of the general path holds here too; anything else takes that path."""
    if h.get("status") != "ok" or not h.keys() <= _PLAIN_OK_KEYS:
        return None
    task, lease, elapsed, granted = h.get("task"), h.get("lease"), h.get("elapsed"), h.get("granted")
    if not (type(task) is str and len(task) <= ID_CHARS
            and type(lease) is int and 0 <= lease <= f.INT64
            and (granted is None or (type(granted) is int and 0 <= granted <= f.INT64))
            and type(elapsed) is float and 0.0 <= elapsed <= MAX_SECONDS):  # NaN fails too
        return None
    return Result(task=task, lease=lease, status=ResultStatus.OK, elapsed=elapsed,
                  granted=granted, error=None, diagnosis=None, encoding=ResultEncoding.PICKLE)


# ----------------------------------------------------------------- from clients

@dataclass(frozen=True)
class TaskSpec:
    """One task of a SUBMIT. ``to_spec()`` is what is journaled and sent on in TASK."""

    kind: TaskKind
    seq: int
    frames: int  # ``nf``: how many of the message's payload frames are this task's
    max_attempts: int = 3
    priority: int = 0
    cost: float = 1.0
    timeout: float | None = None
    requirements: Requirements = Requirements()
    function: str = ""  # ``fn``: the pickled function's digest
    name: str = ""  # a script's file name
    source_name: str = ""  # ``src``: the function's name in its source form
    source_python: str = ""  # ``py``: the Python the source form was made on
    env: Mapping[str, str] = field(default_factory=dict)
    split: tuple[int, ...] = ()  # wire frames per payload frame, when big ones were split
    shared: tuple[Ref, ...] = ()  # ``shm``: payload frames left in shared memory
    # ``fnref``: its function is in the SUBMIT's function table (``fns``), not among its frames
    by_reference: bool = False

    @property
    def portable(self) -> bool:
        return bool(self.source_name)

    @classmethod
    def from_mapping(cls, spec: Any) -> TaskSpec:
        if not isinstance(spec, dict):
            raise f.malformed("each task spec must be a map")
        kind: TaskKind = f.choice(spec, "kind", TaskKind)
        try:
            requirements = Requirements.from_mapping(f.mapping(spec, "req", max_items=16,
                                                               default={}))
        except ValueError as exc:
            raise f.malformed(f"req: {exc}") from None
        name = f.text(spec, "name", max_len=1024, default="")
        py = f.text(spec, "py", max_len=16, default="")
        try:
            env = check_task_env(spec.get("env", {}))
            if kind is TaskKind.SCRIPT:
                check_script_name(name)
            if py:
                parse_python(py)
        except ValueError as exc:
            raise f.malformed(str(exc)) from None
        frames = f.integer(spec, "nf", low=0, high=4096)
        split = _split(spec, frames)
        shared = _refs(spec, len(split) if split else frames)
        if shared and kind is not TaskKind.FUNCTION:
            raise f.malformed("only a function task's frames can be in shared memory")
        by_reference = bool(f.flag(spec, "fnref", default=False))
        if by_reference and (kind is not TaskKind.FUNCTION or split or shared
                             or not spec.get("fn")):
            raise f.malformed("only a function task with a digest (fn), and none of its frames "
                              "split or shared, can name its function by reference (fnref)")
        return cls(
            kind=kind,
            seq=f.integer(spec, "seq", low=0, high=f.INT64),
            frames=frames,
            split=split,
            shared=shared,
            max_attempts=f.integer(spec, "max_attempts", low=1, high=100, default=3),
            priority=f.integer(spec, "priority", low=-MAX_PRIORITY, high=MAX_PRIORITY, default=0),
            cost=f.number(spec, "cost", low=0.0, high=MAX_COST, default=1.0),
            timeout=_timeout(spec),
            requirements=requirements,
            function=f.text(spec, "fn", max_len=ID_CHARS, default=""),
            name=name,
            source_name=f.text(spec, "src", max_len=NAME_CHARS, default=""),
            source_python=py,
            env=env,
            by_reference=by_reference,
        )

    def changed(self, **fields: Any) -> TaskSpec:
        """A copy with ``fields`` replaced: what ``dataclasses.replace`` does, without its
        per-call checks (a .map's tasks are copies of one parsed spec: this runs per task)."""
        neutral = _SPEC_NEUTRAL.issuperset(fields)
        if neutral and _SPEC_BASE not in self.__dict__:
            # Made once on the parsed spec a .map's tasks are copied from, and copied with it.
            object.__setattr__(self, _SPEC_BASE, self._spec_without_seq())
        clone = object.__new__(TaskSpec)
        clone.__dict__.update(self.__dict__, **fields)
        if not neutral:
            clone.__dict__.pop(_SPEC_BASE, None)  # what to_spec made of the original no longer holds
        return clone

    def to_spec(self) -> dict[str, Any]:
        """The checked spec, in the wire's key names: journaled, and sent on in TASK. A new
        dict each time; the values in it (``req``, ``env``...) are shared by the copies of one
        parsed spec (``changed``), a .map's tasks, and nobody changes them in place."""
        base = self.__dict__.get(_SPEC_BASE)
        if base is None:
            # Kept and handed on to copies (changed): a .map's tasks make it once, not once per
            # task (object.__setattr__: the dataclass is frozen).
            base = self._spec_without_seq()
            object.__setattr__(self, _SPEC_BASE, base)
        return {**base, "seq": self.seq}

    def _spec_without_seq(self) -> dict[str, Any]:
        # Interned: the queue holds these strings once, not once per task.
        spec: dict[str, Any] = {"kind": self.kind.value, "max_attempts": self.max_attempts}
        if self.function:
            spec["fn"] = sys.intern(self.function)
        optional = (("priority", self.priority, 0), ("cost", self.cost, 1.0),
                    ("timeout", self.timeout, None),
                    ("name", self.name, ""), ("src", self.source_name, ""),
                    ("py", self.source_python, ""))
        for key, value, default in optional:
            if value != default:
                spec[key] = value
        if self.env:
            spec["env"] = dict(self.env)
        if self.split:
            spec["split"] = list(self.split)
        if self.shared:
            spec["shm"] = [list(ref) for ref in self.shared]
        req = self.requirements.to_mapping()
        if req:
            spec["req"] = req
        return spec


# TaskSpec fields that its ``to_spec`` leaves out (or adds itself): copies that change only these
# keep the original's cached dict.
_SPEC_NEUTRAL = frozenset({"seq", "frames", "by_reference"})
_SPEC_BASE = "_spec_base"


def _split(h: Mapping[str, Any], frames: int) -> tuple[int, ...]:
    """``split``: how many wire frames make each payload frame (serialize.split_frames); they
    must add up to the frames that came."""
    split: tuple[int, ...] = f.int_list(h, "split", max_items=4096, low=1, high=4096, default=())
    if split and sum(split) != frames:
        raise f.malformed(f"'split' adds up to {sum(split)} frames, not {frames}")
    return split


def _refs(h: Mapping[str, Any], frames: int) -> tuple[Ref, ...]:
    try:
        return parse_refs(h.get("shm"), frames)
    except ValueError as exc:
        raise f.malformed(str(exc)) from None


def _elapsed(h: Mapping[str, Any]) -> float:
    """A worker's own clock can step back: a negative or huge ``elapsed`` is clamped, never a
    reason to refuse a real result."""
    value = f.number(h, "elapsed", low=-MAX_SECONDS, high=MAX_SECONDS, default=0.0)
    return max(value, 0.0)


def _timeout(spec: Mapping[str, Any]) -> float | None:
    """Seconds a task may run; 0 or less means no limit, as the client documents it."""
    timeout = f.number(spec, "timeout", low=-MAX_SECONDS, high=MAX_SECONDS, default=None)
    return timeout if timeout is not None and timeout > 0 else None


@dataclass(frozen=True)
class Submit:
    job: str
    name: str
    specs: tuple[Any, ...]  # raw: each is parsed on its own, so one bad task rejects only itself
    # ``fns``: digests of the pickled functions that open the payload, one frame each, for the
    # tasks that name theirs by reference (since 1.4)
    functions: tuple[str, ...] = ()

    @classmethod
    def from_header(cls, h: Mapping[str, Any]) -> Submit:
        return cls(
            job=_shown(h, "job", max_len=ID_CHARS),
            name=_printable(_clip(f.text(h, "name", max_len=f.INT64, default=""), NAME_CHARS)),
            specs=tuple(f.items(h, "tasks", max_items=MAX_SPECS)),
            functions=tuple(f.text_list(h, "fns", max_items=MAX_FUNCTIONS, max_len=ID_CHARS,
                                        default=())),
        )


@dataclass(frozen=True)
class TaskIds:
    """RESULT_ACK, FETCH and CANCEL from a client: a list of task ids (and FETCH's qid)."""

    tasks: tuple[str, ...]
    qid: int

    @classmethod
    def from_header(cls, h: Mapping[str, Any]) -> TaskIds:
        return cls(f.text_list(h, "tasks", max_items=MAX_IDS, max_len=ID_CHARS), qid_of(h))


@dataclass(frozen=True)
class PieceAck:
    """PIECE_ACK from a peer (since 1.8): it has ``got`` bytes of the coordinator's transfer
    ``transfer`` (protocol/pieces.py). The outflow checks both against what it sent."""

    transfer: int
    got: int

    @classmethod
    def from_header(cls, h: Mapping[str, Any]) -> PieceAck:
        return cls(f.integer(h, "x", low=0, high=f.INT64),
                   f.integer(h, "got", low=1, high=f.INT64))


@dataclass(frozen=True)
class Query:
    what: str
    qid: int
    job: str | None
    tasks: bool
    since: int
    page: int
    task: str | None = None  # ``task``: one task's detail (since 1.5)

    @classmethod
    def from_header(cls, h: Mapping[str, Any]) -> Query:
        return cls(
            what=f.text(h, "what", max_len=32),
            qid=qid_of(h),
            job=f.text(h, "job", max_len=NAME_CHARS, default=None),
            tasks=f.flag(h, "tasks", default=True),
            since=f.integer(h, "since", low=0, high=f.INT64, default=0),
            page=f.integer(h, "page", low=0, high=f.INT64, default=0),
            task=f.text(h, "task", min_len=1, max_len=ID_CHARS, default=None),
        )


@dataclass(frozen=True)
class Control:
    action: str
    target: str
    qid: int
    force: bool

    @classmethod
    def from_header(cls, h: Mapping[str, Any]) -> Control:
        return cls(
            action=f.text(h, "action", max_len=32),
            target=f.text(h, "target", min_len=1, max_len=NAME_CHARS),
            qid=qid_of(h),
            force=f.flag(h, "force", default=False),
        )


def departure_of(h: Mapping[str, Any]) -> Departure:
    return Departure.parse(h.get("reason"))


def qid_of(h: Mapping[str, Any]) -> int:
    """A request's id, so an ERROR can fail the one call that caused it; 0 when absent or bad
    (it is read before anything else can fail, and must not fail itself)."""
    qid = h.get("qid", 0)
    return qid if isinstance(qid, int) and not isinstance(qid, bool) and 0 <= qid <= f.INT64 else 0


def check_proto(h: Mapping[str, Any], major: int) -> bool:
    """Whether HELLO's ``proto`` range [lowest, highest] includes ``major``."""
    proto = f.items(h, "proto", max_items=2, default=[major, major])
    if len(proto) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in proto):
        raise ProtocolError(ErrorCode.MALFORMED, "proto must be [lowest, highest] major versions")
    return bool(proto[0] <= major <= proto[1])
