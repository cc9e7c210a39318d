"""``gpumesh.tunnels``: the Tailscale address from a fake ``tailscale`` CLI, and the ngrok
provider against a fake pyngrok (nothing here touches the network)."""

from __future__ import annotations

import os
import stat
import sys
import types
from pathlib import Path

import pytest

from gpumesh import tunnels
from gpumesh.errors import MeshError
from gpumesh.tunnels import NgrokProvider, TunnelError, outside_tailnet, tailscale_ip


@pytest.fixture
def fake_tailscale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Install a ``tailscale`` executable running ``body`` (sh) first on PATH; its arguments
    are recorded in ``args.txt``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")

    def install(body: str) -> Path:
        exe = bin_dir / "tailscale"
        exe.write_text(f'#!/bin/sh\necho "$@" > "{tmp_path}/args.txt"\n{body}\n')
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
        return tmp_path / "args.txt"

    return install


def test_the_address_tailscale_prints_is_the_one_used(fake_tailscale):
    args = fake_tailscale("echo 100.101.102.103")
    assert tailscale_ip() == "100.101.102.103"
    assert args.read_text().split() == ["ip", "-4"]


def test_the_first_of_several_lines_is_used_and_blank_lines_are_ignored(fake_tailscale):
    fake_tailscale("printf '\\n  100.64.0.7  \\n100.64.0.8\\n'")
    assert tailscale_ip() == "100.64.0.7"


def test_a_stopped_or_logged_out_tailscale_says_to_run_tailscale_up(fake_tailscale):
    fake_tailscale("echo 'Tailscale is stopped.' >&2; exit 1")
    with pytest.raises(TunnelError) as failed:
        tailscale_ip()
    message = str(failed.value)
    assert "'tailscale ip -4' failed (exit 1): Tailscale is stopped." in message
    assert "Run 'tailscale up'" in message and "\n" not in message
    assert isinstance(failed.value, MeshError)


def test_no_output_at_all_is_no_address(fake_tailscale):
    fake_tailscale("exit 0")
    with pytest.raises(TunnelError, match=r"printed no address: .*Run 'tailscale up'"):
        tailscale_ip()


def test_a_silent_failure_still_names_the_exit_status(fake_tailscale):
    fake_tailscale("exit 3")
    with pytest.raises(TunnelError, match=r"failed \(exit 3\)\. Is Tailscale running"):
        tailscale_ip()


@pytest.mark.parametrize("answer", ["garbage", "100.64.0", "fd7a:115c:a1e0::1", "300.1.2.3"])
def test_an_answer_that_is_not_one_ipv4_address_is_refused(fake_tailscale, answer):
    fake_tailscale(f"echo '{answer}'")
    with pytest.raises(TunnelError, match="not an IPv4 address") as refused:
        tailscale_ip()
    assert answer in str(refused.value)


def test_an_address_nobody_can_dial_is_refused(fake_tailscale):
    fake_tailscale("echo 0.0.0.0")
    with pytest.raises(TunnelError, match="which no machine can dial"):
        tailscale_ip()


def test_a_long_answer_is_quoted_short(fake_tailscale):
    fake_tailscale("printf 'x%.0s' $(seq 1 5000); exit 1")
    with pytest.raises(TunnelError) as failed:
        tailscale_ip()
    assert len(str(failed.value)) < 400 and "..." in str(failed.value)


def test_a_hanging_tailscale_times_out_with_what_to_check(fake_tailscale):
    fake_tailscale("exec sleep 30")
    with pytest.raises(TunnelError, match=r"did not answer within 0\.3s: is tailscaled running"):
        tailscale_ip(timeout=0.3)


def test_a_missing_binary_says_to_install_tailscale(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no tailscale anywhere
    monkeypatch.setattr(sys, "platform", "linux")
    with pytest.raises(TunnelError, match=r"'tailscale' command was not found: install Tailscale"):
        tailscale_ip()


def test_an_unrunnable_binary_is_a_clear_error(tmp_path):
    not_executable = tmp_path / "tailscale"
    not_executable.write_text("echo 100.64.0.1\n")  # no exec bit
    with pytest.raises(TunnelError, match="could not run"):
        tailscale_ip(binary=str(not_executable))


def test_the_tailnet_range_is_checked_for_a_warning():
    assert not outside_tailnet("100.64.0.1") and not outside_tailnet("100.127.255.254")
    assert outside_tailnet("127.0.0.2") and outside_tailnet("192.168.1.20")


# ------------------------------------------------------------------- ngrok, through a fake pyngrok

class FakePyngrokError(Exception):
    pass


@pytest.fixture
def fake_pyngrok(monkeypatch: pytest.MonkeyPatch):
    """A stand-in ``pyngrok`` package recording calls; ``answer`` is what connect returns or
    raises."""
    calls: list[tuple] = []
    state: dict[str, object] = {"answer": "tcp://4.tcp.ngrok.io:17023"}

    def connect(addr, proto):
        calls.append(("connect", addr, proto))
        answer = state["answer"]
        if isinstance(answer, Exception):
            raise answer
        return types.SimpleNamespace(public_url=answer)

    ngrok = types.ModuleType("pyngrok.ngrok")
    ngrok.connect = connect  # type: ignore[attr-defined]
    ngrok.disconnect = lambda url: calls.append(("disconnect", url))  # type: ignore[attr-defined]
    ngrok.kill = lambda: calls.append(("kill",))  # type: ignore[attr-defined]
    exception = types.ModuleType("pyngrok.exception")
    exception.PyngrokError = FakePyngrokError  # type: ignore[attr-defined]
    package = types.ModuleType("pyngrok")
    package.ngrok = ngrok  # type: ignore[attr-defined]
    package.exception = exception  # type: ignore[attr-defined]
    for name, module in (("pyngrok", package), ("pyngrok.ngrok", ngrok),
                         ("pyngrok.exception", exception)):
        monkeypatch.setitem(sys.modules, name, module)
    return calls, state


def test_ngrok_opens_a_tcp_tunnel_to_the_local_port_and_closes_it(fake_pyngrok):
    calls, _ = fake_pyngrok
    provider = NgrokProvider()
    assert provider.open("127.0.0.1", 8732) == "tcp://4.tcp.ngrok.io:17023"
    assert calls == [("connect", "127.0.0.1:8732", "tcp")]
    provider.close()
    assert calls[1:] == [("disconnect", "tcp://4.tcp.ngrok.io:17023"), ("kill",)]
    provider.close()  # a second close does nothing
    assert len(calls) == 3


def test_ngrok_without_an_auth_token_says_how_to_add_one(fake_pyngrok):
    calls, state = fake_pyngrok
    state["answer"] = FakePyngrokError("ERR_NGROK_4018: authentication failed: Usage of ngrok "
                                       "requires a verified account and authtoken.")
    with pytest.raises(TunnelError) as failed:
        NgrokProvider().open("127.0.0.1", 8732)
    message = str(failed.value)
    assert "ngrok could not open a TCP tunnel: ERR_NGROK_4018" in message
    assert "ngrok config add-authtoken" in message and "internet connection" in message


def test_a_non_tcp_answer_is_refused_and_the_tunnel_closed(fake_pyngrok):
    calls, state = fake_pyngrok
    state["answer"] = "https://abc.ngrok.app"
    with pytest.raises(TunnelError, match="not a tcp:// address"):
        NgrokProvider().open("127.0.0.1", 8732)
    assert calls[1:] == [("disconnect", "https://abc.ngrok.app"), ("kill",)]


def test_a_failed_disconnect_still_kills_ngrok(fake_pyngrok, monkeypatch):
    calls, _ = fake_pyngrok
    provider = NgrokProvider()
    provider.open("127.0.0.1", 8732)

    def refuse(url):
        raise FakePyngrokError("tunnel not found")

    monkeypatch.setattr(sys.modules["pyngrok.ngrok"], "disconnect", refuse)
    provider.close()
    assert calls[-1] == ("kill",)


def test_missing_pyngrok_says_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyngrok", None)  # import fails as if not installed
    with pytest.raises(TunnelError, match=r"pip install 'gpumesh\[tunnel\]'"):
        NgrokProvider().open("127.0.0.1", 8732)


def test_the_provider_protocol_is_what_serve_relies_on():
    class Fake:
        def open(self, host: str, port: int) -> str:
            return f"tcp://tunnel.test:{port}"

        def close(self) -> None:
            pass

    provider: tunnels.TunnelProvider = Fake()
    assert provider.open("127.0.0.1", 1) == "tcp://tunnel.test:1"
    assert {"open", "close"} <= set(dir(NgrokProvider))


# ------------------------------------------------------- ngrok ends with the coordinator, kill -9 too

_STAND_IN = """
import signal, subprocess, sys
from gpumesh.processes import end_with_this_process
helper = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
watcher = end_with_this_process(helper.pid)
print(helper.pid, watcher.pid, flush=True)
signal.pause()
"""


@pytest.mark.skipif(os.name == "nt", reason="POSIX: a dead process's children get a new parent")
def test_a_helper_ends_when_the_process_that_started_it_is_killed_9():
    # ngrok, started by pyngrok in the coordinator, outlived a kill -9 of it: the tunnel stayed
    # up, and held a free account's only agent session, so the next serve --public failed.
    import signal
    import subprocess

    from conftest import poll_until

    from gpumesh.processes import is_alive

    started: list[int] = []
    with subprocess.Popen([sys.executable, "-c", _STAND_IN], stdout=subprocess.PIPE) as coordinator:
        try:
            assert coordinator.stdout is not None
            started += (int(n) for n in coordinator.stdout.readline().split())
            helper, watcher = started
            assert is_alive(helper) and is_alive(watcher)
            coordinator.kill()
            coordinator.wait()
            assert poll_until(lambda: not is_alive(helper), 15), "the helper outlived its starter"
            assert poll_until(lambda: not is_alive(watcher), 15), "the watcher stayed behind"
        finally:
            coordinator.kill()
            for pid in started:
                if is_alive(pid):
                    os.kill(pid, signal.SIGKILL)


def test_the_watcher_leaves_when_the_helper_ends_first_and_refuses_bad_arguments(capsys):
    import subprocess

    from gpumesh import processes

    helper = subprocess.Popen([sys.executable, "-c", "pass"])
    helper.wait()
    assert processes.watch(os.getpid(), helper.pid, None) == 0  # gone already: nothing to end
    assert processes.main(["12", "x", "-"]) == 2 and "usage" in capsys.readouterr().err


def test_ngrok_is_watched_while_its_tunnel_is_open_and_the_watcher_stopped_with_it(fake_pyngrok):
    import subprocess

    calls, _ = fake_pyngrok
    ngrok_process = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    try:
        sys.modules["pyngrok.ngrok"].get_ngrok_process = lambda: types.SimpleNamespace(  # type: ignore[attr-defined]
            proc=ngrok_process)
        provider = NgrokProvider()
        provider.open("127.0.0.1", 8732)
        watcher = provider._watcher
        assert watcher is not None and watcher.poll() is None
        assert str(ngrok_process.pid) in watcher.args
        provider.close()
        assert calls[-1] == ("kill",) and watcher.poll() is not None and provider._watcher is None
    finally:
        ngrok_process.kill()
        ngrok_process.wait()
