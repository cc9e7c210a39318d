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
        def control_job(self, action, target, force=False):
            return {"retried": 2, "stopping": 0}

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


def test_a_job_that_ended_badly_or_waits_on_paused_workers_says_so() -> None:
    # "Status: finished" under a full bar read as a success for a job whose every task was
    # cancelled; a job waiting on paused workers sat at 0% with no word why.
    from gpumesh.cli.jobs import job_summary, progress_line

    ended = {"job": "j", "name": "n", "status": "finished", "outcome": "cancelled",
             "counts": {"cancelled": 5}, "total": 5, "tasks": []}
    assert "Status: finished (cancelled)" in job_summary(ended)
    good = {**ended, "outcome": "succeeded", "counts": {"done": 5}}
    assert "Status: finished\n" in job_summary(good)
    waiting = {"status": "queued", "counts": {"pending": 3}, "total": 3, "workers": 2,
               "workers_paused": 2}
    assert "every worker is paused or draining (2)" in progress_line(waiting)
    assert "paused" not in progress_line({**waiting, "workers_paused": 1})


def test_following_a_job_no_worker_could_run_says_why_once_a_reason(capsys) -> None:
    from gpumesh.cli import jobs

    def status(why: str | None, fails_in: float, state: str = "queued") -> dict:
        view = {"status": state, "counts": {"pending": 1}, "total": 1, "workers": 1,
                "elapsed": 60 - fails_in}
        return {**view, "waiting": why, "fails_in": fails_in} if why else view

    class Mesh:
        def wait_job(self, job_id, progress):
            for view in (status(None, 60), status("no connected worker satisfies gpu A100", 59),
                         status("no connected worker satisfies gpu A100", 58),
                         status("no connected worker satisfies gpu A100", 57)):
                progress(view)
            return status(None, 0, "finished")

    jobs.follow(Mesh(), "j")
    out = capsys.readouterr().out
    assert out.count("waiting: no connected worker satisfies gpu A100; it fails in 59s "
                     "unless such a worker joins") == 1
    assert jobs.waiting_line(status("x", 3, "finished")) is None


def test_a_result_keeps_its_text_where_the_terminal_can_print_it(monkeypatch) -> None:
    import io
    import sys

    from gpumesh.cli.jobs import _shown

    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="utf-8"))
    assert _shown({"s": "héllo ✓"}) == '{"s": "héllo ✓"}'
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="ascii"))
    assert _shown({"s": "héllo"}) == '{"s": "h\\u00e9llo"}'


def test_submit_env_of_an_unset_variable_says_how_to_set_it_in_the_shell(tmp_path,
                                                                         monkeypatch) -> None:
    from click.testing import CliRunner

    from gpumesh.cli.main import cli

    monkeypatch.delenv("NOPE_NOT_SET", raising=False)
    script, payloads = tmp_path / "x.py", tmp_path / "p.json"
    script.write_text("print(1)\n")
    payloads.write_text("[{}]")
    result = CliRunner().invoke(cli, ["submit", str(script), "--payloads", str(payloads),
                                      "--env", "NOPE_NOT_SET"])
    assert result.exit_code == 1
    assert "export NOPE_NOT_SET=VALUE" in result.output and "env={" not in result.output


@pytest.mark.parametrize("counts, said", [
    ({"running": 2}, "none of its tasks has failed or been cancelled (2 still pending or running)"),
    ({"done": 4}, "every task of it succeeded"),
    ({"failed": 1}, "results expire after GPUMESH_RESULT_TTL"),
])
def test_a_retry_that_finds_nothing_says_why_from_the_jobs_counts(counts, said) -> None:
    from types import SimpleNamespace

    from gpumesh.cli.jobs import _why_nothing_to_retry

    mesh = SimpleNamespace(status=lambda job, tasks: {"counts": counts})
    assert said in _why_nothing_to_retry(mesh, "j")  # type: ignore[arg-type]


def test_a_scripts_stderr_streams_above_the_bar_in_whole_lines(capsys) -> None:
    # `submit --wait` printed nothing of what the scripts wrote on stderr (their logs): only a
    # failure's last 1,000 characters, after the end.
    from gpumesh.cli.board import Board

    board = Board(tty=True)
    board.show("  ----   0%  0/2 done  (0s)")
    board.output("w1", "err", b"loading", "t1")  # the line is not ended yet: held
    board.output("w1", "err", b" data\n\rstep 1\rstep 2\n", "t1")
    board.output("w2", "err", b"no newline at the end", "t2")
    board.end()
    captured = capsys.readouterr()
    assert captured.err.splitlines() == ["[w1] loading data", "[w1] step 2",
                                         "[w2] no newline at the end"]
    # In a terminal the bar is wiped before each line and drawn again after it.
    assert captured.out.count("  ----   0%  0/2 done  (0s)") == 1 + 3
    assert captured.out.endswith("\n")
    log = Board(tty=False)
    log.output("w1", "err", b"\x1b[31mred\n", "t1")  # another user's escape codes: shown, inert
    log.show("  ----   0%  0/1 done  (0s)")
    log.show("  ----   0%  0/1 done  (1s)")  # a log gets a line per change, not per poll
    log.end()
    captured = capsys.readouterr()
    assert captured.err == "[w1] \\x1b[31mred\n"
    assert captured.out == "  ----   0%  0/1 done  (0s)\n"


def test_a_result_too_big_to_list_says_its_size_and_where_to_read_it() -> None:
    # `status JOB` left a 5,000-byte output out of its listing without a word.
    from gpumesh.cli.jobs import job_summary

    status = {"job": "abc123", "name": "n", "status": "finished", "outcome": "succeeded",
              "counts": {"done": 1}, "total": 1,
              "tasks": [{"id": "t1", "state": "done", "result_bytes": 5000}]}
    assert "result: 5,000 bytes, too big to list here: gpumesh results abc123 reads it" in \
        job_summary(status)


def test_cancel_and_retry_say_what_is_still_being_stopped(capsys) -> None:
    # A task running on a stopped worker: `cancel` said "Cancelled 4" while status showed it
    # running, and `retry` re-queued 3 without a word of the 4th.
    from gpumesh.cli.jobs import control

    class Mesh:
        def control_job(self, action, target, force=False):
            return ({"cancelled": 4, "stopping": 1} if action == "cancel"
                    else {"retried": 3, "stopping": 1})

    assert control(Mesh(), "cancel", "j") == 0
    out = capsys.readouterr().out
    assert "Cancelled 4 unfinished task(s) of job j" in out
    assert "1 task cancelled while running is still being stopped by its worker" in out
    assert control(Mesh(), "retry", "j") == 0
    out = capsys.readouterr().out
    assert "Re-queued 3 tasks of job j" in out and "not retried: retry again once" in out
