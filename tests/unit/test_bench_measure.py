"""bench/measure.py's measurements against a system that runs in this process (what is
measured is not checked: no test asserts a speed)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.measure import mid_size_map
from bench.params import Params


class InProcess:
    """A System that runs each task here and may get its results wrong."""

    def __init__(self, wrong: bool = False) -> None:
        self.wrong = wrong
        self.sizes: list[int] = []
        self.distinct: list[int] = []

    def map(self, fn: Any, items: list[Any]) -> list[Any]:
        self.sizes += [len(item) for item in items]
        self.distinct.append(len({id(item) for item in items}))
        got = [fn(item) for item in items]
        return got[::-1] if self.wrong else got


def test_the_mid_size_map_sends_each_item_its_size_and_checks_the_results() -> None:
    system = InProcess()
    result = mid_size_map(system, Params(mid_tasks=20, mid_bytes=1000))  # type: ignore[arg-type]
    assert result["mid_tasks_per_s"] > 0 and system.sizes == [1000] * (8 + 20)  # warm-up first
    # Each item an object of its own: a pickle memo (Dask's map) cannot send one for many.
    assert system.distinct == [8, 20]
    with pytest.raises(RuntimeError, match="wrong results"):
        mid_size_map(InProcess(wrong=True), Params(mid_tasks=20, mid_bytes=1000))  # type: ignore[arg-type]


def test_every_metric_gets_a_panel_that_can_be_read() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.plots import _metrics
    from bench.report import METRICS

    systems = [{"key": key, "name": key, **{m.key: 1.0 + n for m in METRICS}}
               for n, key in enumerate(("floor", "gpumesh"))]
    fig = _metrics(plt, systems)
    try:
        shown = {axis.get_title() for axis in fig.axes if axis.axison}
        assert shown == {metric.header for metric in METRICS}
    finally:
        plt.close(fig)
