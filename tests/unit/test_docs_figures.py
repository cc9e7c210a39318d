"""docs/why-not-ray-or-dask.md quotes bench/README.md's latest comparison: its figures are the
bench's own, so a new bench run cannot leave the page telling an older story."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _table(text: str, header: str) -> tuple[list[str], list[list[str]]]:
    """The column names and the rows' cells of the Markdown table whose header row starts with
    ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    names = [cell.strip() for cell in lines[start].strip().strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return names, rows


def _rows(text: str, header: str) -> list[list[str]]:
    return _table(text, header)[1]


def test_the_why_not_page_quotes_the_benchs_latest_comparison():
    # Matched by column name: the bench's table has more columns than the page quotes.
    names, rows = _table((ROOT / "bench/README.md").read_text(), "| system | tiny tasks/s")
    bench = {row[0]: row for row in rows}
    quoted, page = _table((ROOT / "docs/why-not-ray-or-dask.md").read_text(), "| | tiny tasks/s")
    assert len(page) >= 4
    columns = [next(i for i, name in enumerate(names) if name.startswith(wanted))
               for wanted in quoted[1:]]
    assert len(columns) == 4
    for row in page:
        assert row[1:] == [bench[row[0]][c] for c in columns], row[0]


def test_the_ratios_the_page_states_follow_from_its_table():
    text = (ROOT / "docs/why-not-ray-or-dask.md").read_text()
    page = {row[0]: row for row in _rows(text, "| | tiny tasks/s")}

    def number(name: str, column: int) -> float:
        return float(page[name][column].replace(",", ""))

    pool_over_mesh = number("multiprocessing.Pool", 1) / number("gpumesh", 1)
    stated = re.search(r"a `multiprocessing.Pool` is (\d+) times faster for tiny tasks", text)
    assert stated is not None and int(stated.group(1)) == round(pool_over_mesh)
