"""Helpers for the fault suite: execution logs, whole-tree stops, and a network-namespace lab.

The lab follows the hard rule of tests/TESTING.md: lab addresses (10.250.0.0/16) exist only
inside namespaces this process made, those namespaces get no default route, and while a lab
exists the root namespace holds ``unreachable 10.250.0.0/16`` so that a command that forgot
``ip netns exec`` fails with "No route to host" instead of leaving the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import poll_until

HERE = Path(__file__).parent
GUARD = "10.250.0.0/16"
NS_PREFIX = "gmfault-"


# ----------------------------------------------------------------- what the tasks recorded

class Executions:
    """Reads the per-task files that ``faulttasks.record_square`` writes."""

    def __init__(self, log_dir: Path) -> None:
        self.dir = log_dir

    def lines(self, i: int) -> list[tuple[str, int]]:
        path = self.dir / str(i)
        if not path.exists():
            return []
        return [(what, int(agent)) for what, agent, *_ in
                (line.split() for line in path.read_text().splitlines())]

    def starts(self, i: int) -> list[int]:
        return [agent for what, agent in self.lines(i) if what == "start"]

    def ends(self, i: int) -> list[int]:
        return [agent for what, agent in self.lines(i) if what == "end"]

    def ended(self, n: int) -> set[int]:
        return {i for i in range(n) if self.ends(i)}

    def started_count(self) -> int:
        return sum(1 for _ in self.dir.iterdir())

    def in_flight(self, n: int) -> dict[int, int]:
        """Task -> agent pid, for tasks started and not ended (by that agent)."""
        running = {}
        for i in range(n):
            lines = self.lines(i)
            for agent in {a for _, a in lines}:
                if Counter(w for w, a in lines if a == agent)["start"] > \
                        Counter(w for w, a in lines if a == agent)["end"]:
                    running[i] = agent
        return running

    def runs(self, n: int) -> list[int]:
        """How many times each task ran to its end."""
        return [len(self.ends(i)) for i in range(n)]


def assert_one_correct_result_each(futures: list[Any], results: list[Any], n: int) -> None:
    """Every task has exactly one result and every result is ``i * i``."""
    assert len(futures) == n and len(results) == n
    assert results == [i * i for i in range(n)]
    assert len({f.task_id for f in futures}) == n, "two futures share a task id"
    assert all(f.done() and not f.cancelled() and f.exception() is None for f in futures)


# ----------------------------------------------------------------- processes

def tree(pid: int) -> list[psutil.Process]:
    proc = psutil.Process(pid)
    return [proc, *proc.children(recursive=True)]


def signal_tree(pid: int, sig: int) -> list[int]:
    """Send ``sig`` to a process and all its descendants (a sleeping laptop stops them all)."""
    sent = []
    for proc in tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(sig)
            sent.append(proc.pid)
    return sent


def runner_pids(agent_pid: int) -> set[int]:
    return {p.pid for p in psutil.Process(agent_pid).children()}


def _read_line(stream: Any, proc: subprocess.Popen[bytes], deadline: float, what: str) -> str:
    fd = stream.fileno()
    data = b""
    while not data.endswith(b"\n"):
        remaining = deadline - time.time()
        if remaining <= 0:
            pytest.fail(f"timed out waiting for {what}")
        readable, _, _ = select.select([fd], [], [], min(remaining, 0.5))
        if readable:
            chunk = os.read(fd, 1)
            if not chunk:
                pytest.fail(f"{what}: the process exited with code {proc.wait(5)}")
            data += chunk
    return data.decode()


# ----------------------------------------------------------------- the network-namespace lab

def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def netns_available() -> str | None:
    """None when namespaces can be made here, else why not."""
    name = f"{NS_PREFIX}{os.getpid()}-probe"
    try:
        made = _ip("netns", "add", name, check=False)
    except FileNotFoundError:
        return "iproute2 (ip) is not installed"
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def require_netns() -> None:
    """Skip without namespaces; under CI=true, fail instead (CI is expected to allow them)."""
    why = netns_available()
    if why is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"network-namespace fault tests cannot run: {why}")
    pytest.skip(why)


def _netns_pids(name: str) -> list[int]:
    out = _ip("netns", "pids", name, check=False).stdout
    return [int(p) for p in out.split()]


def _delete_netns(name: str) -> None:
    poll_until(lambda: not _kill_all_in(name), 2.5)  # then deleted whatever is left
    _ip("netns", "del", name, check=False)


def _kill_all_in(name: str) -> bool:
    """SIGKILL every process in namespace ``name``; whether there were any."""
    pids = _netns_pids(name)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return bool(pids)


def our_namespaces() -> list[str]:
    listed = _ip("netns", "list", check=False).stdout.splitlines()
    return [line.split()[0] for line in listed if line.startswith(NS_PREFIX)]


def sweep_stale_namespaces() -> None:
    """Delete lab namespaces whose creating process is gone (a crashed earlier run)."""
    for name in our_namespaces():
        owner = name[len(NS_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not psutil.pid_exists(int(owner)):
            _delete_netns(name)


class Lab:
    """Hosts as namespaces on one switch (a bridge in its own namespace), 10.250.N.0/24.

    ``Lab(["a", "b"])`` makes host ``a`` at ``10.250.N.1``, ``b`` at ``10.250.N.2``, and so on;
    each host's interface is ``eth0``. Processes started with ``spawn`` are killed at ``close``.
    """

    def __init__(self, hosts: list[str]) -> None:
        sweep_stale_namespaces()
        self.tag = f"{os.getpid()}-{secrets.token_hex(2)}"
        self.subnet = 1 + secrets.randbelow(254)
        self.hosts = {host: f"{NS_PREFIX}{self.tag}-{host}" for host in hosts}
        self.switch = f"{NS_PREFIX}{self.tag}-sw"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.added_guard = False
        self._made: list[str] = []
        try:
            self._build(hosts)
        except BaseException:
            self.close()
            raise

    def address(self, host: str) -> str:
        return f"10.250.{self.subnet}.{list(self.hosts).index(host) + 1}"

    def ns(self, host: str) -> str:
        return self.hosts[host]

    def _build(self, hosts: list[str]) -> None:
        if not _ip("route", "show", GUARD, check=False).stdout.strip():
            _ip("route", "add", "unreachable", GUARD)
            self.added_guard = True
        for name in [self.switch, *self.hosts.values()]:
            _ip("netns", "add", name)
            self._made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for index, host in enumerate(hosts):
            ns, port = self.hosts[host], f"p{index}"
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port,
                "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def link(self, host: str, up: bool) -> None:
        """Take a host's only link down (Wi-Fi gone) or bring it back."""
        _ip("-n", self.hosts[host], "link", "set", "eth0", "up" if up else "down")

    def run(self, host: str, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.hosts[host], *cmd], capture_output=True,
                              text=True, timeout=timeout)

    def spawn(self, host: str, args: list[str], env: dict[str, str], *, ready: bool = False,
              stdin: int | None = None, stdout: Any = None, stderr: Any = None,
              wait: float = 30.0) -> tuple[subprocess.Popen[bytes], str]:
        """Start ``python ARGS`` inside ``host``. With ``ready``, pass ``--ready-fd`` (as
        gpumesh.client.launch does) and return the first line the child writes to it."""
        cmd = ["ip", "netns", "exec", self.hosts[host], sys.executable, *args]
        if not ready:
            proc = subprocess.Popen(cmd, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
                                    start_new_session=True)
            self.procs.append(proc)
            return proc, ""
        read_fd, write_fd = os.pipe()
        try:
            proc = subprocess.Popen([*cmd, "--ready-fd", str(write_fd)], env=env,
                                    pass_fds=[write_fd], stdin=subprocess.DEVNULL, stdout=stdout,
                                    stderr=stderr, start_new_session=True)
        finally:
            os.close(write_fd)
        self.procs.append(proc)
        try:
            with os.fdopen(read_fd, "rb", buffering=0) as pipe:
                line = _read_line(pipe, proc, time.time() + wait, f"{args[:3]} in {host}")
        except BaseException:
            proc.kill()
            raise
        return proc, line.strip()

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        for name in reversed(self._made):
            _delete_netns(name)
        self._made.clear()
        if self.added_guard and not our_namespaces():
            _ip("route", "del", "unreachable", GUARD, check=False)
            self.added_guard = False


# ----------------------------------------------------------------- a client in another namespace

class Driver:
    """``fault_driver.py`` running somewhere else, answering one JSON line per request."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def call(self, op: str, wait: float = 30.0, **args: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        self.proc.stdin.flush()
        reply = json.loads(_read_line(self.proc.stdout, self.proc, time.time() + wait,
                                      f"the driver's answer to {op}"))
        if "error" in reply:
            pytest.fail(f"driver {op}: {reply['error']}")
        return reply["value"]


def driver_args() -> list[str]:
    return [str(HERE / "fault_driver.py")]
