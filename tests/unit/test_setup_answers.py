"""The wizard's plain half: how answers are checked, saved and turned into next commands."""

from __future__ import annotations

import json
import socket
import stat

import pytest

from gpumesh.cli.join import keeps_own_coordinator
from gpumesh.cli.setup import (
    Answers,
    needs_ui,
    next_steps,
    port_problem,
    save,
    slots_problem,
    token_problem,
    url_problem,
)
from gpumesh.config import Settings, load_connection
from gpumesh.tokens import new_token

STRONG = new_token()


def test_a_pasted_token_is_checked_as_serve_checks_it_without_being_quoted():
    assert token_problem(STRONG, serve=True) is None
    assert token_problem(f"  {STRONG}\n", serve=False) is None
    assert "paste the token" in (token_problem("   ", serve=False) or "")
    assert "no spaces" in (token_problem("abc def", serve=False) or "")
    weak = "hunter2hunter2"
    refused = token_problem(weak, serve=True) or ""
    assert "too weak to guard a coordinator" in refused and weak not in refused
    assert token_problem(weak, serve=False) is None  # the coordinator decides; a warning follows
    hint = token_problem("", serve=False, token_path="/srv/mesh/token") or ""
    assert "the coordinator's /srv/mesh/token" in hint


def test_ports_and_addresses_are_checked_as_serve_and_join_check_them():
    assert port_problem("0") and port_problem("65536") and port_problem("80a")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert "in use" in (port_problem(str(port)) or "")
    assert port_problem(str(port)) is None
    for url in ("192.0.2.10:8000", "tcp://192.0.2.10:8000", "gpumesh://host:8000", "host"):
        assert url_problem(url) is None, url
    assert "unsupported URL scheme" in (url_problem("ftp://x") or "")
    assert slots_problem("4") is None and slots_problem("0") and slots_problem("x")


def test_odd_numbers_are_answered_not_raised():
    # str.isdigit says yes to both; int() refuses them.
    for text in ("²", "9" * 5000, "８０００"):
        assert "number from 1 to 65535" in (port_problem(text) or ""), text
        assert "number from 1 to 1024" in (slots_problem(text) or ""), text


def test_a_port_that_needs_rights_is_not_called_in_use(monkeypatch):
    import errno

    from gpumesh.cli import setup

    class Refusing(socket.socket):
        def bind(self, address):
            raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(setup.socket, "socket", Refusing)
    said = port_problem("80") or ""
    assert "administrator rights" in said and "in use" not in said


@pytest.fixture
def settings(tmp_path):
    return Settings(home=tmp_path / "home")


def test_serve_answers_are_saved_by_serves_own_writer(settings):
    written = save(settings, Answers("serve", STRONG, generated=True, port=8123))
    saved = load_connection(settings.config_path)
    assert saved is not None and (saved.url, saved.token) == ("tcp://127.0.0.1:8123", STRONG)
    assert saved.stretched is not None  # the key cache serve keeps
    assert saved.served == ("127.0.0.1", 8123)  # what a plain 'gpumesh serve' binds again
    assert written == [settings.config_path, settings.home / "token"]
    for path in written:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_client_saves_the_connection_only(settings):
    written = save(settings, Answers("use", STRONG, url="gpumesh://127.0.0.1:8123"))
    assert written == [settings.config_path]
    assert json.loads(settings.config_path.read_text())["url"] == "tcp://127.0.0.1:8123"


def test_a_workers_slot_count_is_saved_for_join(settings):
    save(settings, Answers("join", STRONG, url="tcp://127.0.0.1:8123", slots=3))
    saved = load_connection(settings.config_path)
    assert saved is not None and saved.slots == 3 and saved.served is None
    save(settings, Answers("join", STRONG, url="tcp://127.0.0.1:8123"))  # join's default
    saved = load_connection(settings.config_path)
    assert saved is not None and saved.slots is None


def test_next_commands_name_the_token_file_never_the_token(settings):
    steps = {
        "serve": next_steps(settings, Answers("serve", STRONG, host="0.0.0.0", port=8001)),
        "join": next_steps(settings, Answers("join", STRONG, url="tcp://h:8000", slots=2)),
        "found": next_steps(settings, Answers("join", STRONG, url="tcp://h:8000",
                                              discovered=True)),
        "use": next_steps(settings, Answers("use", STRONG, url="tcp://h:8000")),
    }
    token_file = settings.home / "token"
    assert steps["serve"][0] == f"gpumesh serve --host 0.0.0.0 --port 8001 --token-file {token_file}"
    # join needs nothing more: the URL, the token and the slots are saved.
    assert steps["join"][0] == steps["found"][0] == "gpumesh join"
    assert "2 slots" in steps["join"][1]
    assert steps["use"][0].startswith("gpumesh workers")
    # A pip install ships no demo.py: the steps point at 'gpumesh demo' and the README.
    for role in ("serve", "use"):
        assert not any("demo.py" in line for line in steps[role])
        assert any(line.startswith("gpumesh demo") for line in steps[role])
    assert all(STRONG not in line and STRONG.split(".")[1] not in line
               for lines in steps.values() for line in lines)


def test_joining_another_mesh_keeps_this_machines_own_coordinator(settings):
    """A machine that serves its own mesh, set up to join (or use) another: its saved
    connection and token file stay, or its next 'gpumesh serve' makes a new token and
    every one of its workers is locked out."""
    own, other = new_token(), new_token()
    save(settings, Answers("serve", own, generated=True, port=8123))
    assert keeps_own_coordinator(settings, other) and not keeps_own_coordinator(settings, own)
    for role in ("join", "use"):
        answers = Answers(role, other, url="tcp://127.0.0.1:9000", slots=2,
                          beside_own=keeps_own_coordinator(settings, other))
        written = save(settings, answers)
        assert written == [settings.home / "joined-token"]
        assert (settings.home / "joined-token").read_text().strip() == other
        assert stat.S_IMODE((settings.home / "joined-token").stat().st_mode) == 0o600
        saved = load_connection(settings.config_path)
        assert saved is not None and saved.token == own and saved.served == ("127.0.0.1", 8123)
        assert (settings.home / "token").read_text().strip() == own
        steps = next_steps(settings, answers)
        assert f"--token-file {settings.home / 'joined-token'}" in steps[0]
        assert "tcp://127.0.0.1:9000" in steps[0]
        assert all(other not in line and other.split(".")[1] not in line for line in steps)
    # With no coordinator of its own, join saves as before.
    fresh = Settings(home=settings.home.parent / "fresh")
    assert not keeps_own_coordinator(fresh, other)


def test_the_ui_hint_fits_how_gpumesh_was_installed(tmp_path):
    installed = tmp_path / "site-packages" / "gpumesh"
    installed.mkdir(parents=True)
    assert needs_ui(installed) == 'gpumesh setup needs the ui extra: pip install "gpumesh[ui]"'
    checkout = tmp_path / "src" / "gpumesh"
    checkout.mkdir(parents=True)
    (checkout.parent / "pyproject.toml").write_text('[project]\nname = "gpumesh"\n')
    hint = needs_ui(checkout)
    assert f'pip install -e ".[ui]" in {checkout.parent}' in hint
    (checkout.parent / "pyproject.toml").write_text('[project]\nname = "other"\n')
    assert "gpumesh[ui]" in needs_ui(checkout)  # a package vendored in another project


def test_ipv6_urls_survive_the_wizards_markup_and_a_nameless_uid_is_named(monkeypatch):
    from rich.console import Console

    from gpumesh.cli import setup

    console = Console(record=True, width=200, color_system=None)
    console.print(f"[green]{setup._plain('tcp://[fd00::20]:8000')} answers[/green]")
    assert "tcp://[fd00::20]:8000 answers" in console.export_text()

    def nameless() -> str:
        raise KeyError("getpwuid(): uid not found: 1234")

    monkeypatch.setattr(setup.getpass, "getuser", nameless)
    assert setup._user().startswith("uid ")
