"""Tokens as a user meets them: weak ones refused by a coordinator (or salted when accepted
knowingly), --token-file, the `ps` warning, and the token kept out of every output."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FAST

from gpumesh.cli.tokens import VISIBLE_WARNING
from gpumesh.client import GPUMesh
from gpumesh.client.launch import start_coordinator
from gpumesh.config import Settings
from gpumesh.errors import AuthenticationError, ConfigError
from gpumesh.security import kdf_for
from gpumesh.tokens import new_token, write_token_file

WEAK = "sunshine42"


def gpumesh(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpumesh", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, **FAST, "GPUMESH_HOME": str(home), **extra}
    for name in ("GPUMESH_TOKEN", "GPUMESH_URL", "GPUMESH_WEAK_TOKEN"):
        if name not in extra:
            env.pop(name, None)
    return env


def test_serve_refuses_a_short_token_and_says_how_to_make_one(tmp_path: Path) -> None:
    result = gpumesh("serve", "--port", "0", "--no-self-worker",
                     env=_env(tmp_path, GPUMESH_TOKEN=WEAK))
    assert result.returncode == 1
    assert "too weak to guard a coordinator" in result.stderr
    assert "gpumesh token" in result.stderr and "--weak-token" in result.stderr
    assert WEAK not in result.stdout + result.stderr
    assert VISIBLE_WARNING not in result.stderr  # it came from the environment, not argv
    typed = gpumesh("serve", "--port", "0", "--no-self-worker", "--token", WEAK,
                    env=_env(tmp_path))
    assert typed.returncode == 1
    assert VISIBLE_WARNING in typed.stderr and typed.stderr.count("ps, /proc") == 1
    assert WEAK not in typed.stdout + typed.stderr


def test_start_coordinator_refuses_a_short_token_before_starting_anything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUMESH_WEAK_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="weak_token=True") as caught:
        start_coordinator(port=0, token=WEAK, home=str(tmp_path), self_worker=False)
    assert WEAK not in str(caught.value)
    assert not list(tmp_path.iterdir())  # nothing was started, nothing written


def test_a_weak_token_accepted_knowingly_is_salted_and_works_only_salted(tmp_path: Path) -> None:
    env = {**FAST, "GPUMESH_HOME": str(tmp_path)}
    handle = start_coordinator(port=0, token=WEAK, weak_token=True, home=str(tmp_path),
                               self_worker=False, env=env)
    settings = Settings.from_env({**os.environ, **env})
    try:
        assert re.fullmatch(r"[A-Za-z0-9_-]{11}\.sunshine42", handle.token)
        assert WEAK not in repr(handle)
        with GPUMesh(handle.url, handle.token, quiet=True, settings=settings) as mesh:
            assert mesh.workers() == []
        # The bare secret is another token: its keys are derived with no salt.
        bare = GPUMesh(handle.url, WEAK, quiet=True, settings=settings)
        try:
            with pytest.raises(AuthenticationError):
                bare.workers()
        finally:
            bare.close()
    finally:
        handle.stop()


def _serve_until_ready(args: list[str], env: dict[str, str]) -> tuple[str, str]:
    """Run `gpumesh serve ARGS` until its self-check passes, stop it; (stdout, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "gpumesh", "serve", "--port", "0",
                             "--no-self-worker", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "Self-check" in line:
                break
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            # Killed here, so its failure stays in this test: a Popen left running warns when
            # it is collected, and that warning fails whichever later test is running then.
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            pytest.fail(f"gpumesh serve did not stop within 20 s of SIGINT; it said:\n{err}")
    return "".join(lines) + out, err


def test_the_banner_keeps_the_token_off_command_lines_and_saves_it_0600(tmp_path: Path) -> None:
    home = tmp_path / "home"
    token = new_token()
    out, err = _serve_until_ready(["--token", token], _env(home))
    assert token not in out + err
    assert parse_secret(token) not in out + err
    assert VISIBLE_WARNING in err
    assert "Token: <your token> (as given; never printed)" in out
    assert "gpumesh join tcp://127.0.0.1:" in out and f"--token-file {home}/token" in out
    assert not re.search(r"--token(?!-file)", out), out  # no command line to copy a token into
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    for name in ("token", "config.json"):
        assert stat.S_IMODE((home / name).stat().st_mode) == 0o600
    assert (home / "token").read_text() == token + "\n"
    saved = json.loads((home / "config.json").read_text())
    assert saved["token"] == token and saved["kdf"]["name"] == kdf_for(token)
    # A monitoring command with --token-file and no URL: the saved coordinator answers (it has
    # stopped by now, so the answer is the clear "cannot reach" error, with no token in it).
    result = gpumesh("workers", "--token-file", str(home / "token"), env=_env(home))
    assert "cannot reach a coordinator" in result.stderr
    assert token not in result.stdout + result.stderr
    assert VISIBLE_WARNING not in result.stderr


def test_serve_reads_the_token_file_and_refuses_both_ways_at_once(tmp_path: Path) -> None:
    token_file = tmp_path / "mesh.token"
    token = new_token()
    write_token_file(token_file, token)
    out, err = _serve_until_ready(["--token-file", str(token_file), "--no-save"],
                                  _env(tmp_path / "home"))
    assert token not in out + err and "Self-check" in out and VISIBLE_WARNING not in err
    both = gpumesh("serve", "--port", "0", "--token", token, "--token-file", str(token_file),
                   env=_env(tmp_path / "home"))
    assert both.returncode == 1 and "not both" in both.stderr
    assert token not in both.stdout + both.stderr


def test_gpumesh_token_makes_strong_salted_tokens(tmp_path: Path) -> None:
    printed = gpumesh("token", env=_env(tmp_path)).stdout.strip()
    assert re.fullmatch(r"rand-[A-Za-z0-9_-]{8}\.[A-Za-z0-9_-]{32}", printed)
    path = tmp_path / "mesh.token"
    made = gpumesh("token", "--file", str(path), env=_env(tmp_path))
    assert made.returncode == 0 and made.stdout == ""
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = gpumesh("token", "--file", str(path), env=_env(tmp_path))
    assert again.returncode == 1 and "exists already" in again.stderr
    assert path.read_text().strip() not in again.stdout + again.stderr


def parse_secret(token: str) -> str:
    return token.split(".", 1)[1]
