"""Unit tests for gpumesh.tokens: the SALT.SECRET form, strength, token files (no sockets)."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from gpumesh.errors import ConfigError
from gpumesh.tokens import (
    MIN_SECRET_CHARS,
    Token,
    loose_file_warning,
    new_token,
    parse_token,
    read_token_file,
    refuse_weak,
    weak_warning,
    weakness,
    with_salt,
    write_token_file,
)

SECRET = "s3cr3t-" + "x" * 30


@pytest.mark.parametrize(
    ("text", "salt", "secret"),
    [
        ("AbCdEfGh." + SECRET, "AbCdEfGh", SECRET),  # 8: the shortest salt
        ("A" * 32 + "." + SECRET, "A" * 32, SECRET),  # 32: the longest
        ("a_b-c_d-e." + SECRET, "a_b-c_d-e", SECRET),  # URL-safe punctuation
        ("AbCdEfGhIjK.with.more.dots", "AbCdEfGhIjK", "with.more.dots"),  # first dot splits
        ("AbCdEfG." + SECRET, None, "AbCdEfG." + SECRET),  # 7 characters: not a salt
        ("A" * 33 + "." + SECRET, None, "A" * 33 + "." + SECRET),  # 33: not a salt
        ("Ab+dEfGhIj." + SECRET, None, "Ab+dEfGhIj." + SECRET),  # '+' is not URL-safe
        ("AbCdEfGhIjK.", None, "AbCdEfGhIjK."),  # nothing after the dot: no salt
        (SECRET, None, SECRET),
        ("sunshine42", None, "sunshine42"),
        ("pässwörd.日本語-token", None, "pässwörd.日本語-token"),
    ],
)
def test_parse_token(text: str, salt: str | None, secret: str) -> None:
    token = parse_token(text)
    assert token == Token(salt=salt, secret=secret)
    assert token.text == text


@pytest.mark.parametrize("text", ["", " ", "\n\t"])
def test_an_empty_token_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="empty"):
        parse_token(text)


def test_a_token_never_shows_its_secret() -> None:
    token = parse_token("AbCdEfGhIjK." + SECRET)
    for shown in (repr(token), str(token), f"{token}"):
        assert SECRET not in shown
    assert "AbCdEfGhIjK" in repr(token)  # the salt is not secret


def test_new_tokens_are_salted_strong_url_safe_and_random() -> None:
    tokens = {new_token() for _ in range(50)}
    assert len(tokens) == 50
    for text in tokens:
        assert re.fullmatch(r"rand-[A-Za-z0-9_-]{8}\.[A-Za-z0-9_-]{32}", text), text
        token = parse_token(text)
        assert token.salt is not None and len(token.secret) == 32 and not token.weak


@pytest.mark.parametrize(("length", "weak"), [(1, True), (MIN_SECRET_CHARS - 1, True),
                                              (MIN_SECRET_CHARS, False), (64, False)])
def test_strength_is_the_length_of_the_secret_part(length: int, weak: bool) -> None:
    assert (weakness("y" * length) is not None) == weak
    # A salt adds nothing to the strength: it is not secret.
    assert (weakness("AbCdEfGhIjK." + "y" * length) is not None) == weak


def test_refusing_a_weak_token_says_how_to_get_a_strong_one_and_never_quotes_it() -> None:
    with pytest.raises(ConfigError) as caught:
        refuse_weak("Qm9wNTwLxkE.sunshine42")
    text = str(caught.value)
    assert "sunshine42" not in text and "Qm9wNTwLxkE" not in text
    assert "gpumesh token" in text and "--weak-token" in text and "GPUMESH_WEAK_TOKEN=1" in text
    assert "weak_token=True" in text and "10 characters" in text
    refuse_weak(SECRET)  # a strong one passes
    assert weak_warning(SECRET) is None
    warning = weak_warning("sunshine42")
    assert warning is not None and "sunshine42" not in warning


def test_with_salt_adds_a_salt_only_where_there_is_none() -> None:
    salted = with_salt("sunshine42")
    token = parse_token(salted)
    assert token.secret == "sunshine42" and token.salt is not None and len(token.salt) == 11
    assert with_salt(salted) == salted
    assert with_salt("sunshine42") != salted  # a fresh salt each time


def test_token_files_are_written_0600_from_the_first_byte_and_never_overwritten(
        tmp_path: Path) -> None:
    path = tmp_path / "mesh.token"
    old = os.umask(0)  # the worst umask: anything not created 0600 would show
    try:
        write_token_file(path, SECRET)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with pytest.raises(FileExistsError):
            write_token_file(path, "other")
        write_token_file(path, "replaced-" + SECRET, replace=True)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        os.umask(old)
    assert read_token_file(path) == "replaced-" + SECRET
    assert loose_file_warning(path) is None
    assert [p.name for p in tmp_path.iterdir()] == ["mesh.token"]  # no temporary file left


def test_reading_a_token_file_strips_whitespace(tmp_path: Path) -> None:
    path = tmp_path / "t"
    path.write_text(f"  {SECRET}\r\n\n")
    assert read_token_file(path) == SECRET
    path.write_bytes(b"\xef\xbb\xbf" + SECRET.encode() + b"\r\n")  # PowerShell 5's utf8
    assert read_token_file(path) == SECRET
    path.write_bytes(SECRET.encode("utf-16"))  # PowerShell 5's >
    with pytest.raises(ConfigError, match="it is UTF-16") as caught:
        read_token_file(path)
    assert SECRET not in str(caught.value)


@pytest.mark.parametrize(
    ("content", "match"),
    [(b"", "empty"), (b"  \n", "empty"), (b"a\nb\n", "more than one line"),
     (b"\xff\xfe" + SECRET.encode(), "not UTF-8"), (b"x" * 5000, "longer than")],
)
def test_bad_token_files_are_config_errors_that_never_quote_them(
        tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "t"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=match) as caught:
        read_token_file(path)
    assert str(path) in str(caught.value)
    assert SECRET not in str(caught.value) and "xxxxxxxxxx" not in str(caught.value)


def test_a_missing_token_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the token file"):
        read_token_file(tmp_path / "absent")


def test_a_token_file_others_can_read_is_warned_about(tmp_path: Path) -> None:
    path = tmp_path / "t"
    path.write_text(SECRET)
    path.chmod(0o644)
    warning = loose_file_warning(path)
    assert warning is not None and "0644" in warning and "chmod 600" in warning
    assert SECRET not in warning
