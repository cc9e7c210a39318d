"""``gpumesh setup`` as a user meets it: the real command in a pseudo-terminal, answered with
keystrokes, then what it saved used by the real commands."""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import shlex
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FAST, require

from gpumesh.cli.serve import save_served
from gpumesh.cli.setup import needs_ui
from gpumesh.config import Settings
from gpumesh.tokens import new_token

if sys.platform == "win32":
    pytest.skip("pseudo-terminals are POSIX only", allow_module_level=True)

pexpect = require("pexpect")
require("questionary")
require("rich")

DOWN, ENTER, CTRL_C, CTRL_U = "\x1b[B", "\r", "\x03", "\x15"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
TOKEN_SHAPE = re.compile(r"[A-Za-z0-9_-]{11,13}\.[A-Za-z0-9_-]{22,}")  # SALT.SECRET
PROMPT_TIMEOUT = 30


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, **FAST, "GPUMESH_HOME": str(home),
           "GPUMESH_DISCOVERY_INTERFACES": "127.0.0.1",
           # No cursor-position request: a pty that nobody answers would make prompt_toolkit
           # wait for one and then warn.
           "PROMPT_TOOLKIT_NO_CPR": "1", "NO_COLOR": "1", "TERM": "xterm", **extra}
    for name in ("GPUMESH_TOKEN", "GPUMESH_URL", "GPUMESH_HOST"):
        env.pop(name, None)
    return env


class Wizard:
    """``gpumesh setup`` in a pty; ``output`` is all it wrote, escape sequences removed."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self._log = io.StringIO()
        self.child = pexpect.spawn(sys.executable, ["-m", "gpumesh", *args, "setup"], env=env,
                                   encoding="utf-8", codec_errors="replace",
                                   dimensions=(50, 200), timeout=PROMPT_TIMEOUT)
        self.child.logfile_read = self._log

    def answer(self, prompt: str, keys: str) -> None:
        self.child.expect_exact(prompt)
        self.child.send(keys)

    def finish(self) -> int:
        self.child.expect(pexpect.EOF)
        self.child.close()
        return int(self.child.exitstatus if self.child.exitstatus is not None
                   else 128 + self.child.signalstatus)

    @property
    def output(self) -> str:
        return ANSI.sub("", self._log.getvalue())

    def kill(self) -> None:
        if self.child.isalive():
            self.child.terminate(force=True)


@pytest.fixture
def wizards() -> Iterator[list[Wizard]]:
    started: list[Wizard] = []
    yield started
    for wizard in started:
        wizard.kill()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _start_serve(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], int]:
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "gpumesh", *args, "--no-self-worker",
                             "--ready-fd", str(write_fd)], env=env, pass_fds=[write_fd],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as ready:
        port = int(ready.readline() or b"0")
    if not port:
        proc.kill()
        pytest.fail(f"serve did not start: {proc.communicate(timeout=15)[0]}")
    return proc, port


def _stop(proc: subprocess.Popen[str]) -> str:
    os.killpg(proc.pid, signal.SIGTERM)
    return proc.communicate(timeout=15)[0]


def _join_until_admitted(args: list[str], env: dict[str, str]) -> tuple[bool, str]:
    """Run ``gpumesh join ARGS`` until the coordinator admits it, then stop it: (admitted, its
    output). A join that exits first is (False, its output)."""
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "gpumesh", "join", *args, "--no-benchmark",
                             "--ready-fd", str(write_fd)], env=env, pass_fds=[write_fd],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as ready:
        admitted = bool(ready.readline().strip())
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    return admitted, proc.communicate(timeout=15)[0]


@pytest.fixture
def advertised(tmp_path: Path) -> Iterator[tuple[int, str]]:
    """A coordinator bound to loopback and advertising it there (--host-ip), standing in for a
    LAN coordinator: (its port, its token)."""
    token = secrets.token_urlsafe(32)
    env = {**_env(tmp_path / "coordinator"), "GPUMESH_TOKEN": token}
    proc, port = _start_serve(["serve", "--port", "0", "--host-ip", "127.0.0.1", "--no-save"],
                              env)
    try:
        yield port, token
    finally:
        _stop(proc)


def test_serve_path_saves_what_serve_then_runs_with(tmp_path, wizards):
    home = tmp_path / "home"
    env = _env(home)
    wizard = Wizard(env)
    wizards.append(wizard)
    wizard.answer("This machine will", ENTER)  # start a coordinator
    wizard.answer("The mesh's token", ENTER)  # generate a new one
    wizard.answer("Who may connect", ENTER)  # this machine only
    free = _free_port()
    wizard.answer("Port:", CTRL_U + "0" + ENTER)  # the default is replaced; 0 is refused
    wizard.answer("a port is a number from 1 to 65535", CTRL_U + str(free) + ENTER)
    wizard.answer("Save this?", "y")
    assert wizard.finish() == 0, wizard.output

    config, token_file = home / "config.json", home / "token"
    saved = json.loads(config.read_text())
    token = token_file.read_text().strip()
    assert saved["url"] == f"tcp://127.0.0.1:{free}" and saved["token"] == token
    assert "kdf" in saved  # the stretched-key cache, as serve saves it
    assert _mode(config) == _mode(token_file) == 0o600 and _mode(home) == 0o700
    assert token not in wizard.output
    assert "Summary" in wizard.output and "Token:             new, never shown" in wizard.output

    # The command it prints is the one to run, and everything else finds what it saved.
    line = next(row.strip() for row in wizard.output.splitlines()
                if row.strip().startswith("gpumesh serve "))
    assert line == f"gpumesh serve --port {free} --token-file {token_file}"
    args = shlex.split(line)[1:]
    args[args.index(str(free))] = "0"  # free now: the one chosen may be taken since
    serve, port = _start_serve(args, env)
    try:
        listed = subprocess.run([sys.executable, "-m", "gpumesh", "workers", "--json",
                                 "--url", f"127.0.0.1:{port}"], env=env, capture_output=True,
                                text=True, timeout=60)
        assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr
    finally:
        output = _stop(serve)
    assert "Token: <your token> (as given; never printed)" in output and token not in output


def test_plain_serve_after_the_wizard_keeps_its_token_and_port(tmp_path, wizards):
    home = tmp_path / "home"
    env = _env(home)
    wizard = Wizard(env)
    wizards.append(wizard)
    wizard.answer("This machine will", ENTER)  # start a coordinator
    wizard.answer("The mesh's token", ENTER)  # generate a new one
    wizard.answer("Who may connect", ENTER)  # this machine only
    free = _free_port()
    wizard.answer("Port:", CTRL_U + str(free) + ENTER)
    wizard.answer("Save this?", "y")
    assert wizard.finish() == 0, wizard.output
    token = (home / "token").read_text().strip()
    config = (home / "config.json").read_text()

    serve, port = _start_serve(["serve"], env)  # no --port, no token
    output = _stop(serve)
    shown = token in output
    assert not shown, "serve printed the saved token"
    output = TOKEN_SHAPE.sub("<a token>", output)  # one it made, shown by a failure below
    assert port == free, output
    assert "reused; never printed" in output and "generated for you" not in output
    kept = (home / "token").read_text().strip() == token and json.loads(
        (home / "config.json").read_text())["token"] == json.loads(config)["token"]
    assert kept


def _saved_coordinator(home: Path) -> tuple[str, int]:
    """A coordinator's saved token and port in ``home``, as serve or setup saves them."""
    token, port = new_token(), _free_port()
    save_served(Settings(home=home), f"tcp://127.0.0.1:{port}", token, ("127.0.0.1", port))
    return token, port


def test_setup_again_keeps_the_current_token_by_default(tmp_path, wizards):
    home = tmp_path / "home"
    token, port = _saved_coordinator(home)
    wizard = Wizard(_env(home))
    wizards.append(wizard)
    wizard.answer("holds a saved connection", "y")
    wizard.answer("This machine will", ENTER)
    wizard.answer("keep the current token", ENTER)  # the first choice, the default
    wizard.answer("Who may connect", ENTER)
    wizard.answer("Port:", ENTER)  # the saved port is the default
    wizard.answer("Save this?", "y")
    assert wizard.finish() == 0, wizard.output
    assert "Token:             kept (the current one), never shown" in wizard.output
    assert "locked out" not in wizard.output
    saved = json.loads((home / "config.json").read_text())
    assert saved["url"] == f"tcp://127.0.0.1:{port}"
    kept = saved["token"] == token and (home / "token").read_text().strip() == token
    assert kept and token not in wizard.output


def test_setup_again_with_a_new_token_says_who_is_locked_out(tmp_path, wizards):
    home = tmp_path / "home"
    token, _ = _saved_coordinator(home)
    wizard = Wizard(_env(home))
    wizards.append(wizard)
    wizard.answer("holds a saved connection", "y")
    wizard.answer("This machine will", ENTER)
    wizard.answer("keep the current token", DOWN + ENTER)  # generate a new one
    wizard.answer("Who may connect", ENTER)
    wizard.answer("Port:", ENTER)
    wizard.answer("Save this?", "y")
    assert wizard.finish() == 0, wizard.output
    summary = " ".join(wizard.output.split())  # the summary line may wrap
    assert "workers holding the old token are locked out until they get the new one" in summary
    replaced = (home / "token").read_text().strip() != token
    assert replaced and token not in wizard.output


def test_a_weak_token_is_warned_about_once_and_the_hints_name_real_paths(tmp_path, wizards):
    home = tmp_path / "client"
    weak = "hunter2hunter2"
    wizard = Wizard(_env(home))  # discovery on, on loopback, where nothing is advertised
    wizards.append(wizard)
    wizard.answer("This machine will", DOWN + DOWN + ENTER)  # use it from Python only
    wizard.answer(f"Paste the token (the coordinator's {home / 'token'};", weak + ENTER)
    wizard.answer("Coordinator address", "127.0.0.1:9" + ENTER)
    wizard.answer("Check that it answers now?", "n")
    wizard.answer("Save this?", ENTER)
    assert wizard.finish() == 0, wizard.output
    assert wizard.output.count("this mesh's token is weak") == 1, wizard.output
    summary = " ".join(wizard.output.split())
    assert "A coordinator bound to 127.0.0.1 is never advertised ('gpumesh serve --host " \
           "0.0.0.0' advertises it)" in summary
    assert "python demo.py" not in wizard.output and "gpumesh demo" in wizard.output
    shown = weak in wizard.output
    assert not shown


def test_join_path_offers_the_coordinator_that_discovery_finds(tmp_path, advertised, wizards):
    port, token = advertised
    home = tmp_path / "worker"
    # A deadline, not a wait: browsing returns once this mesh answers (about 1 s on loopback).
    wizard = Wizard(_env(home, GPUMESH_DISCOVERY_TIMEOUT="15"))
    wizards.append(wizard)
    wizard.answer("This machine will", DOWN + ENTER)  # join a mesh as a worker
    wizard.answer("Paste the token", token + ENTER)
    wizard.answer("coordinator(s) of this mesh", "")
    wizard.child.expect_exact(f"at tcp://127.0.0.1:{port}")
    wizard.child.send(ENTER)
    wizard.answer("(slots)", CTRL_U + "3" + ENTER)
    wizard.answer("Save this?", ENTER)
    assert wizard.finish() == 0, wizard.output

    saved = json.loads((home / "config.json").read_text())
    assert saved["url"] == f"tcp://127.0.0.1:{port}" and saved["token"] == token
    assert (home / "token").read_text().strip() == token
    assert _mode(home / "config.json") == _mode(home / "token") == 0o600
    assert saved["slots"] == 3
    assert "Looking for this mesh's coordinator" in wizard.output
    assert any(row.strip() == "gpumesh join" for row in wizard.output.splitlines())
    assert token not in wizard.output

    # That plain command works: the saved coordinator, token and slots, nothing asked of the
    # LAN (discovery off), no token in the environment.
    admitted, output = _join_until_admitted([], _env(home, GPUMESH_DISCOVERY="0"))
    assert admitted, output
    assert f"dialling the saved coordinator tcp://127.0.0.1:{port}" in output
    assert "runs up to 3 task(s) at once" in output and token not in output
    # A token file alone keeps the saved coordinator too, instead of browsing the LAN.
    admitted, output = _join_until_admitted(["--token-file", str(home / "token")],
                                            _env(home, GPUMESH_DISCOVERY="0"))
    assert admitted, output


def test_a_typed_address_is_checked_before_it_is_saved(tmp_path, advertised, wizards):
    port, token = advertised
    home = tmp_path / "client"
    wizard = Wizard(_env(home, GPUMESH_DISCOVERY="0"))
    wizards.append(wizard)
    wizard.answer("This machine will", DOWN + DOWN + ENTER)  # use it from Python only
    wizard.answer("Paste the token", token + ENTER)
    wizard.answer("Coordinator address", "ftp://x" + ENTER)
    wizard.answer("unsupported URL scheme", CTRL_U + f"gpumesh://127.0.0.1:{port}" + ENTER)
    wizard.answer("Check that it answers now?", ENTER)
    wizard.answer("answers: 0 worker(s) alive", "")
    wizard.answer("Save this?", ENTER)
    assert wizard.finish() == 0, wizard.output

    saved = json.loads((home / "config.json").read_text())
    assert saved["url"] == f"tcp://127.0.0.1:{port}" and saved["token"] == token
    assert not (home / "token").exists()  # a client needs the config only
    assert "gpumesh workers" in wizard.output and token not in wizard.output
    # What it saved is what the next command uses.
    listed = subprocess.run([sys.executable, "-m", "gpumesh", "workers", "--json"],
                            env=_env(home), capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr


def test_ctrl_c_at_any_prompt_saves_nothing(tmp_path, wizards):
    home = tmp_path / "home"
    wizard = Wizard(_env(home))
    wizards.append(wizard)
    wizard.answer("This machine will", ENTER)
    wizard.answer("The mesh's token", DOWN + ENTER)  # paste one
    wizard.answer("Paste the token", "half-typed" + CTRL_C)
    assert wizard.finish() == 130
    assert "setup cancelled: nothing was saved" in wizard.output
    assert not (home / "config.json").exists() and not (home / "token").exists()


def test_an_existing_config_is_replaced_only_when_the_user_says_so(tmp_path, wizards):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    before = json.dumps({"url": "tcp://127.0.0.1:9", "token": "k" * 40})
    (home / "config.json").write_text(before)
    wizard = Wizard(_env(home))
    wizards.append(wizard)
    wizard.answer("holds a saved connection (coordinator tcp://127.0.0.1:9)", ENTER)  # no
    assert wizard.finish() == 1
    assert "nothing was saved" in wizard.output
    assert (home / "config.json").read_text() == before


def test_without_a_terminal_it_shows_the_commands_that_ask_nothing(tmp_path):
    done = subprocess.run([sys.executable, "-m", "gpumesh", "setup"], env=_env(tmp_path),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "not a terminal" in done.stderr
    assert "gpumesh serve --port 8000 --token-file mesh.token" in done.stderr
    assert "gpumesh join --token-file mesh.token" in done.stderr
    assert not (tmp_path / "config.json").exists()


def test_without_the_ui_extra_it_says_what_to_install(tmp_path, wizards):
    code = ("import sys; sys.modules['questionary'] = None; sys.argv = ['gpumesh', 'setup'];"
            "from gpumesh.cli.main import main; main()")
    child = pexpect.spawn(sys.executable, ["-c", code], env=_env(tmp_path), encoding="utf-8",
                          timeout=PROMPT_TIMEOUT)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 1
    # As gpumesh was installed: here, the checkout the tests run from.
    assert needs_ui() in " ".join(child.before.split())
