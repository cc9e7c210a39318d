"""Starting a coordinator or a worker from Python, in the background, with a handle to stop it.

Each runs as its own ``python -m gpumesh`` process, so user code in this interpreter cannot stall
its heartbeats. The token travels in the child's environment, never on its command line (where
``ps`` would show it). The child reports readiness on an inherited pipe.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any

from ..config import DEFAULT_HOST, Settings, new_token, parse_url
from ..errors import MeshError
from ..tokens import refuse_weak, weakness, with_salt


@dataclass
class ProcessHandle:
    """A background gpumesh process. ``stop()`` ends it gracefully, then by force."""

    proc: subprocess.Popen[bytes]
    ready_line: str = ""
    _stopped: bool = field(default=False, repr=False)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 10.0) -> int | None:
        if self._stopped:
            return self.proc.returncode
        self._stopped = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def kill(self) -> None:
        """``kill -9``: what a crash looks like to the rest of the mesh."""
        self._stopped = True
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def __enter__(self) -> ProcessHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class CoordinatorHandle(ProcessHandle):
    url: str = ""
    token: str = field(default="", repr=False)
    port: int = 0


@dataclass
class WorkerHandle(ProcessHandle):
    worker_id: str = ""


def _spawn(args: list[str], env: dict[str, str], wait: float, what: str,
           stdout: IO[Any] | int | None) -> tuple[subprocess.Popen[bytes], str]:
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen(
            # Started for this process: it must not outlive it (a crashed script, a kill -9).
            [sys.executable, "-m", "gpumesh", *args, "--ready-fd", str(write_fd),
             "--exit-with-parent"],
            env=env, pass_fds=[write_fd], stdin=subprocess.DEVNULL, stdout=stdout,
            start_new_session=True,
        )
    finally:
        os.close(write_fd)
    try:
        line = _read_ready(read_fd, proc, wait, what)
    except BaseException:
        proc.kill()
        proc.wait(5)
        raise
    finally:
        os.close(read_fd)
    return proc, line


def _read_ready(fd: int, proc: subprocess.Popen[bytes], wait: float, what: str) -> str:
    deadline = time.time() + wait
    data = b""
    while b"\n" not in data:
        remaining = deadline - time.time()
        if remaining <= 0:
            raise MeshError(f"the {what} did not become ready within {wait:g}s")
        readable, _, _ = select.select([fd], [], [], min(remaining, 0.2))
        if readable:
            chunk = os.read(fd, 4096)
            if not chunk:
                code = proc.wait(5)
                raise MeshError(f"the {what} exited with code {code} before it was ready "
                                "(its error is printed above)")
            data += chunk
    return data.split(b"\n", 1)[0].decode()


def _child_env(token: str, home: str | None, extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env["GPUMESH_TOKEN"] = token
    if home is not None:
        env["GPUMESH_HOME"] = str(home)
    env.update(extra or {})
    return env


def start_coordinator(
    port: int = 8000, token: str | None = None, host: str = DEFAULT_HOST, *,
    self_worker: bool = True, slots: int | None = None, db: str | None = None,
    home: str | None = None, safe_mode: bool = False, quiet: bool = True, wait: float = 30.0,
    env: dict[str, str] | None = None, extra_args: list[str] | None = None, save: bool = False,
    weak_token: bool | None = None,
) -> CoordinatorHandle:
    """Run ``gpumesh serve`` in the background. ``port=0`` picks a free port.

    Unlike the command, it leaves the saved connection alone unless ``save=True``: a mesh
    started from a script should not become the user's default. A token shorter than 22
    characters is refused (ConfigError) unless ``weak_token=True`` (or GPUMESH_WEAK_TOKEN=1);
    accepted, it gets a salt in front if it has none, and the handle's ``token`` is that.
    """
    settings = Settings.from_env()
    token = token or settings.token or new_token()
    args = ["serve", "--host", host, "--port", str(port)]
    if weakness(token):
        if not (settings.weak_token if weak_token is None else weak_token):
            refuse_weak(token)
        token = with_salt(token)
        args.append("--weak-token")
    if not self_worker:
        args.append("--no-self-worker")
    if slots is not None:
        args += ["--slots", str(slots)]
    if db is not None:
        args += ["--db", str(db)]
    if safe_mode:
        args.append("--safe-mode")
    if not save:
        args.append("--no-save")
    args += extra_args or []
    proc, line = _spawn(args, _child_env(token, home, env), wait, "coordinator",
                        subprocess.DEVNULL if quiet else None)
    bound_port = int(line)
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "", "*") else host
    url = parse_url(f"{shown_host}:{bound_port}" if ":" not in shown_host
                    else f"[{shown_host}]:{bound_port}").zmq
    return CoordinatorHandle(proc, line, url=url, token=token, port=bound_port)


def start_worker(
    url: str, token: str | None = None, *, slots: int | None = None, home: str | None = None,
    quiet: bool = True, wait: float = 30.0, env: dict[str, str] | None = None,
    extra_args: list[str] | None = None, benchmark: bool = False, save: bool = False,
) -> WorkerHandle:
    """Run ``gpumesh join URL`` in the background; returns once the worker joined.

    Like ``start_coordinator``, it leaves the saved connection alone unless ``save=True``: a
    worker started from a script must not re-point the user's default mesh.
    """
    token = token or Settings.from_env().token
    if not token:
        raise MeshError("add_worker needs the mesh token: pass token= or set GPUMESH_TOKEN")
    args = ["join", url]
    if slots is not None:
        args += ["--slots", str(slots)]
    if not benchmark:
        args.append("--no-benchmark")
    if not save:
        args.append("--no-save")
    args += extra_args or []
    proc, line = _spawn(args, _child_env(token, home, env), wait, "worker",
                        subprocess.DEVNULL if quiet else None)
    return WorkerHandle(proc, line, worker_id=line)
