"""The network-namespace lab itself: lab addresses never leave the machine (TESTING.md's rule)."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys

import pytest
from faultlab import GUARD, Lab, our_namespaces, require_netns

PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=5)
except ConnectionRefusedError:
    print("refused")
except OSError as exc:
    print(exc)
"""


def test_lab_addresses_are_unreachable_from_the_root_namespace():
    require_netns()
    lab = Lab(["a", "b"])
    try:
        # A test that forgot `ip netns exec` must fail here, not send packets out of the machine.
        with socket.socket() as sock, pytest.raises(OSError) as info:
            sock.settimeout(5)
            sock.connect((lab.address("a"), 9))
        assert info.value.errno == errno.EHOSTUNREACH
        route = subprocess.run(["ip", "route", "get", lab.address("b")], capture_output=True,
                               text=True, timeout=10)
        assert route.returncode != 0 or route.stdout.startswith("unreachable")
        # Inside the lab the hosts reach each other: a connection to a closed port is refused
        # by the other host (a reset came back), not unreachable.
        probe = lab.run("b", sys.executable, "-c", PROBE, lab.address("a"))
        assert probe.stdout.strip() == "refused", probe.stdout + probe.stderr
        assert "default" not in lab.run("b", "ip", "route", "show").stdout
    finally:
        added = lab.added_guard
        lab.close()
    if added and not our_namespaces():
        # The guard goes with the last lab, leaving the root namespace as it was.
        assert not subprocess.run(["ip", "route", "show", GUARD], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
