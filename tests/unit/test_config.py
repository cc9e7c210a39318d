"""Unit tests for gpumesh.config: URLs, environment settings and the saved connection file."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest

from gpumesh.config import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    Endpoint,
    Limits,
    SavedConnection,
    Settings,
    Timing,
    ensure_home,
    load_connection,
    new_token,
    parse_url,
    save_connection,
)
from gpumesh.errors import ConfigError, MeshError

TOKEN = "tok-" + "s3cr3t" * 8  # distinctive, so a leak is easy to spot

# --------------------------------------------------------------------------- parse_url


@pytest.mark.parametrize(
    ("url", "host", "port"),
    [
        ("tcp://198.51.100.5:8123", "198.51.100.5", 8123),
        ("gpumesh://box.lan:9001", "box.lan", 9001),
        ("http://192.0.2.10:8000", "192.0.2.10", 8000),
        ("https://example.org:443", "example.org", 443),
        ("TCP://host:1", "host", 1),
        ("host.example:65535", "host.example", 65535),
        ("localhost", "localhost", DEFAULT_PORT),
        ("tcp://myhost", "myhost", DEFAULT_PORT),
        ("[::1]:9000", "::1", 9000),
        ("tcp://[fe80::1]:7000", "fe80::1", 7000),
        ("[::1]", "::1", DEFAULT_PORT),
        ("  tcp://spaced:1234  ", "spaced", 1234),
        ("http://h:8000/", "h", 8000),
    ],
)
def test_parse_url_accepts(url: str, host: str, port: int) -> None:
    endpoint = parse_url(url)
    assert endpoint == Endpoint(host, port)
    assert endpoint.host == host
    assert endpoint.port == port


def test_default_port_is_8000() -> None:
    assert DEFAULT_PORT == 8000
    assert parse_url("bare-host").port == 8000


def test_endpoint_zmq_form() -> None:
    assert parse_url("gpumesh://h:5").zmq == "tcp://h:5"
    assert parse_url("[::1]:9000").zmq == "tcp://[::1]:9000"
    assert str(parse_url("h")) == "tcp://h:8000"
    # The zmq form parses back to the same endpoint.
    for url in ("h:1", "[::1]:9000", "198.51.100.3:80"):
        endpoint = parse_url(url)
        assert parse_url(endpoint.zmq) == endpoint


@pytest.mark.parametrize(
    "url",
    [
        "",
        "   ",
        "ftp://h:21",
        "udp://h:1",
        "ws://h:80",
        "h:0",
        "h:65536",
        "h:99999",
        "h:abc",
        "h:-1",
        "tcp://",
        "tcp://:8000",
        "h:80:90",
        "::1",
        "[::1",
        "tcp://h:80/path",
        "tcp://a b:8000",  # hosts ZeroMQ refuses later, with a traceback
        "*:8000",
        "tcp://;:1",
        "tcp://" + "x" * 300 + ":8000",
        "tcp://h:" + "9" * 5000,  # int() refuses more than 4,300 digits
        "tcp://[:::::]:8000",  # brackets that hold no IPv6 address
        "tcp://[1.2.3]:8000",
    ],
)
def test_parse_url_rejects(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_url(url)
    assert isinstance(info.value, MeshError)
    assert str(info.value) and len(str(info.value)) < 400  # says something, and briefly


@pytest.mark.parametrize("weak", [False, True])
def test_a_token_given_as_the_url_is_refused_and_never_quoted(tmp_path: Path, weak: bool) -> None:
    from gpumesh.tokens import new_token, with_salt

    token = with_salt("hunter2secret") if weak else new_token()
    for url in (token, f"tcp://{token}:8000", f"http://{token}"):
        # Given with the token (join, a client): refused whatever its shape.
        settings = _settings(tmp_path, GPUMESH_URL=url, GPUMESH_TOKEN=token)
        with pytest.raises(ConfigError, match="is a token, not an address") as info:
            settings.resolve_connection()
        assert token not in str(info.value) and token.split(".")[1] not in str(info.value)
    if not weak:  # another mesh's token, or none known: a generated one is told by its shape
        with pytest.raises(ConfigError, match="is a token, not an address") as info:
            parse_url(new_token())


@pytest.mark.parametrize("host", ["192.168.1.20", "myhost.local", "DESKTOP-AB12CDE",
                                  "ip-10-0-0-1.ec2.internal", "3f2a9c1b7d4e5f60718293a4b5c6d7e8",
                                  "gpu-box-01.lab.example.org", "random-host.lan",
                                  "rand-box.lan", "rand-12345678.example",
                                  "Alexanders-MacBook-Pro-2.local",
                                  "Johns-MacBook-Pro-16inch-2021.local"])
def test_host_names_are_not_taken_for_tokens(host: str) -> None:
    assert parse_url(f"tcp://{host}:8000").host == host
    # A weak secret that a host name happens to contain is not the host.
    assert parse_url(f"tcp://{host}:8000", "gpubox01").host == host
    assert parse_url("tcp://gpubox01.lab:8000", "gpubox01").host == "gpubox01.lab"


def test_a_token_made_as_the_spec_says_is_not_taken_for_a_host() -> None:
    # secrets.token_urlsafe(32), the spec's recipe: set as the URL with no token known.
    for token in ("0fI2dQ_yXk3Lm9PzR7sTt4uVw8Ab1Cd5Ef6Gh2Ij3Kl", "_9xQeL2mZk7RtY4wPa8sDf3GhJ6kLz1XcV5bN0mQw"):
        with pytest.raises(ConfigError, match="is a token, not an address") as info:
            parse_url(f"tcp://{token}:8000")
        assert token not in str(info.value)
    # Kubernetes pod names are long, lower case, digits and dashes: hosts. So is a long Mac's.
    assert parse_url("myapp-deployment-5d4f8c7b9-abcde-x1.svc").host.startswith("myapp")
    assert parse_url("Alexandras-MacBook-Pro-14-inch-M3-2023:8000").port == 8000


def test_a_host_zeromq_would_refuse_is_refused_here_in_words() -> None:
    # libzmq's connect() raises EINVAL for a first character other than a letter or digit.
    with pytest.raises(ConfigError, match="is not a host name or an IP address"):
        parse_url("tcp://_abc:8000")
    assert parse_url("tcp://a_b:8000").host == "a_b"  # inside a name ZeroMQ takes it


def test_a_weak_secret_given_alone_as_the_url_is_refused() -> None:
    for url in ("gpubox01", "tcp://gpubox01:8000", "my.dotted.secret"):
        secret = url.removeprefix("tcp://").removesuffix(":8000")
        with pytest.raises(ConfigError, match="is a token, not an address"):
            parse_url(url, f"k5tSOTVpsSQ.{secret}")


def test_parse_url_error_names_the_scheme() -> None:
    with pytest.raises(ConfigError, match="ftp"):
        parse_url("ftp://h:21")


# --------------------------------------------------------------------------- Settings.from_env


def test_from_env_defaults(tmp_path: Path) -> None:
    settings = Settings.from_env({"GPUMESH_HOME": str(tmp_path)})
    assert settings.home == tmp_path
    assert settings.url is None
    assert settings.token is None
    assert settings.host == DEFAULT_HOST
    assert settings.local_only is False
    assert settings.verbose is False
    assert settings.timing == Timing()
    assert settings.limits == Limits()
    assert settings.config_path == tmp_path / "config.json"


def test_from_env_home_defaults_under_user_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    settings = Settings.from_env({})
    assert settings.home == tmp_path / ".gpumesh"


def test_from_env_home_expands_user(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    settings = Settings.from_env({"GPUMESH_HOME": "~/mesh"})
    assert settings.home == tmp_path / "mesh"


def test_from_env_reads_every_variable(tmp_path: Path) -> None:
    env = {
        "GPUMESH_HOME": str(tmp_path / "home"),
        "GPUMESH_URL": "tcp://198.51.100.1:8001",
        "GPUMESH_TOKEN": TOKEN,
        "GPUMESH_HOST": "0.0.0.0",
        "GPUMESH_LOCAL": "1",
        "GPUMESH_VERBOSE": "yes",
        "GPUMESH_HEARTBEAT": "0.5",
        "GPUMESH_LEASE_TTL": "4",
        "GPUMESH_PENDING_TIMEOUT": "30",
        "GPUMESH_CONNECT_TIMEOUT": "1.5",
        "GPUMESH_RECONNECT_GRACE": "12",
        "GPUMESH_RESTORE_GRACE": "2.5",
    }
    settings = Settings.from_env(env)
    assert settings.home == tmp_path / "home"
    assert settings.url == "tcp://198.51.100.1:8001"
    assert settings.token == TOKEN
    assert settings.host == "0.0.0.0"
    assert settings.local_only is True
    assert settings.verbose is True
    assert settings.timing.heartbeat == 0.5
    assert settings.timing.lease_ttl == 4.0
    assert settings.timing.pending_timeout == 30.0
    assert settings.timing.connect_timeout == 1.5
    assert settings.timing.reconnect_grace == 12.0
    assert settings.timing.restore_grace == 2.5
    assert settings.timing.liveness == Timing.liveness
    assert settings.timing.silence_limit == pytest.approx(0.5 * Timing.liveness)


def test_from_env_does_not_read_os_environ_when_given_a_mapping(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GPUMESH_TOKEN", "from-os-environ")
    monkeypatch.setenv("GPUMESH_URL", "tcp://os:1")
    settings = Settings.from_env({"GPUMESH_HOME": str(tmp_path)})
    assert settings.token is None
    assert settings.url is None


def test_from_env_reads_os_environ_by_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GPUMESH_HOME", str(tmp_path))
    monkeypatch.setenv("GPUMESH_TOKEN", "from-os-environ")
    monkeypatch.setenv("GPUMESH_HEARTBEAT", "2")
    settings = Settings.from_env()
    assert settings.token == "from-os-environ"
    assert settings.timing.heartbeat == 2.0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        (" on ", True),
        ("yes", True),
        ("0", False),
        ("false", False),
        ("", False),
        ("no", False),
        ("2", False),
    ],
)
def test_from_env_local_flag(value: str, expected: bool, tmp_path: Path) -> None:
    settings = Settings.from_env({"GPUMESH_HOME": str(tmp_path), "GPUMESH_LOCAL": value})
    assert settings.local_only is expected


def test_from_env_empty_strings_mean_unset(tmp_path: Path) -> None:
    settings = Settings.from_env(
        {
            "GPUMESH_HOME": str(tmp_path),
            "GPUMESH_URL": "",
            "GPUMESH_TOKEN": "",
            "GPUMESH_HEARTBEAT": "",
            "GPUMESH_HOST": "",
        }
    )
    assert settings.url is None
    assert settings.token is None
    assert settings.host == DEFAULT_HOST
    assert settings.timing.heartbeat == Timing.heartbeat


@pytest.mark.parametrize("value", ["fast", "1s", "0", "-1", "0.0", "1,5"])
@pytest.mark.parametrize(
    "name", ["GPUMESH_HEARTBEAT", "GPUMESH_LEASE_TTL", "GPUMESH_CONNECT_TIMEOUT"]
)
def test_from_env_bad_number_is_config_error(name: str, value: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"GPUMESH_HOME": str(tmp_path), name: value})
    assert name in str(info.value)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_from_env_non_finite_number_is_config_error(value: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        Settings.from_env({"GPUMESH_HOME": str(tmp_path), "GPUMESH_HEARTBEAT": value})


@pytest.mark.parametrize("name, value", [
    ("GPUMESH_HEARTBEAT", "1e20"),  # an OverflowError in zmq_poll
    ("GPUMESH_LEASE_TTL", "1e300"),
    ("GPUMESH_MAX_QUEUED_GB", "1e300"),  # an OverflowError from int(inf) in from_env
    ("GPUMESH_QUEUE_MEMORY_MB", "1e300"),
])
def test_from_env_huge_number_is_config_error_naming_it(name: str, value: str,
                                                        tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"{name}=.* at most"):
        Settings.from_env({"GPUMESH_HOME": str(tmp_path), name: value})


def test_with_timing_replaces_only_the_given_fields(tmp_path: Path) -> None:
    settings = Settings.from_env({"GPUMESH_HOME": str(tmp_path), "GPUMESH_HEARTBEAT": "0.5"})
    changed = settings.with_timing(lease_ttl=3.0)
    assert changed.timing.lease_ttl == 3.0
    assert changed.timing.heartbeat == 0.5
    assert settings.timing.lease_ttl == Timing.lease_ttl  # frozen original untouched
    assert changed.home == settings.home


# --------------------------------------------------------------------------- connection file


def test_save_connection_writes_mode_0600_and_loads_back(tmp_path: Path) -> None:
    path = tmp_path / "fresh" / "config.json"
    save_connection(path, "tcp://198.51.100.7:8000", TOKEN)

    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert json.loads(path.read_text()) == {"url": "tcp://198.51.100.7:8000", "token": TOKEN}
    # No temporary file is left behind.
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.json"]

    saved = load_connection(path)
    assert saved == SavedConnection(url="tcp://198.51.100.7:8000", token=TOKEN)


def test_save_connection_replaces_a_world_readable_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"url": "tcp://old:1", "token": "old"}))
    os.chmod(path, 0o644)
    save_connection(path, "tcp://new:2", TOKEN)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_connection(path) == SavedConnection("tcp://new:2", TOKEN)


def test_the_coordinators_bind_and_a_workers_slots_are_saved_and_loaded_back(
        tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    save_connection(path, "tcp://127.0.0.1:18001", TOKEN, served=("0.0.0.0", 18001), slots=3)
    data = json.loads(path.read_text())
    assert data["serve"] == {"host": "0.0.0.0", "port": 18001} and data["slots"] == 3
    saved = load_connection(path)
    assert saved is not None and saved.served == ("0.0.0.0", 18001) and saved.slots == 3
    assert saved.own_coordinator


@pytest.mark.parametrize(("url", "served", "own"), [
    ("tcp://192.0.2.10:8000", None, False),  # a worker's connection to another machine
    ("tcp://192.0.2.10:8000", ("0.0.0.0", 8000), True),  # said by serve itself
    ("tcp://127.0.0.1:8000", None, True),  # saved before serve said so: loopback is here
    ("tcp://localhost:8000", None, True),
    ("tcp://[::1]:8000", None, True),
])
def test_own_coordinator(url: str, served: tuple[str, int] | None, own: bool) -> None:
    assert SavedConnection(url, TOKEN, served=served).own_coordinator is own


@pytest.mark.parametrize("extra", [
    {"serve": "127.0.0.1:8000"}, {"serve": {"host": "", "port": 8000}},
    {"serve": {"host": "127.0.0.1", "port": 0}}, {"serve": {"host": "127.0.0.1", "port": True}},
    {"slots": 0}, {"slots": "3"}, {"slots": 2000}, {"slots": False},
])
def test_a_damaged_bind_or_slot_count_is_config_error(tmp_path: Path, extra: dict) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"url": "tcp://h:1", "token": TOKEN, **extra}))
    with pytest.raises(ConfigError) as info:
        load_connection(path)
    assert TOKEN not in str(info.value)


def test_from_env_says_whether_gpumesh_host_chose_the_bind(tmp_path: Path) -> None:
    assert Settings.from_env({"GPUMESH_HOME": str(tmp_path)}).host_given is False
    given = Settings.from_env({"GPUMESH_HOME": str(tmp_path), "GPUMESH_HOST": "127.0.0.1"})
    assert given.host_given is True and given.host == "127.0.0.1"


def test_load_connection_missing_file_is_none(tmp_path: Path) -> None:
    assert load_connection(tmp_path / "nope.json") is None


@pytest.mark.parametrize(
    "content",
    ["", "not json", "{", "[]", "null", '"text"', "42", '{"url": "tcp://h:1"}', '{"token": "t"}'],
)
def test_load_connection_damaged_file_is_config_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        load_connection(path)
    assert str(path) in str(info.value)


def test_load_connection_unreadable_path_is_config_error(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.mkdir()
    with pytest.raises(ConfigError):
        load_connection(path)


def test_load_connection_non_utf8_file_is_config_error(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b'{"url": "\xff\xfe", "token": "t"}')
    with pytest.raises(ConfigError):
        load_connection(path)


def test_load_connection_null_fields_are_config_error(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"url": null, "token": null}')
    with pytest.raises(ConfigError):
        load_connection(path)


def test_saved_connection_repr_hides_the_token(tmp_path: Path) -> None:
    saved = SavedConnection(url="tcp://h:1", token=TOKEN)
    assert TOKEN not in repr(saved)
    assert "tcp://h:1" in repr(saved)
    path = tmp_path / "config.json"
    save_connection(path, "tcp://h:1", TOKEN)
    loaded = load_connection(path)
    assert loaded is not None
    assert TOKEN not in repr(loaded)
    assert TOKEN not in str(loaded)


def test_new_token_is_random_and_strong() -> None:
    tokens = {new_token() for _ in range(20)}
    assert len(tokens) == 20
    assert all(len(t) >= 43 for t in tokens)


# --------------------------------------------------------------------------- resolve_connection


def _settings(home: Path, **env: str) -> Settings:
    return Settings.from_env({"GPUMESH_HOME": str(home), **env})


def test_resolve_uses_saved_connection_when_nothing_else(tmp_path: Path) -> None:
    save_connection(tmp_path / "config.json", "tcp://saved:1111", "saved-token")
    settings = _settings(tmp_path)
    assert settings.saved_connection() == SavedConnection("tcp://saved:1111", "saved-token")
    assert settings.resolve_connection() == (Endpoint("saved", 1111), "saved-token")


def test_resolve_env_beats_saved(tmp_path: Path) -> None:
    save_connection(tmp_path / "config.json", "tcp://saved:1111", "saved-token")
    settings = _settings(tmp_path, GPUMESH_URL="tcp://env:2222", GPUMESH_TOKEN="env-token")
    assert settings.resolve_connection() == (Endpoint("env", 2222), "env-token")


def test_resolve_explicit_beats_env_and_saved(tmp_path: Path) -> None:
    save_connection(tmp_path / "config.json", "tcp://saved:1111", "saved-token")
    settings = _settings(tmp_path, GPUMESH_URL="tcp://env:2222", GPUMESH_TOKEN="env-token")
    assert settings.resolve_connection("explicit:3333", "explicit-token") == (
        Endpoint("explicit", 3333),
        "explicit-token",
    )


def test_resolve_mixes_sources_per_field(tmp_path: Path) -> None:
    save_connection(tmp_path / "config.json", "tcp://saved:1111", "saved-token")
    settings = _settings(tmp_path, GPUMESH_TOKEN="env-token")
    assert settings.resolve_connection() == (Endpoint("saved", 1111), "env-token")
    assert settings.resolve_connection(url="explicit:3333") == (
        Endpoint("explicit", 3333),
        "env-token",
    )
    assert settings.resolve_connection(token="explicit-token") == (
        Endpoint("saved", 1111),
        "explicit-token",
    )


def test_resolve_without_any_configuration_is_config_error(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    assert settings.saved_connection() is None
    with pytest.raises(ConfigError, match="no coordinator configured"):
        settings.resolve_connection()


def test_resolve_with_url_but_no_token_is_config_error(tmp_path: Path) -> None:
    settings = _settings(tmp_path, GPUMESH_URL="tcp://env:2222")
    with pytest.raises(ConfigError, match="no token configured"):
        settings.resolve_connection()


def test_a_damaged_saved_file_does_not_stand_in_the_way_of_a_given_url_and_token(
        tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not a config")
    settings = _settings(tmp_path)
    endpoint, token = settings.resolve_connection("tcp://h:2222", TOKEN)
    assert (endpoint.zmq, token) == ("tcp://h:2222", TOKEN)
    with pytest.raises(ConfigError, match="config"):  # the file is needed: it is read, and said
        settings.resolve_connection("tcp://h:2222")


def test_resolve_with_bad_url_is_config_error(tmp_path: Path) -> None:
    settings = _settings(tmp_path, GPUMESH_URL="ftp://env:2222", GPUMESH_TOKEN="t")
    with pytest.raises(ConfigError):
        settings.resolve_connection()


def test_resolve_errors_never_contain_the_token(tmp_path: Path) -> None:
    settings = _settings(tmp_path, GPUMESH_URL="ftp://nope:1", GPUMESH_TOKEN=TOKEN)
    with pytest.raises(ConfigError) as info:
        settings.resolve_connection()
    assert TOKEN not in str(info.value)


def test_resolve_with_damaged_saved_file_is_config_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ConfigError):
        _settings(tmp_path).resolve_connection()


# --------------------------------------------------------------------------- token and home


def test_weak_token_acceptance_comes_from_the_environment(tmp_path: Path) -> None:
    assert Settings.from_env({"GPUMESH_HOME": str(tmp_path)}).weak_token is False
    assert _settings(tmp_path, GPUMESH_WEAK_TOKEN="1").weak_token is True
    assert _settings(tmp_path, GPUMESH_WEAK_TOKEN="0").weak_token is False


def test_the_saved_connection_caches_the_stretched_key_bound_to_its_token(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    stretched = bytes(range(32))
    save_connection(path, "tcp://h:1", TOKEN, kdf="kdf-a", stretched=stretched)
    assert stretched.hex() not in repr(load_connection(path))
    saved = load_connection(path)
    assert saved is not None
    assert saved.stretched_for(TOKEN, "kdf-a") == stretched
    assert saved.stretched_for(TOKEN, "kdf-b") is None  # another KDF: derive afresh
    assert saved.stretched_for(TOKEN + "x", "kdf-a") is None  # another token
    # A hand-edited token (or key) no longer matches its check: the cache is ignored.
    data = json.loads(path.read_text())
    data["token"] = TOKEN + "-edited"
    path.write_text(json.dumps(data))
    edited = load_connection(path)
    assert edited is not None and edited.stretched is None
    for damaged in ({"name": 1}, "text", {"name": "k", "key": "zz", "check": "c"}):
        path.write_text(json.dumps({"url": "tcp://h:1", "token": TOKEN, "kdf": damaged}))
        assert load_connection(path) == SavedConnection("tcp://h:1", TOKEN)


def test_home_is_created_0700_whatever_the_umask(tmp_path: Path) -> None:
    home = tmp_path / "a" / "gpumesh-home"
    old = os.umask(0)
    try:
        assert ensure_home(home) == home
    finally:
        os.umask(old)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700


def test_a_loose_home_is_tightened_with_a_notice(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="gpumesh.config"):
        ensure_home(home)
        ensure_home(home)  # already tight: no second notice
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    notices = [r.getMessage() for r in caplog.records if r.name == "gpumesh.config"]
    assert notices == [f"tightened {home} from mode 0755 to 0700: it holds the mesh token and "
                       "the journal"]


def test_a_shared_folder_is_never_tightened(tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp
    with caplog.at_level(logging.WARNING, logger="gpumesh.config"):
        ensure_home(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert "set GPUMESH_HOME to a private folder" in caplog.text


def test_on_windows_home_is_made_and_no_mode_is_read(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # There stat reads 0777 for every writable folder and os has no geteuid.
    import gpumesh.config

    class Windows:
        name = "nt"

        def __getattr__(self, attribute: str) -> object:
            if attribute == "geteuid":
                raise AttributeError(attribute)
            return getattr(os, attribute)

    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o777)
    monkeypatch.setattr(gpumesh.config, "os", Windows())
    assert ensure_home(home) == home
    assert ensure_home(tmp_path / "new" / "home").is_dir()
    save_connection(home / "config.json", "tcp://h:1", TOKEN)
    assert load_connection(home / "config.json") == SavedConnection("tcp://h:1", TOKEN)


def test_save_connection_tightens_a_loose_home(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o775)
    save_connection(home / "config.json", "tcp://h:1", TOKEN)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700


def test_an_https_address_without_a_port_is_refused_as_a_web_address() -> None:
    # https://abc.ngrok-free.app (the spec's first --public) was dialled at port 8000 over
    # ZeroMQ, and timed out with nothing said of why.
    with pytest.raises(ConfigError, match="web address: a coordinator speaks ZeroMQ, not HTTPS"):
        parse_url("https://abc.ngrok-free.app")
    assert parse_url("https://example.org:8443").port == 8443  # a port given is dialled


def test_a_connection_that_cannot_be_written_says_why_and_leaves_no_part_behind(tmp_path,
                                                                                monkeypatch):
    # On a full disk `gpumesh serve` ended in an OSError traceback, a 0-byte .config.json.*
    # left in GPUMESH_HOME.
    import errno
    import json as json_module

    from gpumesh.config import save_connection
    from gpumesh.tokens import write_token_file

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json_module, "dump", full)
    with pytest.raises(ConfigError, match=r"could not save the connection .*\(the disk is full\)"):
        save_connection(tmp_path / "config.json", "tcp://127.0.0.1:8000", "t" * 43)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    token_file = tmp_path / "token"
    token_file.write_text("old\n")

    class Full:
        def __init__(self, *args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("gpumesh.tokens.os.fdopen", Full)
    with pytest.raises(OSError):
        write_token_file(token_file, "new-token", replace=True)
    assert [p.name for p in tmp_path.iterdir()] == ["token"] and token_file.read_text() == "old\n"
