"""Shared fixtures: real coordinator and worker processes on loopback, in temporary state."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumesh.client import GPUMesh
from gpumesh.client.launch import CoordinatorHandle, ProcessHandle, start_coordinator, start_worker
from gpumesh.config import Settings

# Network safety (TESTING.md): zeroconf in the root namespace only ever on loopback. Every
# process a test starts inherits this; tests in network namespaces may choose otherwise.
os.environ["GPUMESH_DISCOVERY_INTERFACES"] = "127.0.0.1"

@pytest.fixture(autouse=True)
def _gpumesh_logging_as_found() -> Iterator[None]:
    """An in-process CLI call (CliRunner) configures the ``gpumesh`` logger as a command would:
    its own stderr handler and ``propagate = False``. Left so, every later test's ``caplog`` sees
    nothing from gpumesh, so each test gets the logger and the CLI's log flags back as found."""
    from gpumesh.cli import output

    logger = logging.getLogger("gpumesh")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    flags = list(output._flags)
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate
    output._flags[:] = flags


@pytest.fixture(autouse=True)
def _default_mesh_forgotten() -> Iterator[None]:
    """``@mesh`` without a mesh, and joblib's ``backend="gpumesh"``, connect the process-wide
    default mesh from the environment a test set. Left connected, it keeps calling a coordinator
    that the test stopped, reconnecting in its thread for the rest of the run (and drawing its
    backoff jitter meanwhile), so each test leaves it as it found it: a mesh it connected is
    closed, and the settings it read are forgotten."""
    from gpumesh.client import decorators

    fields = ("_mesh", "_settings", "_resolved", "_unresolved", "_worker_deadline")
    sources = (decorators.mesh._source, decorators.accelerate._default)
    before = [tuple(getattr(source, name) for name in fields) for source in sources]
    yield
    for source, found in zip(sources, before, strict=True):
        connected = source._mesh
        try:
            if connected is not None and connected is not found[0]:
                connected.close()
        finally:
            for name, value in zip(fields, found, strict=True):
                setattr(source, name, value)


# Fast timing so failure detection takes seconds, not tens of seconds.
FAST = {
    "GPUMESH_DISCOVERY_INTERFACES": "127.0.0.1",
    "GPUMESH_HEARTBEAT": "0.2",
    "GPUMESH_LEASE_TTL": "2",
    "GPUMESH_RESTORE_GRACE": "1.5",
    "GPUMESH_PENDING_TIMEOUT": "3",
    "GPUMESH_CONNECT_TIMEOUT": "5",
    "GPUMESH_RECONNECT_GRACE": "60",
}


def poll_until(condition: Callable[[], object], timeout: float) -> object | None:
    """Poll until ``condition()`` is truthy and return its value; None at the deadline (for
    waits whose end without it is an outcome of its own, not a failure)."""
    deadline = time.time() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.time() >= deadline:
            return None
        time.sleep(0.05)


def wait_for(condition: Callable[[], object], timeout: float = 15.0, what: str = "condition") -> object:
    """Poll until ``condition()`` is truthy; fail the test with ``what`` at the deadline."""
    value = poll_until(condition, timeout)
    if value is None:
        pytest.fail(f"timed out after {timeout}s waiting for {what}")
    return value


@contextlib.contextmanager
def user_script(script: Path, args: list[str], env: dict[str, str]
                ) -> Iterator[subprocess.Popen[str]]:
    """A user's script run as ``python SCRIPT ARGS`` in a process group of its own, its output
    piped as text; killed with whatever it started if it is still running at the end."""
    proc = subprocess.Popen([sys.executable, str(script), *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


class Mesh:
    """A coordinator plus workers started for one test, all torn down at its end."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.token = secrets.token_urlsafe(32)
        # Workers must import the test modules to unpickle functions defined in them, as any
        # worker needs the modules a task's function comes from.
        tests = Path(__file__).parent
        path = [str(tests), *(str(d) for d in sorted(tests.iterdir()) if d.is_dir()),
                os.environ.get("PYTHONPATH", "")]
        self.env = {**FAST, "GPUMESH_HOME": str(home), "PYTHONPATH": os.pathsep.join(filter(None, path))}
        self.handles: list[ProcessHandle] = []
        self.clients: list[GPUMesh] = []
        self.coordinator: CoordinatorHandle | None = None
        self.db = str(home / "journal.db")

    @property
    def settings(self) -> Settings:
        return Settings.from_env({**os.environ, **self.env})

    def start_coordinator(self, port: int = 0, **options: object) -> CoordinatorHandle:
        options.setdefault("self_worker", False)
        handle = start_coordinator(port=port, token=self.token, home=str(self.home), env=self.env,
                                   db=self.db, **options)  # type: ignore[arg-type]
        self.coordinator = handle
        self.handles.append(handle)
        return handle

    def add_worker(self, slots: int = 1, env: dict[str, str] | None = None,
                   token: str | None = None, **options: object) -> ProcessHandle:
        assert self.coordinator is not None
        handle = start_worker(self.coordinator.url, token=token or self.token, slots=slots,
                              home=str(self.home), env={**self.env, **(env or {})},
                              **options)  # type: ignore[arg-type]
        self.handles.append(handle)
        return handle

    def client(self, token: str | None = None, url: str | None = None) -> GPUMesh:
        assert self.coordinator is not None
        client = GPUMesh(url or self.coordinator.url, token or self.token, quiet=True,
                         settings=self.settings)
        self.clients.append(client)
        return client

    def wait_workers(self, count: int, client: GPUMesh | None = None) -> list[dict]:
        client = client or self.client()
        return wait_for(lambda: (lambda ws: ws if len(ws) >= count else None)(
            [w for w in client.workers() if w["alive"]]), what=f"{count} alive workers")  # type: ignore[return-value]

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for handle in reversed(self.handles):
            handle.stop(timeout=5)


@pytest.fixture
def mesh_env(tmp_path: Path) -> Iterator[Mesh]:
    env = Mesh(tmp_path)
    try:
        yield env
    finally:
        env.close()


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A coordinator's shared-memory folder (gpumesh.sharedmem), made under this test's
    temporary path."""
    from gpumesh.sharedmem import SharedFolder

    monkeypatch.setattr("gpumesh.sharedmem._base", lambda: tmp_path)
    made = SharedFolder.create("k")
    assert made is not None
    yield made
    made.close()


def require(module: str):  # type: ignore[no-untyped-def]
    """Import an optional dependency: skip when missing locally, fail under CI (CI installs it)."""
    if os.environ.get("CI", "").lower() == "true":
        return __import__(module)
    return pytest.importorskip(module)
