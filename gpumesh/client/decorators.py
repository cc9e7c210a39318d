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
import inspect
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Generic, ParamSpec, TypeVar, overload

from ..config import CONFIG_FILE, Settings, env_flag, home_folder
from ..errors import ConfigError
from ..scheduler import Requirements
from .api import GPUMesh
from .console import say_line
from .engine import TaskFuture
from .tasks import Call, TaskOptions, plan_calls

P = ParamSpec("P")
R = TypeVar("R")


def _ran_here(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> TaskFuture:
    """``fn(*args, **kwargs)`` run now, in this process, as a finished future (awaitable, as a
    mesh task's is); its exception, if it raised, is the future's."""
    future = TaskFuture()
    try:
        future.set_result(fn(*args, **kwargs))
    except BaseException as exc:  # as a task's error: raised by .result()
        future.set_exception(exc)
    return future


class InPlaceFunction:
    """A mesh function as it arrives on a worker inside a task's pickle: calls, ``.map``,
    ``.submit``, ``.aio`` and ``.amap`` run in place, in the task's own process. A task that
    sent its callees back to the mesh would wait for slots it may itself be holding."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn

    def __repr__(self) -> str:
        return f"<mesh function {getattr(self.fn, '__qualname__', self.fn)!r}, run in place>"

    def __reduce__(self) -> tuple[Any, ...]:
        return (InPlaceFunction, (self.fn,))

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else InPlaceFunction(functools.partial(self.fn, obj))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def map(self, items: Iterable[Any]) -> list[Any]:
        return _calls_here(self.fn, plan_calls(self.fn, items, TaskOptions()))

    def submit(self, *args: Any, **kwargs: Any) -> TaskFuture:
        return _ran_here(self.fn, args, kwargs)

    async def aio(self, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(self.fn, *args, **kwargs)

    async def amap(self, items: Iterable[Any]) -> AsyncIterator[tuple[int, Any]]:
        async for done in _calls_here_async(self.fn, plan_calls(self.fn, items, TaskOptions())):
            yield done

    def to(self, device: str) -> InPlaceFunction:
        return self


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
        # Shipped to a worker (say, called from another mesh function), it runs in place: code
        # already running on the mesh runs its callees there, .map and .submit included.
        return (InPlaceFunction, (self.fn,))

    def __copy__(self) -> MeshFunction[P, R]:
        return self  # as a function copies: itself, decorated still

    def __deepcopy__(self, memo: dict[int, Any]) -> MeshFunction[P, R]:
        return self

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        # A method: bound, with .map and .submit of its own (a partial of self had neither).
        return self if obj is None else MeshFunction(
            functools.partial(self.fn, obj), self._source, self.options, mesh_only=self.mesh_only)

    def _mesh(self) -> GPUMesh | None:
        """The connected mesh to use for this call, or None for the local path."""
        # Read on its own: the escape hatch works when another GPUMESH_* variable does not
        # parse (every call then raised the mesh settings' ConfigError).
        if env_flag("GPUMESH_LOCAL"):
            self._say("GPUMESH_LOCAL=1: running locally")
            return None
        mesh = self._source.mesh()
        if mesh is None:
            self._say("no coordinator configured: running locally")
            return None
        if not mesh.connect():
            text = f"no coordinator answering at {mesh.endpoint}: running locally"
            if not mesh.quiet and self._source.first_time_unreachable(str(mesh.endpoint)):
                # Said once whatever GPUMESH_VERBOSE: a mesh was configured, and a typo'd port
                # ran everything here without a word, the user sure the mesh did the work.
                say_line(f"[gpumesh] {text} (GPUMESH_LOCAL=1 to mean it; GPUMESH_VERBOSE=1 "
                         "says which path each call takes)")
            else:
                self._say(text)
            return None
        if not self.mesh_only and not self._source.has_worker(mesh):
            self._say(f"no worker connected to {mesh.endpoint} within "
                      f"{mesh.connect_timeout:g}s: running locally (mesh_only=True waits)")
            return None
        return mesh

    def _say(self, text: str) -> None:
        try:
            verbose = self._source.settings().verbose
        except ConfigError:  # a variable that does not parse: said when the mesh is needed
            verbose = env_flag("GPUMESH_VERBOSE")
        if verbose:
            # Not self.__name__: update_wrapper copies it only when the callable has one.
            name = getattr(self.fn, "__name__", repr(self.fn))
            say_line(f"[gpumesh] {name}: {text}")  # whole: lines of several threads ran together

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
            return _calls_here(self.fn, calls)
        self._say(f"{len(calls)} tasks sent to the mesh at {mesh.endpoint}")
        futures = mesh.submit_calls(self.fn, calls, self.options)
        return mesh.gather(futures, fallback=lambda i: self.fn(*calls[i][0], **calls[i][1]))

    async def aio(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """``await fn.aio(...)``: one task, awaited. Cancelling the awaiting asyncio task cancels
        the mesh task. Without a mesh, the call runs locally in a thread."""
        mesh = await asyncio.to_thread(self._mesh)
        if mesh is None:
            return await asyncio.to_thread(self.fn, *args, **kwargs)
        # Pickling the arguments (an array, a tensor) and a reconnect's wait happen off the
        # event loop, as in amap: the loop's other tasks go on meanwhile.
        future = (await _off_loop(mesh.submit_calls, self.fn, [(args, kwargs)], self.options))[0]
        return await asyncio.wrap_future(future)

    async def amap(self, items: Iterable[Any]) -> AsyncIterator[tuple[int, R]]:
        """``async for index, result in fn.amap(items)``: results as they finish, with their
        index. Leaving the loop early, or cancelling it, cancels what is left on the mesh."""
        calls = plan_calls(self.fn, items, self.options)
        mesh = await asyncio.to_thread(self._mesh)
        if mesh is None:
            async for done in _calls_here_async(self.fn, calls):
                yield done
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
        """Start one task and return its future (needs a reachable coordinator). With
        ``GPUMESH_LOCAL=1`` (inside a task, say) the call runs here and the future is done."""
        if env_flag("GPUMESH_LOCAL"):
            self._say("GPUMESH_LOCAL=1: running locally")
            return _ran_here(self.fn, args, kwargs)
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
        # What the last failed resolution saw: tried again once that changed.
        self._unresolved: tuple[Any, ...] | None = None
        self._worker_deadline: float | None = None
        self._unreachable_told: set[str] = set()

    def first_time_unreachable(self, endpoint: str) -> bool:
        """Whether this is the first call to find ``endpoint`` not answering (then it is told)."""
        with self._lock:
            first = endpoint not in self._unreachable_told
            self._unreachable_told.add(endpoint)
            return first

    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = Settings.from_env()
        return self._settings

    def mesh(self) -> GPUMesh | None:
        with self._lock:
            if self._resolved:
                return self._mesh
            seen = _configuration()
            if seen == self._unresolved:
                return None  # as when last tried: running locally costs no second look
            self._settings = None  # read the environment again: it changed, or never read
            settings = self.settings()  # a variable that does not parse is the user's to hear
            try:
                self._mesh = GPUMesh(settings=settings)
            except ConfigError:
                # Nothing configured: calls run locally until `gpumesh serve` or `join` saves
                # a connection, or GPUMESH_URL/GPUMESH_TOKEN are set (a notebook's next cell).
                self._unresolved = seen
                return None
            self._resolved = True
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


def _calls_here(fn: Callable[..., Any], calls: Sequence[Call]) -> list[Any]:
    """``.map``'s calls run in this process, in order (no mesh, or inside a task)."""
    return [fn(*args, **kwargs) for args, kwargs, _ in calls]


async def _calls_here_async(fn: Callable[..., Any], calls: Sequence[Call]
                            ) -> AsyncIterator[tuple[int, Any]]:
    """``.amap``'s calls run in this process, one at a time in a thread, with their index."""
    for index, (args, kwargs, _) in enumerate(calls):
        yield index, await asyncio.to_thread(fn, *args, **kwargs)


def _configuration() -> tuple[Any, ...]:
    """What a mesh's resolution reads, cheaply: the environment's names and the saved
    connection file's identity and change time."""
    env = tuple(os.environ.get(name) for name in (
        "GPUMESH_URL", "GPUMESH_TOKEN", "GPUMESH_HOME", "GPUMESH_DISCOVERY", "HOME"))
    path = home_folder() / CONFIG_FILE
    try:
        info = path.stat()
        saved: tuple[Any, ...] = (info.st_ino, info.st_size, info.st_mtime_ns)
    except OSError:
        saved = ()
    return env, saved


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
        return _decorate(fn, self._source, options)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            # hasattr(mesh, "__wrapped__"), doctest, mock and copy ask for these: not the
            # mesh's, and never worth a ConfigError.
            raise AttributeError(name)
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
            return _decorate(target, self._installed or self._default, options)
        source = _source_of(target) if target is not None else (self._installed or self._default)
        return _decorate(None, source, options)


def _decorate(fn: Any, source: MeshSource, options: dict[str, Any]) -> Any:
    """``@mesh``, ``@mesh(gpu=...)`` and ``mesh(fn, gpu=...)`` alike: the options are checked
    (an unknown name is a TypeError) and kept in every form, the function given or not."""
    options = dict(options)
    only = bool(options.pop("mesh_only", False))
    opts = _options(**_defaults(options))

    def bind(f: Any) -> MeshFunction[Any, Any]:
        _check_function(f)
        return MeshFunction(f, source, opts, mesh_only=only)

    return bind if fn is None else bind(fn)


def _check_function(fn: Any) -> None:
    """What a decorator is given must be a plain synchronous function (or other callable):
    ``@mesh("A100")`` passes the string as the function, and a coroutine or generator
    function returns what cannot leave a worker, while it runs locally as written."""
    if isinstance(fn, MeshFunction):
        return
    if not callable(fn):
        raise TypeError(f"@mesh and @accelerate decorate a function, not a {type(fn).__name__} "
                        f"({fn!r}); options go by name: @mesh(gpu='A100')")
    kind = ("a coroutine function (async def)" if inspect.iscoroutinefunction(fn) else
            "an async generator function" if inspect.isasyncgenfunction(fn) else
            "a generator function" if inspect.isgeneratorfunction(fn) else None)
    if kind is not None:
        raise TypeError(
            f"{getattr(fn, '__qualname__', fn)} is {kind}: what it returns cannot leave a "
            "worker. Decorate a plain function that returns the value (a list instead of a "
            "generator); await a mesh function with fn.aio(...)")


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
