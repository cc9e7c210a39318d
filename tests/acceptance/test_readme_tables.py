"""The README's CLI table and environment-variable table agree with `gpumesh --help` and with
the variables the code reads, both ways."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from gpumesh.cli.main import cli

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end]


def _help(*args: str) -> str:
    result = CliRunner().invoke(cli, [*args, "--help"])
    assert result.exit_code == 0, result.output
    return result.output


def test_every_command_is_in_the_cli_table_and_every_row_is_a_command():
    table = [row for row in _section("CLI").splitlines() if row.startswith("| `gpumesh ")]
    listed = set()
    for row in table:
        for cell in re.findall(r"`gpumesh ([a-z]+)", row.split("|")[1]):
            listed.add(cell)
        listed.update(re.findall(r"/ `?(resume|drain)\b", row.split("|")[1]))
    commands = set(cli.commands)  # type: ignore[attr-defined]
    assert commands - listed == set(), "commands missing from the README's CLI table"
    assert listed - commands == set(), "README rows for commands that do not exist"


def test_every_option_in_the_cli_table_exists_in_that_commands_help():
    missing = []
    for row in _section("CLI").splitlines():
        if not row.startswith("| `gpumesh "):
            continue
        usage = re.split(r"(?<!\\)\|", row)[1]
        for part in re.split(r" / ", usage):
            name = re.search(r"gpumesh ([a-z]+)", part) or re.match(r"`?([a-z]+)", part.strip())
            if name is None or name.group(1) not in cli.commands:  # type: ignore[attr-defined]
                continue
            text = _help(name.group(1))
            for option in re.findall(r"(--[a-z][a-z-]*)", part):
                if option not in text:
                    missing.append(f"{name.group(1)} {option}")
    assert not missing, missing


def test_environment_table_matches_the_variables_the_code_reads():
    code = set()
    for path in (ROOT / "gpumesh").rglob("*.py"):
        code.update(re.findall(r"[\"'](GPUMESH_[A-Z_]+)[\"']", path.read_text()))
    table = set(re.findall(r"^\| `(GPUMESH_[A-Z_]+)`", README, re.M))
    assert code - table == set(), "read by the code, missing from the README's table"
    assert table - code == set(), "in the README's table, read nowhere"


# Options every command takes alike, which the paragraph under the table describes once.
_GENERAL = {"--help", "--url", "--token", "--token-file", "--color", "--no-color"}


def test_every_option_of_every_command_is_in_its_cli_table_row():
    section = _section("CLI")
    rows: dict[str, str] = {}
    for row in section.splitlines():
        if row.startswith("| `gpumesh "):
            usage = re.split(r"(?<!\\)\|", row)[1]  # a cell may hold an escaped \|
            for name in re.findall(r"(?:/ `?(?:gpumesh )?|gpumesh )([a-z]+)", usage):
                rows[name] = rows.get(name, "") + usage
    missing = []
    for name, command in cli.commands.items():  # type: ignore[attr-defined]
        for param in command.params:
            for option in getattr(param, "opts", []) + getattr(param, "secondary_opts", []):
                if not option.startswith("--") or param.hidden:  # type: ignore[attr-defined]
                    continue
                general = option in _GENERAL and option in section.split("\n\n", 2)[-1]
                if not general and option not in rows.get(name, ""):
                    missing.append(f"{name} {option}")
    assert not missing, f"options in --help but not in the README's CLI table: {missing}"
