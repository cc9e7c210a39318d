"""gpumesh as a user runs it: ``gpumesh serve --no-self-worker`` and ``gpumesh join --slots 1``
processes on loopback, a ``GPUMesh`` client in this process.

Each run gets a fresh GPUMESH_HOME in a temporary folder and a generated token, handed to the
children in their environment (never on a command line, where ``ps`` shows it).
"""

from __future__ import annotations

import os
import select
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from ..procs import (
    REPO_ROOT,
    descendants,
    free_port,
    python_env,
    python_exe,
    spawn,
    stop_group,
    wait_for,
)
from .base import System

CALL_TIMEOUT = 120.0  # seconds: a broken mesh fails the measurement instead of hanging it


class Mesh:
    """A coordinator and its workers in process groups of their own, and the paths they use."""

    # Where its processes start. ``python -m`` puts this folder first on sys.path, ahead of
    # PYTHONPATH: the gpumesh it holds is the one they import (bench.ab's other tree).
    cwd: Path = REPO_ROOT

    def __init__(self, token: str, home: Path, port: int, host: str = "127.0.0.1",
                 journal: bool = True) -> None:
        self.token = token
        self.journal = journal  # False: ``serve --db :memory:`` (the journal-cost comparison)
        self.home = home
        self.port = port
        self.host = host
        self.url = f"tcp://{host}:{port}"
        self.log: IO[Any] = open(home / "processes.log", "ab")  # noqa: SIM115 - closed in stop()
        self.coordinator: Any = None
        self.workers: list[Any] = []

    @classmethod
    def fresh(cls, host: str = "127.0.0.1", journal: bool = True) -> Mesh:
        from gpumesh.tokens import new_token

        home = Path(tempfile.mkdtemp(prefix="gpumesh-bench-"))
        return cls(new_token(), home, free_port(host), host, journal)

    def env(self) -> dict[str, str]:
        return python_env({"GPUMESH_TOKEN": self.token, "GPUMESH_HOME": str(self.home)})

    def start_coordinator(self, prefix: tuple[str, ...] = ()) -> None:
        """Launch ``gpumesh serve``; ``wait_listening`` tells when it accepts connections."""
        self._ready_read, ready_write = os.pipe()
        try:
            self.coordinator = spawn(
                [*prefix, python_exe(), "-m", "gpumesh", "serve", "--host", self.host,
                 "--port", str(self.port), "--no-self-worker", "--no-save", "--no-color",
                 "--exit-with-parent", "--ready-fd", str(ready_write),
                 *(() if self.journal else ("--db", ":memory:"))],
                env=self.env(), log=self.log, pass_fds=[ready_write], cwd=self.cwd)
        finally:
            os.close(ready_write)

    def wait_listening(self, timeout: float = 60.0) -> None:
        """Block until serve reports it listens (the line it writes on its ready pipe): a
        client that connects earlier is refused and does not retry."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"gpumesh serve was not listening within {timeout:g}s")
                readable, _, _ = select.select([self._ready_read], [], [], remaining)
                if readable:
                    if not os.read(self._ready_read, 64):
                        raise RuntimeError("gpumesh serve exited before it listened:\n"
                                           + self.tail_log())
                    return
        finally:
            os.close(self._ready_read)

    def add_worker(self, prefetch: str | None = None, prefix: tuple[str, ...] = (),
                   join_args: tuple[str, ...] = ()) -> None:
        """Launch ``gpumesh join --slots 1``, with join's own ``--prefetch`` unless given."""
        extra = [*(["--prefetch", prefetch] if prefetch is not None else []), *join_args]
        self.workers.append(spawn(
            [*prefix, python_exe(), "-m", "gpumesh", "join", self.url, "--slots", "1", *extra,
             "--no-benchmark", "--no-save", "--no-color", "--exit-with-parent"],
            env=self.env(), log=self.log, cwd=self.cwd))

    def client(self) -> Any:
        from gpumesh import GPUMesh
        from gpumesh.config import Settings

        settings = Settings.from_env({**os.environ, "GPUMESH_HOME": str(self.home)})
        return GPUMesh(self.url, self.token, quiet=True, connect_timeout=30, settings=settings)

    def journal_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.home.glob("coordinator-*.db*"))

    def stop(self) -> None:
        for proc in [*self.workers, self.coordinator]:
            if proc is not None:
                stop_group(proc)
        self.log.close()
        shutil.rmtree(self.home, ignore_errors=True)

    def tail_log(self, lines: int = 20) -> str:
        self.log.flush()
        text = (self.home / "processes.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])


def wait_for_workers(client: Any, count: int, timeout: float = 60.0) -> None:
    wait_for(lambda: sum(1 for w in client.workers() if w["alive"]) >= count, timeout,
             f"{count} gpumesh workers joining", every=0.05)


class GpumeshSystem(System):
    name = "gpumesh"
    key = "gpumesh"

    def start(self) -> None:
        # Everything is launched at once, as a user starting a mesh would: the first call waits
        # for the coordinator and a worker, and cold start counts all of it.
        self.mesh = Mesh.fresh()
        self.mesh.start_coordinator()
        for _ in range(self.params.workers):
            self.mesh.add_worker(prefetch=self.params.gpumesh_prefetch)
        self.mesh.wait_listening()
        self.client = self.mesh.client()

    def wait_ready(self) -> None:
        wait_for_workers(self.client, self.params.workers)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return self.client.submit(fn, *args).result(CALL_TIMEOUT)
        except TimeoutError:
            raise TimeoutError(f"no result within {CALL_TIMEOUT:g}s") from None

    def map(self, fn: Callable[..., Any], items: list[Any]) -> list[Any]:
        return self.client.map(fn, items, timeout=CALL_TIMEOUT)

    def stop(self) -> None:
        if hasattr(self, "client"):
            self.client.close()
        if hasattr(self, "mesh"):
            self.mesh.stop()

    def processes(self) -> dict[int, str]:
        roles = {os.getpid(): "client", self.mesh.coordinator.pid: "coordinator"}
        for number, worker in enumerate(self.mesh.workers, 1):
            roles[worker.pid] = f"worker {number} agent"
            roles.update({pid: f"worker {number} runners" for pid in descendants(worker.pid)})
        return roles

    def failure_context(self) -> str:
        return self.mesh.tail_log() if hasattr(self, "mesh") else ""
