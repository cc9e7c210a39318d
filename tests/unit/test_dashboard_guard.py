"""The dashboard's Host rule: the names and the port a request may come by."""

from __future__ import annotations

from gpumesh.dashboard.guard import Guard


def test_a_host_without_a_port_is_the_schemes_default_port():
    # Browsers leave out :443 over HTTPS and :80 over HTTP.
    assert Guard("t", "0.0.0.0", 443, tls=True).host_ok("10.0.0.5")
    assert not Guard("t", "0.0.0.0", 443, tls=True).host_ok("10.0.0.5:80")
    assert Guard("t", "127.0.0.1", 80).host_ok("127.0.0.1")
    assert not Guard("t", "127.0.0.1", 443).host_ok("127.0.0.1")  # plain HTTP on 443
    assert not Guard("t", "0.0.0.0", 8443, tls=True).host_ok("10.0.0.5")
