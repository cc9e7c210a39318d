"""Token guessing from one address, for the fault suite: N handshakes with a wrong token, then
one with the right token. Run inside a lab namespace; prints one JSON line.

``python handshake_flood.py URL N`` with the right token in GPUMESH_TOKEN. The wrong token is
derived once (one scrypt), so this measures the coordinator's side, not the guesser's KDF.
"""

from __future__ import annotations

import json
import os
import sys
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from gpumesh.security import configure_client, derive_keys

OUTCOMES = {
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "ok",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no_detail",
    zmq.EVENT_DISCONNECTED: "disconnected",
}


def handshake(ctx: zmq.Context, url: str, keys: object, timeout: float) -> str:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.reconnect_ivl = 60_000  # one attempt each
    configure_client(sock, keys)  # type: ignore[arg-type]
    monitor = sock.get_monitor_socket(sum(OUTCOMES))
    try:
        sock.connect(url)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not monitor.poll(int(left * 1000) + 1):
                break
            event = recv_monitor_message(monitor)["event"]
            if event in OUTCOMES:
                return OUTCOMES[event]
        return "timeout"
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


def main() -> None:
    url, count = sys.argv[1], int(sys.argv[2])
    right = derive_keys(os.environ["GPUMESH_TOKEN"])
    wrong = derive_keys("WrongGuess1." + "g" * 32)
    ctx = zmq.Context()
    started, outcomes = [], {}
    try:
        for _ in range(count):
            started.append(time.time())
            outcome = handshake(ctx, url, wrong, 5.0)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        finished = time.time()
        right_after = handshake(ctx, url, right, 4.0)
    finally:
        ctx.term()
    print(json.dumps({"started": started, "finished": finished, "outcomes": outcomes,
                      "right_after": right_after}), flush=True)


if __name__ == "__main__":
    main()
