"""Light simulated workers: many CURVE DEALERs in one process, speaking the real protocol.

Each says HELLO as ``gpumesh join`` does (one slot, no credit: it never asks for a task), then
heartbeats at the interval WELCOME gives, until SIGINT, when it says DISCONNECT ``left``.
Prints ``welcomed N`` once every socket has its WELCOME. Used by ``--scale``:

    GPUMESH_TOKEN=... python -m bench.simworkers URL COUNT NAME
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from typing import Any

import msgpack
import zmq

from gpumesh import __version__
from gpumesh.protocol import MAJOR, Command, encode
from gpumesh.security import configure_client, derive_keys


def hello_header(name: str, index: int) -> dict[str, Any]:
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    info = {"hostname": f"{name}-{index}", "device": "CPU", "device_name": "simulated",
            "cores": 1, "memory": 10**9, "gpus": [], "python": python,
            "python_full": sys.version.split()[0], "platform": "Linux", "cloudpickle": "3",
            "gpumesh": __version__, "torch": None, "score": 0.0}
    return {"role": "worker", "id": secrets.token_hex(6), "incarnation": secrets.token_hex(4),
            "proto": [MAJOR, MAJOR], "slots": 1, "credit": 0, "prefetch": 0, "held": [],
            "info": info, "draining": False, "mode": "active", "release": []}


def run(url: str, count: int, name: str) -> None:
    keys = derive_keys(os.environ["GPUMESH_TOKEN"])
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sockets = []
    poller = zmq.Poller()
    for index in range(count):
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        configure_client(sock, keys)
        sock.connect(url)
        sock.send_multipart(encode(Command.HELLO, hello_header(name, index)))
        poller.register(sock, zmq.POLLIN)
        sockets.append(sock)
    welcomed: set[zmq.Socket[bytes]] = set()
    interval = 1.0
    next_beat = time.monotonic() + interval
    try:
        while True:
            timeout = max(next_beat - time.monotonic(), 0)
            for sock, _ in poller.poll(int(timeout * 1000)):
                while sock.poll(0):
                    frames = sock.recv_multipart()
                    if frames[1][0] == Command.WELCOME and sock not in welcomed:
                        interval = float(msgpack.unpackb(frames[2]).get("heartbeat", interval))
                        welcomed.add(sock)
                        if len(welcomed) == count:
                            print(f"welcomed {count}", flush=True)
            if time.monotonic() >= next_beat:
                beat = encode(Command.HEARTBEAT, {"leases": []})
                for sock in welcomed:
                    sock.send_multipart(beat)
                next_beat += interval
    except KeyboardInterrupt:
        bye = encode(Command.DISCONNECT, {"reason": "left"})
        for sock in welcomed:
            sock.send_multipart(bye)
        time.sleep(0.5)  # let the goodbyes leave before the sockets close
    finally:
        for sock in sockets:
            sock.close(0)
        ctx.term()


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]), sys.argv[3])
