"""Jobs from the command line, as a user runs them: submit, status, cancel, retry, kill, devices,
and the worker owner's pause/resume/drain. Real coordinator and worker processes on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wait_for
from test_examples import readme_command

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "examples"

SLEEPY = """
import json, sys, time
p = json.load(sys.stdin)
time.sleep(p.get("sleep", 0))
print(json.dumps({"x": p["x"]}))
"""
GATED = """
import json, os, sys, time
p = json.load(sys.stdin)
deadline = time.monotonic() + 60
while not os.path.exists(p["gate"]) and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps({"x": p["x"]}))
"""
FLAKY = """
import json, os, sys
p = json.load(sys.stdin)
if p["x"] % 3 == 0 and not os.path.exists(p["marker"]):
    sys.exit("not yet")
print(json.dumps({"x": p["x"], "square": p["x"] ** 2}))
"""


def cli(mesh, *args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **mesh.env, "GPUMESH_URL": mesh.coordinator.url,
           "GPUMESH_TOKEN": mesh.token, **(env or {})}
    return subprocess.run([sys.executable, "-m", "gpumesh", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def write_job(tmp_path: Path, source: str, payloads: list) -> tuple[str, str]:
    script, data = tmp_path / "job.py", tmp_path / "payloads.json"
    script.write_text(source)
    data.write_text(json.dumps(payloads))
    return str(script), str(data)


def job_status(mesh, job: str) -> dict:
    result = cli(mesh, "status", job, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def submit_detached(mesh, script: str, payloads: str) -> str:
    result = cli(mesh, "submit", script, "--payloads", payloads, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["job"]


def test_the_spec_grid_search_prints_progress_and_the_summary(mesh_env):
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=2)
    # Exactly the README's line (its CLI section shows this run).
    argv = readme_command("$ gpumesh submit examples/grid_search.py")[1:]
    assert argv[:2] == ["gpumesh", "submit"]
    result = cli(mesh_env, *argv[1:])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    job = out.split("[OK] Submitted job ")[1].split()[0]
    assert f"[OK] Submitted job {job}\nJob: examples/grid_search.py ({job})\n" in out  # spec's
    assert "#################### 100%  6/6 done" in out
    assert "  Status: finished\n  Counts: {'done': 6}" in out
    tasks = [line for line in out.splitlines() if line.startswith("  ✓ task ")]
    assert len(tasks) == 6 and "cost=10.0  worker=" in tasks[-1]
    results = [json.loads(line.split("result: ", 1)[1]) for line in out.splitlines()
               if line.startswith("    result: ")]
    payloads = json.loads((EXAMPLES / "payloads.json").read_text())
    assert [(r["lr"], r["epochs"]) for r in results] == [(p["lr"], p["epochs"]) for p in payloads]
    assert all(0.5 < r["val_accuracy"] <= 1.0 for r in results)
    assert mesh_env.token not in out + result.stderr


def test_another_terminal_sees_the_job_and_its_results(mesh_env, tmp_path):
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=2)
    script, payloads = write_job(tmp_path, SLEEPY, [{"x": i} for i in range(4)])
    job = submit_detached(mesh_env, script, payloads)
    final = wait_for(lambda: (lambda s: s if s["status"] == "finished" else None)(
        job_status(mesh_env, job[:6])), what="the job to finish")
    assert final["counts"] == {"done": 4} and final["name"] == script
    assert [t["result"] for t in final["tasks"]] == [{"x": i} for i in range(4)]
    listing = cli(mesh_env, "status")
    assert job in listing.stdout and "4/4 done" in listing.stdout
    assert json.loads(cli(mesh_env, "status", "--json").stdout)["jobs"][0]["job"] == job


def test_submit_without_wait_says_the_job_keeps_running_and_how_to_follow_it(mesh_env, tmp_path):
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=1)
    script, payloads = write_job(tmp_path, SLEEPY, [{"x": 1, "sleep": 60}])
    result = cli(mesh_env, "submit", script, "--payloads", payloads)
    assert result.returncode == 0, result.stderr
    job = result.stdout.split("[OK] Submitted job ")[1].split()[0]
    assert (f"[OK] Submitted job {job} (1 task): it runs on the mesh without this terminal\n"
            f"Follow it with: gpumesh status {job}\n") in result.stdout, result.stdout
    # The command has exited; the job runs on, and the command it gave follows it.
    wait_for(lambda: job_status(mesh_env, job)["counts"].get("running") == 1,
             what="the detached job running after submit exited")
    follow = cli(mesh_env, "status", job)
    assert follow.returncode == 0 and job in follow.stdout and "running" in follow.stdout, \
        follow.stdout + follow.stderr
    assert cli(mesh_env, "cancel", job).returncode == 0


def test_cancel_stops_a_running_job_and_the_worker_stays(mesh_env, tmp_path):
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=2)
    script, payloads = write_job(tmp_path, SLEEPY, [{"x": i, "sleep": 60} for i in range(4)])
    job = submit_detached(mesh_env, script, payloads)
    wait_for(lambda: job_status(mesh_env, job)["counts"].get("running") == 2, what="2 running")
    result = cli(mesh_env, "cancel", job)
    assert result.returncode == 0 and "Cancelled 4 unfinished task(s)" in result.stdout
    final = wait_for(lambda: (lambda s: s if s["status"] == "finished" else None)(
        job_status(mesh_env, job)), timeout=30, what="the cancellation")
    assert final["counts"] == {"cancelled": 4}
    script2, payloads2 = write_job(tmp_path, SLEEPY, [{"x": 7}])
    after = cli(mesh_env, "submit", script2, "--payloads", payloads2, "--wait")
    assert after.returncode == 0 and "1/1 done" in after.stdout


def test_retry_reruns_only_the_failed_tasks(mesh_env, tmp_path):
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=2)
    marker = tmp_path / "fixed"
    script, payloads = write_job(tmp_path, FLAKY, [{"x": i, "marker": str(marker)} for i in range(6)])
    first = cli(mesh_env, "submit", script, "--payloads", payloads, "--wait", "--name", "flaky")
    assert first.returncode == 1
    assert "Counts: {'done': 4, 'failed': 2}" in first.stdout
    assert "error: script job.py exited with code 1: not yet" in first.stdout  # its stderr
    marker.touch()
    again = cli(mesh_env, "retry", "flaky", "--wait")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "Re-queued 2 tasks" in again.stdout and "Counts: {'done': 6}" in again.stdout
    squares = [t["result"]["square"] for t in job_status(mesh_env, "flaky")["tasks"]]
    assert squares == [i * i for i in range(6)]
    assert "Nothing to retry in job flaky" in cli(mesh_env, "retry", "flaky").stdout


def test_kill_removes_a_worker_and_its_task_runs_elsewhere(mesh_env, tmp_path):
    mesh_env.start_coordinator()
    doomed = mesh_env.add_worker(slots=1)
    # The task runs until the test says so: with a 2 s sleep, a loaded CI machine took long
    # enough to see it running and start `gpumesh kill` that the task had already finished.
    gate = tmp_path / "gate"
    script, payloads = write_job(tmp_path, GATED, [{"x": 1, "gate": str(gate)}])
    job = submit_detached(mesh_env, script, payloads)
    wait_for(lambda: job_status(mesh_env, job)["counts"].get("running") == 1, what="the task to run")
    result = cli(mesh_env, "kill", doomed.worker_id[:6])
    assert result.returncode == 0, result.stderr
    assert f"Removed worker {doomed.worker_id}" in result.stdout and "1 running task(s)" in result.stdout
    assert doomed.proc.wait(timeout=10) == 0  # it left on purpose: no crash, no restart
    gate.touch()
    survivor = mesh_env.add_worker(slots=1)
    final = wait_for(lambda: (lambda s: s if s["status"] == "finished" else None)(
        job_status(mesh_env, job)), what="the job to finish elsewhere")
    assert final["tasks"][0]["worker"] == survivor.worker_id
    assert final["tasks"][0]["attempts"] == 1  # a removal spends no attempt
    unknown = cli(mesh_env, "kill", "nosuchworker")
    assert unknown.returncode == 1 and "no worker 'nosuchworker'" in unknown.stderr


def test_owner_pauses_resumes_and_drains_without_losing_work(mesh_env, tmp_path):
    mesh_env.start_coordinator()
    # One task at a time, so "running" means running: under the default (auto) prefetch the
    # short first task would let the next two queue on this worker, counted as leased.
    worker = mesh_env.add_worker(slots=1, extra_args=["--prefetch", "0"])
    paused = cli(mesh_env, "pause")
    assert paused.returncode == 0 and f"worker {worker.worker_id} paused" in paused.stdout
    # The worker answers its owner at once and tells the coordinator right after.
    wait_for(lambda: json.loads(cli(mesh_env, "workers", "--json").stdout)[0]["state"]
             == "paused", what="the coordinator to see the worker paused")
    # Task 2 runs until the test says so (a fixed sleep raced the `drain` on a loaded machine:
    # task 2 could end, and task 3 start, before the drain arrived); 1 and 3 run at once.
    gate = tmp_path / "gate"
    script, payloads = write_job(tmp_path, GATED, [{"x": 1, "gate": str(tmp_path)},
                                                   {"x": 2, "gate": str(gate)},
                                                   {"x": 3, "gate": str(tmp_path)}])
    job = submit_detached(mesh_env, script, payloads)
    # A negative check, without a sleep: the coordinator dispatches in the SUBMIT's own turn
    # and in every turn after, and each status read is a connection of its own (a HELLO and a
    # QUERY: turns of their own). Read twice, nothing may have started on the paused worker.
    for _ in range(2):
        assert job_status(mesh_env, job)["counts"] == {"pending": 3}
    assert cli(mesh_env, "resume").returncode == 0
    wait_for(lambda: job_status(mesh_env, job)["counts"].get("done") == 1, what="1 done")
    wait_for(lambda: job_status(mesh_env, job)["counts"].get("running") == 1, what="the long one")
    env = {**os.environ, **mesh_env.env, "GPUMESH_URL": mesh_env.coordinator.url,
           "GPUMESH_TOKEN": mesh_env.token}
    with subprocess.Popen([sys.executable, "-m", "gpumesh", "drain", "--wait"], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as drain:
        wait_for(lambda: json.loads(cli(mesh_env, "workers", "--json").stdout)[0]["state"]
                 == "draining", what="the worker draining")
        gate.touch()  # the running task may finish now; the worker then leaves
        out, err = drain.communicate(timeout=60)
    drained = subprocess.CompletedProcess(drain.args, drain.returncode, out, err)
    assert drained.returncode == 0, drained.stderr
    assert "running task(s) will finish" in drained.stdout and "has left the mesh" in drained.stdout
    assert worker.proc.wait(timeout=10) == 0
    view = job_status(mesh_env, job)
    assert view["counts"] == {"done": 2, "pending": 1}  # the running task finished first
    mesh_env.add_worker(slots=1)
    wait_for(lambda: job_status(mesh_env, job)["counts"] == {"done": 3}, what="the rest")
    nobody = cli(mesh_env, "pause", "--worker", "zzzz")
    assert nobody.returncode == 1 and "no worker 'zzzz' runs on this machine" in nobody.stderr
    elsewhere = cli(mesh_env, "pause", env={"GPUMESH_HOME": str(tmp_path / "other")})
    assert elsewhere.returncode == 1 and "no worker runs on this machine" in elsewhere.stderr


def test_submit_wait_shows_what_the_scripts_log_on_stderr(mesh_env, tmp_path):
    # Only a failure's last 1,000 characters of stderr reached `submit --wait`, at the end.
    mesh_env.start_coordinator()
    worker = mesh_env.add_worker(slots=1)
    script, payloads = write_job(tmp_path, "import json, sys\n"
                                           "p = json.load(sys.stdin)\n"
                                           "print('epoch', p['x'], 'loss 0.5', file=sys.stderr)\n"
                                           "print(json.dumps(p))\n", [{"x": 1}, {"x": 2}])
    result = cli(mesh_env, "submit", script, "--payloads", payloads, "--wait")
    assert result.returncode == 0, result.stderr
    shown = [line for line in result.stderr.splitlines() if "loss" in line]
    assert sorted(shown) == [f"[{worker.worker_id[:8]}] epoch 1 loss 0.5",
                             f"[{worker.worker_id[:8]}] epoch 2 loss 0.5"]
    assert "loss" not in result.stdout  # stdout stays the bar and the results
    # With --json too (stdout stays one document), a last line without its newline included.
    script, payloads = write_job(tmp_path, "import json, sys\np = json.load(sys.stdin)\n"
                                           "print(json.dumps(p))\n"
                                           "sys.stderr.write('done, no newline')\n", [{"x": 1}])
    as_json = cli(mesh_env, "submit", script, "--payloads", payloads, "--wait", "--json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["counts"] == {"done": 1}
    assert f"[{worker.worker_id[:8]}] done, no newline" in as_json.stderr.splitlines()


def test_a_gpu_requirement_on_a_cpu_mesh_fails_naming_it(mesh_env, tmp_path):
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=1)
    script, payloads = write_job(tmp_path, SLEEPY, [{"x": 1, "gpu": "A100"}])
    result = cli(mesh_env, "submit", script, "--payloads", payloads, "--wait")
    assert result.returncode == 1
    assert "[failed]" in result.stdout and "A100" in result.stdout
    assert "closest:" in result.stdout


def test_fake_inventories_place_tasks_and_show_in_devices(mesh_env, tmp_path):
    mesh_env.start_coordinator()
    gpu = mesh_env.add_worker(slots=None, extra_args=["--max-slots", "2"], env={
        "GPUMESH_TEST_INVENTORY": json.dumps({"gpus": [{"name": "NVIDIA RTX 4090", "vram": 24e9}] * 4,
                                              "hostname": "gpubox"})})
    cpu = mesh_env.add_worker(slots=2, env={"GPUMESH_TEST_INVENTORY": '{"hostname": "cpubox"}'})
    listing = {w["id"]: w for w in json.loads(cli(mesh_env, "workers", "--json").stdout)}
    assert listing[gpu.worker_id]["slots"] == 2  # --max-slots caps the 4 detected GPUs
    pool = json.loads(cli(mesh_env, "devices", "--json").stdout)
    assert sorted(d["type"] for d in pool) == ["CPU", "GPU", "GPU", "GPU", "GPU"]
    table = cli(mesh_env, "devices").stdout
    assert "NVIDIA RTX 4090 24.0GB" in table and "2 worker(s), 4 GPU(s)" in table
    script, payloads = write_job(tmp_path, SLEEPY, [{"x": i, "gpu": "4090"} for i in range(4)]
                                 + [{"x": 9, "cores": 1}])
    job = submit_detached(mesh_env, script, payloads)
    final = wait_for(lambda: (lambda s: s if s["status"] == "finished" else None)(
        job_status(mesh_env, job)), what="the job")
    workers = [t["worker"] for t in final["tasks"]]
    assert workers[:4] == [gpu.worker_id] * 4
    assert [t["result"] for t in final["tasks"]][:4] == [{"x": i} for i in range(4)]
    assert cpu.worker_id in listing


@pytest.mark.parametrize("command", ["submit", "status", "cancel", "retry", "kill", "devices",
                                     "pause", "resume", "drain"])
def test_job_commands_have_help_with_an_example(command):
    result = subprocess.run([sys.executable, "-m", "gpumesh", command, "--help"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "Example" in result.stdout


@pytest.mark.parametrize("content, words", [
    ("not json", "is not valid JSON"), ("[]", "at least one payload"),
    ('{"lr": 0.1}', "must hold a JSON list"), ("[1, 2]", "must be a JSON object")])
def test_bad_payload_files_are_refused_before_anything_is_sent(tmp_path, content, words):
    script, payloads = write_job(tmp_path, SLEEPY, [])
    Path(payloads).write_text(content)
    result = subprocess.run(
        [sys.executable, "-m", "gpumesh", "submit", script, "--payloads", payloads,
         "--url", "tcp://127.0.0.1:9", "--token", "t" * 43],
        capture_output=True, text=True, timeout=30, env={**os.environ, "GPUMESH_HOME": str(tmp_path)})
    assert result.returncode == 1 and words in result.stderr
    assert "t" * 43 not in result.stderr
