"""A stop request that a signal handler may make.

``serve``, ``join`` and ``dashboard`` stop on SIGINT/SIGTERM. Their handlers called
``threading.Event.set``, which takes the event's lock: a signal that lands while the main thread
holds it (inside the event's own ``wait``, or inside a first handler's ``set``, when two signals
come at once, as from ``pkill`` matching both ``timeout`` and its child) waited on that lock for
good, and every later signal stacked another wait on it: ``serve`` never stopped. ``StopFlag``
takes no lock: ``set`` stores a flag and writes a byte to a socket pair that ``wait`` selects on
(a socket, not a pipe: ``serve`` runs on Windows too).
"""

from __future__ import annotations

import select
import socket


class StopFlag:
    """``set`` (from anywhere, a signal handler included, any number of times), ``is_set``,
    and ``wait(timeout)``, as ``threading.Event``'s. The socket pair is made by the first
    ``wait``: a flag only ever asked ``is_set`` (the worker agent's) holds no descriptors."""

    def __init__(self) -> None:
        self._set = False
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None

    def set(self) -> None:
        self._set = True
        self._wake()

    def _wake(self) -> None:
        writer = self._writer
        if writer is None:
            return  # nobody waits yet: the first wait reads the flag after making the pair
        try:
            writer.send(b"x")
        except OSError:  # full (set many times, never waited on) or closed: the flag says it
            pass

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Whether it is set, once it is or after ``timeout`` seconds (None: until it is)."""
        if self._set:
            return True
        if self._reader is None:
            reader, writer = socket.socketpair()
            reader.setblocking(False)
            writer.setblocking(False)
            self._reader, self._writer = reader, writer
            if self._set:  # set before the writer was there to wake this wait
                return True
        try:
            select.select([self._reader], [], [], timeout)
        except (OSError, ValueError):  # closed meanwhile
            pass
        return self._set

    def close(self) -> None:
        for end in (self._reader, self._writer):
            if end is not None:
                end.close()

    def __del__(self) -> None:
        self.close()
