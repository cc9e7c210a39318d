"""``gpumesh serve --tailscale`` and ``--public`` as real processes, on loopback only: a fake
``tailscale`` that answers 127.0.0.2 (a loopback address, TESTING.md's network rule) and a
fake tunnel provider installed by a launcher script, so no packet leaves the machine."""

from __future__ import annotations

import errno
import os
import secrets
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FAST

TAILNET_STANDIN = "127.0.0.2"

# Runs the CLI with a fake ngrok: it records what it was asked to forward and when it closed.
LAUNCHER = '''
import sys
from pathlib import Path

from gpumesh import tunnels

LOG = Path(sys.argv[1])
MODE = sys.argv[2]


class FakeTunnel:
    def open(self, host, port):
        LOG.write_text(f"open {host}:{port}\\n")
        if MODE == "fail":
            raise tunnels.TunnelError("--public: ngrok could not open a TCP tunnel: ERR_NGROK_4018")
        return "tcp://7.tcp.ngrok.io:19123"

    def close(self):
        with LOG.open("a") as log:
            log.write("closed\\n")


if MODE == "no-pyngrok":
    sys.modules["pyngrok"] = None  # the real provider, as on a machine without the extra
else:
    tunnels.NgrokProvider = FakeTunnel
sys.argv = ["gpumesh", *sys.argv[3:]]
from gpumesh.cli.main import main

main()
'''


def _env(tmp_path: Path, token: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, **FAST, "GPUMESH_HOME": str(tmp_path / "home"), "GPUMESH_TOKEN": token,
           **extra}
    for name in ("GPUMESH_URL", "GPUMESH_HOST", "GPUMESH_WEAK_TOKEN"):
        env.pop(name, None)
    return env


def _fake_tailscale(tmp_path: Path, body: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "tailscale"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


class Serve:
    """One ``serve`` process started with --ready-fd; stopped (its process group) at teardown."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        read_fd, write_fd = os.pipe()
        self.proc = subprocess.Popen([*argv, "--ready-fd", str(write_fd)], env=env,
                                     pass_fds=[write_fd], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as ready:  # EOF if serve exits first: never hangs
            self.port = int(ready.readline() or b"0")

    def stop(self) -> tuple[str, str]:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.communicate(timeout=10)


@pytest.fixture
def serves() -> Iterator[list[Serve]]:
    started: list[Serve] = []
    yield started
    for serve in started:
        serve.stop()


def _connects(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(5)
        code = sock.connect_ex((host, port))
    assert code in (0, errno.ECONNREFUSED), os.strerror(code)
    return code == 0


def test_serve_tailscale_binds_and_prints_the_tailscale_address(tmp_path, serves):
    token = secrets.token_urlsafe(32)
    path = _fake_tailscale(tmp_path, f'[ "$*" = "ip -4" ] && echo {TAILNET_STANDIN}')
    serve = Serve([sys.executable, "-m", "gpumesh", "serve", "--tailscale", "--port", "0",
                   "--no-self-worker", "--no-save"], _env(tmp_path, token, PATH=path))
    serves.append(serve)
    assert serve.port, "serve did not start: " + "".join(serve.stop())
    # Bound to the Tailscale address only: nothing answers on 127.0.0.1 at that port.
    assert _connects(TAILNET_STANDIN, serve.port)
    assert not _connects("127.0.0.1", serve.port)
    out, err = serve.stop()
    assert f"Coordinator listening on {TAILNET_STANDIN}:{serve.port}" in out
    assert (f"Join over Tailscale:      gpumesh join tcp://{TAILNET_STANDIN}:{serve.port}"
            " --token-file FILE") in out
    assert "Not advertised on the LAN" in out
    assert f"'tailscale ip -4' answered {TAILNET_STANDIN}, outside Tailscale's" in err
    assert token not in out + err


@pytest.mark.parametrize(("body", "said"), [
    ("echo 'Tailscale is stopped.' >&2; exit 1",
     "'tailscale ip -4' failed (exit 1): Tailscale is stopped."),
    ("exit 0", "'tailscale ip -4' printed no address"),
    ("echo 'not an address'", "answered 'not an address', not an IPv4 address"),
])
def test_serve_tailscale_that_cannot_get_an_address_says_so_in_one_line(tmp_path, body, said):
    token = secrets.token_urlsafe(32)
    env = _env(tmp_path, token, PATH=_fake_tailscale(tmp_path, body))
    done = subprocess.run([sys.executable, "-m", "gpumesh", "serve", "--tailscale", "--port", "0",
                           "--no-self-worker", "--no-save"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --tailscale: ") and said in lines[0]
    assert "Coordinator listening" not in done.stdout and token not in done.stdout + done.stderr


def test_serve_tailscale_refuses_host_ip_and_public_together(tmp_path):
    env = _env(tmp_path, secrets.token_urlsafe(32),
               PATH=_fake_tailscale(tmp_path, "echo 100.64.0.1"))
    base = [sys.executable, "-m", "gpumesh", "serve", "--tailscale", "--port", "0", "--no-save"]
    for extra, said in ((["--host-ip", "100.64.0.9"], "drop --host-ip"),
                        (["--public"], "choose one")):
        done = subprocess.run([*base, *extra], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 1 and said in done.stderr, done.stderr


def _launcher(tmp_path: Path, mode: str, *args: str) -> list[str]:
    script = tmp_path / "launch.py"
    script.write_text(LAUNCHER)
    return [sys.executable, str(script), str(tmp_path / "tunnel.log"), mode, *args]


def test_serve_public_prints_the_url_and_the_warning_and_closes_the_tunnel(tmp_path, serves):
    token = secrets.token_urlsafe(32)
    serve = Serve(_launcher(tmp_path, "ok", "serve", "--public", "--port", "0",
                            "--no-self-worker"), _env(tmp_path, token))
    serves.append(serve)
    assert serve.port, "serve did not start: " + "".join(serve.stop())
    log = tmp_path / "tunnel.log"
    assert log.read_text() == f"open 127.0.0.1:{serve.port}\n"
    out, err = serve.stop()
    assert log.read_text().splitlines()[-1] == "closed"
    home = tmp_path / "home"
    assert ("Join from ANYWHERE:       gpumesh join tcp://7.tcp.ngrok.io:19123 "
            f"--token-file {home}/token") in out
    assert "Anyone on the internet who has the token can run arbitrary code" in out
    assert "the token\n   is the only thing keeping them out" in out
    assert "Bound to 127.0.0.1 only: the LAN cannot reach it, the tunnel below can." in out
    assert "Other machines CANNOT reach" not in out
    assert "[gpumesh] public tunnel closed" in out
    assert token not in out + err


def test_serve_public_whose_tunnel_fails_stops_with_one_line(tmp_path):
    token = secrets.token_urlsafe(32)
    done = subprocess.run(_launcher(tmp_path, "fail", "serve", "--public", "--port", "0",
                                    "--no-self-worker", "--no-save"),
                          env=_env(tmp_path, token), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: --public: ngrok could not open a TCP tunnel: ERR_NGROK_4018"]
    assert "Join from ANYWHERE" not in done.stdout and token not in done.stdout + done.stderr


def test_serve_public_without_pyngrok_says_which_extra_to_install(tmp_path):
    done = subprocess.run(_launcher(tmp_path, "no-pyngrok", "serve", "--public", "--port", "0",
                                    "--no-self-worker", "--no-save"),
                          env=_env(tmp_path, secrets.token_urlsafe(32)), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    assert "error: --public needs pyngrok: pip install 'gpumesh[tunnel]'" in done.stderr


def test_serve_public_refuses_a_weak_token(tmp_path):
    done = subprocess.run(_launcher(tmp_path, "ok", "serve", "--public", "--port", "0",
                                    "--no-self-worker", "--no-save", "--weak-token"),
                          env=_env(tmp_path, "sunshine42"), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and "--public refuses a weak token" in done.stderr
    assert not (tmp_path / "tunnel.log").exists()
    assert "sunshine42" not in done.stdout + done.stderr


def test_serve_public_refuses_a_bind_the_tunnel_would_reach_beyond_loopback(tmp_path):
    # Bound to one LAN address, the tunnel dialled it: every peer came from that address,
    # which the lockout does not exempt, so one stranger's failed tries locked all out.
    done = subprocess.run(_launcher(tmp_path, "ok", "serve", "--public", "--host", "192.0.2.7",
                                    "--port", "0", "--no-self-worker", "--no-save"),
                          env=_env(tmp_path, secrets.token_urlsafe(32)), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and "--public with --host 192.0.2.7" in done.stderr
    assert not (tmp_path / "tunnel.log").exists()
