"""Message events of gpumesh's processes, for ``python -m bench.timeline``: nothing in gpumesh
knows of it.

``install(folder)`` wraps, as each module is imported, the functions a single call's messages
pass through: ``gpumesh.transport.send_frames`` and ``receive`` (the ZeroMQ sockets of the client,
the coordinator and the worker agent) and ``gpumesh.runner.pipe.send_message`` and
``recv_message`` (between an agent and its runner; tasks an agent hands ahead to a busy runner
go by ``Runner.flush`` instead, unrecorded), and ``zmq.Poller.poll``, where their loops wait
(a ``wake`` event when it returns with a socket ready). It wraps each module's functions before
any other module binds their names, so the coordinator's ``from ..transport import
send_frames`` gets the wrapper too. While the file ``folder/on`` exists, each call appends one
line to ``folder/events``:

    wall-clock ns, pid, thread id, thread name, that thread's CPU ns, event, command

Only command names go in: no header, no payload, no key. With ``on`` absent a call costs one
``stat``: the bench's untraced calls pay that, and nothing else of the hook.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

EVENTS = "events"
SWITCH = "on"
_WRAPPED = {"gpumesh.transport": ("send_frames", "receive"),
            "gpumesh.runner.pipe": ("send_message", "recv_message")}


class Recorder:
    def __init__(self, folder: str) -> None:
        self.switch = os.path.join(folder, SWITCH)
        self.path = os.path.join(folder, EVENTS)
        self.fd: int | None = None

    def on(self) -> bool:
        return os.path.exists(self.switch)

    def write(self, event: str, command: str) -> None:
        # The time first: what follows is the recording's own cost.
        at, cpu = time.time_ns(), time.thread_time_ns()
        name = threading.current_thread().name.replace(" ", "_")
        line = f"{at} {os.getpid()} {threading.get_native_id()} {name} {cpu} {event} {command}\n"
        try:  # inside gpumesh's send path: a full disk or a folder gone must not fail it
            if self.fd is None:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.write(self.fd, line.encode())  # one write(2) of one line: lines never interleave
        except OSError:
            pass


def command_name(frames: Sequence[Any]) -> str:
    """The command of a message as ``encode`` made it (after a ROUTER's routing frame, if
    any); a BATCH names what it carries: ``BATCH[TASK,RESULT_ACK]``. ``?`` for anything else:
    this runs inside gpumesh's send path and must not raise there."""
    import msgpack

    from gpumesh.protocol.messages import SIGNATURE, Command

    try:
        for index in range(min(2, len(frames) - 1)):
            if bytes(frames[index]) == SIGNATURE:
                command = Command(bytes(frames[index + 1])[0])
                if command is Command.BATCH:
                    return batch_name(msgpack.unpackb(bytes(frames[index + 2]), raw=False).get("m"))
                return command.name
    except Exception:
        pass
    return "?"


def batch_name(items: Any) -> str:
    """``BATCH[...]`` of a BATCH header's ``m``; ``BATCH[?]`` for one that is not well formed
    (gpumesh's ``unbundle`` skips what it cannot read; so does this)."""
    from gpumesh.protocol.messages import Command

    try:
        return f"BATCH[{','.join(Command(item[0]).name for item in items)}]"
    except Exception:
        return "BATCH[?]"


def _recording(name: str, original: Callable[..., Any], recorder: Recorder) -> Callable[..., Any]:
    """``original`` recording each call while ``recorder`` is on."""
    if name == "send_frames":
        def send_frames(sock: Any, frames: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
            if recorder.on():
                recorder.write("send", command_name(frames))
            return original(sock, frames, *args, **kwargs)
        return send_frames
    if name == "receive":
        def receive(frames: Any, *args: Any, **kwargs: Any) -> Any:
            msg = original(frames, *args, **kwargs)
            if recorder.on():
                recorder.write("recv", batch_name(msg.header.get("m"))
                               if msg.command.name == "BATCH" else msg.command.name)
            return msg
        return receive
    if name == "send_message":
        def send_message(sock: Any, frames: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
            if recorder.on():
                recorder.write("pipe-send", "-")
            return original(sock, frames, *args, **kwargs)
        return send_message

    # Recorded once in: the call waits. Extra arguments pass through, so a wrapped function
    # that grows a keyword (recv_message's ``stall``) does not break the traced processes.
    def recv_message(sock: Any, *args: Any, **kwargs: Any) -> Any:
        frames = original(sock, *args, **kwargs)
        if recorder.on():
            recorder.write("pipe-recv", "-")
        return frames
    return recv_message


def _wrap(module: Any, name: str, recorder: Recorder) -> None:
    original = getattr(module, name)
    wrapper = _recording(name, original, recorder)
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(module, name, wrapper)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the modules to wrap as the path would, and wraps them once they have run."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _WRAPPED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader, recorder = spec.loader, self.recorder
        exec_module = loader.exec_module

        def exec_and_wrap(module: Any) -> None:
            exec_module(module)
            for name in _WRAPPED[fullname]:
                _wrap(module, name, recorder)

        loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec


def _record_wakeups(recorder: Recorder) -> None:
    """A ``wake`` event each time a ``zmq.Poller.poll`` of the process that may have slept (a
    timeout other than 0) returns with a socket ready: the loops of the client's engine, the
    coordinator and the agent sleep there, so a hop splits into the way there and what the
    woken thread does before its ``recv``. (``Socket.poll`` goes through it too: the agent's
    wait for its first WELCOME, not on a call's path.)"""
    import zmq

    original = zmq.Poller.poll

    def poll(self: Any, timeout: Any = None) -> Any:
        ready = original(self, timeout)
        if ready and timeout != 0 and recorder.on():
            recorder.write("wake", "-")
        return ready

    poll.__wrapped__ = original  # type: ignore[attr-defined]
    zmq.Poller.poll = poll  # type: ignore[method-assign]


def install(folder: str) -> Recorder:
    """Record this process's message events into ``folder`` (see the module's text), and
    return the recorder, for events of the caller's own (``write``) into the same open file. In
    a process that already imported gpumesh, what binds the names by value keeps the
    originals: call this first."""
    recorder = Recorder(folder)
    _record_wakeups(recorder)
    for fullname, names in _WRAPPED.items():
        module = sys.modules.get(fullname)
        if module is not None:
            for name in names:
                _wrap(module, name, recorder)
    sys.meta_path.insert(0, _Finder(recorder))
    return recorder
