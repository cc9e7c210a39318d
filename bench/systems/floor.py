"""The floor: a plain pyzmq ROUTER/DEALER broker and worker processes, no safety at all.

No encryption, no journal, no leases, no retries: the least work any broker over TCP can do to
move a pickled call to a worker process and its result back. The broker and each worker are
separate processes, as gpumesh's coordinator and workers are. Run as a module, it is one of them:

    python -m bench.systems.floor broker FRONT_PORT BACK_PORT
    python -m bench.systems.floor worker BACK_PORT
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
from collections.abc import Callable
from typing import Any

import zmq

from ..procs import python_env, python_exe, spawn, stop_group
from .base import System

READY = b"READY"
COUNT = b"?"  # a client asking the broker how many workers have said READY
_INDEX = struct.Struct("!I")


def _socket(ctx: zmq.Context[zmq.Socket[bytes]], kind: int) -> zmq.Socket[bytes]:
    sock = ctx.socket(kind)
    sock.linger = 0
    # Unbounded queues: a ROUTER silently drops what it cannot queue, and the client sends a
    # whole map before it reads any result.
    sock.sndhwm = sock.rcvhwm = 0
    return sock


def dumps(value: Any) -> list[Any]:
    """Pickle protocol 5 with large buffers out of band: a numpy array travels without a copy."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return [head, *(b.raw() for b in buffers)]


def loads(frames: list[Any]) -> Any:
    return pickle.loads(frames[0], buffers=[memoryview(f) for f in frames[1:]])


def run_broker(front_port: int, back_port: int) -> None:
    """Hand each request to an idle worker (one task per worker at a time), results back."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    front, back = _socket(ctx, zmq.ROUTER), _socket(ctx, zmq.ROUTER)
    front.bind(f"tcp://127.0.0.1:{front_port}")
    back.bind(f"tcp://127.0.0.1:{back_port}")
    idle: list[bytes] = []
    known: set[bytes] = set()
    queue: list[list[Any]] = []
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    while True:
        for sock, _ in poller.poll():
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if sock is back:
                    worker, rest = frames[0], frames[1:]
                    idle.append(worker)
                    known.add(worker)
                    if rest[0] != READY:
                        front.send_multipart(rest, copy=False)
                elif frames[1] == COUNT:
                    front.send_multipart([frames[0], COUNT, str(len(known)).encode()])
                else:
                    queue.append(frames)
        while idle and queue:
            back.send_multipart([idle.pop(), *queue.pop(0)], copy=False)


def run_worker(back_port: int) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = _socket(ctx, zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{back_port}")
    sock.send(READY)
    while True:
        client, index, *call = sock.recv_multipart(copy=False)
        fn, args = loads(call)
        sock.send_multipart([client, index, *dumps(fn(*args))], copy=False)


class FloorSystem(System):
    name = "floor (pyzmq broker)"
    key = "floor"

    def start(self) -> None:
        from ..procs import free_port

        front, back = free_port(), free_port()
        module = [python_exe(), "-m", "bench.systems.floor"]
        env = python_env()
        self._broker = spawn([*module, "broker", str(front), str(back)], env=env)
        self._workers = [spawn([*module, "worker", str(back)], env=env)
                         for _ in range(self.params.workers)]
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = _socket(self._ctx, zmq.DEALER)
        self._sock.rcvtimeo = 120_000
        self._sock.connect(f"tcp://127.0.0.1:{front}")

    def wait_ready(self) -> None:
        from ..procs import wait_for

        def all_joined() -> bool:
            self._sock.send_multipart([COUNT, b""])
            _, count = self._sock.recv_multipart()
            return int(count) >= self.params.workers

        wait_for(all_joined, 30, "the floor's workers joining")

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.map_args(fn, [args])[0]

    def map(self, fn: Callable[..., Any], items: list[Any]) -> list[Any]:
        return self.map_args(fn, [(item,) for item in items])

    def map_args(self, fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> list[Any]:
        for index, args in enumerate(calls):
            self._sock.send_multipart([_INDEX.pack(index), *dumps((fn, args))], copy=False)
        results: list[Any] = [None] * len(calls)
        for _ in calls:
            tag, *frames = self._sock.recv_multipart(copy=False)
            results[_INDEX.unpack(tag.bytes)[0]] = loads(frames)
        return results

    def stop(self) -> None:
        if hasattr(self, "_sock"):
            self._sock.close(0)
            self._ctx.term()
        for proc in [*getattr(self, "_workers", []), getattr(self, "_broker", None)]:
            if proc is not None:
                stop_group(proc, grace=1.0)

    def processes(self) -> dict[int, str]:
        roles = {os.getpid(): "client", self._broker.pid: "broker"}
        roles.update({w.pid: f"worker {i + 1}" for i, w in enumerate(self._workers)})
        return roles


if __name__ == "__main__":
    role, *ports = sys.argv[1:]
    try:
        if role == "broker":
            run_broker(int(ports[0]), int(ports[1]))
        else:
            run_worker(int(ports[0]))
    except KeyboardInterrupt:
        pass
