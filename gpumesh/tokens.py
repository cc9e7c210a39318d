"""The token as text: its ``SALT.SECRET`` form, its strength, new tokens, and token files.

A token is a secret, optionally preceded by a salt and a dot. The salt (8-32 URL-safe
characters) is not secret: it makes each mesh's key derivation different, so nobody can
precompute guesses for every mesh at once. The secret is what an attacker must guess. Generated
tokens are ``rand-XXXXXXXX.SECRET``: a 13-character salt whose ``rand-`` says the secret is
random, and a 32-character (192-bit) secret.

Nothing here prints or logs a token, and no message built here contains one. ``Token`` hides
its secret from ``repr`` and ``str``; ``Token.text`` is the only way back to the full string.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError
from .fileio import utf16_marked

# 22 URL-safe base64 characters carry 132 bits when random: the least a coordinator accepts
# without --weak-token. It measures length, not randomness: a generated token is what is meant.
MIN_SECRET_CHARS = 22
# A generated token's salt starts with this, and its secret is 32 characters of
# secrets.token_urlsafe: 192 random bits, which no stretching could make harder to guess, so
# its keys skip scrypt (gpumesh.security). Nothing else can tell a random secret from a chosen
# one: a hand-written token with this prefix and a chosen secret loses the stretching.
RANDOM_SALT_PREFIX = "rand-"
RANDOM_SECRET_CHARS = 32
SALT_MIN, SALT_MAX = 8, 32
_SALT = re.compile(rf"[A-Za-z0-9_-]{{{SALT_MIN},{SALT_MAX}}}")
# A token file holds one line; anything much longer is not a token file.
MAX_TOKEN_FILE_BYTES = 4096

HOW_TO_GENERATE = "generate one with 'gpumesh token'"
WEAK_FLAG = "--weak-token (GPUMESH_WEAK_TOKEN=1; weak_token=True from Python)"


@dataclass(frozen=True)
class Token:
    """A parsed token. ``salt`` is None when the token has no ``SALT.`` part."""

    salt: str | None
    secret: str = field(repr=False)

    @property
    def text(self) -> str:
        """The full token, as a peer must be given it."""
        return f"{self.salt}.{self.secret}" if self.salt else self.secret

    @property
    def weak(self) -> bool:
        return len(self.secret) < MIN_SECRET_CHARS

    @property
    def random(self) -> bool:
        """Made by ``new_token``, by its form: a ``rand-`` salt and a 32-character secret."""
        return (self.salt is not None and self.salt.startswith(RANDOM_SALT_PREFIX)
                and len(self.secret) >= RANDOM_SECRET_CHARS)

    def __str__(self) -> str:
        return repr(self)


def parse_token(text: str) -> Token:
    """Split ``SALT.SECRET``; a token whose part before the first dot is not a salt (8-32
    URL-safe characters) has no salt, and all of it is the secret."""
    if not text or not text.strip():
        raise ConfigError("the token is empty: set GPUMESH_TOKEN, or pass --token-file PATH")
    head, dot, rest = text.partition(".")
    if dot and rest and _SALT.fullmatch(head):
        return Token(salt=head, secret=rest)
    return Token(salt=None, secret=text)


def new_salt() -> str:
    return secrets.token_urlsafe(8)  # 11 characters


def new_token() -> str:
    """A fresh ``SALT.SECRET`` token: a ``rand-`` salt of 13 characters (which says the secret
    is random) and a 192-bit secret (32 characters)."""
    return f"{RANDOM_SALT_PREFIX}{secrets.token_urlsafe(6)}.{secrets.token_urlsafe(24)}"


def with_salt(text: str) -> str:
    """The token with a fresh salt in front when it has none (the secret is kept as it is)."""
    token = parse_token(text)
    return token.text if token.salt else f"{new_salt()}.{token.secret}"


def weakness(text: str) -> str | None:
    """Why the token is weak, without quoting it; None when it is long enough."""
    token = parse_token(text)
    if not token.weak:
        return None
    return (f"its secret part has {len(token.secret)} characters, fewer than the "
            f"{MIN_SECRET_CHARS} a random token needs for 128 bits")


def refuse_weak(text: str) -> None:
    """What a coordinator does with a weak token it was not told to accept: stop, and say how
    to get a strong one."""
    why = weakness(text)
    if why:
        raise ConfigError(
            f"this token is too weak to guard a coordinator: {why}. Anyone who records one "
            f"handshake can guess a short token offline. {HOW_TO_GENERATE[0].upper()}"
            f"{HOW_TO_GENERATE[1:]} (or leave the token out and 'gpumesh serve' makes one), "
            f"or pass {WEAK_FLAG} to accept a weak token knowingly"
        )


def weak_warning(text: str) -> str | None:
    """The one-line warning for a weak token that is used anyway; None for a strong one."""
    why = weakness(text)
    if not why:
        return None
    return (f"this mesh's token is weak ({why}): anyone who records one handshake can try to "
            f"guess it offline; {HOW_TO_GENERATE} and use that instead")


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in ``path`` (surrounding whitespace removed). The error names the file, never
    what is in it."""
    where = Path(path)
    try:
        with open(where, "rb") as handle:
            raw = handle.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read the token file {where}: {exc.strerror}") from None
    if len(raw) > MAX_TOKEN_FILE_BYTES:
        raise ConfigError(f"{where} is not a token file: it is longer than "
                          f"{MAX_TOKEN_FILE_BYTES} bytes")
    try:
        # A BOM is no part of the token: Notepad and PowerShell 5's "Out-File -Encoding utf8"
        # write one, and a machine whose file has none would be refused without a clue why.
        text = raw.decode("utf-8-sig").strip()
    except UnicodeDecodeError:
        utf16 = utf16_marked(raw)
        raise ConfigError(
            f"{where} is not a token file: it is not UTF-8 text"
            + (" (it is UTF-16, as PowerShell's > writes: write it with "
               "'gpumesh token --file FILE', or '... | Out-File -Encoding ascii FILE')"
               if utf16 else "")) from None
    if not text:
        raise ConfigError(f"the token file {where} is empty: {HOW_TO_GENERATE} --file {where}")
    if "\n" in text:
        raise ConfigError(f"{where} is not a token file: it has more than one line")
    return text


def loose_file_warning(path: str | os.PathLike[str]) -> str | None:
    """A warning when a token file can be read by other users; None when it cannot (or on
    Windows, where every file reads 0666 and chmod cannot change it: its ACL decides)."""
    if os.name == "nt":
        return None
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        return (f"warning: the token file {path} is readable by other users "
                f"(mode {stat.S_IMODE(mode):04o}): chmod 600 {path}")
    return None


def write_token_file(path: str | os.PathLike[str], token: str, *, replace: bool = False) -> None:
    """Write ``token`` to a file that is 0600 from its first byte. An existing file is an error
    unless ``replace``, which swaps the new file in whole."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}") if replace else target
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(token + "\n")
        if replace:
            os.replace(tmp, target)
    except OSError:  # a full disk: no half-written token file left to read as the token
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
