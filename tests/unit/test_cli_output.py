"""What the job commands print for other programs, and how they read a payloads file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpumesh.cli.jobs import _read_payloads
from gpumesh.cli.output import json_text


def test_json_for_other_programs_is_strict_json() -> None:
    # A script's diverged loss: JSON has no NaN, and JavaScript's or Go's parser refuses it.
    document = {"result": {"loss": float("nan"), "best": [float("inf"), 1.5]}, "when": object}
    text = json_text(document)
    strict = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the output"))
    assert strict["result"] == {"loss": None, "best": [None, 1.5]}
    assert strict["when"] == repr(object)
    assert "\n" not in json_text({"a": [1, 2]}, indent=None)


@pytest.mark.parametrize(("raw", "said"), [
    ('[{"lr": 0.1}]'.encode("utf-16"), "it is UTF-16, as PowerShell's > writes"),
    (b'[{"lr": 0.1}]\xff', "is not UTF-8 text"),
    (b"[" * 100_000, "nests lists or objects too deeply"),
    (b'{"lr": 0.1}', "must hold a JSON list"),
])
def test_a_payloads_file_that_cannot_be_read_says_why_without_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], raw: bytes, said: str) -> None:
    path = tmp_path / "payloads.json"
    path.write_bytes(raw)
    with pytest.raises(SystemExit) as exit_info:
        _read_payloads(str(path))
    assert exit_info.value.code == 1
    error = capsys.readouterr().err
    assert error.startswith("error: ") and said in error and "Traceback" not in error


def test_a_payloads_file_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    path = tmp_path / "payloads.json"
    path.write_bytes(b"\xef\xbb\xbf" + b'[{"lr": 0.1}, {"lr": 0.01}]')  # Notepad's UTF-8
    assert _read_payloads(str(path)) == [{"lr": 0.1}, {"lr": 0.01}]


@pytest.mark.parametrize("command", [["doctor"], ["discover"], ["submit", "x.py"],
                                     ["serve", "--pending-timeout"]])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_durations_must_be_numbers_of_seconds(command: list[str], value: str) -> None:
    # click's FloatRange lets NaN through any range, and infinity past one without a top.
    from click.testing import CliRunner

    from gpumesh.cli.main import cli

    flag = [] if command[-1].startswith("--") else ["--timeout"]
    result = CliRunner().invoke(cli, [*command, *flag, value])
    assert result.exit_code == 2, result.output  # a usage error: nothing ran
    assert "Invalid value for" in result.output


def test_a_dashboard_that_cannot_bind_names_the_flag_that_fixes_it() -> None:
    import errno
    import socket

    from gpumesh.cli.dashboard import _bind_failure

    in_use = _bind_failure("127.0.0.1", 8265, OSError(errno.EADDRINUSE, "Address in use"))
    assert in_use.endswith("Pick another port with --dashboard-port")
    not_here = _bind_failure("10.9.9.9", 8265, OSError(errno.EADDRNOTAVAIL, "Cannot assign"))
    assert "--dashboard-host must be an address of this machine" in not_here
    assert "--dashboard-port" not in not_here
    nameless = _bind_failure("*", 8265, socket.gaierror(-2, "Name or service not known"))
    assert "--dashboard-host must be" in nameless
    assert "administrator rights" in _bind_failure("0.0.0.0", 443, OSError(errno.EACCES, "no"))


def test_ctrl_c_while_waiting_on_a_retry_or_a_drain_stops_the_waiting_only(capsys, monkeypatch):
    """As for submit --wait: exit 130 with what goes on, not click's bare 'Aborted!'."""
    from pathlib import Path

    from gpumesh.cli import jobs, owner
    from gpumesh.config import Settings

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    class Mesh:
        def retry_job(self, target, force=False):
            return 2

    monkeypatch.setattr(jobs, "follow", interrupted)
    assert jobs.control(Mesh(), "retry", "abc123", wait=True) == 130
    said = capsys.readouterr().err
    assert "keeps running on the mesh" in said and "gpumesh status abc123" in said

    entry = {"worker": "w1", "pid": 1, "port": 1, "secret": "x"}
    monkeypatch.setattr(owner.local, "local_workers", lambda home: [entry])
    monkeypatch.setattr(owner.local, "send", lambda e, action, timeout=5.0: {
        "worker": "w1", "running": 1, "handed_back": 0})
    monkeypatch.setattr(owner, "_wait_gone", interrupted)
    assert owner.steer(Settings(home=Path("/nonexistent")), "drain", None, wait=True) == 130
    assert "the drain goes on" in capsys.readouterr().err
