"""The worker agent: a DEALER to the coordinator, a runner per slot, and nothing else.

The agent never runs user code, so heartbeats keep flowing whatever a task does. It reconnects
forever (1 s doubling to 32 s, with jitter) and, on every new session, tells the coordinator
which leases it still holds and re-sends results the coordinator has not acknowledged.

The machine's owner steers it through the local control channel (control.py, owner.py):
``pause`` stops new work and hands back what is queued, ``resume`` undoes that, ``drain`` lets
running tasks finish and then leaves (``drain-now`` hands them back at once). Nobody's work is
lost.
"""

from __future__ import annotations

import logging
import math
import os
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import zmq

from .. import clock
from .._version import __version__
from ..config import Endpoint, Settings, parse_url
from ..errors import AuthenticationError, MeshError
from ..protocol import (
    Command,
    Departure,
    ErrorCode,
    Gpu,
    Message,
    ResultEncoding,
    ResultStatus,
    Role,
    WorkerMode,
    encode,
    gpu_satisfies,
    serialize,
)
from ..protocol.fields import INT64, for_terminal
from ..protocol.refs import parse_refs
from ..protocol.requirements import parse_size
from ..protocol.vocabulary import KEPT_FUNCTIONS
from ..runner.pipe import PipeClosed
from ..security import derive_keys
from ..session import Session
from ..sharedmem import SharedFolder
from ..shmowners import PREFIX_CHARS, tagged
from ..stopflag import StopFlag
from ..transport import DealerLink, LinkEvent
from . import scratch
from .control import ControlServer
from .owner import OwnerControls
from .runners import BadRunnerMessage, QueuedTask, Runner, RunningTask, checked_result
from .telemetry import Sampler

log = logging.getLogger("gpumesh.worker")

_SHM_DIR = "_shm_dir"  # the folder a result's shared frames are in: kept here, never sent
_SHM_START = "_shm_start"  # how its runner's result files are named (shmowners.tagged): here only
NEVER_JOINED_HINT = 60.0  # seconds without ever reaching the coordinator before a hint
# Auto prefetch: while recent tasks run under PREFETCH_HORIZON, queue about PREFETCH_WORK
# seconds of them per slot (at least one, at most AUTO_PREFETCH_PER_SLOT): enough to hide the
# round trip between a result and the next task, and to let TASKs come in runs. A task queued
# behind another waits at most PREFETCH_HORIZON while a worker elsewhere may be idle.
PREFETCH_HORIZON = 0.2
PREFETCH_WORK = 0.01
AUTO_PREFETCH_PER_SLOT = 64
PREFETCH_BYTES = 64 << 20  # and no deeper than about this much task input per slot
MAX_PREFETCH = 256  # what a HELLO may announce (protocol.headers)
RUN_TIME_WEIGHT = 0.2  # of the newest task in the moving average
# While tasks this short keep coming, what a turn posts waits up to COALESCE_WINDOW for the
# results after it (at most COALESCE_MAX messages): every message costs each process on the
# way a wake-up, and a wake-up costs more than a no-op task. A worker with nothing queued behind
# its running tasks (a single call, long tasks) sends at once.
COALESCE_RUN = 0.002
COALESCE_WINDOW = 0.005
COALESCE_MAX = 64
# While tasks that short keep coming, a busy runner is handed as many as AHEAD_DEEP tasks
# ahead, and its socket is left unread for RUNNER_NAP after each read: its results pile up in
# the socket (safe there if it dies) and are read together, instead of a wake-up for each.
AHEAD_DEEP = 64
RUNNER_NAP = 0.001
RELEASES_KEPT = 10_000  # leases a session's CREDITs handed back, repeated in the next HELLO
# A task handed ahead to a runner whose task has run this long goes back to the coordinator
# (when every slot is busy): dropping it restarts the runner after its task.
AHEAD_HAND_BACK = 2.0
# How long a worker that is leaving waits for the coordinator to answer its DISCONNECT, or,
# from a coordinator that does not answer (before protocol 1.6), lingers for it to go out (ms).
GOODBYE_LINGER_MS = 1000
RUNNER_READS = 256  # messages read from one runner in one turn, at most
RUNNER_READ_TIME = 0.05  # ... and none begun after this long (_read_runner says why)
# A task past its timeout whose runner still has results waiting is read on for this long
# before it is ruled late: the result waiting may be its own.
LATE_GRACE = 2.0
# A runner whose socket closed has this long to finish exiting (its descriptors close before
# it can be reaped) before it is taken for one that runs on, and killed.
DYING_GRACE = 1.0
EXIT_REAP_WAIT = 5.0  # seconds join waits at exit for its killed runners to be gone
# A runner that exits before it is ready is started again at once the first time, then after
# START_BACKOFF seconds, doubling up to START_BACKOFF_MAX; the owner is told as it first waits.
RETRY_FAILED_STARTS = 2
START_BACKOFF = 0.5
START_BACKOFF_MAX = 30.0
DYING_READS = 64  # reads of a dead runner's output pipes at most: 4 MiB of its last words



class WorkerAgent:
    """Serve tasks until ``stop()``. ``say`` receives the user-facing lines ([worker] ...)."""

    def __init__(
        self, settings: Settings, endpoint: Endpoint, token: str, *, slots: int,
        info: dict[str, Any], say: Callable[[str], None] | None = None,
        worker_id: str | None = None, gpu_indices: list[int] | None = None,
        on_joined: Callable[[str], None] | None = None, prefetch: int | None = 0,
        local_control: bool = True, pass_env: Sequence[str] = (),
        rediscover: Callable[[], str | None] | None = None, found_on_lan: bool = False,
    ) -> None:
        if slots < 1:
            raise ValueError("a worker needs at least one slot")
        self.settings = settings
        self.endpoint = endpoint
        self.keys = derive_keys(token)
        self.slots = slots
        # Tasks granted beyond the free slots wait here, hiding the round trip for tiny tasks.
        # A long task would hold queued ones back from idle workers elsewhere, so ``None``
        # (auto) queues only while recent tasks are short, and only as deep as PREFETCH_HORIZON.
        self.auto_prefetch = prefetch is None
        self.prefetch = (min(AUTO_PREFETCH_PER_SLOT * slots, MAX_PREFETCH) if prefetch is None
                         else min(max(prefetch, 0), MAX_PREFETCH))  # announced in HELLO
        self._mean_run: float | None = None  # moving average of task run time, seconds
        self._mean_bytes = 0.0  # moving average of a task's input, bytes
        self._granted_depth = 0  # the prefetch depth included in what was granted so far
        # The depth the coordinator bounds what it sends by: HELLO's prefetch, then CREDIT's.
        self._announced_depth = 0
        self._posted_at: float | None = None  # when what the link holds unsent was first posted
        self._napping: set[int] = set()  # runner sockets left out of the poller for now
        self.info = info
        self.say = say or (lambda line: None)
        self.on_joined = on_joined
        self.worker_id = worker_id or secrets.token_hex(6)
        self.incarnation = secrets.token_hex(4)
        self._stop = StopFlag()  # join's signal handlers set it (stopflag.py)
        self._ctx = zmq.Context()
        self.link = DealerLink(self._ctx, endpoint, self.keys, settings.limits)
        # User code must not find the mesh token in its environment.
        env = {k: v for k, v in os.environ.items() if k != "GPUMESH_TOKEN"}
        self.runners = []
        # The GPU each slot is pinned to: a task that needs a given model or VRAM is started
        # only in a slot whose own GPU has it (the coordinator checks the worker as a whole).
        self.slot_gpus: list[Gpu | None] = []
        by_index = {g.get("index"): g for g in info.get("gpus", []) if isinstance(g, dict)}
        for slot in range(slots):
            slot_env = dict(env)
            gpu = None
            if gpu_indices:
                # One GPU per slot: the runner sees exactly its own device as cuda:0.
                index = gpu_indices[slot % len(gpu_indices)]
                slot_env["CUDA_VISIBLE_DEVICES"] = visible_device(env, index)
                found = by_index.get(index)
                gpu = Gpu(str(found.get("name", "")), _size(found.get("vram"))) if found else None
            self.slot_gpus.append(gpu)
            self.runners.append(Runner(slot, slot_env, settings.limits.max_message_bytes,
                                       pass_env=pass_env))
        if gpu_indices and slots < len(gpu_indices):
            # Fewer slots than GPUs (--max-slots): the coordinator is told only of the GPUs a
            # slot runs on. Told of all, it placed an A100 task here for the A100 no slot has;
            # the agent sent it back as crashed, an attempt charged each time.
            used = set(gpu_indices[:slots])
            self.info = {**info, "gpus": [
                g for g in info.get("gpus", []) if not isinstance(g, dict)
                or g.get("backend") != "cuda" or g.get("index") in used]}
        self.queue: deque[QueuedTask] = deque()
        # Pickled functions the coordinator told this session to keep (TASK ``fnkeep``), by
        # digest: later TASKs of the same function name it (``fnref``) instead of carrying it.
        self.functions: dict[str, Any] = {}
        self._resyncing = False  # a HELLO went out for a missing function; WELCOME ends it
        # lease id -> (RESULT header, frames), kept until the coordinator's RESULT_ACK
        self.unacked: dict[int, tuple[dict[str, Any], list[Any]]] = {}
        # The coordinator's shared-memory folder, when this agent can read it (same machine):
        # big frames then come and go as file names (gpumesh.sharedmem).
        self.shm: SharedFolder | None = None
        self._shm_owner: str | None = None  # the prefix its runners' results are named with
        self._tagged = 0  # tasks tagged so far (shmowners.tagged): never the same tag twice
        self.joined_once = False
        self.granted = 0
        self._handed_back_down = 0  # tasks handed back while no runner could start
        self.received = 0  # TASKs received in this session: the coordinator's count of sent
        self.mode = WorkerMode.ACTIVE  # the owner's choice (gpumesh pause/resume/drain)
        self.removed = False  # `gpumesh kill` took this worker out of the mesh
        self.owner = OwnerControls(self)
        # CPU/RAM/GPU use for the heartbeats, sampled in a thread of its own.
        self.sampler = Sampler(gpu_indices)
        self._local_control = local_control
        self.control: ControlServer | None = None
        self._goodbye_linger = 0  # set once a DISCONNECT is on its way (_leave)
        self.left_running = self.left_waiting = 0  # tasks given back as it left (_leave)
        self._goodbye_answered = False  # this session's coordinator answers a DISCONNECT
        # Leases handed back while the coordinator could not hear it: sent with the next HELLO.
        self._pending_release: list[int] = []
        self._released: list[int] = []  # leases this session's CREDITs handed back
        self._hello_release: list[int] = []  # the releases the last HELLO carried
        self._started_at = 0.0
        self._hinted = False
        self._lost_at: float | None = None  # when the coordinator went silent (one outage)
        # A worker that found its coordinator by discovery looks again when it goes silent:
        # it may have moved to another address. The browse runs in a thread; its answer is
        # picked up by the loop (only the loop touches the link).
        self._rediscover = rediscover
        self._browsing: threading.Thread | None = None
        self._moved_to: Endpoint | None = None
        # Where to go back to when an address the LAN suggested stays silent or fails the
        # handshake (anyone on the LAN can advertise the mesh's public fingerprint): the
        # address given or saved, from the start (its coordinator may be down as this worker
        # starts, and an impostor's suggestion must not replace it for good); then the last
        # address whose coordinator welcomed us. None only for an address found on the LAN.
        self._found_on_lan = found_on_lan
        self._trusted: Endpoint | None = None if found_on_lan else endpoint
        self._dialled: Endpoint | None = None  # where the last HELLO went
        # HELLO/WELCOME, heartbeats, silence and reconnects: the session; tasks: this class.
        self.session = Session(Role.WORKER, self.worker_id, endpoint, settings.timing,
                               self.link, self)
        self._polled: tuple[Any, ...] = ()  # what self._poll watches
        self._poll: tuple[zmq.Poller, dict[int, tuple[Runner, str]]] = (zmq.Poller(), {})

    # ----------------------------------------------------------------- lifecycle

    def stop(self) -> None:
        self._stop.set()

    @property
    def welcomed(self) -> bool:
        """True while the coordinator has admitted this worker (a session is up)."""
        return self.session.welcomed

    @property
    def draining(self) -> bool:
        """True when the owner paused or drains this worker: it takes no new tasks."""
        return self.mode is not WorkerMode.ACTIVE

    def run(self) -> None:
        """Serve until stopped. Raises AuthenticationError/ProtocolMismatch on a fatal mismatch."""
        scratch.sweep()  # runner folders of agents killed before they could remove them
        for runner in self.runners:
            runner.start()
        self.link.open()
        if self._local_control:
            self.control = ControlServer(self._ctx, self.settings.home, self.worker_id,
                                         self.endpoint.zmq)
        self._started_at = clock.now()
        self.session.start(self._started_at)
        self.sampler.start()
        try:
            while not self._stop.is_set():
                self._turn()
            self._leave()
        finally:
            self.sampler.stop()
            for runner in self.runners:
                runner.kill()
            deadline = time.monotonic() + EXIT_REAP_WAIT  # gone before join exits, if they go
            for runner in self.runners:
                runner.reap_dying(max(deadline - time.monotonic(), 0.0))
            scratch.wait(max(deadline - time.monotonic(), 0.0))  # their folders too
            if self.control is not None:
                self.control.close()
            if self.shm is not None:
                self.shm.release()
            self.link.close(self._goodbye_linger)
            self._ctx.term()

    def _leave(self) -> None:
        """Tell the coordinator we are going, so it re-queues our tasks at once."""
        # What goes back to the mesh with us, for join's last line (Ctrl+C said nothing of it).
        self.left_running = sum(1 for r in self.runners if r.task is not None)
        self.left_waiting = len(self.queue) + sum(len(r.ahead) for r in self.runners)
        if self.welcomed and not self.removed:
            reason = (Departure.DRAINED if self.mode is WorkerMode.DRAINING else Departure.LEFT).value
            self.link.flush()
            self.link.send(encode(Command.DISCONNECT, {"reason": reason}))
            if self._goodbye_answered:
                # The worker exits once the coordinator answered (or a second passed): a
                # goodbye sent is not a goodbye handled, and serve stops its coordinator as
                # soon as its self-worker has exited. After that, nothing is worth a linger.
                self._await_goodbye(time.monotonic() + GOODBYE_LINGER_MS / 1000)
            else:
                # A coordinator before 1.6: the socket lingers for the goodbye to go out.
                self._goodbye_linger = GOODBYE_LINGER_MS

    def _await_goodbye(self, deadline: float) -> None:
        """Read until the coordinator's DISCONNECT, which it sends after handling ours; what
        else arrives (a task sent before it read our goodbye) it has requeued already."""
        sock = self.link.sock
        while sock is not None and time.monotonic() < deadline:
            try:
                msg = self.link.recv()
            except MeshError as exc:  # a coordinator of another version: no answer to wait for
                log.debug("no goodbye from the coordinator: %s", exc)
                return
            if msg is not None:
                if msg.command is Command.DISCONNECT:
                    return
                continue
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                log.debug("the coordinator did not acknowledge this worker's goodbye in time")
                return

    def _poller(self) -> tuple[zmq.Poller, dict[int, tuple[Runner, str]]]:
        """The loop's poller and which runner each descriptor belongs to, built again only
        when a socket or a runner's pipes changed (a restart), not every turn."""
        fds = [(fd, what, runner) for runner in self.runners for fd, what in runner.fds()]
        key = (self.link.sock, self.link.monitor,
               self.control.sock if self.control is not None else None,
               tuple((fd, what, id(runner)) for fd, what, runner in fds))
        if key != self._polled:
            self._polled = key
            poller = zmq.Poller()
            for sock in key[:3]:
                if sock is not None:
                    poller.register(sock, zmq.POLLIN)
            for fd, _, _ in fds:
                poller.register(fd, zmq.POLLIN)
            self._poll = (poller, {fd: (runner, what) for fd, what, runner in fds})
            self._napping = set()
        return self._poll

    def _nap_runners(self, poller: zmq.Poller, now: float) -> None:
        """Leave unpolled, for RUNNER_NAP after its last read, the socket of each runner busy
        with short tasks that has more handed ahead; poll it again after."""
        napping = {runner.control.fileno() for runner in self.runners
                   if runner.control is not None and self._napping_runner(runner, now)}
        for fd in napping - self._napping:
            poller.unregister(fd)
        for fd in self._napping - napping:
            poller.register(fd, zmq.POLLIN)
        self._napping = napping

    def _napping_runner(self, runner: Runner, now: float) -> bool:
        return (bool(runner.ahead) and runner.task is not None and self._short_tasks()
                and now < runner.read_at + RUNNER_NAP)

    def _short_tasks(self) -> bool:
        """Recent tasks ran so short that a wake-up per task costs more than they do."""
        return self._mean_run is not None and self._mean_run < COALESCE_RUN

    def _turn(self) -> None:
        poller, fd_owner = self._poller()
        self._nap_runners(poller, clock.now())
        sock = self.link.sock
        self._flush_runners()  # never wait with a task held back from its runner
        ready = dict(poller.poll(self._poll_timeout()))
        now = clock.now()
        # Only when poll named it: reading an empty monitor costs a poll of its own every turn.
        if self.link.monitor is not None and self.link.monitor in ready:
            for event in self._link_events():
                if event is LinkEvent.CONNECTED:
                    log.debug("handshake with %s succeeded", self.endpoint)
        if sock is not None and sock in ready:
            for _ in range(1000):
                msg = self.link.recv()
                if msg is None:
                    break
                self.session.on_message(msg, now)
            self._flush_runners()  # the tasks of every TASK read, one write per runner
        if self.control is not None and self.control.sock in ready:
            self.control.serve(lambda action: self.owner.on_control(action, now))
        for fd in ready:
            if isinstance(fd, int) and fd in fd_owner:
                runner, what = fd_owner[fd]
                if what == "control":
                    if runner.control is None or runner.control.fileno() != fd:
                        continue  # restarted earlier in this turn: the new one has its own turn
                    self._on_runner_message(runner, now)
                else:
                    self._on_runner_output(runner, what)
        self._check_runners(now)
        self._start_queued(now)  # what it hands ahead goes with the next turn's first flush
        self._hand_back_waiting(now)
        self._follow_move()
        self.session.tick(now)
        if self.mode is WorkerMode.DRAINING:
            self.owner.finish_drain(now)
        if not self._coalescing(now):
            self.link.flush()  # what this turn said goes out together, as one BATCH
            self._posted_at = None

    def _flush_runners(self) -> None:
        """Write what was handed ahead to each runner (``Runner.flush``). A runner that cannot
        take it is gone: its pipe's end of file, or ``_check_runners``, handles that."""
        for runner in self.runners:
            try:
                runner.flush()
            except OSError:
                pass

    def _coalescing(self, now: float) -> bool:
        """Whether to hold what was posted for the results about to follow it."""
        posted = self.link.posted
        if not posted:
            return False
        if self._posted_at is None:
            self._posted_at = now
        # Held results hold back the grant too: send once half of what is queued ran.
        waiting = len(self.queue) + sum(len(r.ahead) for r in self.runners)
        return (waiting > self.prefetch_depth() // 2 and self._short_tasks()
                and posted < COALESCE_MAX and now - self._posted_at < COALESCE_WINDOW)

    def _poll_timeout(self) -> int:
        if self.link.backlog:
            return 0
        now = clock.now()
        waits = [self.session.heartbeat / 2, self.session.next_timer(now)]
        if self._posted_at is not None:
            waits.append(self._posted_at + COALESCE_WINDOW - now)
        waits += [runner.read_at + RUNNER_NAP - now for runner in self.runners
                  if runner.control is not None and runner.control.fileno() in self._napping]
        idle = [r for r in self.runners if r.idle]
        hand_back = self._hand_back_due(now)
        if hand_back is not None:
            waits.append(hand_back - now)
        for runner in self.runners:
            if runner.start_at is not None:
                waits.append(runner.start_at - time.monotonic())
            if runner.task is not None and runner.task.deadline is not None:
                waits.append(runner.task.deadline - now)
            if idle and runner.next is not None and runner.task is not None \
                    and any(self._slot_fits(r.slot, runner.next.task.header) for r in idle):
                # Move it, then (_move_stuck_ahead); one that fits no idle slot (another
                # GPU's task) waits for nothing: past due, it made every poll 1 ms long.
                waits.append(runner.task.started + PREFETCH_HORIZON - now)
        return max(1, int(min(waits) * 1000))

    # ----------------------------------------------------------------- the session's hooks

    def on_hello(self) -> dict[str, Any]:
        """A new session: what this worker holds and grants, for the HELLO."""
        self._dialled = self.endpoint  # a HELLO goes there: that address has its try
        held = [[task.task_id, task.lease_id] for task in self._held_tasks()]
        # Finished but not yet acknowledged: claimed too, so their results count after a
        # coordinator restart (only leases a coordinator granted or re-claimed are accepted).
        held += [[result["task"], lease] for lease, (result, _) in self.unacked.items()]
        self._granted_depth = self.prefetch_depth()
        self._announced_depth = self.prefetch  # what HELLO's prefetch bounds it by
        # What this HELLO hands back: what waited for it, and what the last session's CREDITs
        # handed back, in case they never arrived.
        self._hello_release = list(dict.fromkeys([*self._released, *self._pending_release]))
        self._released = []
        self.granted = self.free_slots()
        self._handed_back_down = 0  # a new session's grant starts whole
        self.received = 0
        self.functions.clear()  # the coordinator starts its count of what we keep afresh too
        return {
            "incarnation": self.incarnation, "slots": self.slots, "credit": self.granted,
            "prefetch": self.prefetch, "held": held, "info": self.info,
            "draining": self.draining, "mode": self.mode.value,
            "release": self._hello_release, "fnref": True, "control": True,
        }

    def heartbeat_header(self) -> dict[str, Any]:
        stats = self.sampler.latest()
        header: dict[str, Any] = {"leases": self._held_leases()}
        if stats is not None:
            header["stats"] = stats
        return header

    def on_lost(self, now: float, delay: float, was_welcomed: bool) -> None:
        """One line when an outage starts (and one when it ends, in on_welcome), however many
        retries it takes; a hint if a worker never reached its coordinator for a minute."""
        trusted = self._trusted
        if trusted is not None and self._dialled == self.endpoint != trusted:
            # An address the LAN suggested was dialled and did not welcome us, and anyone on
            # the LAN can advertise the mesh's fingerprint at an address that stays silent: the
            # next try goes back to the one that did, and a browse may suggest another after
            # it. (One suggested while a try at the old address was under way gets its own.)
            log.info("no welcome at %s, found on the LAN: trying %s again", self.endpoint,
                     trusted)
            self.endpoint = self.link.endpoint = self.session.endpoint = trusted
        self._browse_again()
        if self._lost_at is None:
            self._lost_at = now
            if self.joined_once:
                self.say(f"[worker] lost the coordinator at {self.endpoint}; retrying until it "
                         "is back (Ctrl+C to stop)")
            else:
                self.say(f"[worker] cannot reach a coordinator at {self.endpoint} yet (is "
                         "'gpumesh serve' running there?); retrying until it answers")
        elif not self.joined_once and not self._hinted \
                and now - self._started_at > NEVER_JOINED_HINT:
            self._hinted = True
            self.say("[worker] still no coordinator after "
                     f"{now - self._started_at:.0f}s: check the URL and port, and that "
                     "the coordinator was started with --host to accept other machines "
                     "(Ctrl+C to stop)")
        else:
            log.debug("still no coordinator at %s; retrying in %.1fs", self.endpoint, delay)

    def _browse_again(self) -> None:
        """Look for the coordinator on the LAN again (a discovered worker only), in the
        background: one browse at a time."""
        if self._rediscover is None or (self._browsing is not None and self._browsing.is_alive()):
            return
        rediscover = self._rediscover

        def browse() -> None:
            try:
                url = rediscover()
            except Exception as exc:  # no answer, several, another version: keep retrying
                log.debug("looking for the coordinator again: %s", exc)
                return
            if url and parse_url(url) != self.endpoint:
                self._moved_to = parse_url(url)

        self._browsing = threading.Thread(target=browse, name="gpumesh-rediscover", daemon=True)
        self._browsing.start()

    def _link_events(self) -> list[LinkEvent]:
        """The link's events. A failed handshake at an address that LAN discovery suggested
        is not fatal when another address already admitted us: anyone can advertise a copy of
        the mesh's fingerprint, so it is a wrong address, and the worker goes back."""
        try:
            return self.link.monitor_events()
        except AuthenticationError:
            trusted = self._trusted
            if trusted is None and self._found_on_lan and not self.joined_once:
                raise AuthenticationError(
                    f"{self.endpoint}, found on the LAN, failed the handshake: either the token "
                    "is not this mesh's, or another machine advertises itself as its "
                    "coordinator. Pass the coordinator's URL: gpumesh join tcp://HOST:PORT "
                    "--token-file FILE") from None
            if trusted is None or trusted == self.endpoint:
                raise  # the address we were given, or the one that admitted us: a real refusal
            self.say(f"[worker] {self.endpoint}, found on the LAN, failed the handshake: it is "
                     f"not this mesh's coordinator; dialling {trusted} again")
            self.endpoint = self.link.endpoint = self.session.endpoint = trusted
            self.link.reset()
            self.session.hello()
            return []

    def _follow_move(self) -> None:
        """Dial the coordinator's new address: at once when the session is waiting out its
        back-off (up to 32 s between tries), else from the next reconnect on."""
        moved, self._moved_to = self._moved_to, None
        if moved is None or self.welcomed:
            return
        self.say(f"[worker] found the coordinator again on the LAN, now at {moved}")
        self.endpoint = self.link.endpoint = self.session.endpoint = moved
        if self.session.reconnect_at is not None:
            self.session.reconnect_at = clock.now()  # this turn's tick dials it

    def on_disconnect(self, header: dict[str, Any], now: float) -> bool:
        if header.get("reason") != "kill":
            return False  # a new session, as after silence
        # The coordinator already re-queued our tasks: stop them and leave for good.
        by = header.get("by")
        self.say("[worker] removed from the mesh ('gpumesh kill'"
                 + (f" by {str(by)[:200]}" if by else "") + "): stopping")
        self.removed = True
        self.queue.clear()
        self.unacked.clear()
        self.stop()
        return True

    @property
    def url(self) -> str:
        return self.endpoint.zmq

    def send_credit(self, release: Sequence[int] = ()) -> None:
        if not self.welcomed:
            # The next HELLO carries the mode and these leases: nothing is charged for them.
            self._pending_release.extend(release)
            return
        header: dict[str, Any] = {"granted": self.granted, "draining": self.draining,
                                  "mode": self.mode.value, "depth": self._granted_depth}
        self._announced_depth = self._granted_depth
        if release:
            header["release"] = list(release)
            # Kept for the next HELLO too: a CREDIT posted as the link silently died (or reset
            # with it) is never read, and a HELLO that neither holds nor releases a lease
            # makes the coordinator charge it an attempt. Releasing one twice is harmless.
            self._released.extend(release)
            del self._released[:-RELEASES_KEPT]
        self.link.post(encode(Command.CREDIT, header))

    def _hand_back_due(self, now: float) -> float | None:
        """When ``_hand_back_waiting`` has something to do (now or later), or None: only in
        auto prefetch (a fixed --prefetch is the owner's choice: its tasks wait here), while
        active, and while every slot runs a task."""
        if self.mode is not WorkerMode.ACTIVE or not self.auto_prefetch or not self.runners \
                or any(r.task is None for r in self.runners):
            return None
        all_long = max(r.task.started for r in self.runners  # type: ignore[union-attr]
                       ) + PREFETCH_HORIZON
        due = [all_long] if self.queue or self._granted_depth else []
        due += [max(r.task.started + AHEAD_HAND_BACK, all_long)  # type: ignore[union-attr]
                for r in self.runners if r.ahead]
        return min(due) if due else None

    def _hand_back_waiting(self, now: float) -> None:
        """Once every slot runs a task that has turned out long (PREFETCH_HORIZON), what is
        queued here goes back to the coordinator unstarted and the depth it may send goes to 0:
        those tasks were granted while tasks were short, and would wait here while another
        worker idles. As tasks finish the slots take new ones, one each; short tasks raise the
        depth again. A task handed ahead to a runner goes back once that runner's task has run
        AHEAD_HAND_BACK: the runner restarts after its task to skip it, which an occasional
        slow task among short ones should not cost (a warm CUDA context, a loaded model)."""
        due = self._hand_back_due(now)
        if due is None or now < due:
            return
        all_long = all(_running_for(r, now) >= PREFETCH_HORIZON for r in self.runners)
        released: list[int] = []
        if all_long:
            released = [queued.task.lease_id for queued in self.queue]
            self.queue.clear()
        for runner in self.runners:
            if runner.ahead and all_long and _running_for(runner, now) >= AHEAD_HAND_BACK:
                # What it wrote first: its long task may have just ended, and the one handed
                # ahead started, or even finished (handed back, it would run twice).
                if runner.control is not None:
                    self._read_written(runner, now, dead=False)
                if runner.ahead and _running_for(runner, now) >= AHEAD_HAND_BACK:
                    released += [queued.task.lease_id for queued in runner.drop_ahead()]
        if not all_long or (not released and not self._granted_depth):
            return
        # The grant stays (the coordinator keeps the largest it heard; what it may send is
        # now bounded by the depth this CREDIT gives, 0).
        self._granted_depth = 0
        if released:
            log.info("handed %d queued task(s) back: every slot runs a long task",
                     len(released))
        self.send_credit(release=released)

    def free_slots(self) -> int:
        busy = len(self._held_tasks())
        return 0 if self.draining else max(self.slots + self._granted_depth - busy, 0)

    def prefetch_depth(self) -> int:
        """Tasks to hold queued beyond the slots now: fixed, or (auto) by recent run times."""
        if not self.auto_prefetch:
            return self.prefetch
        if self._mean_run is None or self._mean_run >= PREFETCH_HORIZON:
            return 0
        per_slot = min(math.ceil(PREFETCH_WORK / max(self._mean_run, 1e-6)),
                       AUTO_PREFETCH_PER_SLOT,
                       max(int(PREFETCH_BYTES // max(self._mean_bytes, 1.0)), 1))
        return min(per_slot * self.slots, self.prefetch)

    def _note_run_time(self, seconds: float) -> None:
        """Fold a finished task's run time in, and move the grant toward the new depth: up at
        once, down by one task per finished task (what was granted cannot be taken back)."""
        mean = self._mean_run
        self._mean_run = seconds if mean is None else mean + RUN_TIME_WEIGHT * (seconds - mean)
        depth = self.prefetch_depth()
        if depth > self._granted_depth:
            self.granted += depth - self._granted_depth
            self._granted_depth = depth
            if depth > self._announced_depth:
                # The coordinator bounds what it sends by the last depth it heard (CREDIT's;
                # HELLO's prefetch before any): a grant alone would not lift that bound.
                self.send_credit()
        elif depth < self._granted_depth:
            self.granted -= 1
            self._granted_depth -= 1

    def on_message(self, msg: Message, now: float) -> None:
        command = msg.command
        if command is Command.TASK:
            if self.session.awaiting_welcome:
                # Sent before the coordinator read the HELLO said since on this socket (a
                # function it never gave us, a stalled big message): that HELLO did not claim
                # it, so the coordinator has put it back in the queue. Run here too, it would
                # run twice at once, on credit the new session never granted.
                log.debug("dropped task %s, sent before this worker's new HELLO was read",
                          for_terminal(str(msg.header.get("task"))[:64]))
                return
            self.received += 1
            self._on_task(msg, now)
        elif command is Command.RESULT_ACK:
            for lease_id in _lease_ids([msg.header.get("lease")]):
                self.unacked.pop(lease_id, None)
        elif command is Command.CANCEL:
            for lease_id in _lease_ids(msg.header.get("leases")):
                self._cancel(lease_id, now, report=True)
        elif command is Command.CONTROL:
            # A client of the mesh asked (the coordinator says who): as the owner's own
            # command would, except that it never overrides what the owner chose here.
            action, by = msg.header.get("action"), str(msg.header.get("by", "?"))[:200]
            if action in ("drain", "pause", "resume"):
                self.owner.on_control(str(action), now, by=by)
        elif command is Command.ERROR:
            if msg.header.get("code") == ErrorCode.MALFORMED.value and not self.joined_once:
                # Our HELLO was refused (e.g. more slots than the coordinator accepts for this
                # machine): saying HELLO again would be refused the same way.
                raise MeshError(f"the coordinator refused this worker: "
                                f"{for_terminal(str(msg.header.get('message'))[:500])}")
            log.warning("coordinator error: %s",
                        for_terminal(str(msg.header.get("message"))[:500]))

    def on_welcome(self, h: dict[str, Any], now: float) -> None:
        self._resyncing = False
        self._goodbye_answered = h.get("goodbye") is True
        self._trusted = self.endpoint  # this address admitted us: a coordinator of the mesh
        folder = SharedFolder.join(h.get("shm")) if self.settings.share_memory else None
        if self.shm is not None:
            self.shm.release()
        self.shm = folder
        self._shm_owner = self.shm.owner_prefix() if self.shm is not None else None
        if self.shm is not None:
            # Before anything that names a shared file: the coordinator reads in order.
            self.link.post(encode(Command.HEARTBEAT, {"leases": self._held_leases(),
                                                      "shm": self.shm.proof}))
        dropped = sum(self._cancel(lease_id, now, report=False)
                      for lease_id in _lease_ids(h.get("abort")))
        # The HELLO carried those; the coordinator has them back. Any handed back since it
        # went (a hand-back, a pause before the WELCOME) go now.
        carried = set(self._hello_release)
        self._pending_release = [lease for lease in self._pending_release if lease not in carried]
        if self._pending_release:
            self.send_credit(release=self._pending_release)
            self._pending_release = []
        if dropped and not self.draining:
            # HELLO counted those slots as busy; they are free again. (A lease whose task
            # finished meanwhile was already credited when it reported.)
            self.granted += dropped
            self.send_credit()
        for header, frames in self.unacked.values():
            # Credit is per session: re-sent results carry this session's grant, not the old one.
            self._send_result(header, frames)
        if not self.joined_once:
            self.joined_once = True
            self.say(f"[worker] joined mesh as {self.worker_id}")
            for line in version_notes(self.info, h):
                self.say(line)
            if self.on_joined is not None:
                self.on_joined(self.worker_id)
        elif self._lost_at is not None:
            self.say(f"[worker] back: reconnected to {self.endpoint} after "
                     f"{now - self._lost_at:.0f}s away")
        else:  # the coordinator restarted or forgot us, and we were not silent for long
            log.info("new session with the coordinator at %s", self.endpoint)
        self._lost_at = None

    def _on_task(self, msg: Message, now: float) -> None:
        h = msg.header
        size = serialize.payload_nbytes(msg.payload)
        self._mean_bytes += RUN_TIME_WEIGHT * (size - self._mean_bytes)
        payload = self._with_function(h, msg.payload)
        if payload is None:
            return
        if not _lease_ids([h.get("lease")]) or type(h.get("task")) is not str:
            log.warning("dropped a task without a task id and lease this worker can read")
            return
        if self.draining:
            # Sent before the coordinator heard we stopped taking work: hand it straight back.
            self.send_credit(release=[int(h["lease"])])
            return
        if self._runners_down():
            self._hand_back_while_down([int(h["lease"])])
            return
        # The agent's own bookkeeping keys, never sent: a TASK naming them would choose the
        # folder whose files a timeout or cancel removes (drop_unsent).
        h.pop(_SHM_DIR, None)
        h.pop(_SHM_START, None)
        task = RunningTask(str(h["task"]), int(h["lease"]), now, None, h, received=now)
        runner_header = {"kind": h.get("kind", "fn"), "fn": h.get("fn", ""), "name": h.get("name", "")}
        if h.get("src"):
            # The pickle only loads on the submitter's Python; elsewhere run the source form.
            foreign = str(h.get("py", "")) != str(self.info.get("python", ""))
            runner_header.update(src=str(h["src"]), form="source" if foreign else "pickle")
        try:
            frames = serialize.join_frames(payload, h.get("split"))
            refs = parse_refs(h.get("shm"), len(frames))
            if refs and self.shm is None:
                raise ValueError("its frames are in a shared-memory folder this worker cannot read")
        except (ValueError, TypeError) as exc:
            self._report(task, {"status": "error", "error": {
                "type": "gpumesh.BadTask", "message": f"the task's frames do not add up: {exc}",
                "traceback": ""}}, [], now)
            return
        if "need" in h and not any(self._slot_fits(slot, h) for slot in range(self.slots)):
            # The coordinator matched the worker as a whole (a GPU no slot is pinned to, with
            # --max-slots): it would wait here for good, its lease renewed by every heartbeat.
            self._report(task, {"status": ResultStatus.CRASHED.value, "diagnosis": (
                "no slot of this worker has a GPU that meets the task's needs "
                f"({_needs(h.get('need'))}); it runs on another worker")}, [], now)
            return
        if self.shm is not None and runner_header["kind"] == "fn":
            # The runner maps shared input itself and leaves a big result there: the bytes
            # never pass through the agent.
            runner_header["shm_dir"] = task.header[_SHM_DIR] = str(self.shm.path)
            if self._shm_owner is not None:  # its results stay while this agent keeps them
                self._tagged += 1
                runner_header["shm_owner"] = task.header[_SHM_START] = tagged(
                    self._shm_owner, self._tagged)
            if refs:
                runner_header["shm"] = [list(ref) for ref in refs]
        self.queue.append(QueuedTask(task, runner_header, frames))
        self._start_queued(now)

    def _with_function(self, h: dict[str, Any], payload: list[Any]) -> list[Any] | None:
        """The task's frames with its function first, kept or put back as the TASK says (before
        anything else: the coordinator counts on every TASK being read in order). None when
        it names a function this session does not have: then a new session sorts it out."""
        digest = h.get("fn")
        if not isinstance(digest, str):
            return payload
        if h.get("fnref") is True:
            function = self.functions.get(digest)
            if function is None:
                if not self._resyncing:  # one new session; the HELLO hands back the others too
                    log.warning("task %s names a function this worker was never given; starting "
                                "a new session so the coordinator sends it again", h.get("task"))
                    # Handed back by that HELLO, unstarted: no attempt is charged for it.
                    self._pending_release.extend(_lease_ids([h.get("lease")]))
                    self.session.hello()
                    self._resyncing = True
                return None
            return [function, *payload]
        if h.get("fnkeep") is True and payload:
            if h.get("fnreset") is True:
                self.functions.clear()
            elif len(self.functions) >= KEPT_FUNCTIONS and digest not in self.functions:
                # Told to keep one more than the protocol allows: a coordinator that does not
                # count. Memory stays bounded; a later fnref for a function forgotten here
                # starts a new session, which sends it again.
                log.warning("the coordinator asked this worker to keep over %d functions; "
                            "forgetting the others", KEPT_FUNCTIONS)
                self.functions.clear()
            kept = payload[0]
            # As bytes: the tasks that name it hand it on to a runner with their own frames,
            # which are written the short way when all are bytes (runner/pipe.py, encode_small).
            self.functions[digest] = kept if type(kept) is bytes else bytes(
                getattr(kept, "buffer", kept))
        return payload

    def _start_queued(self, now: float) -> None:
        """Start queued tasks, in order, each in an idle slot that suits it; while tasks are
        short, hand each busy runner its next one ahead (gpumesh/worker/runners.py)."""
        idle = [r for r in self.runners if r.idle]
        if idle:
            self._move_stuck_ahead(idle, now)
        if not self.queue:
            return
        for queued in list(self.queue) if idle else ():
            runner = next((r for r in idle if self._slot_fits(r.slot, queued.task.header)), None)
            if runner is None:
                continue  # its GPU is busy: later tasks may still fit the free slots
            idle.remove(runner)
            self.queue.remove(queued)
            _started(queued.task, now)
            try:
                runner.send(queued.task, queued.header, queued.frames)
            except OSError:
                self.queue.appendleft(queued)
                runner.task = None
                self._runner_died(runner, now)
            if not idle:
                break
        if not self.queue or self.draining or self._mean_run is None \
                or self._mean_run >= PREFETCH_HORIZON:
            return  # a long task handed ahead could wait while another slot is free
        depth = AHEAD_DEEP if self._short_tasks() else 1
        handed = True
        while self.queue and handed:  # one per runner a round: the busy runners share them
            handed = False
            for runner in self.runners:
                runner.ahead_depth = depth
                if not self.queue:
                    return
                if not runner.takes_ahead or _running_for(runner, now) >= PREFETCH_HORIZON:
                    continue  # a task this long is no sign that the next will start soon
                ahead = next((q for q in self.queue
                              if self._slot_fits(runner.slot, q.task.header)), None)
                if ahead is None or not runner.fits_ahead(ahead):
                    continue
                self.queue.remove(ahead)
                try:
                    runner.hand_ahead(ahead)
                    handed = True
                except OSError:
                    self.queue.appendleft(ahead)  # the runner died: _check_runners sees to it

    def _move_stuck_ahead(self, idle: list[Runner], now: float) -> None:
        """A task handed ahead to a runner whose task turned out long goes back to the queue
        when a slot it fits is free, instead of waiting behind that task."""
        for runner in self.runners:
            ahead = runner.next
            if ahead is None or _running_for(runner, now) < PREFETCH_HORIZON:
                continue
            if any(self._slot_fits(r.slot, ahead.task.header) for r in idle):
                # What it wrote first, as above: a task of it that already ran stays its.
                if runner.control is not None:
                    self._read_written(runner, now, dead=False)
                if runner.next is not None and _running_for(runner, now) >= PREFETCH_HORIZON:
                    # The runner skips them, and restarts after its task.
                    self._requeue_front(runner.drop_ahead())

    def _slot_fits(self, slot: int, header: dict[str, Any]) -> bool:
        """Whether the GPU this slot is pinned to meets the task's ``need`` (the scheduler's
        rule, gpu_satisfies, applied to one GPU)."""
        need = header.get("need")
        gpu = self.slot_gpus[slot] if slot < len(self.slot_gpus) else None
        if not isinstance(need, dict) or gpu is None:
            return True  # no GPU requirement, or no pinning to judge it by
        model, vram = need.get("gpu"), need.get("vram")
        return gpu_satisfies(gpu, model if isinstance(model, (str, bool)) else None,
                             vram if isinstance(vram, int) else None)

    def _cancel(self, lease_id: int, now: float, *, report: bool) -> bool:
        """Drop a queued or running task; False when this agent no longer has it."""
        cancelled = {"status": ResultStatus.CANCELLED.value}
        for queued in list(self.queue):
            if queued.task.lease_id == lease_id:
                self.queue.remove(queued)
                if report:
                    self._report(queued.task, cancelled, [], now)
                return True
        for runner in self.runners:
            holds = (runner.task is not None and runner.task.lease_id == lease_id) or any(
                queued.task.lease_id == lease_id for queued, _ in runner.ahead)
            if holds and runner.control is not None:
                # Results it wrote that are still unread first: with tasks handed ahead the
                # runner may be past this one, and a task that finished is not cancelled (nor
                # run again, with its side effects, once those behind it are requeued).
                self._read_written(runner, now, dead=False)
                for queued in list(self.queue):  # a runner that broke put it back there
                    if queued.task.lease_id == lease_id:
                        self.queue.remove(queued)
                        if report:
                            self._report(queued.task, cancelled, [], now)
                        return True
            if any(queued.task.lease_id == lease_id for queued, _ in runner.ahead):
                # Those handed ahead go together (the runner restarts after its task); the
                # others go back to the front of the queue, in order.
                dropped = runner.drop_ahead()
                self._requeue_front([q for q in dropped if q.task.lease_id != lease_id])
                if report:
                    gone = next(q for q in dropped if q.task.lease_id == lease_id)
                    self._report(gone.task, cancelled, [], now)
                return True
            if runner.task is not None and runner.task.lease_id == lease_id:
                task = runner.task
                runner.task = None
                self._restart(runner)
                self.drop_unsent(task)
                if report:
                    self._report(task, cancelled, [], now)
                return True
        return False

    def _restart(self, runner: Runner) -> None:
        """Kill and start a runner again; a task handed ahead to it goes back to the front
        of the queue (it never started)."""
        self._requeue_front(runner.take_back())
        runner.kill()
        runner.start()

    def _requeue_front(self, tasks: list[QueuedTask]) -> None:
        """Tasks a runner gave back, to the front of the queue in order, each with a new tag
        for its result files: the runner that had them may have started one after all (a drop
        it read too late), and what that one wrote goes by the old tag once it is restarted
        (Runner.start) while another runner may be writing under the new one."""
        for queued in tasks:
            start = queued.task.header.get(_SHM_START)
            if isinstance(start, str):
                self._tagged += 1
                queued.header["shm_owner"] = queued.task.header[_SHM_START] = tagged(
                    start[:PREFIX_CHARS], self._tagged)
        self.queue.extendleft(reversed(tasks))

    # ----------------------------------------------------------------- runners

    def _on_runner_message(self, runner: Runner, now: float) -> None:
        """Handle what the runner wrote: every message waiting, up to RUNNER_READS (a runner
        left unread for a while has written several results)."""
        proc = runner.proc
        runner.read_at = now
        written, ended, why = self._read_runner(runner, time.monotonic() + RUNNER_READ_TIME,
                                                waiting=True)
        self._handle_written(runner, written, now)
        if ended == "broken" and runner.proc is proc:
            self._runner_broke(runner, why, now)
        elif ended == "closed" and runner.proc is proc:
            self._runner_died(runner, now)

    @staticmethod
    def _read_runner(runner: Runner, budget: float, *, waiting: bool = False
                     ) -> tuple[list[tuple[dict[str, Any], list[Any]]], str, str]:
        """The messages waiting on a runner's socket, RUNNER_READS at most and none begun
        after ``budget`` (monotonic): each may take READ_STALL to come whole, and a task that
        writes to its runner's socket without end must not hold the loop. ``waiting``: poll
        said one is there. Also how the read ended: "all" (nothing left), "more" (cut short),
        "closed", or "broken" with the reason."""
        written: list[tuple[dict[str, Any], list[Any]]] = []
        for count in range(RUNNER_READS):
            if count or not waiting:
                if runner.control is None or not runner.has_message():
                    return written, "all", ""
                if time.monotonic() > budget:
                    return written, "more", ""
            try:
                written.append(runner.receive())
            except PipeClosed:
                return written, "closed", ""
            except BadRunnerMessage as exc:
                return written, "broken", str(exc)
        return written, "more", ""

    def _handle_written(self, runner: Runner, written: list[tuple[dict[str, Any], list[Any]]],
                        now: float) -> None:
        """Messages a runner wrote, read together. What their tasks printed goes out before
        their results, so the caller sees it first: one read of each pipe for them all (the
        markers tell whose each piece is), not one per result. Then each result, in order,
        until one makes the agent restart the runner: what the old one wrote is gone with it."""
        proc = runner.proc
        if any(not header.get("ready") for header, _ in written):
            for stream in ("out", "err"):
                for _ in range(64):  # at most 4 MiB per stream here; the rest follows as usual
                    if not self._on_runner_output(runner, stream) or runner.drained[stream]:
                        break
        for header, frames in written:
            if runner.proc is not proc:
                return
            self._on_runner_header(runner, header, frames, now)

    def _on_runner_header(self, runner: Runner, header: dict[str, Any], frames: list[Any],
                          now: float) -> None:
        if header.get("ready"):
            runner.ready = True
            if runner.failed_starts >= RETRY_FAILED_STARTS:
                self.say(f"[worker] runner {runner.slot} started again")
            runner.failed_starts = 0
            if self._handed_back_down and not self.draining:
                # What was handed back while no runner could start used up the grant it came
                # under: granted again, or the coordinator would send this worker nothing.
                self.granted += self._handed_back_down
                self._handed_back_down = 0
                self.send_credit()
            return
        task = runner.task
        restart = header.get("restart")
        if type(restart) is str and restart:
            # The runner's process is not what a task may start in any more (it exits after
            # this result): the task's result counts, and what was handed ahead goes back to
            # the front of the queue, never started.
            log.info("restarting runner %d after task %s: %s", runner.slot,
                     task.task_id if task is not None else "-", for_terminal(restart[:500]))
            runner.task = None
            if task is not None:
                self._report(task, checked_result(header), frames, now)
            self._restart(runner)
            return
        following = runner.finished()
        if following is not None:
            _started(following.task, now)  # it began as the runner wrote this result
        if task is not None:
            self._report(task, checked_result(header), frames, now)
        if runner.restart_after_task:
            self._restart(runner)  # the task handed ahead was dropped: it must not run on

    def _on_runner_output(self, runner: Runner, stream: str) -> bool:
        """Forward what the runner printed; False when there was nothing to read."""
        pieces = runner.read_stream(stream)
        for task, chunk in pieces or ():
            if task is None:
                log.debug("runner %d printed outside a task: %r", runner.slot, chunk[:200])
                continue
            if self.welcomed:
                self.link.post(encode(Command.OUTPUT, {"task": task.task_id, "stream": stream},
                                      [chunk]))
        return pieces is not None

    def _check_runners(self, now: float) -> None:
        for runner in self.runners:
            if runner.dying:
                runner.reap_dying()  # killed ones that took their time: collected once gone
            if runner.start_at is not None:  # waiting out its back-off after failed starts
                if time.monotonic() >= runner.start_at:
                    runner.start_at = None
                    runner.start()
                continue
            dead = runner.proc is not None and runner.proc.poll() is not None
            if runner.control is not None and (dead or _late(runner.task, now)):
                # Its results may already be in the socket, unread (the agent reads a runner
                # busy with tiny tasks once a millisecond): then the task that died or ran late
                # is a later one than we thought, and the ones before it finished.
                read_all = self._read_written(runner, now, dead=dead)
                dead = runner.proc is not None and runner.proc.poll() is not None  # restarted?
                if not read_all and not dead and runner.task is not None \
                        and runner.task.deadline is not None \
                        and now < runner.task.deadline + LATE_GRACE:
                    continue  # results still waiting: read on before it is ruled late
            if dead:
                self._runner_died(runner, now)
            elif runner.task is not None and _late(runner.task, now):
                task, runner.task = runner.task, None
                self._restart(runner)
                self.drop_unsent(task)
                timeout = float(task.header.get("timeout", 0))
                self._report(task, {"status": ResultStatus.TIMEOUT.value, "error": {
                    "type": "gpumesh.TaskTimeout",
                    "message": f"the task ran past its timeout of {timeout:g}s and was stopped",
                    "traceback": ""}}, [], now)

    def _read_written(self, runner: Runner, now: float, *, dead: bool) -> bool:
        """Handle the messages a runner wrote before it died or ran late, without waiting
        (until a message makes the agent restart it: the new runner is not the one read).
        Whether all that was waiting was read: from a live runner only RUNNER_READ_TIME's
        worth; from a dead one all (it writes no more), so no result it wrote is lost. Its
        death, if the socket closed, is the caller's to handle."""
        proc = runner.proc
        budget = math.inf if dead else time.monotonic() + RUNNER_READ_TIME
        written, ended, why = self._read_runner(runner, budget)
        self._handle_written(runner, written, now)
        if ended == "broken" and runner.proc is proc:
            self._runner_broke(runner, why, now)
        return ended == "all"

    def _runner_broke(self, runner: Runner, why: str, now: float) -> None:
        """The runner wrote what cannot be read: it is alive but out of step, so it is killed,
        its task reported crashed (and retried elsewhere), and a new one started."""
        log.warning("runner %d wrote an unreadable message (%s): restarting it", runner.slot, why)
        runner.kill()
        self._runner_died(runner, now, what=(
            f"the runner wrote an unreadable message on its control socket ({why}); the "
            "task's code may have written to that socket"))

    def _runner_died(self, runner: Runner, now: float, what: str = "") -> None:
        # What it printed last goes to its task's client, and into the diagnosis: a bounded
        # number of reads, since a process it started may live on and print without end.
        for stream in ("out", "err"):
            for _ in range(DYING_READS):
                if runner.proc is None or not self._on_runner_output(runner, stream):
                    break
        task, runner.task = runner.task, None
        self._requeue_front(runner.take_back())  # handed ahead, never started
        # One killed already and still going (a runner that broke): not waited for again.
        code = None if runner.proc in runner.dying else runner.reap(timeout=DYING_GRACE)
        if code is not None:
            # What its task started (a pool, a `yes`) dies with it. Only once it is reaped: its
            # socket closes as it exits, a moment before poll() can say it has.
            runner.kill_group()
        if code is None and runner.proc is not None and runner.proc not in runner.dying:
            # Its socket closed (its task's code closed it?) but it runs on: it can take no
            # more work, and must not keep running beside its replacement, holding a GPU.
            runner.kill()
            what = what or (f"the runner's control socket closed, and the runner had not exited "
                            f"{DYING_GRACE:g} s later (killed)")
        diagnosis = runner.diagnosis(code, what, task)
        if task is not None:
            self.drop_unsent(task)
            log.warning("task %s: %s", task.task_id, diagnosis)
            self._report(task, {"status": ResultStatus.CRASHED.value, "diagnosis": diagnosis}, [], now)
        elif not runner.ready:
            runner.failed_starts += 1
            if runner.failed_starts >= RETRY_FAILED_STARTS:
                # Started in a loop it would take a core, and never run what waits for it.
                delay = min(START_BACKOFF * 2 ** (runner.failed_starts - RETRY_FAILED_STARTS),
                            START_BACKOFF_MAX)
                runner.start_at = time.monotonic() + delay
                if runner.failed_starts == RETRY_FAILED_STARTS:
                    self.say(f"[worker] runner {runner.slot} cannot start: {diagnosis} (is a "
                             "file in this folder named as a module Python imports? start "
                             "join from another folder); trying again, less and less often")
                else:
                    log.warning("runner %d failed to start again: %s", runner.slot, diagnosis)
                if self._runners_down():
                    self._fail_queued(diagnosis)
                return
            log.warning("runner %d failed to start: %s", runner.slot, diagnosis)
        runner.start()

    def _runners_down(self) -> bool:
        """Every runner waits out its start back-off: no task can start here for now."""
        return all(r.start_at is not None for r in self.runners)

    def _hand_back_while_down(self, leases: list[int]) -> None:
        """No runner of this worker can start: these go back to the coordinator unstarted (no
        attempt charged; another worker runs them), rather than wait here, their leases renewed,
        for a runner that never comes. Their grant is not renewed until a runner is ready, so
        the coordinator soon sends this worker nothing."""
        if leases:
            self._handed_back_down += len(leases)
            self.send_credit(release=leases)

    def _fail_queued(self, diagnosis: str) -> None:
        waiting, self.queue = list(self.queue), deque()
        log.warning("no runner of this worker can start (%s): %d waiting task(s) go back",
                    diagnosis, len(waiting))
        self._hand_back_while_down([queued.task.lease_id for queued in waiting])

    def read_finished(self, now: float) -> None:
        """Handle the results runners with tasks handed ahead wrote and the agent has not read
        yet (it reads a runner busy with tiny tasks once a millisecond): before those tasks are
        handed back, which of them ran is known."""
        for runner in self.runners:
            if runner.ahead and runner.control is not None:
                self._read_written(runner, now, dead=False)

    def drop_unsent(self, task: RunningTask) -> None:
        """A stopped task's runner may have left its result in the shared folder before it could
        say so: nothing will ever name those files, and they bear this agent's prefix, so the
        coordinator would keep them while this agent runs (gpumesh/shmowners.py)."""
        start, where = task.header.get(_SHM_START), task.header.get(_SHM_DIR)
        if isinstance(start, str) and isinstance(where, str) and where:
            folder = self.shm if self.shm is not None and str(self.shm.path) == where \
                else SharedFolder(Path(where), "")  # the coordinator moved meanwhile
            folder.remove_starting([start])

    def _report(self, task: RunningTask, header: dict[str, Any], frames: list[Any], now: float) -> None:
        elapsed = max(now - task.started, 0.0)
        ran = header.pop("ran", None)
        if isinstance(ran, float) and 0.0 <= ran <= now - task.received + 1.0:
            # The runner's own clock: a task handed ahead started before the agent saw it.
            elapsed = ran
        if not self.draining:
            self.granted += 1
            if header.get("status") == ResultStatus.OK.value:
                self._note_run_time(elapsed)
        result = {**header, "task": task.task_id, "lease": task.lease_id,
                  "elapsed": round(elapsed, 6)}
        if log.isEnabledFor(logging.DEBUG):  # -v: each task's end here
            log.debug("task %s: %s after %.3fs", task.task_id, header.get("status"), elapsed)
        if "shm" in result:
            result[_SHM_DIR] = task.header.get(_SHM_DIR, "")
        self.unacked[task.lease_id] = (result, frames)
        if self.welcomed:
            self._send_result(result, frames)

    def _send_result(self, result: dict[str, Any], frames: list[Any]) -> None:
        """A RESULT with this session's grant: its big frames left in the shared-memory folder
        when the coordinator shares this machine, the rest split to the frame limit."""
        header = {**result, "granted": self.granted}
        shm_dir = header.pop(_SHM_DIR, None)
        if "shm" in header and (self.shm is None or str(self.shm.path) != shm_dir):
            # Left in a folder this coordinator does not share (it moved): send the bytes.
            try:
                frames = SharedFolder(Path(str(shm_dir)), "").resolve(
                    frames, parse_refs(header.pop("shm"), len(frames)))
            except (ValueError, OSError) as exc:
                # Gone with that folder, or this process cannot read it now (SharedFrameBusy:
                # short of descriptors or memory): either way the task must run again.
                header = {key: header[key] for key in ("task", "lease", "granted", "elapsed")
                          if key in header}
                header.update(status=ResultStatus.CRASHED.value,
                              diagnosis=f"its result was lost before it was sent: {exc}")
                frames = []
        pickled = header.get("encoding", ResultEncoding.PICKLE.value) == ResultEncoding.PICKLE.value
        if self.shm is not None and pickled and frames and "shm" not in header:
            frames, refs = self.shm.share(frames)
            if refs:
                header["shm"] = [list(ref) for ref in refs]
                if result.get("lease") in self.unacked:
                    # Sent again after a reconnect, it names these same files: a copy of
                    # its own each time would stay in memory for as long as this agent runs
                    # (its frames are this agent's: gpumesh/shmowners.py).
                    self.unacked[result["lease"]] = (
                        {**result, "shm": header["shm"], _SHM_DIR: str(self.shm.path)}, frames)
        frames, layout = serialize.split_frames(frames, self.settings.limits.chunk_bytes)
        if layout is not None:
            header["split"] = layout
        self.link.post(encode(Command.RESULT, header, frames))

    # ----------------------------------------------------------------- timers

    def _held_tasks(self) -> list[RunningTask]:
        """Running, handed ahead or queued: what this worker holds a lease for."""
        tasks = [r.task for r in self.runners if r.task is not None]
        tasks += [queued.task for r in self.runners for queued, _ in r.ahead]
        return tasks + [q.task for q in self.queue]

    def _held_leases(self) -> list[int]:
        return [task.lease_id for task in self._held_tasks()]


def _lease_ids(value: Any) -> list[int]:
    """The lease ids of a list the coordinator sent; anything else in it is left out, so one
    bad item cannot stop the rest of a WELCOME or a CANCEL."""
    if type(value) is not list:
        return []
    return [item for item in value if type(item) is int and 0 <= item <= INT64]


def _running_for(runner: Runner, now: float) -> float:
    return now - runner.task.started if runner.task is not None else 0.0


def _late(task: RunningTask | None, now: float) -> bool:
    return task is not None and task.deadline is not None and now >= task.deadline


def _started(task: RunningTask, now: float) -> None:
    task.started = now
    timeout = task.header.get("timeout")
    if isinstance(timeout, (int, float)) and timeout > 0:
        # The clock starts when the task runs: time queued behind others does not count.
        task.deadline = now + float(timeout)


def _size(value: Any) -> int:
    """A GPU's VRAM from the inventory (bytes, or a size such as 40GB); 0 when unreadable."""
    try:
        return parse_size(value) if value is not None else 0
    except ValueError:
        return 0


def _needs(need: Any) -> str:
    """A TASK's ``need`` in words, for a diagnosis (only the fields it may carry)."""
    if not isinstance(need, dict):
        return "?"
    said = []
    if isinstance(need.get("gpu"), str):
        said.append(f"gpu={for_terminal(need['gpu'][:64])}")
    if isinstance(need.get("vram"), int) and not isinstance(need.get("vram"), bool):
        said.append(f"vram={need['vram'] / 1e9:.1f}GB")
    return ", ".join(said) or "a GPU"


def visible_device(env: dict[str, str], index: int) -> str:
    """What CUDA_VISIBLE_DEVICES names torch's device ``index`` as, for a runner: torch numbers
    the devices this process sees, so where the owner started the worker with its own list
    (``CUDA_VISIBLE_DEVICES=2,3 gpumesh join``: indexes, UUIDs or MIG ids), index 0 is that
    list's first entry, not physical GPU 0."""
    given = [part.strip() for part in env.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    given = [part for part in given if part]
    if "CUDA_VISIBLE_DEVICES" in env and 0 <= index < len(given):
        return given[index]
    return str(index)


def version_notes(info: dict[str, Any], welcome: dict[str, Any]) -> list[str]:
    """What a joining worker should know of how it differs from its coordinator: another
    Python means functions pickled there cannot load here; another gpumesh (same protocol)
    works but should be brought level."""
    notes = []
    mine, theirs = str(info.get("python", "")), welcome.get("python")
    if isinstance(theirs, str) and re.fullmatch(r"\d{1,2}\.\d{1,3}", theirs) and mine \
            and theirs != mine:
        notes.append(
            f"[worker] this machine runs Python {mine} and the coordinator Python {theirs}: "
            f"functions pickled on Python {theirs} cannot load here, so this worker takes "
            "scripts and plain top-level functions (sent as source) only. To take every "
            f"task, join with Python {theirs} (a venv made with python{theirs}, then "
            "'pip install gpumesh').")
    version = welcome.get("gpumesh")
    if isinstance(version, str) and re.fullmatch(r"[0-9A-Za-z.+-]{1,32}", version) \
            and version != __version__:
        notes.append(f"[worker] gpumesh {__version__} here and {version} on the coordinator: "
                     f"they speak the same protocol, but install gpumesh {version} here when "
                     "you can")
    return notes
