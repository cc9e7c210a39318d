"""``gpumesh.firewall``: the Windows rule's commands and what serve says (no Windows here: the
platform, the admin check and the command runner are injected)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpumesh import firewall
from gpumesh.firewall import add_rule_command, firewall_step, is_admin

ADD_8000 = ('netsh advfirewall firewall add rule name="gpumesh 8000" dir=in action=allow '
            "protocol=TCP localport=8000")


class Netsh:
    """Records the command lines it is given; ``codes`` maps a verb to its exit status."""

    def __init__(self, show: int = 1, add: int = 0) -> None:
        self.codes = {"show": show, "add": add}
        self.ran: list[str] = []

    def __call__(self, command: str) -> int:
        self.ran.append(command)
        return self.codes[command.split()[3]]


def test_the_rule_commands_are_exactly_what_an_administrator_would_type():
    assert add_rule_command(8000) == ADD_8000
    assert firewall.show_rule_command(8000) == \
        'netsh advfirewall firewall show rule name="gpumesh 8000"'
    assert firewall.delete_rule_command(41234) == \
        'netsh advfirewall firewall delete rule name="gpumesh 41234"'


def test_nothing_happens_off_windows():
    netsh = Netsh()
    assert firewall_step(8000, platform="linux", admin=lambda: True, run=netsh) is None
    assert firewall_step(8000, platform="darwin", admin=lambda: True, run=netsh) is None
    assert netsh.ran == []


def test_the_platform_is_read_when_serve_runs(monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")
    netsh = Netsh(show=0)
    step = firewall_step(8000, admin=lambda: False, run=netsh)
    assert step is not None and netsh.ran == [firewall.show_rule_command(8000)]


def test_an_existing_rule_is_kept_and_nothing_is_added():
    netsh = Netsh(show=0)
    step = firewall_step(8000, platform="win32", admin=lambda: True, run=netsh)
    assert step == firewall.Step('   Windows firewall: rule "gpumesh 8000" already allows '
                                 "inbound TCP 8000")
    assert netsh.ran == [firewall.show_rule_command(8000)]


def test_an_administrator_gets_the_rule_added_and_kept_for_the_next_run():
    netsh = Netsh(show=1, add=0)
    step = firewall_step(8000, platform="win32", admin=lambda: True, run=netsh)
    assert netsh.ran == [firewall.show_rule_command(8000), ADD_8000]
    assert step is not None and not step.warning
    assert 'added rule "gpumesh 8000" (inbound TCP 8000); it stays for the next run' in step.message
    assert firewall.delete_rule_command(8000) in step.message


def test_without_administrator_rights_it_says_exactly_what_to_run():
    netsh = Netsh(show=1)
    step = firewall_step(8000, platform="win32", admin=lambda: False, run=netsh)
    assert netsh.ran == [firewall.show_rule_command(8000)]  # nothing it is not allowed to do
    assert step is not None and step.warning
    assert step.message.startswith("warning: the Windows firewall may block workers")
    assert "in an Administrator prompt" in step.message and step.message.endswith(ADD_8000)


def test_a_failed_add_is_a_warning_with_the_command():
    netsh = Netsh(show=1, add=1)
    step = firewall_step(8000, platform="win32", admin=lambda: True, run=netsh)
    assert step is not None and step.warning
    assert "adding the Windows firewall rule failed" in step.message
    assert step.message.endswith(ADD_8000)


@pytest.mark.skipif(sys.platform == "win32", reason="the Windows answer depends on the session")
def test_nobody_is_an_administrator_off_windows():
    assert is_admin() is False


def test_netsh_that_cannot_start_is_a_failure_not_a_crash(monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError("netsh")

    monkeypatch.setattr(firewall.subprocess, "run", missing)
    assert firewall.run_netsh(firewall.show_rule_command(8000)) == 127


def test_netsh_runs_by_its_full_path_never_found_in_the_current_folder(monkeypatch):
    # CreateProcess looks for a bare "netsh" in Python's folder and the current one first: a
    # netsh.exe planted in Downloads ran with the Administrator's rights serve asked for.
    ran: list[str] = []
    monkeypatch.setenv("SystemRoot", r"C:\Windows")
    monkeypatch.setattr(firewall.subprocess, "run", lambda command, **kwargs: ran.append(
        command) or subprocess.CompletedProcess(command, 0))
    assert firewall.run_netsh(firewall.show_rule_command(8000)) == 0
    assert ran == [r'"C:\Windows\System32\netsh.exe" advfirewall firewall show rule '
                   'name="gpumesh 8000"']
