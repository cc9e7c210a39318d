"""The source form of a function, for workers on another Python (client/portable.py)."""

from __future__ import annotations

import json

import msgpack

from gpumesh.client.portable import SourceForm, source_form
from gpumesh.runner.execute import run_source
from gpumesh.scheduler import Requirements, TaskView, WorkerView, choose, could_ever_run


def decorate(fn):
    return fn


@decorate
def scale(values: list[float], factor: float = 2.0) -> str:
    return json.dumps([v * factor for v in values])


def test_the_source_form_drops_decorators_and_annotations_and_keeps_imports():
    form = source_form(scale)
    assert isinstance(form, SourceForm)
    text = form.frame.decode()
    assert "@decorate" not in text and "list[float]" not in text
    assert text.startswith("import json\n")


def test_the_source_form_runs_with_plain_arguments():
    form = source_form(scale)
    frames = form.frames(([1.0, 2.5],), {"factor": 3.0})
    header, result = run_source("scale", frames)
    assert header == {"status": "ok"}
    from gpumesh.protocol import serialize

    assert serialize.loads(result) == "[3.0, 7.5]"


def test_arguments_that_are_not_plain_data_get_no_source_form():
    form = source_form(scale)
    assert form.frames((object(),), {}) is None
    assert form.frames(({1: "non-string key"},), {}) is None
    assert form.frames((["a", b"b", None, True],), {}) is not None


def test_values_msgpack_would_change_get_no_source_form():
    """The source form's call must get the very values the pickled one gets: a tuple came back
    a list (x + (1,) failed only on the other-Python worker), an IntEnum or a numpy float a
    plain number, and an int beyond 64 bits raised OverflowError out of the submit."""
    import enum

    import numpy as np

    class Level(enum.IntEnum):
        HIGH = 2

    form = source_form(scale)
    for value in ((3, 3), [1, (2,)], {"k": (1,)}, Level.HIGH, np.float64(1.5), 2**70, -(2**64)):
        assert form.frames((value,), {}) is None, value
        assert form.frames((), {"v": value}) is None, value
    assert form.frames((2**63, -(2**63), [1.5, "x"]), {"k": {"n": None}}) is not None


def uses_math_inside(xs):
    return [math.sqrt(x) for x in xs] + list(map(lambda x: math.floor(x), xs))


import math  # noqa: E402  (imported after the function on purpose: its module's import counts)


def test_names_read_in_comprehensions_and_lambdas_bring_their_imports():
    form = source_form(uses_math_inside)
    assert isinstance(form, SourceForm), form
    assert form.frame.decode().startswith("import math\n")
    header, result = run_source("uses_math_inside", form.frames(([4.0, 9.0],), {}))
    from gpumesh.protocol import serialize

    assert header == {"status": "ok"} and serialize.loads(result) == [2.0, 3.0, 4, 9]


def test_closures_and_lambdas_have_no_source_form():
    offset = 3

    def shifted(x):
        return x + offset

    assert "closes over" in source_form(shifted)
    assert "not defined by a plain def" in source_form(lambda x: x) or \
        "not a plain" in source_form(lambda x: x)
    assert "not a plain Python function" in source_form(len)


def test_a_broken_source_form_is_a_clear_task_error():
    header, _ = run_source("missing", [b"x = 1\n", msgpack.packb([[], {}])])
    assert header["status"] == "error"
    assert "source form of missing could not be loaded" in header["error"]["message"]


def test_a_portable_task_may_run_on_another_python_but_prefers_the_same_one():
    req = Requirements(python="3.11")
    other = WorkerView("old", free=1, python="3.10")
    same = WorkerView("same", free=1, python="3.11", load=0)
    strict = TaskView("t", req)
    portable = TaskView("t", req, portable=True)
    assert choose(strict, [other]) is None and not could_ever_run(strict, [other])
    assert choose(portable, [other]).worker_id == "old" and could_ever_run(portable, [other])
    assert choose(portable, [other, same]).worker_id == "same"


SCALE = 3.0


def helper(x):
    return x * SCALE


def uses_module_names(x):
    return helper(x) + SCALE


def uses_only_its_own(x, *rest, factor=2):
    total = [x]
    for value in rest:
        total.append(value * factor)
    return json.dumps(total)


def test_functions_that_need_module_level_names_get_no_source_form():
    reason = source_form(uses_module_names)
    assert isinstance(reason, str) and "SCALE, helper" in reason
    assert isinstance(source_form(uses_only_its_own), SourceForm)
