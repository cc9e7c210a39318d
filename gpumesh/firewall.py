"""The Windows firewall rule that lets other machines reach ``serve``'s port.

On Windows, a coordinator bound beyond loopback is unreachable from other machines until an
inbound rule allows its port. ``serve`` adds one named ``gpumesh PORT`` when it runs as
Administrator, and otherwise prints the exact command to run in an Administrator prompt. The
rule is left in place when serve stops: the next run on that port needs it again, and
``netsh advfirewall firewall delete rule name="gpumesh PORT"`` removes it.

The command builders and ``firewall_step`` are pure apart from the injected ``run`` and
``admin`` callables, so they are tested on any platform; nothing runs outside Windows.
"""

from __future__ import annotations

import ntpath
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass


def rule_name(port: int) -> str:
    return f"gpumesh {port}"


def add_rule_command(port: int) -> str:
    """The ``netsh`` command line that allows inbound TCP on ``port`` (run verbatim on Windows,
    where a command line is a string: what is printed is exactly what runs)."""
    return (f'netsh advfirewall firewall add rule name="{rule_name(port)}" dir=in action=allow '
            f"protocol=TCP localport={port}")


def show_rule_command(port: int) -> str:
    return f'netsh advfirewall firewall show rule name="{rule_name(port)}"'


def delete_rule_command(port: int) -> str:
    return f'netsh advfirewall firewall delete rule name="{rule_name(port)}"'


def is_admin() -> bool:
    """Whether this process may change the firewall (Windows only; False elsewhere)."""
    if sys.platform != "win32":
        return False
    import ctypes

    try:
        return bool(ctypes.windll.shell32.IsUserAnAdmin())
    except (AttributeError, OSError):
        return False


def netsh_path(environ: Mapping[str, str] | None = None) -> str:
    """``netsh.exe`` in System32, by its full path: a command line naming plain ``netsh`` is
    looked up in Python's folder and the current one first, where a planted ``netsh.exe``
    would run with the Administrator's rights this step needs."""
    env = os.environ if environ is None else environ
    root = env.get("SystemRoot") or env.get("SYSTEMROOT") or r"C:\Windows"
    return ntpath.join(root, "System32", "netsh.exe")


def run_netsh(command: str) -> int:
    """Run one ``netsh`` command line; its exit status (127 when netsh cannot be started)."""
    if command.startswith("netsh "):
        command = f'"{netsh_path()}" {command[len("netsh "):]}'
    try:
        return subprocess.run(command, capture_output=True, stdin=subprocess.DEVNULL,
                              timeout=30, check=False).returncode
    except (OSError, subprocess.TimeoutExpired):
        return 127


@dataclass(frozen=True)
class Step:
    """The line ``serve`` prints about the firewall (to stderr when ``warning``)."""

    message: str
    warning: bool = False


def firewall_step(port: int, *, platform: str | None = None,
                  admin: Callable[[], bool] = is_admin,
                  run: Callable[[str], int] = run_netsh) -> Step | None:
    """Make sure other machines can reach ``port`` through the Windows firewall.

    None off Windows. Otherwise: an existing ``gpumesh PORT`` rule is kept; as Administrator
    the rule is added; without it, the step says what to run in an Administrator prompt.
    """
    if (platform or sys.platform) != "win32":
        return None
    if run(show_rule_command(port)) == 0:
        return Step(f"   Windows firewall: rule \"{rule_name(port)}\" already allows inbound TCP "
                    f"{port}")
    add = add_rule_command(port)
    if not admin():
        return Step(f"warning: the Windows firewall may block workers on other machines. Run "
                    f"this once in an Administrator prompt (or re-run serve as Administrator): "
                    f"{add}", warning=True)
    if run(add) != 0:
        return Step(f"warning: adding the Windows firewall rule failed; run this in an "
                    f"Administrator prompt: {add}", warning=True)
    return Step(f"   Windows firewall: added rule \"{rule_name(port)}\" (inbound TCP {port}); "
                f"it stays for the next run. Remove it with: {delete_rule_command(port)}")
