"""Results as a pandas DataFrame (the optional ``gpumesh[notebook]`` extra)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def results_to_dataframe(results: Iterable[Any]) -> Any:
    """A row per result. Dict results spread into columns (missing keys are NaN); anything else
    lands in one ``result`` column. An exception among the results (a list made with
    ``f.exception() or f.result()`` over futures, say) goes to ``error``."""
    try:
        import pandas as pd
    except ImportError:
        raise ImportError(
            "results_to_dataframe needs pandas, which is not installed here: "
            "pip install 'gpumesh[notebook]' (or pip install pandas)"
        ) from None
    if isinstance(results, Mapping) and "tasks" in results:
        return pd.DataFrame(_job_rows(results))  # a job's status, e.g. from mesh.wait_job()
    if isinstance(results, (Mapping, str, bytes)):
        raise TypeError("results_to_dataframe takes a list of results (from .map or gather) or a "
                        f"job's status (from mesh.status/wait_job), not a {type(results).__name__}")
    rows: list[dict[str, Any]] = []
    for value in results:
        if isinstance(value, Mapping):
            rows.append(dict(value))
        elif isinstance(value, BaseException):
            rows.append({"error": f"{type(value).__name__}: {value}"})
        else:
            rows.append({"result": value})
    return pd.DataFrame(rows)


def _job_rows(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A row per task of a job: its id, state and worker, its result spread into columns."""
    rows = []
    for task in status["tasks"]:
        row: dict[str, Any] = {"task": task.get("id"), "state": task.get("state"),
                               "worker": task.get("worker", "")}
        result = task.get("result")
        if isinstance(result, Mapping):
            row.update(result)
        elif result is not None:
            row["result"] = result
        if task.get("error"):
            row["error"] = task["error"]
        rows.append(row)
    return rows
