"""``@mesh`` and ``@accelerate``: a function that runs on the mesh, or locally when there is none.

Either path returns the identical value. The local path is taken when ``GPUMESH_LOCAL=1``, when
no coordinator is configured, when the configured one does not answer at call time, or when no
worker has been connected to it for the connect timeout (``GPUMESH_CONNECT_TIMEOUT``, counted
from the first call) unless the function was decorated with ``mesh_only=True``, whose calls
wait for a worker. ``GPUMESH_VERBOSE=1`` says on stderr which path each call took.

``env=["NAME", ...]`` sends the caller's values of those variables with each task (workers
otherwise give tasks only an allow-listed environment); ``env={"NAME": "value"}`` sends the
values given. A call that runs locally runs in the caller's own environment as it is.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any, Generic, ParamSpec, TypeVar, overload

from ..config import Settings
from ..errors import ConfigError
from ..scheduler import Requirements
from .api import GPUMesh
from .engine import TaskFuture
from .tasks import TaskOptions, plan_calls

P = ParamSpec("P")
R = TypeVar("R")


def _plain(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn


class MeshFunction(Generic[P, R]):
    """A function bound to a mesh. Calling it runs one task; ``.map`` runs a batch."""

    def __init__(self, fn: Callable[P, R], source: MeshSource, options: TaskOptions, *,
                 mesh_only: bool = False) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self._source = source
        self.options = options
        self.mesh_only = mesh_only

    def __repr__(self) -> str:
        return f"<mesh function {getattr(self.fn, '__qualname__', self.fn)!r}>"

    def __reduce__(self) -> tuple[Any, ...]:
        # Shipped to a worker (say, called from another mesh function), it is the plain function:
        # code already running on the mesh runs its callees in place.
        return (_plain, (self.fn,))

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else functools.partial(self, obj)

    def _mesh(self) -> GPUMesh | None:
        """The connected mesh to use for this call, or None for the local path."""
        settings = self._source.settings()
        if settings.local_only:
            self._say("GPUMESH_LOCAL=1: running locally")
            return None
        mesh = self._source.mesh()
        if mesh is None:
            self._say("no coordinator configured: running locally")
            return None
        if not mesh.connect():
            self._say(f"no coordinator answering at {mesh.endpoint}: running locally")
            return None
        if not self.mesh_only and not self._source.has_worker(mesh):
            self._say(f"no worker connected to {mesh.endpoint} within "
                      f"{mesh.connect_timeout:g}s: running locally (mesh_only=True waits)")
            return None
        return mesh

    def _say(self, text: str) -> None:
        if self._source.settings().verbose:
            # Not self.__name__: update_wrapper copies it only when the callable has one.
            name = getattr(self.fn, "__name__", repr(self.fn))
            # One write per line: print() writes the text and its newline separately, and
            # lines from calls on several threads ran together.
            sys.stderr.write(f"[gpumesh] {name}: {text}\n")

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        mesh = self._mesh()
        if mesh is None:
            return self.fn(*args, **kwargs)
        self._say(f"sent to the mesh at {mesh.endpoint}")
        futures = mesh.submit_calls(self.fn, [(args, kwargs)], self.options)
        return mesh.gather(futures, fallback=lambda _: self.fn(*args, **kwargs))[0]

    def map(self, items: Iterable[Any]) -> list[R]:
        """One task per item (a dict is keyword arguments); results in input order.

        A dict's scheduler keys (gpu, cores, memory, vram, cost) place its task.
        """
        calls = plan_calls(self.fn, items, self.options)
        mesh = self._mesh()
        if mesh is None:
            return [self.fn(*args, **kwargs) for args, kwargs, _ in calls]
        self._say(f"{len(calls)} tasks sent to the mesh at {mesh.endpoint}")
        futures = mesh.submit_calls(self.fn, calls, self.options)
        return mesh.gather(futures, fallback=lambda i: self.fn(*calls[i][0], **calls[i][1]))

    async def aio(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """``await fn.aio(...)``: one task, awaited. Cancelling the awaiting asyncio task cancels
        the mesh task. Without a mesh, the call runs locally in a thread."""
        mesh = await asyncio.to_thread(self._mesh)
        if mesh is None:
            return await asyncio.to_thread(self.fn, *args, **kwargs)
        future = mesh.submit_calls(self.fn, [(args, kwargs)], self.options)[0]
        return await asyncio.wrap_future(future)

    async def amap(self, items: Iterable[Any]) -> AsyncIterator[tuple[int, R]]:
        """``async for index, result in fn.amap(items)``: results as they finish, with their
        index. Leaving the loop early, or cancelling it, cancels what is left on the mesh."""
        calls = plan_calls(self.fn, items, self.options)
        mesh = await asyncio.to_thread(self._mesh)
        if mesh is None:
            for index, (args, kwargs, _) in enumerate(calls):
                yield index, await asyncio.to_thread(self.fn, *args, **kwargs)
            return
        # Pickling every item happens off the event loop, which would otherwise stand still
        # for it (planning the calls, done above, is cheap).
        futures = await _off_loop(mesh.submit_calls, self.fn, calls, self.options)
        loop = asyncio.get_running_loop()
        finished: asyncio.Queue[int] = asyncio.Queue()

        def tell(index: int) -> Callable[[Any], None]:
            def done(_: Any) -> None:
                try:
                    loop.call_soon_threadsafe(finished.put_nowait, index)
                except RuntimeError:
                    pass  # the loop is closed: nobody iterates any more
            return done

        # One callback per future and a queue, not asyncio.wait over everything still out
        # after each result: that is quadratic in the number of items.
        for index, future in enumerate(futures):
            future.add_done_callback(tell(index))
        try:
            for _ in range(len(futures)):
                index = await finished.get()
                future = futures[index]
                if future.cancelled():
                    raise asyncio.CancelledError(f"task {index} of the amap was cancelled")
                yield index, future.result()
        finally:
            for future in futures:
                future.cancel()

    def submit(self, *args: P.args, **kwargs: P.kwargs) -> TaskFuture:
        """Start one task and return its future (needs a reachable coordinator)."""
        mesh = self._source.mesh()
        if mesh is None:
            raise ConfigError("no coordinator configured: run 'gpumesh serve' or set GPUMESH_URL")
        return mesh.submit_calls(self.fn, [(args, kwargs)], self.options)[0]

    def to(self, device: str) -> MeshFunction[P, R]:
        """The same function bound to a device class: ``"cuda"``/``"gpu"`` or ``"cpu"``."""
        kind = device.lower().split(":")[0]
        if kind in ("cuda", "gpu", "mps"):
            req = replace(self.options.requirements, gpu=self.options.requirements.gpu or True)
        elif kind == "cpu":
            req = replace(self.options.requirements, gpu=None, vram=None)
        else:
            raise ConfigError(f"unknown device {device!r}: use 'cuda' or 'cpu'")
        return MeshFunction(self.fn, self._source, replace(self.options, requirements=req),
                            mesh_only=self.mesh_only)


class MeshSource:
    """Where a decorated function finds its mesh: a given GPUMesh, or the saved configuration."""

    def __init__(self, mesh: GPUMesh | None = None) -> None:
        self._mesh = mesh
        self._settings: Settings | None = mesh.settings if mesh is not None else None
        self._lock = threading.Lock()
        self._resolved = mesh is not None
        self._worker_deadline: float | None = None

    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = Settings.from_env()
        return self._settings

    def mesh(self) -> GPUMesh | None:
        with self._lock:
            if not self._resolved:
                self._resolved = True
                try:
                    self._mesh = GPUMesh(settings=self.settings())
                except ConfigError:
                    self._mesh = None  # nothing configured: every call runs locally
            return self._mesh

    def has_worker(self, mesh: GPUMesh) -> bool:
        """Whether a worker is connected, waiting for one until the connect timeout has passed
        since the first time this was asked. The coordinator pushes the alive workers'
        Pythons to its clients, so this costs no round trip."""
        if self._worker_deadline is None:
            self._worker_deadline = time.monotonic() + mesh.connect_timeout
        while True:
            engine = mesh._engine
            pythons = engine.worker_pythons if engine is not None else None
            if pythons is None or pythons:  # None: a coordinator that does not say
                return True
            if time.monotonic() >= self._worker_deadline:
                return False
            time.sleep(0.02)


def _options(gpu: str | bool | None, cores: int | None, memory: str | int | None,
             vram: str | int | None, timeout: float | None, max_attempts: int, priority: int,
             cost: float, env: Iterable[str] | Mapping[str, str] | None) -> TaskOptions:
    req = Requirements.from_mapping({"gpu": gpu, "cores": cores, "memory": memory, "vram": vram})
    return TaskOptions(timeout=timeout, max_attempts=max_attempts, priority=priority, cost=cost,
                       requirements=req, env=env)


class DefaultMesh:
    """``from gpumesh import mesh``: a decorator, and the GPUMesh of the saved configuration.

    ``@mesh`` decorates; ``mesh.workers()`` and the other GPUMesh methods reach the mesh that
    ``gpumesh serve``/``join`` saved (or that GPUMESH_URL/GPUMESH_TOKEN name).
    """

    def __init__(self) -> None:
        self._source = MeshSource()

    @overload
    def __call__(self, fn: Callable[P, R], /) -> MeshFunction[P, R]: ...

    @overload
    def __call__(self, fn: None = None, /, **options: Any) -> Callable[[Callable[P, R]], MeshFunction[P, R]]: ...

    def __call__(self, fn: Callable[P, R] | None = None, /, **options: Any) -> Any:
        if fn is None:
            only = bool(options.pop("mesh_only", False))
            return lambda f: MeshFunction(f, self._source, _options(**_defaults(options)),
                                          mesh_only=only)
        return MeshFunction(fn, self._source, TaskOptions())

    def __getattr__(self, name: str) -> Any:
        mesh = self._source.mesh()
        if mesh is None:
            raise ConfigError(
                "no coordinator configured: run 'gpumesh serve' (or 'gpumesh join') on this "
                "machine, or set GPUMESH_URL and GPUMESH_TOKEN"
            )
        return getattr(mesh, name)

    def __repr__(self) -> str:
        return "<gpumesh default mesh (saved configuration)>"


def _defaults(options: dict[str, Any]) -> dict[str, Any]:
    known = {"gpu": None, "cores": None, "memory": None, "vram": None, "timeout": None,
             "max_attempts": 3, "priority": 0, "cost": 1.0, "env": None}
    unknown = set(options) - set(known)
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; known: {sorted(known)}")
    return {**known, **options}


class Accelerate:
    """``@accelerate(mesh, gpu=..., cores=..., memory=..., timeout=...)``, or bare ``@accelerate``
    after ``accelerate.install(mesh)`` (the saved configuration's mesh before that)."""

    def __init__(self) -> None:
        self._installed: MeshSource | None = None
        self._default = MeshSource()

    def install(self, mesh: GPUMesh | DefaultMesh) -> None:
        """Make bare ``@accelerate`` use ``mesh``."""
        self._installed = _source_of(mesh)

    def __call__(self, target: Any = None, /, **options: Any) -> Any:
        if callable(target) and not isinstance(target, (GPUMesh, DefaultMesh)):
            return MeshFunction(target, self._installed or self._default, TaskOptions())
        source = _source_of(target) if target is not None else (self._installed or self._default)
        only = bool(options.pop("mesh_only", False))
        opts = _options(**_defaults(options))
        return lambda fn: MeshFunction(fn, source, opts, mesh_only=only)


def _source_of(mesh: GPUMesh | DefaultMesh) -> MeshSource:
    if isinstance(mesh, DefaultMesh):
        return mesh._source
    if isinstance(mesh, GPUMesh):
        return MeshSource(mesh)
    raise TypeError(f"expected a GPUMesh, got {type(mesh).__name__}")


accelerate = Accelerate()
mesh = DefaultMesh()


async def _off_loop(submit: Callable[..., list[TaskFuture]], *args: Any) -> list[TaskFuture]:
    """``submit(*args)`` in a thread, awaited. Cancelled meanwhile, the tasks it sent are
    cancelled as soon as it returns: nobody is left to collect them."""
    sending = asyncio.ensure_future(asyncio.to_thread(submit, *args))
    try:
        return await asyncio.shield(sending)
    except asyncio.CancelledError:
        def cancel_sent(done: asyncio.Future[list[TaskFuture]]) -> None:
            if not done.cancelled() and done.exception() is None:
                for future in done.result():
                    future.cancel()
        sending.add_done_callback(cancel_sent)
        raise
