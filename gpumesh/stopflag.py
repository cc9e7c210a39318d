"""A stop request that a signal handler may make.

``serve``, ``join`` and ``dashboard`` stop on SIGINT/SIGTERM. Their handlers called
``threading.Event.set``, which takes the event's lock: a signal that lands while the main thread
holds it (inside the event's own ``wait``, or inside a first handler's ``set``, when two signals
come at once, as from ``pkill`` matching both ``timeout`` and its child) waited on that lock for
good, and every later signal stacked another wait on it: ``serve`` never stopped. ``StopFlag``
takes no lock: ``set`` stores a flag and writes a byte to a socket pair that ``wait`` reads
(a socket, not a pipe: ``serve`` runs on Windows too).
"""

from __future__ import annotations

import contextlib
import socket


class StopFlag:
    """``set`` (from anywhere, a signal handler included, any number of times), ``is_set``,
    and ``wait(timeout)``, as ``threading.Event``'s."""

    def __init__(self) -> None:
        self._set = False
        # Made here, not at the first wait: serve raises its descriptor limit, and a pair made
        # later may have numbers past what select() takes. wait() blocks in recv, which takes
        # any number (and a signal's handler ends it, PEP 475 retrying the call after it).
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)

    def set(self) -> None:
        self._set = True
        self._wake()

    def _wake(self) -> None:
        try:
            self._writer.send(b"x")
        except OSError:  # full (set many times, never waited on) or closed: the flag says it
            pass

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Whether it is set, once it is or after ``timeout`` seconds (None: until it is)."""
        if not self._set:
            try:
                self._reader.settimeout(timeout)
                self._reader.recv(4096)
            except (TimeoutError, OSError):  # socket.timeout is TimeoutError; closed meanwhile
                pass
        return self._set

    def close(self) -> None:
        self._reader.close()
        self._writer.close()

    def __del__(self) -> None:
        with contextlib.suppress(AttributeError):  # __init__ did not get as far
            self.close()
