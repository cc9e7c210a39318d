"""THREAT_MODEL.md's citations still hold: each `path:line` (`snippet`) is on that line or
within a few lines of it, so the text cannot drift from the code unnoticed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
NEAR = 4  # lines either side
CITATION = re.compile(r"`(gpumesh/[\w/]+\.py):(\d+)`\s*[(,]?\s*`([^`]+)`", re.S)
LOCATION = re.compile(r"`gpumesh/[\w/]+\.py:\d+`")


def citations() -> list[tuple[str, int, str]]:
    text = (ROOT / "THREAT_MODEL.md").read_text()
    return [(path, int(line), " ".join(snippet.split()))
            for path, line, snippet in CITATION.findall(text)]


def test_there_are_citations_for_every_boundary():
    text = (ROOT / "THREAT_MODEL.md").read_text()
    for boundary in ("network peer", "as a client", "as a worker", "submitted code",
                     "same machine", "LAN discovery"):
        assert boundary in text
    assert len(citations()) >= 15
    assert len(citations()) == len(LOCATION.findall(text)), "a path:line without its snippet"


def stale(cited: list[tuple[str, int, str]]) -> list[str]:
    """The citations whose snippet is not on their line or within NEAR lines of it."""
    wrong = []
    for path, line, snippet in cited:
        lines = (ROOT / path).read_text().splitlines()
        window = lines[max(0, line - 1 - NEAR):line + NEAR]
        if not any(snippet in " ".join(row.split()) for row in window):
            wrong.append(f"{path}:{line} no longer holds {snippet!r}")
    return wrong


def test_every_cited_line_holds_its_snippet():
    wrong = stale(citations())
    assert not wrong, "\n".join(wrong)


def test_the_checker_catches_a_moved_line():
    path, line, snippet = citations()[0]
    lines = (ROOT / path).read_text().splitlines()
    moved = line + 20 + 2 * NEAR
    assert not any(snippet in " ".join(row.split()) for row in lines[moved - 1 - NEAR:moved + NEAR])
    assert stale([(path, line, snippet)]) == []
    assert stale([(path, moved, snippet)]) == [f"{path}:{moved} no longer holds {snippet!r}"]
