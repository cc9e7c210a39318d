"""What ``serve`` and ``join`` take from the connection saved on this machine when they are told
nothing: the coordinator's own token, address and port; a worker's coordinator, token and slots.
Real commands on 127.0.0.1, in a temporary GPUMESH_HOME; no token ever reaches the output."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from conftest import FAST

from gpumesh.config import save_connection
from gpumesh.tokens import new_token, write_token_file


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, **FAST, "GPUMESH_HOME": str(home), **extra}
    for name in ("GPUMESH_TOKEN", "GPUMESH_URL", "GPUMESH_HOST", "GPUMESH_WEAK_TOKEN"):
        if name not in extra:
            env.pop(name, None)
    return env


# A token as gpumesh makes them (SALT.SECRET): blanked out of any output a test may show.
TOKEN_SHAPE = re.compile(r"[A-Za-z0-9_-]{11,13}\.[A-Za-z0-9_-]{22,}")


def _until_ready(args: list[str], env: dict[str, str]) -> tuple[str, str]:
    """Run ``gpumesh ARGS --ready-fd N`` until it reports ready, then stop it: (what it wrote
    to the fd, or "" when it exited first; its output, every token in it blanked out, so that
    a failed assertion shows none).  ``_leaks`` checks the raw output."""
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "gpumesh", *args, "--ready-fd", str(write_fd)],
                            env=env, pass_fds=[write_fd], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    os.close(write_fd)
    try:
        with os.fdopen(read_fd, "rb") as ready:
            line = ready.readline().decode().strip()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        output = proc.communicate(timeout=30)[0]
    _raw.append(output)
    return line, TOKEN_SHAPE.sub("<a token>", output)


_raw: list[str] = []


def _leaks(token: str) -> bool:
    """Whether the last command's output showed the token or its secret (a bool, so that a
    failure prints neither)."""
    return token in _raw[-1] or token.split(".", 1)[-1] in _raw[-1]


def test_plain_serve_reuses_the_token_address_and_port_its_coordinator_saved(tmp_path):
    home = tmp_path / "home"
    env = _env(home)
    # 127.0.0.2 is loopback too: a bind address other than the default, without leaving lo.
    first, output = _until_ready(["serve", "--host", "127.0.0.2", "--port", "0",
                                  "--no-self-worker"], env)
    assert first, output
    token = (home / "token").read_text().strip()
    assert f"Saved, readable only by you, in {home / 'token'}" in output

    port, output = _until_ready(["serve", "--no-self-worker"], env)
    leaked = _leaks(token)
    assert not leaked, "serve printed the saved token"
    assert port == first, output
    assert f"Coordinator listening on 127.0.0.2:{first}" in output, output
    assert "the address and port as this machine's coordinator saved them" in output
    assert f"Token: <your token> (the one saved in {home / 'token'}, reused" in output
    assert "replacing" not in output and "generated for you" not in output
    kept = (home / "token").read_text().strip() == token == json.loads(
        (home / "config.json").read_text())["token"]
    assert kept  # a bool: a failure prints no token
    assert json.loads((home / "config.json").read_text())["serve"] == {
        "host": "127.0.0.2", "port": int(first)}

    # A different token given explicitly is used and saved, and the replacement is said.
    other = new_token()
    port, output = _until_ready(["serve", "--no-self-worker"], _env(home, GPUMESH_TOKEN=other))
    leaked = _leaks(other) or _leaks(token)
    assert not leaked, "serve printed a token"
    assert port == first, output
    assert "Token: <your token> (as given; never printed)" in output
    assert "replacing the token saved there before: workers holding the old one are locked " \
           "out until they get this one" in output, output
    replaced = (home / "token").read_text().strip() == other
    assert replaced


def test_serve_makes_a_token_only_when_none_is_saved_and_never_over_an_unreadable_one(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "token").write_text("")  # empty: not a token
    os.chmod(home / "token", 0o600)
    port, output = _until_ready(["serve", "--port", "0", "--no-self-worker"], _env(home))
    assert not port and "holds this machine's saved token" in output, output
    assert (home / "token").read_text() == ""


def test_a_weak_saved_token_is_reused_only_when_accepted_again(tmp_path):
    home = tmp_path / "home"
    weak = "sunshine42"
    first, output = _until_ready(["serve", "--port", "0", "--no-self-worker", "--weak-token"],
                                 _env(home, GPUMESH_TOKEN=weak))
    assert first, output
    salted = (home / "token").read_text().strip()
    port, output = _until_ready(["serve", "--no-self-worker"], _env(home))
    assert not port and "is too weak to guard a coordinator" in output, output
    assert "--weak-token to keep it" in output and "leave the token out" not in output
    port, output = _until_ready(["serve", "--no-self-worker", "--weak-token"], _env(home))
    leaked = _leaks(salted) or weak in _raw[-1]
    assert not leaked
    assert port == first, output
    kept = (home / "token").read_text().strip() == salted
    assert kept


def test_a_workers_saved_token_is_not_a_coordinators(tmp_path):
    """A worker's saved connection (to another machine) holds that mesh's token: a coordinator
    started here makes its own, and says it replaced the saved one."""
    home = tmp_path / "home"
    theirs = new_token()
    save_connection(home / "config.json", "tcp://192.0.2.10:8000", theirs)
    write_token_file(home / "token", theirs)
    port, output = _until_ready(["serve", "--port", "0", "--no-self-worker"], _env(home))
    assert port, "serve did not start"
    # Its output is not a terminal: the new token is in the saved file, not in the output.
    assert f"Token: <generated> (saved in {home / 'token'}; not printed" in output
    assert "replacing the token saved there before" in output
    made = (home / "token").read_text().strip()
    different = made != theirs
    assert different
    leaked = _leaks(made)
    assert not leaked, "serve printed the token it generated into a pipe"


def test_plain_join_uses_the_saved_url_token_and_slots(tmp_path, mesh_env):
    coordinator = mesh_env.start_coordinator()
    home = tmp_path / "worker"
    save_connection(home / "config.json", coordinator.url, mesh_env.token, slots=2)
    # Discovery off: the saved URL is dialled, nothing is looked for on the LAN.
    env = _env(home, GPUMESH_DISCOVERY="0")
    worker, output = _until_ready(["join", "--no-benchmark", "--no-save"], env)
    assert worker, output
    assert f"dialling the saved coordinator {coordinator.url}" in output
    assert "runs up to 2 task(s) at once" in output
    leaked = _leaks(mesh_env.token)
    assert not leaked

    # --token-file alone keeps the saved URL; --slots wins over the saved count.
    token_file = tmp_path / "mesh.token"
    write_token_file(token_file, mesh_env.token)
    worker, output = _until_ready(["join", "--token-file", str(token_file), "--slots", "1",
                                   "--no-benchmark", "--no-save"], env)
    assert worker, output
    assert "runs up to 1 task(s) at once" in output


def test_join_saves_the_slots_it_was_told_and_keeps_the_coordinators_own_record(tmp_path,
                                                                              mesh_env):
    coordinator = mesh_env.start_coordinator()
    home = tmp_path / "both"
    save_connection(home / "config.json", coordinator.url, mesh_env.token,
                    served=("127.0.0.1", coordinator.port))
    worker, output = _until_ready(["join", "--slots", "3", "--no-benchmark"],
                                  _env(home, GPUMESH_DISCOVERY="0"))
    assert worker, output
    saved = json.loads((home / "config.json").read_text())
    assert saved["slots"] == 3
    assert saved["serve"] == {"host": "127.0.0.1", "port": coordinator.port}


def test_join_with_nothing_saved_and_no_token_says_how_to_get_one(tmp_path):
    done = subprocess.run([sys.executable, "-m", "gpumesh", "join", "--no-benchmark"],
                          env=_env(tmp_path / "empty"), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1
    assert "no token" in done.stderr and "gpumesh setup" in done.stderr


def test_a_saved_bind_beyond_loopback_is_not_taken_again_without_being_asked(tmp_path):
    # "No flag at all is loopback only": a plain serve after one with --host 0.0.0.0 bound
    # 0.0.0.0 again, while the exposed banner gave that command as the loopback one.
    home = tmp_path / "home"
    env = _env(home)
    first, output = _until_ready(["serve", "--port", "0", "--no-self-worker"], env)
    assert first, output
    config = json.loads((home / "config.json").read_text())
    config["serve"]["host"] = "0.0.0.0"  # as a serve --host 0.0.0.0 saves it; none is bound
    (home / "config.json").write_text(json.dumps(config))
    port, output = _until_ready(["serve", "--no-self-worker"], env)
    assert port == first, output
    assert f"Coordinator listening on 127.0.0.1:{first}" in output, output
    assert "the last coordinator here was bound to 0.0.0.0; without --host it is loopback " \
           "only: pass --host 0.0.0.0" in output, output


def test_a_weak_token_salted_but_not_saved_says_how_to_keep_the_same_mesh(tmp_path):
    import re

    home = tmp_path / "home"
    weak = "sunshine42"
    port, output = _until_ready(
        ["serve", "--no-self-worker", "--port", "0", "--weak-token", "--no-save"],
        _env(home, GPUMESH_TOKEN=weak))
    assert port, output
    salt = re.search(r"Token: ([A-Za-z0-9_-]{11})\.<your token>", output)
    assert salt is not None, output
    assert (f"Not saved (--no-save): start it again with the token in this form "
            f"(GPUMESH_TOKEN={salt.group(1)}.<your token>) to keep the same mesh") in output
    assert not _leaks(weak) and not (home / "token").exists()
