"""``gpumesh setup``: the guided wizard that asks what ``serve``/``join`` would be told, then saves
what they save (rich + questionary, the ``ui`` extra, imported only when the wizard runs).

The answers are checked and saved by the plain functions at the top (``token_problem``,
``port_problem``, ``url_problem``, ``save``, ``next_steps``), which the tests call directly; the
flow below them only asks and shows. The token is never shown: not in a prompt (typed input is
masked), not in the summary, not in the commands printed at the end (they name the token file).
"""

from __future__ import annotations

import errno
import getpass
import hmac
import os
import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import click

from ..config import DEFAULT_HOST, DEFAULT_PORT, Settings, parse_url
from ..errors import AuthenticationError, ConfigError, MeshError
from ..tokens import new_token, parse_token, weak_warning, weakness, write_token_file
from .output import fail

Role = Literal["serve", "join", "use"]
LAN = "0.0.0.0"
CANCELLED = "setup cancelled: nothing was saved"
NOT_A_TERMINAL = """\
error: gpumesh setup asks questions, and this is not a terminal. The same, without questions:
  gpumesh token --file mesh.token                     # a new token, in a 0600 file
  gpumesh serve --port 8000 --token-file mesh.token   # a coordinator (add --host 0.0.0.0 for the LAN)
  gpumesh join --token-file mesh.token                # a worker: finds the mesh on the LAN
  gpumesh join tcp://HOST:8000 --token-file mesh.token   # ... or names its coordinator"""


def needs_ui(package: Path | None = None) -> str:
    """What to install for the wizard, as gpumesh was installed: from a source checkout (the
    package folder beside the project's pyproject.toml) the extra of that checkout, else the
    published one."""
    package = package or Path(__file__).resolve().parents[1]
    project = package.parent / "pyproject.toml"
    try:
        checkout = 'name = "gpumesh"' in project.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        checkout = False
    if checkout:
        return (f'gpumesh setup needs the ui extra: pip install -e ".[ui]" in {package.parent} '
                "(the source checkout this gpumesh runs from)")
    return 'gpumesh setup needs the ui extra: pip install "gpumesh[ui]"'


@dataclass(frozen=True)
class Answers:
    """What the wizard was told. ``url`` is None for serve; ``slots`` None means join's default.
    ``kept``: the token is the one this machine's coordinator saved; ``replaces``: saving it
    replaces another token that coordinator saved."""

    role: Role
    token: str = field(repr=False)
    generated: bool = False
    kept: bool = False
    replaces: bool = False
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    url: str | None = None
    discovered: bool = False
    slots: int | None = None
    # This machine's own coordinator saved another token: join/use must not replace it (its
    # next `gpumesh serve` would make a new one and lock its workers out), so this mesh's token
    # goes in a file of its own and the next steps name it.
    beside_own: bool = False

    @property
    def local_url(self) -> str:
        """The URL this machine dials: loopback, for both binds the wizard offers."""
        return parse_url(f"127.0.0.1:{self.port}").zmq if self.role == "serve" else \
            parse_url(self.url or "").zmq


def token_problem(text: str, *, serve: bool, token_path: str = "~/.gpumesh/token") -> str | None:
    """Why a pasted token cannot be used, in one line that never quotes it; None when it can.
    A coordinator refuses a weak token, as ``serve`` does without ``--weak-token``.
    ``token_path`` is where the coordinator keeps it, as shown in the hint."""
    text = text.strip()
    if not text:
        return f"paste the token (the one line in the coordinator's {token_path})"
    if any(ch.isspace() for ch in text):
        return "a token has no spaces: paste the one line of the token file"
    try:
        parse_token(text)
    except ConfigError as exc:
        return str(exc)
    why = weakness(text)
    if serve and why:
        return (f"too weak to guard a coordinator: {why}. Choose 'generate a new token' "
                "instead (or run 'gpumesh serve --weak-token' yourself)")
    return None


def port_problem(text: str, host: str = DEFAULT_HOST) -> str | None:
    """Why ``text`` is not a port a coordinator could bind on ``host`` now; None when it is."""
    number = _number(text, 5)
    if number is None or not 1 <= number <= 65535:
        return "a port is a number from 1 to 65535 (8000 is the usual one)"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, number))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (f"port {number} is in use on this machine (a coordinator running "
                        "already?): choose another")
            if exc.errno == errno.EACCES:
                return (f"port {number} needs administrator rights on this machine (ports "
                        "below 1024 do): choose one from 1024 up, such as 8000")
            return f"port {number} cannot be used here ({exc.strerror}): choose another"
    return None


def _number(text: str, digits: int) -> int | None:
    """``text`` as a number of at most ``digits`` ASCII digits; None otherwise. (str.isdigit
    says yes to "²", which int() refuses, and to thousands of digits, which int() refuses
    too.)"""
    text = text.strip()
    if not text or len(text) > digits or not all("0" <= c <= "9" for c in text):
        return None
    return int(text)


def url_problem(text: str, token: str | None = None) -> str | None:
    """Why ``text`` is not a coordinator URL (HOST:PORT, tcp://, gpumesh://); None when it is.
    With ``token``, the token pasted where the address goes is one (it is not repeated)."""
    try:
        parse_url(text, token)
    except ConfigError as exc:
        return str(exc)
    return None


def slots_problem(text: str) -> str | None:
    number = _number(text, 4)
    if number is None or not 1 <= number <= 1024:
        return "slots is a number from 1 to 1024: how many tasks run here at once"
    return None


def home_display(path: Path) -> str:
    from .serve import _home_display

    return _home_display(path)


def save(settings: Settings, answers: Answers) -> list[Path]:
    """Save the answers as ``serve``/``join`` save theirs (their own functions), and, for a
    worker, the token file that the printed ``join`` command names. Returns what was written."""
    from ..security import derive_keys
    from .join import save_joined
    from .serve import TOKEN_FILE, save_served

    derive_keys(answers.token)  # cached by now mostly; save_kdf keeps the result, as serve's does
    if answers.role == "serve":
        token_path = save_served(settings, answers.local_url, answers.token,
                                 (answers.host, answers.port))
        return [settings.config_path, token_path]
    if answers.beside_own:
        joined = settings.home / JOINED_TOKEN_FILE
        write_token_file(joined, answers.token, replace=True)
        return [joined]
    save_joined(settings, answers.local_url, answers.token, answers.slots)
    if answers.role == "use":
        return [settings.config_path]
    token_path = settings.home / TOKEN_FILE
    write_token_file(token_path, answers.token, replace=True)
    return [settings.config_path, token_path]


JOINED_TOKEN_FILE = "joined-token"


def _plain(text: str) -> str:
    """``text`` shown as it is inside rich markup: an IPv6 URL's ``[fd00::20]`` is not a tag."""
    from rich.markup import escape

    return escape(text)


def _user() -> str:
    """Who tasks run as. getpass raises where the uid has no passwd entry and no USER (a
    container started with --user 1234)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError, ImportError):
        return f"uid {os.getuid()}" if hasattr(os, "getuid") else "this user"


def token_file(settings: Settings, answers: Answers | None = None) -> str:
    """The token file the next steps name: this machine's own, or, beside its own
    coordinator, the joined mesh's."""
    from .serve import TOKEN_FILE

    name = JOINED_TOKEN_FILE if answers is not None and answers.beside_own else TOKEN_FILE
    return home_display(settings.home / name)


def next_steps(settings: Settings, answers: Answers) -> list[str]:
    """The commands to run next, with what each does; they name the token file, never the token."""
    tokens = f"--token-file {token_file(settings)}"
    if answers.role == "serve":
        host = f" --host {answers.host}" if answers.host != DEFAULT_HOST else ""
        steps = [f"gpumesh serve{host} --port {answers.port} {tokens}",
                 "   starts the coordinator, with this machine as its first worker"]
        if answers.host == DEFAULT_HOST:
            steps.append("   only this machine can join; run 'gpumesh setup' again to open it "
                          "to the LAN")
        else:
            steps.append(f"   on another machine: copy {token_file(settings)} there (scp, "
                         "readable only by you), then run 'gpumesh setup' there and choose to "
                         "join, or 'gpumesh join --token-file FILE'")
        return steps + CODE_STEPS
    if answers.beside_own:
        given = f"--url {answers.local_url} --token-file {token_file(settings, answers)}"
        if answers.role == "join":
            return [f"gpumesh join {answers.local_url} --token-file {token_file(settings, answers)}",
                    "   joins this machine to that mesh as a worker, until Ctrl+C"
                    + (f" (add --slots {answers.slots})" if answers.slots else "")
                    + "; this machine's own coordinator keeps its saved connection"]
        return [f"gpumesh workers {given}   # that mesh's workers",
                f"   from Python: GPUMESH_URL={answers.local_url} GPUMESH_TOKEN=\"$(cat "
                f"{token_file(settings, answers)})\" python your_script.py; a plain @mesh keeps "
                "using this machine's own coordinator"]
    if answers.role == "join":
        steps = ["gpumesh join",
                 "   joins this machine to the mesh as a worker, until Ctrl+C, with the saved "
                 "coordinator and token" + (f", {answers.slots} slots" if answers.slots else "")]
        if answers.discovered:
            steps.append("   (it finds the coordinator on the LAN again, even after it moves)")
        return steps
    return ["gpumesh workers   # the mesh's workers, through the saved connection", *CODE_STEPS]


# A pip install ships no demo.py: the README's Quickstart shows the code, 'gpumesh demo' runs it.
CODE_STEPS = ["then, in another terminal, a script with 'from gpumesh import mesh' and @mesh on a "
              "function runs it on the mesh (the README's Quickstart, step 3)",
              "gpumesh demo   # to watch @mesh code at work first, on a mesh of its own"]


# ----------------------------------------------------------------------------- the flow


def run(settings: Settings) -> None:
    """Ask, show the summary, save after a yes, print what to run next. Exits 130 on Ctrl+C."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        click.echo(NOT_A_TERMINAL, err=True)
        sys.exit(1)
    try:
        import questionary
        from rich.console import Console
    except ImportError:
        fail(needs_ui())
    wizard = _Wizard(settings, questionary, Console(highlight=False))
    try:
        answers = wizard.ask()
    except (KeyboardInterrupt, EOFError):
        click.echo("")
        click.echo(CANCELLED, err=True)
        sys.exit(130)
    if answers is None:
        click.echo(CANCELLED)
        sys.exit(1)
    # Past the yes, a Ctrl+C would leave "nothing was saved" untrue: the two files are written
    # whole (each swapped in), so the save runs to its end.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        written = save(settings, answers)
    except MeshError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot save in {settings.home}: {exc.strerror or exc}")
    finally:
        signal.signal(signal.SIGINT, previous)
    wizard.done(answers, written)


class _Wizard:
    """The questions, in the order a newcomer meets them."""

    def __init__(self, settings: Settings, questionary: Any, console: Any) -> None:
        self.settings = settings
        self.q = questionary
        self.console = console

    def ask(self) -> Answers | None:
        """The confirmed answers, or None when the user declined to save them."""
        self.console.print("[bold]Welcome to gpumesh.[/bold] A few questions, then this machine "
                           "is set up; nothing is saved until you confirm.")
        if not self._may_replace():
            return None
        role: Role = self.q.select("This machine will…", choices=[
            self.q.Choice("start a coordinator (serve): the mesh's hub, and its first worker",
                          "serve"),
            self.q.Choice("join a mesh as a worker: lend this machine's CPU/GPU", "join"),
            self.q.Choice("use a mesh from Python only: run @mesh code on it", "use"),
        ]).unsafe_ask()
        answers = self._serve() if role == "serve" else self._connect(role)
        self._summary(answers)
        if not self.q.confirm("Save this?", default=True).unsafe_ask():
            return None
        return answers

    def _may_replace(self) -> bool:
        path = self.settings.config_path
        if not path.exists():
            return True
        try:
            saved = self.settings.saved_connection()
            what = f"coordinator {saved.url}" if saved else "empty"
        except ConfigError:
            what = "not readable"
        return bool(self.q.confirm(
            f"{home_display(path)} holds a saved connection ({what}). Replace it at the end?",
            default=False).unsafe_ask())

    def _token(self, *, serve: bool, current: str | None = None) -> tuple[str, bool]:
        """(the token, whether it was generated). ``current``: the token this machine's
        coordinator saved, offered first to a coordinator."""
        if serve:
            choices = [self.q.Choice("generate a new token (recommended)", "new"),
                       self.q.Choice("paste an existing token", "paste")]
            if current is not None:
                choices.insert(0, self.q.Choice(
                    f"keep the current token (the one in {token_file(self.settings)}; its "
                    "workers stay in)", "keep"))
            made = self.q.select("The mesh's token (whoever holds it can run code on every "
                                 "worker):", choices=choices).unsafe_ask()
            if made == "keep" and current is not None:
                return current, False
            if made == "new":
                return new_token(), True
        path = token_file(self.settings)
        token = self.q.password(
            f"Paste the token (the coordinator's {path}; typing is hidden):",
            validate=lambda text: token_problem(text, serve=serve, token_path=path) or True,
        ).unsafe_ask().strip()
        from ..security import note_weak

        # Marked as warned, so deriving its keys later does not log the same warning again.
        if note_weak(token):
            self.console.print(f"[yellow]warning:[/yellow] {_plain(weak_warning(token) or '')}")
        return token, False

    def _serve(self) -> Answers:
        from .serve import saved_coordinator

        try:
            own = saved_coordinator(self.settings, quiet=True)
        except MeshError:
            own = None  # an unreadable token file: nothing to keep, and it is replaced
        current = own.token if own is not None else None
        token, generated = self._token(serve=True, current=current)
        kept = current is not None and hmac.compare_digest(current.encode(), token.encode())
        if generated:
            self.console.print(f"A new token will be saved in {_plain(token_file(self.settings))}, "
                               "readable only by you (it is never printed).")
        user = _user()
        host = self.q.select("Who may connect to the coordinator?", choices=[
            self.q.Choice("this machine only (127.0.0.1): the safe default", DEFAULT_HOST),
            self.q.Choice(f"the LAN (0.0.0.0): anyone who reaches the port AND has the token "
                          f"can run code here as {user}", LAN),
        ]).unsafe_ask()
        if host == LAN:
            self.console.print(f"[yellow]The coordinator will be reachable from other machines: "
                               f"only do this on a network you trust, and keep the token "
                               f"secret.[/yellow] Tasks run as {_plain(user)}.")
        saved_port = own.port if own is not None and own.port else DEFAULT_PORT
        port = self.q.text("Port:", default=str(saved_port),
                           validate=lambda text: port_problem(text, host) or True).unsafe_ask()
        return Answers("serve", token, generated=generated, kept=kept,
                       replaces=current is not None and not kept, host=host, port=int(port))

    def _connect(self, role: Role) -> Answers:
        token, _ = self._token(serve=False)
        url, discovered = self._find(token)
        if url is None:
            url = self._typed_url(token)
        from .join import keeps_own_coordinator  # join's own test: the two must agree

        slots = self._slots() if role == "join" else None
        return Answers(role, token, url=url, discovered=discovered, slots=slots,
                       beside_own=keeps_own_coordinator(self.settings, token))

    def _find(self, token: str) -> tuple[str | None, bool]:
        """A coordinator of this token's mesh chosen among those the LAN advertises."""
        from ..discovery import adapters, browse, browse_interfaces
        from ..protocol import MAJOR
        from ..security import derive_keys

        if not self.settings.discovery:
            return None, False
        interfaces = browse_interfaces(self.settings.discovery_interfaces)
        if not interfaces:
            self.console.print("No LAN interface to look for the coordinator on (only loopback, "
                               "container, VM or VPN adapters).")
            return None, False
        timeout = max(self.settings.discovery_timeout, 3.0)
        with self.console.status(f"Looking for this mesh's coordinator on the LAN "
                                 f"({', '.join(interfaces)}, up to {timeout:g}s)…"):
            fingerprint = derive_keys(token).fingerprint
            try:
                found = browse(timeout, interfaces, want=fingerprint)
            except MeshError as exc:
                self.console.print(f"{exc}.", markup=False)
                return None, False
        ours = [f for f in found if f.mesh == fingerprint and f.proto == MAJOR]
        if not ours:
            others = len([f for f in found if f.mesh != fingerprint])
            self.console.print("No coordinator of this mesh answered on the LAN"
                               + (f" ({others} of other meshes did)." if others else ".")
                               + " A coordinator bound to 127.0.0.1 is never advertised "
                               "('gpumesh serve --host 0.0.0.0' advertises it). Give its "
                               "address instead.")
            return None, False
        local = adapters()
        choices = [self.q.Choice(f"{f.host} at {f.urls(local)[0]} (gpumesh {f.version})",
                                 f.urls(local)[0]) for f in ours]
        choices.append(self.q.Choice("another one: type its address", ""))
        url = self.q.select(f"Found {len(ours)} coordinator(s) of this mesh:",
                            choices=choices).unsafe_ask()
        return (url, True) if url else (None, False)

    def _typed_url(self, token: str) -> str:
        while True:
            url = parse_url(self.q.text(
                "Coordinator address (HOST:PORT, tcp://HOST:PORT or gpumesh://HOST:PORT):",
                validate=lambda text: url_problem(text, token) or True).unsafe_ask(), token).zmq
            if not self.q.confirm("Check that it answers now?", default=True).unsafe_ask():
                return url
            if self._answers(url, token):
                return url
            if self.q.confirm("Use this address anyway?", default=False).unsafe_ask():
                return url

    def _answers(self, url: str, token: str) -> bool:
        from .doctor import connect_and_list

        with self.console.status(f"Connecting to {_plain(url)}…"):
            try:
                listing = connect_and_list(url, token, 5.0, self.settings)
            except AuthenticationError:
                self.console.print(f"[yellow]{_plain(url)} answers, but refuses this token[/yellow]: "
                                   "check that it is this mesh's token.")
                return False
            except MeshError as exc:
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                self.console.print(f"[yellow]{_plain(url)} does not answer:[/yellow] {_plain(first)}")
                return False
        alive = len([w for w in listing if w.get("alive")])
        self.console.print(f"[green]{_plain(url)} answers[/green]: {alive} worker(s) alive.")
        return True

    def _slots(self) -> int | None:
        from ..worker import devices
        from .join import default_slots

        default = default_slots(devices.probe())
        text = self.q.text("Tasks to run here at once (slots):", default=str(default),
                           validate=lambda text: slots_problem(text) or True).unsafe_ask()
        return None if int(text) == default else int(text)

    def _summary(self, answers: Answers) -> None:
        rows = {"serve": "start a coordinator", "join": "join a mesh as a worker",
                "use": "use a mesh from Python"}
        token = "kept (the current one), never shown" if answers.kept else \
            "new, never shown" if answers.generated else "pasted, never shown"
        lines = [("This machine will", rows[answers.role]), ("Token", token)]
        if answers.replaces:
            lines.append(("Current token", "replaced: workers holding the old token are locked "
                          "out until they get the new one"))
        if answers.role == "serve":
            lines.append(("Reachable from", "this machine only" if answers.host == DEFAULT_HOST
                          else "the LAN (0.0.0.0)"))
            lines.append(("Port", str(answers.port)))
        else:
            lines.append(("Coordinator", f"{answers.url}"
                          + (" (found on the LAN)" if answers.discovered else "")))
        if answers.role == "join":
            lines.append(("Slots", "as detected" if answers.slots is None else str(answers.slots)))
        if answers.beside_own:
            lines.append(("This machine", "keeps its own coordinator's connection and token as "
                          "the default; this mesh's token gets a file of its own"))
            saved = [token_file(self.settings, answers)]
        else:
            saved = [home_display(self.settings.config_path)]
            if answers.role != "use":
                saved.append(token_file(self.settings))
        lines.append(("Saved in", ", ".join(saved) + " (readable only by you)"))
        self.console.print("")
        self.console.print("[bold]Summary[/bold]")
        for name, value in lines:
            self.console.print(f"  {name + ':':<18} {value}", markup=False)

    def done(self, answers: Answers, written: list[Path]) -> None:
        self.console.print("")
        self.console.print(f"[green]Saved[/green] {_plain(', '.join(home_display(p) for p in written))}.")
        self.console.print("Next, run:")
        for line in next_steps(self.settings, answers):
            self.console.print(f"  {line}", markup=False, soft_wrap=True)
