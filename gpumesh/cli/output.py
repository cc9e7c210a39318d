"""Terminal output shared by the commands: colour, the [OK] lines, tables, logging setup."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from typing import Any, NoReturn

import click


def color_enabled() -> bool:
    """GPUMESH_COLOR=1/0 forces it; otherwise colour when stdout is a terminal."""
    forced = os.environ.get("GPUMESH_COLOR", "").strip().lower()
    if forced in ("1", "true", "yes", "on", "always"):
        return True
    if forced in ("0", "false", "no", "off", "never"):
        return False
    return sys.stdout.isatty() and os.environ.get("NO_COLOR") is None


def ok(text: str) -> None:
    tag = click.style("[OK]", fg="green", bold=True) if color_enabled() else "[OK]"
    click.echo(f"{tag} {text}", color=color_enabled())


def warn(text: str) -> None:
    click.echo(click.style(text, fg="yellow") if color_enabled() else text, color=color_enabled())


def fail(text: str, code: int = 1) -> NoReturn:
    """Print ``error: text`` on stderr and exit."""
    click.echo(f"error: {text}", err=True)
    sys.exit(code)


def worker_table(workers: list[dict[str, Any]]) -> str:
    lines = ["", "  WORKERS", "  " + "-" * 54]
    if not workers:
        lines.append("  (no workers joined yet: run 'gpumesh join URL --token-file FILE' on a machine)")
    for w in workers:
        score = f"{float(w.get('score', 0.0)):.3f}"
        lines.append(f"  {w.get('device', 'CPU'):<5}{w['id'][:8]:<12}{w.get('hostname', ''):<18}"
                     f"score={score:<10}[{w.get('state', 'alive' if w.get('alive') else 'lost')}]")
    return "\n".join(lines) + "\n"


def json_text(document: Any, indent: int | None = 2, *, ascii_only: bool = True) -> str:
    """``document`` as strict JSON for another program: NaN and infinities (a script's
    diverged loss) become null, since JSON has no spelling for them and strict parsers
    (JavaScript's, Go's) refuse Python's; what JSON cannot hold at all is shown by repr.
    ``ascii_only=False`` keeps text as it is ("héllo", not "h\\u00e9llo"), for people."""
    return json.dumps(_finite(document), indent=indent, default=repr, allow_nan=False,
                      ensure_ascii=ascii_only)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                 "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


_flags: list[str] = []  # the global logging options of this command, for its children


def child_log_flags() -> list[str]:
    """``-v``/``--json-logs`` as this command got them: a process it starts (the self-worker)
    logs the same way, so every process of a mesh speaks one format."""
    return list(_flags)


def say(line: str) -> None:
    """A line about the mesh's life (a worker joined, a reconnect): printed on stdout, or under
    ``--json-logs`` one JSON object on stderr like every log record, so a log collector
    (Docker, journald) reads the whole process as JSON."""
    if "--json-logs" in _flags:
        logging.getLogger("gpumesh.events").info("%s", line)
    else:
        click.echo(line)


def setup_logging(verbose: bool, json_logs: bool) -> None:
    _flags[:] = (["-v"] if verbose else []) + (["--json-logs"] if json_logs else [])
    handler = logging.StreamHandler(sys.stderr)
    if json_logs:
        handler.setFormatter(JsonFormatter())
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        formatter.converter = time.localtime
        handler.setFormatter(formatter)
    root = logging.getLogger("gpumesh")
    root.handlers[:] = [handler]
    # Under --json-logs the mesh's life lines (INFO, gpumesh.events) are part of the log.
    root.setLevel(logging.DEBUG if verbose else logging.INFO if json_logs else logging.WARNING)
    root.propagate = False


def is_terminal() -> bool:
    """Whether stdout is a terminal: secrets (a generated token, the dashboard's link key) are
    printed only there, never into a log or a pipe others may read."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False
