"""The token options every command shares (--token, --token-file) and the key cache they use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
from click.core import ParameterSource

from ..config import Settings
from ..errors import MeshError
from ..tokens import loose_file_warning, read_token_file
from .output import fail

_FILE = "gpumesh.token_file"
VISIBLE_WARNING = ("warning: --token on a command line is visible to every local user (ps, "
                   "/proc/PID/cmdline): set GPUMESH_TOKEN or use --token-file PATH instead")


def _remember_file(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        ctx.meta[_FILE] = value


def token_options(*, envvar: bool, what: str) -> Callable[[Any], Any]:
    """``--token`` (warned about when typed on a command line) and ``--token-file``.

    With ``envvar`` the token also comes from GPUMESH_TOKEN through click (serve, join);
    otherwise GPUMESH_TOKEN is read later, with the saved connection as the last fallback.
    """
    def decorate(fn: Any) -> Any:
        fn = click.option(
            "--token-file", type=click.Path(dir_okay=False), default=None, expose_value=False,
            callback=_remember_file,
            help="Read the mesh token from this file (one line, readable only by you).")(fn)
        return click.option(
            "--token", envvar="GPUMESH_TOKEN" if envvar else None, default=None,
            help=f"The mesh token {what}. Prefer GPUMESH_TOKEN or --token-file: other local "
                 "users can read a command line.")(fn)
    return decorate


def chosen_token(token: str | None) -> str | None:
    """The token of this command: --token-file when given, else what --token resolved to.

    A token typed on the command line gets a warning (once: this runs once per command).
    """
    ctx = click.get_current_context()
    typed = token is not None and ctx.get_parameter_source("token") is ParameterSource.COMMANDLINE
    if typed:
        click.echo(VISIBLE_WARNING, err=True)
    path = ctx.meta.get(_FILE)
    if path is None:
        return token
    if typed:
        fail("pass --token or --token-file, not both")
    try:
        text = read_token_file(path)
    except MeshError as exc:
        fail(str(exc))
    warning = loose_file_warning(path)
    if warning:
        click.echo(warning, err=True)
    return text


def prime_key_cache(settings: Settings) -> None:
    """Let this command reuse the saved connection's stretched key instead of paying scrypt
    (about 0.4 s) again. A damaged or stale cache is ignored: the key is derived afresh."""
    from ..security import kdf_for, remember_stretched

    try:
        saved = settings.saved_connection()
    except MeshError:
        return
    if saved is not None:
        stretched = saved.stretched_for(saved.token, kdf_for(saved.token))
        if stretched is not None:
            remember_stretched(saved.token, stretched)


def save_kdf(token: str) -> dict[str, Any]:
    """The ``save_connection`` arguments that cache this token's stretched key, when known."""
    from ..security import cached_stretch, kdf_for

    stretched = cached_stretch(token)
    return {"kdf": kdf_for(token), "stretched": stretched} if stretched else {}
