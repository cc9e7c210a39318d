"""The client's own lines on stderr (``[gpumesh] ...``), each written whole.

``print(text, file=sys.stderr)`` writes the text and its newline as two writes: a line from the
engine's thread (connected, reconnected) and one from the caller's (tasks sent) ran together
when stderr was a file or a pipe, and a ``grep`` of the log then lost a line.
"""

from __future__ import annotations

import sys


def say_line(text: str) -> None:
    """Write ``text`` and its newline to stderr in one write; nothing where there is no
    stderr (``pythonw.exe``: ``sys.stderr`` is None) or it is closed, as ``print`` did."""
    stream = sys.stderr
    if stream is None:
        return
    try:
        stream.write(text + "\n")
    except (ValueError, OSError):
        pass
