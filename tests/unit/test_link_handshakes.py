"""How the client and worker link reads failed handshakes (transport.DealerLink)."""

from __future__ import annotations

import struct

import pytest
import zmq

from gpumesh.config import Endpoint, Limits
from gpumesh.errors import AuthenticationError
from gpumesh.security import derive_keys
from gpumesh.transport import DealerLink


class Monitor:
    """A monitor socket's stand-in: the events given, then nothing."""

    def __init__(self, *events: int) -> None:
        self.events = list(events)

    def poll(self, timeout: int = 0) -> bool:
        return bool(self.events)

    def recv_multipart(self) -> list[bytes]:
        return [struct.pack("=hi", self.events.pop(0), 0), b"tcp://127.0.0.1:9"]


def _link() -> DealerLink:
    return DealerLink(zmq.Context.instance(), Endpoint("127.0.0.1", 9),
                      derive_keys("a-token-for-nobody-" + "x" * 30), Limits())


def test_failed_handshakes_at_an_address_that_admitted_us_are_the_network_not_the_token():
    """libzmq reports a connection dropped mid-handshake as NO_DETAIL: a coordinator behind a
    proxy as it restarts, a lossy Wi-Fi link. Two in a row made a worker that had joined exit
    for good (its unacknowledged results lost), and every future of a client fail."""
    link = _link()
    link.monitor = Monitor(zmq.EVENT_HANDSHAKE_SUCCEEDED,
                           *[zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL] * 50,
                           zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    link.monitor_events()  # no AuthenticationError: it keeps trying


def test_two_failed_handshakes_at_a_new_address_are_still_a_wrong_token():
    link = _link()
    link.monitor = Monitor(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    with pytest.raises(AuthenticationError, match="not a gpumesh coordinator"):
        link.monitor_events()
    link = _link()
    link.monitor = Monitor(zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    with pytest.raises(AuthenticationError):
        link.monitor_events()  # a refusal by key is never the network's
