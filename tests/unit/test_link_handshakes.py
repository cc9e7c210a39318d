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


def test_what_a_worker_posts_behind_its_result_in_pieces_keeps_only_a_bounded_output():
    from gpumesh.protocol import Command, decode, encode
    from gpumesh.protocol.pieces import OUTPUT_CUT_NOTICE, OUTPUT_HELD_BYTES, STREAM_BYTES

    link = _link()  # never opened: the pieces it sends go nowhere, and stay unacknowledged
    link.sends_pieces = True
    assert link.send(encode(Command.RESULT, {"task": "big"}, [b"r" * STREAM_BYTES]))
    assert link.sending_pieces
    went: list = []
    link.send = lambda frames: went.append(frames) or True  # type: ignore[method-assign]
    for _ in range(3 * OUTPUT_HELD_BYTES // 65536):
        link.post(encode(Command.OUTPUT, {"task": "t", "stream": "out"}, [b"o" * 65536]))
    link.post(encode(Command.RESULT, {"task": "t"}, [b"done"]))
    link.flush()
    said = [decode(frames, Limits()) for frames in went]
    assert said[-1].command is Command.RESULT
    printed = [bytes(m.payload[0]) for m in said[:-1]]
    assert printed[-1] == OUTPUT_CUT_NOTICE and sum(map(len, printed[:-1])) == OUTPUT_HELD_BYTES
