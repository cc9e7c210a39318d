"""The handshake watch on a real ROUTER over loopback: which failed handshakes reach the
failed-handshake count that ZAP cannot see (gpumesh.security.HandshakeWatch)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
import zmq
from conftest import wait_for

from gpumesh.security import (
    MeshAuthenticator,
    configure_client,
    configure_server,
    derive_keys,
    start_authenticator,
    watch_handshakes,
)

TOKEN = "WatchTest01." + "w" * 32
WRONG = "WatchTest02." + "w" * 32


class Coordinator:
    """Just the coordinator's socket setup: ZAP handler, CURVE ROUTER, the watch."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.keys = derive_keys(TOKEN)
        self.auth: MeshAuthenticator = start_authenticator(self.ctx, self.keys)
        self.seen: list[tuple[str | None, str]] = []
        self.lock = threading.Lock()
        real = self.auth.failed_before_zap

        def spy(address: str | None, why: str) -> None:
            with self.lock:
                self.seen.append((address, why))
            real(address, why)

        self.auth.failed_before_zap = spy  # type: ignore[method-assign]
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        configure_server(self.router, self.keys)
        self.watch = watch_handshakes(self.router, self.auth)
        self.port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.url = f"tcp://127.0.0.1:{self.port}"

    def failures(self) -> list[tuple[str | None, str]]:
        with self.lock:
            return list(self.seen)

    def close(self) -> None:
        self.watch.stop()
        self.router.close(linger=0)
        self.auth.stop()
        self.ctx.term()


@pytest.fixture
def coordinator() -> Iterator[Coordinator]:
    made = Coordinator()
    try:
        yield made
    finally:
        made.close()
    assert not made.watch._thread.is_alive()


def _dealer(ctx: zmq.Context, url: str, token: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.reconnect_ivl = 60_000
    configure_client(sock, derive_keys(token))
    sock.connect(url)
    return sock


def test_a_wrong_token_is_counted_and_the_right_one_is_not(coordinator: Coordinator) -> None:
    ctx = zmq.Context()
    try:
        good = _dealer(ctx, coordinator.url, TOKEN)
        good.send(b"hello")
        assert coordinator.router.poll(10_000), "the right token did not get through"
        coordinator.router.recv_multipart()
        bad = _dealer(ctx, coordinator.url, WRONG)
        found = wait_for(coordinator.failures, timeout=10, what="the wrong token counted")
        bad.close()
        good.close()
    finally:
        ctx.term()
    assert len(found) == 1  # type: ignore[arg-type]
    address, why = found[0]  # type: ignore[index]
    # Loopback connections fail in microseconds; the address is read when the watch wins that
    # race and is None (counted as unknown) when it does not; it is never another peer's.
    assert address in ("127.0.0.1", None)
    assert "server key" in why


def test_bytes_that_are_not_zmtp_are_counted(coordinator: Coordinator) -> None:
    with socket.create_connection(("127.0.0.1", coordinator.port), timeout=5) as raw:
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n")
    found = wait_for(coordinator.failures, timeout=10, what="the garbage counted")
    assert found[0][1] in ("it closed before any handshake (not ZMTP?)",  # type: ignore[index]
                           "it closed or timed out before finishing a handshake")
