"""gpumesh doctor against a real coordinator and workers on loopback, and with it stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from gpumesh._version import __version__


def doctor(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpumesh", "doctor", *args],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=60)


def _clean(env: dict[str, str]) -> dict[str, str]:
    return {**env, "GPUMESH_URL": "", "GPUMESH_TOKEN": ""}


def test_doctor_on_a_live_mesh_flags_the_worker_with_another_cloudpickle(mesh_env):
    coordinator = mesh_env.start_coordinator(save=True)
    mesh_env.add_worker()
    mesh_env.add_worker(env={"GPUMESH_TEST_INVENTORY": json.dumps(
        {"cloudpickle": "0.0.1", "hostname": "odd-one"})})
    mesh_env.wait_workers(2)
    config = (mesh_env.home / "config.json").read_bytes()
    env = _clean(mesh_env.env)

    text = doctor(env)
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert f"gpumesh {__version__} imported from" in out
    assert f"{coordinator.url} answers: 2 worker(s) alive" in out
    assert "odd-one: differs: cloudpickle 0.0.1" in out
    assert "1 of 2 worker(s) run other versions" in out
    assert mesh_env.token not in out + text.stderr

    as_json = doctor(env, "--json")
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)  # stdout is the document and nothing else
    checks = {c["name"]: c for c in doc["checks"]}
    assert checks["coordinator"]["data"]["answers"] is True
    assert checks["workers"]["status"] == "warn"
    odd = [w for w in checks["workers"]["data"]["workers"] if w["hostname"] == "odd-one"]
    assert odd[0]["differs"] == ["cloudpickle"]
    assert "warn: 1 of 2 worker(s)" in as_json.stderr
    assert mesh_env.token not in as_json.stdout + as_json.stderr
    assert (mesh_env.home / "config.json").read_bytes() == config  # read-only


def test_doctor_with_the_coordinator_down_warns_and_exits_zero(mesh_env):
    coordinator = mesh_env.start_coordinator(save=True)
    coordinator.stop()
    env = _clean(mesh_env.env)
    result = doctor(env, "--timeout", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"[WARN]  {coordinator.url} does not answer" in result.stdout
    assert mesh_env.token not in result.stdout + result.stderr
    doc = json.loads(doctor(env, "--json", "--timeout", "1").stdout)
    assert doc["status"] == "warn"
    assert {c["name"]: c for c in doc["checks"]}["coordinator"]["data"]["answers"] is False


def test_doctor_with_a_wrong_token_says_so(mesh_env):
    coordinator = mesh_env.start_coordinator(save=True)
    wrong = "x" * 11 + "." + "y" * 32
    result = doctor({**_clean(mesh_env.env), "GPUMESH_TOKEN": wrong}, "--url", coordinator.url)
    assert result.returncode == 0
    assert "refuses this token" in result.stdout
    assert wrong not in result.stdout + result.stderr and mesh_env.token not in result.stdout


def test_doctor_with_a_damaged_config_exits_one(tmp_path):
    (tmp_path / "config.json").write_text("not json")
    result = doctor({"GPUMESH_HOME": str(tmp_path), "GPUMESH_URL": "", "GPUMESH_TOKEN": ""})
    assert result.returncode == 1
    assert "[FAULT] cannot read the saved connection" in result.stdout
