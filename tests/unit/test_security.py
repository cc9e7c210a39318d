"""Unit tests for gpumesh.security: token -> CURVE keys (no sockets).

Each distinct token costs one scrypt (about 0.4 s), so the tests share a few module-scoped
derivations.
"""

from __future__ import annotations

import hashlib
import hmac
import logging

import pytest
import zmq
from conftest import poll_until
from zmq.utils import z85

from gpumesh import security
from gpumesh.errors import ConfigError
from gpumesh.security import (
    KDF,
    ZAP_DOMAIN,
    MeshKeys,
    _AllowMeshClient,
    cached_stretch,
    derive_keys,
    remember_stretched,
    stretch,
)

SALTED = "AbCdEfGhIjK." + "k" * 32  # the generated form: SALT.SECRET
OTHER_SALT = "ZyXwVuTsRqP." + "k" * 32  # same secret, another mesh's salt
STRONG = "Zq3-" + "k" * 40  # a saltless strong token, like secrets.token_urlsafe(32)
GENERATED = "rand-AbCdEfGh." + "k" * 32  # the form `gpumesh token` makes: random, no scrypt
WEAK = "Qm9wNTwLxkE.sunshine42"  # a weak secret with a salt, as `serve --weak-token` makes it

_Z85_ALPHABET = set(
    b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)


@pytest.fixture(scope="module")
def keys() -> dict[str, MeshKeys]:
    return {token: derive_keys(token) for token in (SALTED, OTHER_SALT, STRONG)}


def _all_keys(keys: MeshKeys) -> list[bytes]:
    return [keys.server_public, keys.server_secret, keys.client_public, keys.client_secret]


def test_known_answers_pin_the_key_derivation(keys: dict[str, MeshKeys]) -> None:
    # A change here changes every mesh's keys: a breaking change (docs/stability.md).
    assert KDF == "scrypt-n17-r8-p1/gpumesh-v2"
    assert keys[SALTED].fingerprint == "5c64e191a241"
    assert keys[SALTED].server_public == b"&Y}rdFO?ea]w1gK=QkRABexBo<4Y:W+*h(7P0O2o"
    assert keys[STRONG].fingerprint == "8c0d53e011f9"
    assert keys[STRONG].server_public == b"(474<+*zpCsc(7^p25fE(<[c/SDEBgMZ@nyoX9x<"


def test_the_salt_makes_the_same_secret_another_mesh(keys: dict[str, MeshKeys]) -> None:
    for a, b in zip(_all_keys(keys[SALTED]), _all_keys(keys[OTHER_SALT]), strict=True):
        assert a != b
    assert keys[SALTED].fingerprint != keys[OTHER_SALT].fingerprint


def test_a_saltless_token_is_stretched_too_with_the_domain_salt(keys: dict[str, MeshKeys]) -> None:
    secret = STRONG.encode()
    plain = security._hkdf(secret, b"curve-server")  # what an unstretched token would give
    assert z85.encode(plain) != keys[STRONG].server_secret
    expected = hashlib.scrypt(secret, salt=b"gpumesh/v2/no-salt", n=2**17, r=8, p=1,
                              maxmem=2**28, dklen=32)
    assert stretch(STRONG) == expected


def test_derivation_is_deterministic_and_cached_per_process(keys: dict[str, MeshKeys]) -> None:
    assert cached_stretch(SALTED) is not None
    assert derive_keys(SALTED) == keys[SALTED]
    assert cached_stretch("never.derived-in-this-process-at-all") is None


def test_a_remembered_stretch_is_used_instead_of_scrypt() -> None:
    token = "CacheTest01." + "c" * 32
    remember_stretched(token, b"\x07" * 32)  # what the CLI does with the saved config's cache
    assert stretch(token) == b"\x07" * 32
    assert derive_keys(token).fingerprint == security._hkdf(b"\x07" * 32, b"fingerprint", 6).hex()


def test_the_cache_is_bounded() -> None:
    for i in range(security._CACHE_SIZE + 3):
        remember_stretched(f"bound-{i:02d}", bytes([i]) * 32)
    assert cached_stretch("bound-00") is None
    assert cached_stretch(f"bound-{security._CACHE_SIZE + 2:02d}") is not None


def test_server_and_client_pairs_differ(keys: dict[str, MeshKeys]) -> None:
    assert keys[SALTED].server_public != keys[SALTED].client_public
    assert keys[SALTED].server_secret != keys[SALTED].client_secret


def test_keys_are_z85_and_public_matches_secret(keys: dict[str, MeshKeys]) -> None:
    for derived in keys.values():
        for key in _all_keys(derived):
            assert len(key) == 40 and set(key) <= _Z85_ALPHABET
            assert len(z85.decode(key)) == 32
        assert zmq.curve_public(derived.server_secret) == derived.server_public
        assert zmq.curve_public(derived.client_secret) == derived.client_public


def test_fingerprint_is_short_hex(keys: dict[str, MeshKeys]) -> None:
    fingerprint = keys[SALTED].fingerprint
    assert len(fingerprint) == 12 and fingerprint == fingerprint.lower()
    int(fingerprint, 16)


def test_a_weak_token_still_derives_and_warns_once_without_quoting_it(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gpumesh.security"):
        first = derive_keys(WEAK)
        assert derive_keys(WEAK) == first
    warnings = [r for r in caplog.records if r.name == "gpumesh.security"]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert "weak" in text and "gpumesh token" in text
    assert "sunshine42" not in text and "Qm9wNTwLxkE" not in text
    assert zmq.curve_public(first.client_secret) == first.client_public


@pytest.mark.parametrize("token", ["", " ", "   ", "\t\n"])
def test_empty_token_is_config_error(token: str) -> None:
    with pytest.raises(ConfigError, match="empty"):
        derive_keys(token)


def test_repr_hides_the_secret_keys(keys: dict[str, MeshKeys]) -> None:
    derived = keys[SALTED]
    text = repr(derived)
    for secret in (derived.server_secret, derived.client_secret):
        assert secret.decode() not in text and repr(secret) not in text
    assert "secret" not in text
    assert SALTED not in text
    assert derived.fingerprint in text
    assert str(derived) == text


def test_mesh_keys_are_frozen(keys: dict[str, MeshKeys]) -> None:
    with pytest.raises(AttributeError):
        keys[SALTED].server_secret = b"x" * 40  # type: ignore[misc]


def test_zap_callback_admits_only_the_derived_client_key(keys: dict[str, MeshKeys]) -> None:
    allow = _AllowMeshClient(keys[SALTED])
    assert allow.callback(ZAP_DOMAIN, keys[SALTED].client_public) is True
    assert allow.callback(ZAP_DOMAIN, keys[OTHER_SALT].client_public) is False
    assert allow.callback(ZAP_DOMAIN, keys[SALTED].server_public) is False
    assert allow.callback("other-domain", keys[SALTED].client_public) is False


def test_one_token_is_stretched_once_however_many_threads_ask(monkeypatch):
    import hashlib
    import threading
    import types

    from gpumesh import security

    calls = []
    real = hashlib.scrypt
    waiting = threading.Semaphore(0)  # released by each thread that waits for a stretch

    class WatchedEvent(threading.Event):
        def wait(self, timeout=None):
            waiting.release()
            return super().wait(timeout)

    def held_scrypt(*args, **kwargs):
        calls.append(1)
        for _ in range(3):  # held until every other thread asked and waits for this one
            if not waiting.acquire(timeout=10):
                raise AssertionError("the other threads did not wait for the stretch under way")
        return real(*args, **{**kwargs, "n": 2**10})

    monkeypatch.setattr(security.hashlib, "scrypt", held_scrypt)
    # Only security's Events are watched (threading.Thread waits on Events of its own).
    monkeypatch.setattr(security, "threading",
                        types.SimpleNamespace(**{**vars(threading), "Event": WatchedEvent}))
    token = "coalesce." + "q" * 40
    results = []
    threads = [threading.Thread(target=lambda: results.append(security.stretch(token)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(calls) == 1 and len(results) == 4 and len(set(results)) == 1
    assert security._in_flight == {}


def test_a_child_forked_mid_stretch_stretches_for_itself(monkeypatch):
    import hashlib
    import os
    import threading

    from gpumesh import security

    real = hashlib.scrypt
    started, release = threading.Event(), threading.Event()
    parent = os.getpid()

    def slow_scrypt(*args, **kwargs):
        started.set()
        if os.getpid() == parent:
            release.wait(10)  # in flight until the forked child has stretched for itself
        return real(*args, **{**kwargs, "n": 2**10})

    monkeypatch.setattr(security.hashlib, "scrypt", slow_scrypt)
    token = "forked." + "z" * 40
    thread = threading.Thread(target=security.stretch, args=(token,))
    thread.start()
    assert started.wait(5)
    pid = os.fork()
    if pid == 0:  # the child: nobody will finish the parent's stretch here
        try:
            security.stretch(token)
            os._exit(0)
        except BaseException:
            os._exit(1)
    ended = poll_until(lambda: (waited := os.waitpid(pid, os.WNOHANG))[0] and waited, 10)
    if ended is None:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        raise AssertionError("the forked child waited forever for its parent's stretch")
    _, status = ended
    release.set()
    thread.join(5)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_generated_token_skips_scrypt_and_its_keys_are_pinned(monkeypatch):
    def no_scrypt(*args, **kwargs):
        raise AssertionError("a generated token's secret is random: it needs no scrypt")

    monkeypatch.setattr(security.hashlib, "scrypt", no_scrypt)
    keys = derive_keys(GENERATED)
    assert security.kdf_for(GENERATED) == "hmac-sha256-random/gpumesh-v2"
    material = hmac.new(b"gpumesh/v2/salt/rand-AbCdEfGh", b"k" * 32, hashlib.sha256).digest()
    assert stretch(GENERATED) == material
    assert keys.server_secret == z85.encode(security._hkdf(material, b"curve-server"))
    assert keys.fingerprint == "015853f23b37"
    assert keys.server_public == b"a=&(%K+hX9P5Mt6EU(4K3eHuuaiQ]o7tccIwW+=k"
    # Another salt is another mesh, as for stretched tokens.
    assert derive_keys("rand-ZyXwVuTs." + "k" * 32).fingerprint != keys.fingerprint


def test_only_the_generated_form_skips_scrypt():
    from gpumesh.tokens import new_token, parse_token

    assert parse_token(new_token()).random and len(new_token()) == 13 + 1 + 32
    for chosen in ("rand-AbCdEfGh." + "k" * 31,  # a shorter secret: perhaps a chosen one
                   "AbCdEfGhIjK." + "k" * 32,  # a salt of the older form
                   "rand-" + "k" * 40):  # no dot: all of it is the secret
        assert not parse_token(chosen).random
        assert security.kdf_for(chosen) == KDF
