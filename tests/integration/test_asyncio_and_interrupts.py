"""asyncio over the engine, and Ctrl+C: an interrupted call stops its tasks on the mesh, a detached
job keeps running."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

from conftest import wait_for
from gates import wait_gate

from gpumesh.client.decorators import MeshFunction, MeshSource
from gpumesh.client.tasks import TaskOptions


def triple(x, gate=""):
    """3x; given a ``gate`` file, once the test has made it (a minute at most)."""
    if gate:
        wait_gate(gate)
    return 3 * x


def nap(seconds):
    time.sleep(seconds)
    return seconds


def broken_first(x):
    """The first item fails at once; the others take a minute."""
    if x == 0:
        raise RuntimeError("first item broken")
    return nap(60)


def idle(client):
    counts = client.status(tasks=False)["counts"]
    return not counts.get("running") and not counts.get("pending")


def test_await_futures_aio_and_amap_in_finishing_order(mesh_env, tmp_path):
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=3)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    fn = MeshFunction(triple, MeshSource(client), TaskOptions())
    gate = tmp_path / "gate"

    async def main():
        assert await client.submit(triple, 1) == 3
        assert await fn.aio(2) == 6
        seen = []
        async for pair in fn.amap([(3, str(gate)), (0, ""), (1, "")]):  # tuples: the args
            seen.append(pair)
            if len(seen) == 2:
                gate.touch()  # the first task ends only now: it must come last
        assert sorted(seen) == [(0, 9), (1, 0), (2, 3)]
        assert seen[-1] == (0, 9)
        long = asyncio.ensure_future(MeshFunction(nap, MeshSource(client), TaskOptions()).aio(60))
        await asyncio.to_thread(wait_for, lambda: client.status(tasks=False)["counts"].get(
            "running"), what="the awaited task running")
        long.cancel()
        try:
            await long
        except asyncio.CancelledError:
            pass

    asyncio.run(main())
    wait_for(lambda: idle(client), what="the cancelled task stopped on the mesh")


def test_cancelling_the_task_iterating_amap_cancels_its_pending_tasks(mesh_env):
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=2)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    fn = MeshFunction(nap, MeshSource(client), TaskOptions())
    seen = []

    async def consume():
        async for pair in fn.amap([60] * 6):
            seen.append(pair)

    async def main():
        consumer = asyncio.ensure_future(consume())
        await asyncio.to_thread(wait_for, lambda: client.status(tasks=False)["counts"].get(
            "running") == 2, what="two of the six tasks running, four pending")
        assert client.status(tasks=False)["counts"].get("pending") == 4
        consumer.cancel()
        try:
            await consumer
        except asyncio.CancelledError:
            pass

    asyncio.run(main())
    wait_for(lambda: idle(client), what="nothing of the cancelled amap left on the mesh")
    assert seen == []
    assert client.status()["jobs"][0]["counts"] == {"cancelled": 6}


def _client_process(mesh_env, code: str) -> subprocess.Popen[str]:
    env = {**os.environ, **mesh_env.env, "GPUMESH_URL": mesh_env.coordinator.url,
           "GPUMESH_TOKEN": mesh_env.token}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_interruptible)


def _interruptible() -> None:
    """Ctrl+C as a terminal delivers it: a shell runs background jobs (CI, nohup) with SIGINT
    ignored, and Python then never turns SIGINT into KeyboardInterrupt in the children."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_once_running(proc: subprocess.Popen[str], client, running: int,
                            what: str) -> tuple[str, str]:
    """Ctrl+C the process once ``running`` of its tasks run on the mesh; its (stdout, stderr)."""
    try:
        wait_for(lambda: client.status(tasks=False)["counts"].get("running") == running,
                 what=what)
        proc.send_signal(signal.SIGINT)
        return proc.communicate(timeout=30)
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[str]) -> None:
    """Kill it if it still runs, and close its pipes either way (a test that failed must not
    leave open files for a later test's gc to trip over)."""
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=10)


def test_ctrl_c_during_map_cancels_its_tasks_on_the_mesh(mesh_env):
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=2)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    proc = _client_process(mesh_env, """
        from gpumesh import mesh
        from test_asyncio_and_interrupts import nap
        mesh(nap).map([60] * 8)
        """)
    _, err = _interrupt_once_running(proc, client, 2, "the map running on both slots")
    assert proc.returncode != 0
    assert "[gpumesh] interrupted: cancelled 8 unfinished task(s) on the mesh" in err, err
    assert mesh_env.token not in err
    wait_for(lambda: idle(client), what="nothing of the interrupted map left on the mesh")
    assert client.status()["jobs"][0]["counts"].get("cancelled") == 8


def test_ctrl_c_during_a_single_call_cancels_its_task_on_the_mesh(mesh_env):
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=1)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    proc = _client_process(mesh_env, """
        from gpumesh import mesh
        from test_asyncio_and_interrupts import nap
        mesh(nap)(60)
        """)
    _, err = _interrupt_once_running(proc, client, 1, "the call running on the mesh")
    assert proc.returncode != 0
    lines = [line for line in err.splitlines() if line.startswith("[gpumesh] interrupted")]
    assert lines == ["[gpumesh] interrupted: cancelled 1 unfinished task(s) on the mesh"], err
    assert "KeyboardInterrupt" in err  # the interrupt still reaches the caller
    wait_for(lambda: idle(client), what="the interrupted call's task stopped on the mesh")
    assert client.status()["jobs"][0]["counts"] == {"cancelled": 1}


def _slow_job(mesh_env, tmp_path) -> tuple[Any, list[str], dict[str, str]]:
    """A mesh with one worker, the arguments of a one-task job that runs a minute
    (``submit SCRIPT --payloads FILE --wait``), and the environment to submit it from."""
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=1)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    script = tmp_path / "slow.py"
    script.write_text("import time; time.sleep(60); print(1)\n")
    payloads = tmp_path / "p.json"
    payloads.write_text(json.dumps([{}]))
    env = {**os.environ, **mesh_env.env, "GPUMESH_URL": mesh_env.coordinator.url,
           "GPUMESH_TOKEN": mesh_env.token}
    return client, ["submit", str(script), "--payloads", str(payloads), "--wait"], env


def test_ctrl_c_during_submit_wait_leaves_the_job_running(mesh_env, tmp_path):
    client, args, env = _slow_job(mesh_env, tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "gpumesh", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_interruptible)
    # The task may run before this client has read the coordinator's acceptance (a loaded
    # machine starves it): Ctrl+C must come once it says so, or it rightly answers "may run".
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith("Job: "):  # the last line before it waits
            break
    else:
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"submit --wait ended before it waited: {err}")
    out, err = _interrupt_once_running(proc, client, 1, "the job running")
    assert proc.returncode == 130, err
    assert "keeps running on the mesh" in err and "gpumesh status " in err, err
    assert client.status(tasks=False)["counts"].get("running") == 1
    job = client.status()["jobs"][0]["job"]
    assert client.cancel_job(job) == 1


# Ctrl+C landing the instant the coordinator accepted the job, before `submit --wait` waits.
CTRL_C_AT_ACCEPTANCE = """
import sys
from gpumesh.cli.main import main
from gpumesh.client.api import GPUMesh

accepted = GPUMesh._wait_accepted

def then_ctrl_c(self, *args, **kwargs):
    accepted(self, *args, **kwargs)
    raise KeyboardInterrupt

GPUMesh._wait_accepted = then_ctrl_c
sys.argv = ["gpumesh", *sys.argv[1:]]
main()
"""


def test_ctrl_c_as_submit_wait_learns_the_job_was_accepted_leaves_it_running(mesh_env,
                                                                             tmp_path):
    client, args, env = _slow_job(mesh_env, tmp_path)
    done = subprocess.run([sys.executable, "-c", CTRL_C_AT_ACCEPTANCE, *args], env=env, text=True,
                          capture_output=True, timeout=60)
    assert done.returncode == 130, done.stderr
    job = client.status()["jobs"][0]["job"]
    assert f"Stopped waiting; job {job} keeps running on the mesh" in done.stderr, done.stderr
    assert "Aborted!" not in done.stderr
    wait_for(lambda: client.status(tasks=False)["counts"].get("running") == 1,
             what="the job running on after its submitter stopped waiting")
    assert client.cancel_job(job) == 1


# Ctrl+C landing right after `submit --wait` printed the job's line, before it waits: a test
# that interrupts once the job runs could hit that on a loaded machine (CI, 2026-12-06).
CTRL_C_AFTER_JOB_LINE = """
import sys
import click
from gpumesh.cli.main import main

echo = click.echo

def echo_then_ctrl_c(message=None, *args, **kwargs):
    echo(message, *args, **kwargs)
    if isinstance(message, str) and message.startswith("Job: "):
        raise KeyboardInterrupt

click.echo = echo_then_ctrl_c
sys.argv = ["gpumesh", *sys.argv[1:]]
main()
"""


def test_ctrl_c_just_after_submit_wait_printed_the_job_leaves_it_running(mesh_env, tmp_path):
    client, args, env = _slow_job(mesh_env, tmp_path)
    done = subprocess.run([sys.executable, "-c", CTRL_C_AFTER_JOB_LINE, *args], env=env,
                          text=True, capture_output=True, timeout=60)
    assert done.returncode == 130, done.stderr
    job = client.status()["jobs"][0]["job"]
    assert f"Stopped waiting; job {job} keeps running on the mesh" in done.stderr, done.stderr
    assert "Aborted!" not in done.stderr
    assert client.cancel_job(job) == 1


def test_a_script_that_exits_on_a_maps_error_leaves_nothing_of_it_running(mesh_env):
    """The error cancels the rest of the map; the script then exits at once. The cancels were
    queued for the client's I/O thread, which died with the interpreter before it sent them:
    the other tasks ran on, for nobody."""
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=2)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    proc = _client_process(mesh_env, """
        from gpumesh import mesh
        from test_asyncio_and_interrupts import broken_first
        mesh(broken_first).map(range(6))
        """)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        _stop(proc)
    assert proc.returncode != 0 and "first item broken" in err, err
    wait_for(lambda: idle(client), timeout=20, what="nothing of the failed map left on the mesh")
    assert client.status()["jobs"][0]["counts"] == {"failed": 1, "cancelled": 5}
