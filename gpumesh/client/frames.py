"""Results as a pandas DataFrame (the optional ``gpumesh[notebook]`` extra)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def results_to_dataframe(results: Iterable[Any]) -> Any:
    """A row per result. Dict results spread into columns (missing keys are NaN); anything else
    lands in one ``result`` column. Exceptions (from ``gather`` with errors kept) go to ``error``."""
    try:
        import pandas as pd
    except ImportError:
        raise ImportError(
            "results_to_dataframe needs pandas, which is not installed here: "
            "pip install 'gpumesh[notebook]' (or pip install pandas)"
        ) from None
    rows: list[dict[str, Any]] = []
    for value in results:
        if isinstance(value, Mapping):
            rows.append(dict(value))
        elif isinstance(value, BaseException):
            rows.append({"error": f"{type(value).__name__}: {value}"})
        else:
            rows.append({"result": value})
    return pd.DataFrame(rows)
