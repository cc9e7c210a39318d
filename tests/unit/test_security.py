"""Unit tests for gpumesh.security: token -> CURVE keys (no sockets)."""

from __future__ import annotations

import pytest
import zmq
from zmq.utils import z85

from gpumesh.errors import ConfigError
from gpumesh.security import (
    STRONG_TOKEN_CHARS,
    ZAP_DOMAIN,
    MeshKeys,
    _AllowMeshClient,
    derive_keys,
)

STRONG = "Zq3-" + "k" * 40  # 44 chars, like secrets.token_urlsafe(32)
OTHER_STRONG = "Zq3-" + "k" * 39 + "j"
SHORT = "correct horse battery"  # < 32 chars: the scrypt path

_Z85_ALPHABET = set(
    b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)


@pytest.fixture(scope="module")
def strong_keys() -> MeshKeys:
    return derive_keys(STRONG)


@pytest.fixture(scope="module")
def short_keys() -> MeshKeys:
    return derive_keys(SHORT)


def _all_keys(keys: MeshKeys) -> list[bytes]:
    return [keys.server_public, keys.server_secret, keys.client_public, keys.client_secret]


def test_derive_keys_is_deterministic(strong_keys: MeshKeys, short_keys: MeshKeys) -> None:
    assert derive_keys(STRONG) == strong_keys
    assert derive_keys(SHORT) == short_keys


def test_different_tokens_give_different_keys(strong_keys: MeshKeys, short_keys: MeshKeys) -> None:
    other = derive_keys(OTHER_STRONG)
    for a, b in zip(_all_keys(strong_keys), _all_keys(other), strict=True):
        assert a != b
    assert strong_keys.fingerprint != other.fingerprint
    for a, b in zip(_all_keys(strong_keys), _all_keys(short_keys), strict=True):
        assert a != b


def test_server_and_client_pairs_differ(strong_keys: MeshKeys) -> None:
    assert strong_keys.server_public != strong_keys.client_public
    assert strong_keys.server_secret != strong_keys.client_secret


@pytest.mark.parametrize("which", ["strong_keys", "short_keys"])
def test_keys_are_z85_and_public_matches_secret(which: str, request: pytest.FixtureRequest) -> None:
    keys: MeshKeys = request.getfixturevalue(which)
    for key in _all_keys(keys):
        assert isinstance(key, bytes)
        assert len(key) == 40
        assert set(key) <= _Z85_ALPHABET
        assert len(z85.decode(key)) == 32
    assert zmq.curve_public(keys.server_secret) == keys.server_public
    assert zmq.curve_public(keys.client_secret) == keys.client_public


def test_fingerprint_is_short_hex(strong_keys: MeshKeys) -> None:
    assert len(strong_keys.fingerprint) == 12
    int(strong_keys.fingerprint, 16)
    assert strong_keys.fingerprint == strong_keys.fingerprint.lower()


def test_short_tokens_work_and_are_stretched(short_keys: MeshKeys) -> None:
    assert len(SHORT) < STRONG_TOKEN_CHARS
    assert len(short_keys.server_public) == 40
    # The length boundary: 31 chars is stretched, 32 is not; both still derive valid keys.
    k31 = derive_keys("a" * (STRONG_TOKEN_CHARS - 1))
    k32 = derive_keys("a" * STRONG_TOKEN_CHARS)
    assert k31 != k32
    assert zmq.curve_public(k31.client_secret) == k31.client_public
    assert zmq.curve_public(k32.client_secret) == k32.client_public


def test_single_character_token_works() -> None:
    keys = derive_keys("x")
    assert zmq.curve_public(keys.server_secret) == keys.server_public


def test_unicode_token_works() -> None:
    keys = derive_keys("pässwörd-ñ-日本")
    assert keys == derive_keys("pässwörd-ñ-日本")
    assert zmq.curve_public(keys.client_secret) == keys.client_public


@pytest.mark.parametrize("token", ["", " ", "   ", "\t\n"])
def test_empty_token_is_config_error(token: str) -> None:
    with pytest.raises(ConfigError, match="empty"):
        derive_keys(token)


def test_repr_hides_the_secret_keys(strong_keys: MeshKeys) -> None:
    text = repr(strong_keys)
    assert strong_keys.server_secret.decode() not in text
    assert strong_keys.client_secret.decode() not in text
    assert repr(strong_keys.server_secret) not in text
    assert repr(strong_keys.client_secret) not in text
    assert "secret" not in text
    assert STRONG not in text
    # The public parts are fine to show.
    assert strong_keys.fingerprint in text
    assert str(strong_keys) == text


def test_mesh_keys_are_frozen(strong_keys: MeshKeys) -> None:
    with pytest.raises(AttributeError):
        strong_keys.server_secret = b"x" * 40  # type: ignore[misc]


def test_zap_callback_admits_only_the_derived_client_key(strong_keys: MeshKeys) -> None:
    allow = _AllowMeshClient(strong_keys)
    other = derive_keys(OTHER_STRONG)
    assert allow.callback(ZAP_DOMAIN, strong_keys.client_public) is True
    assert allow.callback(ZAP_DOMAIN, other.client_public) is False
    assert allow.callback(ZAP_DOMAIN, strong_keys.server_public) is False
    assert allow.callback("other-domain", strong_keys.client_public) is False
