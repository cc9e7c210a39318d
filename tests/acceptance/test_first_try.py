"""What a first try of gpumesh hit (issue 12), replayed as a new user would: each one fixed."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import wait_for

from gpumesh import accelerate

EXAMPLES = Path(__file__).parents[2] / "examples"


def run(script: Path, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(script)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout)


def test_python_api_example_leaves_the_saved_connection_alone(mesh_env):
    coordinator = mesh_env.start_coordinator(save=True)
    config = mesh_env.home / "config.json"
    before = config.read_bytes()
    env = {**mesh_env.env, "GPUMESH_URL": "", "GPUMESH_TOKEN": ""}
    result = run(EXAMPLES / "python_api.py", env)
    assert result.returncode == 0, result.stderr
    assert "'lr': 0.05" in result.stdout
    assert config.read_bytes() == before  # the example's workers saved nothing
    workers = subprocess.run([sys.executable, "-m", "gpumesh", "workers", "--json"],
                             env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert workers.returncode == 0, workers.stderr
    assert coordinator.alive


DECORATED = textwrap.dedent("""
    from gpumesh import mesh

    @mesh
    def square(x):
        return x * x

    print(square(7))
""")


def test_mesh_call_with_no_worker_runs_locally_after_the_connect_timeout(mesh_env, tmp_path):
    mesh_env.start_coordinator(save=True)  # no self-worker, no worker
    script = tmp_path / "square.py"
    script.write_text(DECORATED)
    # Long enough to connect on a loaded machine: the no-worker wait is what ends it.
    env = {**mesh_env.env, "GPUMESH_URL": "", "GPUMESH_TOKEN": "", "GPUMESH_VERBOSE": "1",
           "GPUMESH_CONNECT_TIMEOUT": "5"}
    result = run(script, env, timeout=30)
    assert result.stdout == "49\n", result.stderr
    assert "no worker connected to tcp://127.0.0.1:" in result.stderr
    assert "running locally" in result.stderr


def test_mesh_only_waits_for_a_worker_instead(mesh_env):
    mesh_env.start_coordinator()
    client = mesh_env.client()
    assert client.connect()
    only = accelerate(client, mesh_only=True)(abs)
    anywhere = accelerate(client)(abs)
    assert only._mesh() is client  # goes to the mesh at once, to wait for a worker there
    assert anywhere._mesh() is None  # no worker within the connect timeout: local
    mesh_env.add_worker()
    wait_for(lambda: anywhere._mesh() is client, what="the worker to be seen")
    assert anywhere(-3) == 3


THREADS = textwrap.dedent("""
    import threading
    from gpumesh import mesh

    @mesh
    def f(x):
        return x

    def calls():
        for i in range(300):
            f(i)

    threads = [threading.Thread(target=calls) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
""")


def test_verbose_lines_from_several_threads_stay_whole(tmp_path):
    script = tmp_path / "threads.py"
    script.write_text(THREADS)
    result = run(script, {"GPUMESH_LOCAL": "1", "GPUMESH_VERBOSE": "1",
                          "GPUMESH_HOME": str(tmp_path)})
    lines = result.stderr.splitlines()
    assert len(lines) == 8 * 300
    assert set(lines) == {"[gpumesh] f: GPUMESH_LOCAL=1: running locally"}


def test_serve_no_save_without_a_token_never_says_saved(tmp_path):
    # On a terminal (a pseudo-terminal here) the generated token is shown once, as the user
    # who ran serve is the one reading it.
    import pty

    env = {**os.environ, "GPUMESH_HOME": str(tmp_path), "GPUMESH_TOKEN": "", "GPUMESH_URL": ""}
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "gpumesh", "serve", "--port", "0",
                             "--no-save", "--no-self-worker", "--no-color"], env=env,
                            stdout=follower, stderr=follower, start_new_session=True)
    os.close(follower)
    out = ""
    try:
        deadline = time.time() + 30
        while "Self-check" not in out:
            assert time.time() < deadline, out
            ready, _, _ = select.select([leader], [], [], 0.5)
            if ready:
                chunk = os.read(leader, 4096)
                assert chunk, out
                out += chunk.decode(errors="replace").replace("\r\n", "\n")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(10)
        os.close(leader)
    said = [line for line in out.splitlines() if "saved" in line.lower()]
    assert said == ["   (not saved: give it to 'gpumesh join' as GPUMESH_TOKEN or --token-file)"]
    assert "generated for you" in out
    assert not (tmp_path / "config.json").exists() and not (tmp_path / "token").exists()


def test_serve_never_writes_a_generated_token_into_output_that_is_not_a_terminal(tmp_path):
    # A log, journald or `docker logs` would keep it for whoever reads them.
    env = {**os.environ, "GPUMESH_HOME": str(tmp_path), "GPUMESH_TOKEN": "", "GPUMESH_URL": ""}
    done = subprocess.run([sys.executable, "-m", "gpumesh", "serve", "--port", "0", "--no-save",
                           "--no-self-worker"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "Token:" not in done.stdout + done.stderr
    assert "set GPUMESH_TOKEN or pass --token-file" in done.stdout + done.stderr
    assert not (tmp_path / "config.json").exists() and not (tmp_path / "token").exists()


def gives_a_generator(n):
    return (i for i in range(n))


def test_a_generator_return_value_is_named_as_such(mesh_env):
    mesh_env.start_coordinator()
    mesh_env.add_worker()
    client = mesh_env.client()
    with pytest.raises(TypeError, match="return value is a generator.*list"):
        client.map(gives_a_generator, [3])


FAILING = textwrap.dedent("""
    from gpumesh import mesh


    def helper(x):
        raise ValueError(f"bad value {x}")


    @mesh(max_attempts=1)
    def task(x):
        return helper(x) + 1


    CALL
""")


@pytest.mark.parametrize("call", ["task(5)", "task.submit(5).result()",
                                  "mesh.executor().submit(task, 5).result()",
                                  "import asyncio; asyncio.run(task.aio(5))"])
def test_remote_traceback_shows_the_callers_own_source_lines(mesh_env, tmp_path, call):
    """Each way a user meets a task's error (only a call and .map did before: a submit's
    result, an executor's, an awaited one showed File "<dynamic-code>" without its line)."""
    mesh_env.start_coordinator(save=True)
    mesh_env.add_worker()
    mesh_env.wait_workers(1)
    script = tmp_path / "failing.py"
    script.write_text(FAILING.replace("CALL", call))
    result = run(script, {**mesh_env.env, "GPUMESH_URL": "", "GPUMESH_TOKEN": ""})
    assert result.returncode == 1
    err = result.stderr
    assert "ValueError: bad value 5" in err
    assert "Remote traceback" in err, err
    assert "<dynamic-code>" not in err, err
    assert f'File "{script}", line 11, in task\n    return helper(x) + 1' in err, err
    assert f'File "{script}", line 6, in helper\n    raise ValueError(f"bad value {{x}}")' in err


def test_color_and_no_color_together_are_refused():
    for command in ("serve", "join"):
        result = subprocess.run([sys.executable, "-m", "gpumesh", command, "--color", "--no-color"],
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 2
        assert "--color and --no-color contradict each other" in result.stderr


def test_readme_install_and_limitations_say_what_is_true():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert "pip install ./gpumesh" not in readme
    assert "Function tasks run only on workers with the submitter's Python" not in readme
    assert "as source" in readme and "mesh_only=True" in readme
