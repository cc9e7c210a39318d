"""The CLI and the README's quickstart, run as a user runs them."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require, user_script, wait_for

from gpumesh._version import __version__

# The shipped example is what the README tells users to run: test that very file.
DEMO = (Path(__file__).parents[2] / "examples" / "demo.py").read_text()
EXPECTED = ("{'lr': 0.01, 'accuracy': 0.91}\n"
            "[{'lr': 0.01, 'accuracy': 0.91}, {'lr': 0.05, 'accuracy': 0.95}]\n")


def gpumesh(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpumesh", *args], env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def test_version_line():
    out = gpumesh("--version").stdout.strip()
    assert out == f"gpumesh {__version__} ({platform.python_version()}, {platform.system()})"


@pytest.mark.parametrize("command", ["serve", "join", "workers", "demo"])
def test_every_command_has_help_with_an_example(command):
    result = gpumesh(command, "--help")
    assert result.returncode == 0
    assert "Example" in result.stdout


def test_quickstart_demo_script_on_the_mesh_then_locally(mesh_env, tmp_path):
    coordinator = mesh_env.start_coordinator(self_worker=True, save=True)
    script = tmp_path / "demo.py"
    script.write_text(DEMO)
    env = {**os.environ, **mesh_env.env}
    env.pop("GPUMESH_URL", None)
    env.pop("GPUMESH_TOKEN", None)
    remote = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                            timeout=60)
    assert remote.stdout == EXPECTED, remote.stderr
    assert "[gpumesh] connected to coordinator at tcp://127.0.0.1:" in remote.stderr
    assert mesh_env.token not in remote.stdout + remote.stderr
    coordinator.stop()
    local = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                           timeout=30)
    assert local.stdout == EXPECTED, local.stderr
    verbose = subprocess.run([sys.executable, str(script)], env={**env, "GPUMESH_VERBOSE": "1"},
                             capture_output=True, text=True, timeout=30)
    assert "running locally" in verbose.stderr
    forced = subprocess.run([sys.executable, str(script)], env={**env, "GPUMESH_LOCAL": "1"},
                            capture_output=True, text=True, timeout=30)
    assert forced.stdout == EXPECTED


def test_workers_lists_all_three_alive(mesh_env):
    coordinator = mesh_env.start_coordinator(self_worker=True, slots=1, save=True)
    mesh_env.add_worker()
    mesh_env.add_worker()
    mesh_env.wait_workers(3)
    result = gpumesh("workers", env=mesh_env.env)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.strip().startswith("CPU")]
    assert len(rows) == 3
    assert all(re.match(r"^  CPU  [0-9a-f]{8}    \S+\s+score=[0-9.]+\s+\[alive\]$", r) for r in rows)
    as_json = gpumesh("workers", "--json", "--url", coordinator.url, "--token", mesh_env.token,
                      env={"GPUMESH_HOME": str(mesh_env.home / "elsewhere")})
    assert as_json.returncode == 0 and '"alive": true' in as_json.stdout


def test_workers_without_configuration_says_what_to_do(tmp_path):
    result = gpumesh("workers", env={"GPUMESH_HOME": str(tmp_path), "GPUMESH_URL": "",
                                     "GPUMESH_TOKEN": ""})
    assert result.returncode == 1
    assert "no coordinator configured" in result.stderr


def test_demo_runs_end_to_end_and_leaves_nothing_running():
    result = gpumesh("demo", "--workers", "2", "--tasks", "12", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "remote results equal local ones: yes" in result.stdout
    assert "nothing left running" in result.stdout
    ran_on = next(line for line in result.stdout.splitlines() if "ran on:" in line)
    assert ran_on.count("tasks)") >= 2  # the .map really spread over workers


def test_urls_in_every_spelling_reach_the_same_coordinator(mesh_env):
    coordinator = mesh_env.start_coordinator()
    port = coordinator.port
    for url in (f"http://127.0.0.1:{port}", f"gpumesh://127.0.0.1:{port}", f"127.0.0.1:{port}"):
        client = mesh_env.client(url=url)
        wait_for(client.connect, what=f"a connection through {url}")
        assert client.workers() == []


def test_a_killed_serve_takes_its_self_worker_along(mesh_env):
    psutil = require("psutil")
    coordinator = mesh_env.start_coordinator(self_worker=True)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    (self_worker,) = [p for p in psutil.Process(coordinator.pid).children()
                      if "join" in p.cmdline()]
    coordinator.kill()  # kill -9: no chance to stop its child itself
    wait_for(lambda: not self_worker.is_running() or self_worker.status() == psutil.STATUS_ZOMBIE,
             what="the orphaned self-worker to exit")


def test_a_mesh_started_from_a_script_goes_when_the_script_is_killed(mesh_env, tmp_path):
    psutil = require("psutil")
    coordinator = mesh_env.start_coordinator()
    script = tmp_path / "starter.py"
    script.write_text(
        "import os, sys, time\n"
        "from gpumesh import GPUMesh\n"
        f"w = GPUMesh.add_worker({coordinator.url!r}, token={mesh_env.token!r}, home={str(tmp_path)!r})\n"
        "print(w.pid, flush=True)\n"
        "time.sleep(600)\n")
    starter = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, **mesh_env.env})
    try:
        worker = psutil.Process(int(starter.stdout.readline()))
        starter.kill()
        starter.wait(10)
        wait_for(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE,
                 what="the worker of the killed script to exit")
    finally:
        starter.kill()
        starter.wait(10)
        starter.stdout.close()


def _a_client_of_one_worker(mesh_env, tmp_path, source: str, **env: str):
    """A coordinator with one 1-slot worker, a user's script of ``source`` to run against it
    with ``env`` added, and a client to watch it: (coordinator, script, env, watcher)."""
    coordinator = mesh_env.start_coordinator()
    mesh_env.add_worker(slots=1)
    script = tmp_path / "user_script.py"
    script.write_text(source)
    env = {**os.environ, **mesh_env.env, "GPUMESH_URL": coordinator.url,
           "GPUMESH_TOKEN": mesh_env.token, **env}
    return coordinator, script, env, mesh_env.client()


def test_a_map_run_here_while_the_coordinator_was_gone_says_it_will_run_again(mesh_env,
                                                                             tmp_path):
    # The coordinator journaled the tasks, went away, and the client ran them here after the
    # reconnect grace and exited: the restarted coordinator ran them all again (side effects
    # twice, results for nobody) without a word to the user.
    # On the worker (which does not see HERE) a task waits; run here, it returns at once.
    coordinator, script, env, watcher = _a_client_of_one_worker(
        mesh_env, tmp_path, "import os, select\nfrom gpumesh import mesh\n\n@mesh\n"
        "def double(x):\n    if not os.environ.get('HERE'):\n"
        "        select.select([], [], [], 60)\n    return 2 * x\n\n"
        "print(double.map([1, 2, 3]))\n", HERE="1", GPUMESH_RECONNECT_GRACE="1")
    with user_script(script, [], env) as proc:
        wait_for(lambda: watcher.status().get("counts") == {"pending": 2, "running": 1},
                 what="the map's tasks accepted, one running")
        watcher.close()
        coordinator.stop()
        out, err = proc.communicate(timeout=60)
    assert out == "[2, 4, 6]\n", err
    assert "may not have heard that 3 task(s) of job" in err and "gpumesh cancel " in err


def test_ctrl_c_with_the_coordinator_gone_does_not_claim_a_cancel_it_could_not_make(mesh_env,
                                                                                    tmp_path):
    # "interrupted: cancelled 148 unfinished task(s) on the mesh" was printed after a kill -9
    # of the coordinator (then the restarted coordinator ran them all), and the Ctrl+C waited
    # the whole 10 s for an answer from a dead coordinator.
    import signal

    coordinator, script, env, watcher = _a_client_of_one_worker(
        mesh_env, tmp_path, "from gpumesh import GPUMesh\n\ndef wait(i):\n    import select\n"
        "    select.select([], [], [], 60)\n    return i\n\n"
        "print(GPUMesh().map(wait, range(20)))\n")
    with user_script(script, [], env) as proc:
        wait_for(lambda: watcher.status().get("counts", {}).get("running") == 1,
                 what="the map's first task running")
        watcher.close()
        coordinator.proc.kill()  # kill -9: no goodbye to the client
        coordinator.proc.wait()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert "interrupted: 20 unfinished task(s) cancelled here" in err
    assert "did not confirm it (unreachable)" in err and "on the mesh" not in err
