"""The joblib backend ``"gpumesh"``: ``with parallel_config(backend="gpumesh")`` runs joblib's
batches (every scikit-learn ``n_jobs``) as mesh tasks through the futures engine.

Registered when joblib is imported in a process that imported gpumesh (``gpumesh/__init__``
watches for it), workers included, so nested ``Parallel`` calls that name the backend resolve.
Batching: joblib's auto-batching, tuned for a round trip across machines (a batch aims at 0.5 to
5 s of work). When a task fails, joblib aborts: every batch still pending or running on the mesh
is cancelled there. Without a reachable coordinator it falls back to loky, saying so on stderr.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import weakref
from typing import Any

from joblib._parallel_backends import (  # joblib's documented extension point lives here
    AutoBatchingMixin,
    FallbackToBackend,
    LokyBackend,
    ParallelBackendBase,
    SequentialBackend,
)

from ..config import env_flag
from ..errors import ConfigError, MeshError
from .api import GPUMesh, new_job_id
from .console import say_line
from .tasks import TaskOptions

NAME = "gpumesh"
# joblib calls a backend's submit() since 1.5; before, apply_async() with other callbacks.
JOBLIB_NEEDED = (1, 5)

SLOTS_FRESH = 1.0  # seconds a mesh's slot count is reused
MESH_N_JOBS_LEAST = 2  # what n_jobs=-1 (or None) is at least: 1 would mean "run it here"
_SLOTS: weakref.WeakKeyDictionary[GPUMesh, tuple[float, int]] = weakref.WeakKeyDictionary()

class MeshBackend(AutoBatchingMixin, ParallelBackendBase):
    """``MeshBackend(mesh=None, options=None)``: ``mesh`` a ``GPUMesh`` (default: the saved
    connection, or ``GPUMESH_URL``/``GPUMESH_TOKEN``), ``options`` per-task ``TaskOptions``."""

    MIN_IDEAL_BATCH_DURATION = 0.5  # a round trip through the coordinator, hidden under work
    MAX_IDEAL_BATCH_DURATION = 5
    supports_retrieve_callback = True
    supports_timeout = True
    supports_return_generator = True
    uses_threads = False
    supports_sharedmem = False
    default_n_jobs = -1

    def __init__(self, nesting_level: int | None = None, inner_max_num_threads: int | None = None,
                 mesh: GPUMesh | None = None, options: TaskOptions | None = None,
                 **kwargs: Any) -> None:
        super().__init__(nesting_level=nesting_level,
                         inner_max_num_threads=inner_max_num_threads, **kwargs)
        self.mesh = mesh
        self.options = options or TaskOptions()
        self._futures: set[concurrent.futures.Future[Any]] = set()
        self._lock = threading.Lock()
        self._aborted = False  # this Parallel call failed: a batch sent now is cancelled
        self._job = ""

    def __reduce__(self) -> Any:
        # A nested backend travels to workers inside joblib's batches: without the connection.
        return (MeshBackend, (self.nesting_level, self.inner_max_num_threads, None, self.options))

    def _connected_mesh(self) -> GPUMesh | None:
        if self.mesh is None:
            from .decorators import mesh as default

            if _local_only():
                return None  # GPUMESH_LOCAL=1 (inside a task, say): as @mesh, it runs here
            self.mesh = default._source.mesh()
        if self.mesh is None or not self.mesh.connect():
            return None
        return self.mesh

    def effective_n_jobs(self, n_jobs: int | None) -> int:
        if n_jobs == 0:
            raise ValueError("n_jobs == 0 in Parallel has no meaning")
        if n_jobs is not None and n_jobs > 0:
            return n_jobs
        slots = self._slots()
        # -1 is every slot of the mesh, -2 all but one, as joblib counts CPUs. Never 1: joblib
        # runs n_jobs=1 in this process, so a mesh of one slot (or none joined yet) would get
        # nothing at all; the coordinator queues what its slots cannot start yet.
        return max(slots + 1 + (n_jobs if n_jobs is not None else -1), MESH_N_JOBS_LEAST)

    def _slots(self) -> int:
        """The mesh's alive slots, asked at most once a second: joblib calls
        ``effective_n_jobs`` many times per ``Parallel`` call, and a query each time ran into
        the coordinator's limit of 20 requests a second per client."""
        mesh = self._connected_mesh()
        if mesh is None:
            return 1
        now = time.monotonic()
        known = _SLOTS.get(mesh)
        if known is not None and now - known[0] < SLOTS_FRESH:
            return known[1]
        try:
            workers = mesh.workers()
        except MeshError:
            # The coordinator did not answer in time (or went): joblib and scikit-learn ask
            # this to size their work, not to run it; the last count, or one, will do.
            return known[1] if known is not None else 1
        slots = sum(int(w.get("slots", 1) or 1) for w in workers if w.get("alive")) or 1
        _SLOTS[mesh] = (now, slots)
        return slots

    def configure(self, n_jobs: int = 1, parallel: Any = None, prefer: str | None = None,
                  require: str | None = None, **kwargs: Any) -> int:
        _check_joblib_version()
        if require == "sharedmem":
            # Mesh tasks share no memory with the caller: joblib then runs the call here.
            raise FallbackToBackend(SequentialBackend(nesting_level=self.nesting_level))
        mesh = self._connected_mesh()
        if mesh is None:
            why = "GPUMESH_LOCAL=1" if self.mesh is None and _local_only() else \
                "no coordinator answering"
            say_line(f"[gpumesh] joblib: {why}: running with loky on this machine")
            raise FallbackToBackend(LokyBackend(nesting_level=self.nesting_level,
                                                inner_max_num_threads=self.inner_max_num_threads))
        self.parallel = parallel
        self._job = new_job_id()
        with self._lock:
            self._aborted = False
        return self.effective_n_jobs(n_jobs)

    def start_call(self) -> None:
        """Each ``Parallel`` call (several under one ``with Parallel(...) as p``): the last
        one's abort is over."""
        super().start_call()
        with self._lock:
            self._aborted = False

    def submit(self, func: Any, callback: Any = None) -> concurrent.futures.Future[Any]:
        assert self.mesh is not None
        future: concurrent.futures.Future[Any]
        try:
            future = self.mesh.submit_calls(func, [((), {})], self.options, job=self._job,
                                            name=_job_name(func))[0]
        except Exception as exc:
            # A batch that cannot be sent (an argument that does not pickle). joblib sends
            # its later batches from the callback of an earlier one, where a raise would be
            # only logged and the batch wait forever: the error goes through its future,
            # and joblib raises it as it would a task's.
            future = concurrent.futures.Future()
            future.set_exception(exc)
        with self._lock:
            aborted = self._aborted
            if not aborted:
                self._futures.add(future)
        if aborted:
            future.cancel()  # sent as joblib aborted: nobody will collect it
        future.add_done_callback(self._forget)
        if callback is not None:
            future.add_done_callback(callback)
        return future

    def _forget(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._futures.discard(future)

    def retrieve_result_callback(self, future: concurrent.futures.Future[Any]) -> Any:
        return future.result()

    def abort_everything(self, ensure_ready: bool = True) -> None:
        """A batch failed: what is still pending or running on the mesh is cancelled there."""
        with self._lock:
            futures, self._futures = list(self._futures), set()
            self._aborted = True
        for future in futures:
            future.cancel()  # the engine sends CANCEL: pending never start, running stop

    def terminate(self) -> None:
        self.reset_batch_stats()

    def get_nested_backend(self) -> tuple[ParallelBackendBase, int | None]:
        # Inside a mesh task, a nested Parallel runs in that task: a task that waited on other
        # tasks could hold every slot of a small mesh and wait forever.
        return SequentialBackend(nesting_level=(self.nesting_level or 0) + 1), None


def _local_only() -> bool:
    return env_flag("GPUMESH_LOCAL")  # as @mesh reads it: whatever else fails to parse


def _check_joblib_version() -> None:
    import joblib

    try:
        version = tuple(int(part) for part in joblib.__version__.split(".")[:2])
    except ValueError:
        return  # a development build: assume it is recent
    if version < JOBLIB_NEEDED:
        raise ConfigError(
            f"gpumesh's joblib backend needs joblib {'.'.join(map(str, JOBLIB_NEEDED))} or "
            f"later, and this is joblib {joblib.__version__}: pip install -U joblib")


def register() -> None:
    """Register ``"gpumesh"`` with joblib (idempotent)."""
    from joblib import register_parallel_backend

    register_parallel_backend(NAME, MeshBackend)


def _job_name(batch: Any) -> str:
    """What ``gpumesh status`` calls the job: the function joblib runs (its batch holds
    ``(function, args, kwargs)`` items), as ``joblib _fit_and_score``."""
    try:
        function = batch.items[0][0]
    except (AttributeError, IndexError, TypeError, KeyError):
        return "joblib"
    inner = getattr(function, "func", function)  # functools.partial, joblib's own wrappers
    name = getattr(inner, "__qualname__", None) or type(inner).__name__
    return f"joblib {name}"
