"""Entry point of a runner process: ``python -m gpumesh.runner FD``.

The worker agent starts one runner per slot and hands it one end of a socket pair. The runner
reads a task, runs it, writes the result, and waits for the next one, so there is no process
start per task. It never talks to the network: a task that hangs, hogs the GIL or crashes the
interpreter cannot stop the agent's heartbeats.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

import msgpack

from .execute import run_function, run_script
from .pipe import PipeClosed, recv_message, send_message

MAX_TASK_BYTES = 1 << 40


def _exit_with_parent() -> None:
    """Die with the agent: a runner orphaned by ``kill -9`` of its agent must not run on."""
    parent = os.getppid()
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            try:
                os.killpg(os.getpid(), signal.SIGKILL)  # also any script the task started
            finally:
                os._exit(1)


def main(argv: list[str]) -> int:
    threading.Thread(target=_exit_with_parent, name="gpumesh-parent-watch", daemon=True).start()
    sock = socket.socket(fileno=int(argv[0]))
    send_message(sock, [msgpack.packb({"ready": True})])
    while True:
        try:
            frames = recv_message(sock, MAX_TASK_BYTES)
        except PipeClosed:
            return 0
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
        runner = run_script if header.get("kind") == "script" else run_function
        result_header, result_frames = runner(header, frames[1:])
        del frames
        sys.stdout.flush()
        sys.stderr.flush()
        send_message(sock, [msgpack.packb(result_header, use_bin_type=True), *result_frames])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
