"""One terminal shared by a job's progress bar and what its tasks print.

``submit --wait`` redraws its bar in place on stdout while the job runs; what the job's scripts
write on stderr (their logs: stdout is a script's result) streams in on the connection's thread.
Unshared, each line would land in the middle of the bar, and the bar be redrawn over it. Here a
task's line is printed whole, above the bar, with its worker's id, and the bar drawn again under
it.
"""

from __future__ import annotations

import sys
import threading

import click

from ..protocol.fields import for_terminal

PARTIAL_BYTES = 4096  # of a line not ended yet, per task and stream, held before it is shown
PARTIAL_KEYS = 256  # tasks and streams with a line not ended yet, at most


class Board:
    """The bar (``show``), whole lines above it (``above``, ``output``), and its end (``end``).

    In a terminal the bar is redrawn in place; elsewhere (a log, a pipe) it is printed as a line
    each time it changes, not on each poll.
    """

    def __init__(self, tty: bool | None = None) -> None:
        self.tty = sys.stdout.isatty() if tty is None else tty
        self._lock = threading.Lock()
        self._bar = ""  # the bar as drawn now: "" while none is on the screen
        self._logged = ""  # the bar as last printed as a line (not a terminal)
        self._partial: dict[tuple[str, str, str], bytes] = {}

    def show(self, line: str) -> None:
        with self._lock:
            if self.tty:
                click.echo("\r" + line.ljust(len(self._bar)), nl=False)
                self._bar = line
            elif line.split("(")[0] != self._logged.split("(")[0]:
                click.echo(line)
                self._logged = line

    def above(self, text: str, err: bool = False) -> None:
        """A whole line, above the bar (which is drawn again under it)."""
        with self._lock:
            if self.tty and self._bar:
                click.echo("\r" + " " * len(self._bar) + "\r", nl=False)
            click.echo(text, err=err)
            if self.tty and self._bar:
                click.echo(self._bar, nl=False)

    def output(self, worker: str, stream: str, data: bytes, task: str = "") -> None:
        """What a task printed (GPUMesh's ``output``): each line it ended, on stderr, as
        ``[worker] line``; what a line overwrote with a carriage return (a tqdm bar's steps)
        is left out, as the terminal would have."""
        key = (worker, stream, task)
        with self._lock:
            text = self._partial.pop(key, b"") + data
            *lines, rest = text.split(b"\n")
            if len(rest) > PARTIAL_BYTES:
                lines.append(rest)
                rest = b""
            if rest:
                if len(self._partial) >= PARTIAL_KEYS:
                    self._partial.clear()  # tasks that never ended a line: not held for good
                self._partial[key] = rest
        for line in lines:
            self._line(worker, line)

    def end(self) -> None:
        """The lines tasks left unended, and the bar's line closed."""
        with self._lock:
            held, self._partial = self._partial, {}
        for (worker, _, _), line in held.items():
            self._line(worker, line)
        with self._lock:
            if self.tty and self._bar:
                click.echo("")
            self._bar = ""

    def _line(self, worker: str, line: bytes) -> None:
        shown = line.rstrip(b"\r").rsplit(b"\r", 1)[-1].decode("utf-8", "replace")
        self.above(f"[{for_terminal(worker)}] {for_terminal(shown)}", err=True)
