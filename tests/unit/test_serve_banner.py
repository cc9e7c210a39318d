"""The join line serve prints when other machines may connect: one that can work."""

from __future__ import annotations

import pytest

from gpumesh.cli import serve


def _banner(capsys: pytest.CaptureFixture[str], **options: object) -> list[str]:
    serve._exposed_banner("0.0.0.0", 8732, ["192.0.2.10"], " --token-file FILE", **options)
    return capsys.readouterr().out.splitlines()


def test_with_discovery_the_join_line_needs_no_address(capsys):
    lines = _banner(capsys)
    assert "   Join from ANOTHER machine: gpumesh join --token-file FILE" in lines


def test_without_discovery_the_join_line_carries_the_address(capsys):
    # GPUMESH_DISCOVERY=0 (the Docker image's): nothing advertises the coordinator, so a join
    # without a URL would find nothing.
    lines = _banner(capsys, discovery=False)
    assert "   Join from ANOTHER machine: gpumesh join tcp://192.0.2.10:8732 --token-file FILE" \
        in lines
    assert not any(line.endswith("gpumesh join --token-file FILE") for line in lines)
    assert any("in a container, give the Docker host's address" in line for line in lines)


def test_the_discovery_interfaces_are_what_is_advertised_when_bound_everywhere():
    # README: "addresses of this machine to advertise and browse on, instead of its LAN
    # addresses" (a machine whose only network is a VPN advertised nothing).
    from gpumesh.config import Settings

    chosen = Settings.from_env({"GPUMESH_HOME": "/nonexistent",
                                "GPUMESH_DISCOVERY_INTERFACES": "10.8.0.2"})
    assert serve._advertised(chosen, "0.0.0.0", None) == ["10.8.0.2"]
    assert serve._advertised(chosen, "0.0.0.0", "192.0.2.7") == ["192.0.2.7"]  # --host-ip wins
    assert serve._advertised(chosen, "127.0.0.1", None) == []  # loopback: never advertised
