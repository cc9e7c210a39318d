"""Payload-dict scheduler keys and per-call options, as `.map`, `mesh.submit` and the CLI use them."""

from __future__ import annotations

import pytest
from conftest import require

from gpumesh.client.frames import results_to_dataframe
from gpumesh.client.tasks import TaskOptions, plan_calls, scheduler_options, script_task
from gpumesh.errors import ConfigError
from gpumesh.scheduler import Requirements


def test_scheduler_keys_leave_the_payload_and_become_options():
    payload, options = scheduler_options(
        {"lr": 0.1, "gpu": "A100", "cores": 8, "memory": "16GB", "vram": "40GB", "cost": 5},
        TaskOptions(timeout=9.0))
    assert payload == {"lr": 0.1}
    assert options.requirements == Requirements(gpu="A100", cores=8, memory=16 * 10**9,
                                                vram=40 * 10**9)
    assert options.cost == 5.0 and options.timeout == 9.0
    assert options.spec("script")["req"] == {"gpu": "A100", "cores": 8, "memory": 16 * 10**9,
                                             "vram": 40 * 10**9}


def test_a_payload_without_scheduler_keys_is_untouched():
    base = TaskOptions()
    payload = {"lr": 0.1}
    assert scheduler_options(payload, base) == (payload, base)
    assert scheduler_options([1, 2], base) == ([1, 2], base)


def test_payload_keys_add_to_the_decorator_requirements():
    base = TaskOptions(requirements=Requirements(gpu=True))
    _, options = scheduler_options({"memory": "1GB"}, base)
    assert options.requirements == Requirements(gpu=True, memory=10**9)


@pytest.mark.parametrize("bad, words", [({"cores": "many"}, "cores"), ({"memory": "lots"}, "size"),
                                        ({"cost": "heavy"}, "cost"), ({"cost": -1}, "cost"),
                                        ({"gpu": 3}, "gpu")])
def test_bad_scheduler_values_name_the_payload(bad, words):
    with pytest.raises(ConfigError) as info:
        scheduler_options(bad, TaskOptions(), where="payload 3")
    assert "payload 3" in str(info.value) and words in str(info.value)


def test_map_keeps_a_key_the_function_declares():
    def train(lr, gpu=None):
        return lr, gpu

    (args, kwargs, options), = plan_calls(train, [{"lr": 1, "gpu": "A100", "cost": 2}], TaskOptions())
    assert kwargs == {"lr": 1, "gpu": "A100"}
    assert options.requirements.gpu == "A100" and options.cost == 2.0


def test_map_items_other_than_dicts_keep_the_base_options():
    base = TaskOptions(priority=3)
    calls = plan_calls(abs, [-1, (2,)], base)
    assert [(c[0], c[1], c[2]) for c in calls] == [((-1,), {}, base), ((2,), {}, base)]


def test_map_items_of_every_shape_become_the_same_calls_however_they_mix():
    import collections
    import types

    Point = collections.namedtuple("Point", "x y")
    base = TaskOptions()
    items = [1, Point(2, 3), [4], types.MappingProxyType({"a": 5}), (6, 7), 8,
             collections.OrderedDict(b=9, cost=2), {"c": 10}, "s", Point(11, 12)]
    calls = plan_calls(lambda *a, **k: None, items, base)
    assert [(c[0], c[1]) for c in calls] == [
        ((1,), {}), ((2, 3), {}), (([4],), {}), ((), {"a": 5}), ((6, 7), {}), ((8,), {}),
        ((), {"b": 9}), ((), {"c": 10}), (("s",), {}), ((11, 12), {})]
    assert calls[6][2].cost == 2.0 and all(c[2] is base for i, c in enumerate(calls) if i != 6)


def test_a_script_payload_reaches_the_script_without_scheduler_keys():
    payload, options = scheduler_options({"x": 1, "cost": 3.0}, TaskOptions())
    spec, frames = script_task("s.py", b"print(1)", payload, options)
    assert frames[1] == b'{"x": 1}' and spec["cost"] == 3.0


def test_results_to_dataframe_spreads_dicts_into_columns():
    pd = require("pandas")
    frame = results_to_dataframe([{"lr": 0.1, "acc": 0.9}, {"lr": 0.2}, 7, ValueError("bad")])
    assert isinstance(frame, pd.DataFrame)
    assert list(frame.columns) == ["lr", "acc", "result", "error"]
    assert frame["lr"].tolist()[:2] == [0.1, 0.2]
    assert frame["result"].tolist()[2] == 7
    assert frame["error"].tolist()[3] == "ValueError: bad"


def test_results_to_dataframe_without_pandas_says_how_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pandas(name, *args, **kwargs):
        if name == "pandas":
            raise ImportError("No module named 'pandas'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pandas)
    with pytest.raises(ImportError, match=r"pip install 'gpumesh\[notebook\]'"):
        results_to_dataframe([1])


def test_unpicklable_arguments_say_what_to_do_instead():
    import threading

    from gpumesh.client.tasks import PickledFunction

    with pytest.raises(TypeError) as info:
        PickledFunction(len).task((threading.Lock(),), {}, PickledFunction(len).spec(TaskOptions()))
    text = str(info.value)
    assert "arguments of len" in text and "_thread.lock" in text
    assert "open the resource inside the function" in text


def test_results_to_dataframe_of_a_job_status_has_a_row_per_task():
    require("pandas")
    status = {"job": "j", "tasks": [
        {"id": "t1", "state": "done", "worker": "w1", "result": {"lr": 0.1, "acc": 0.9}},
        {"id": "t2", "state": "failed", "worker": "w2", "error": "boom"},
        {"id": "t3", "state": "done", "worker": "w1", "result": "text"}]}
    frame = results_to_dataframe(status)
    assert frame["task"].tolist() == ["t1", "t2", "t3"]
    assert frame["acc"].tolist()[0] == 0.9 and frame["error"].tolist()[1] == "boom"
    assert frame["result"].tolist()[2] == "text"
    with pytest.raises(TypeError, match="list of results"):
        results_to_dataframe({"lr": 0.1})


def test_wait_summaries_of_big_jobs_list_only_what_did_not_succeed():
    from gpumesh.cli.jobs import job_summary

    tasks = [{"id": f"t{i}", "state": "done", "cost": 1.0, "worker": "w", "result": i}
             for i in range(30)]
    tasks[7] = {"id": "t7", "state": "failed", "cost": 1.0, "worker": "w", "error": "boom"}
    status = {"job": "j1", "name": "n", "status": "finished", "counts": {"done": 29, "failed": 1},
              "total": 30, "tasks": tasks}
    short = job_summary(status, limit=20)
    assert "task t7 [failed]" in short and "error: boom" in short and "task t8" not in short
    assert "29 of 30 tasks not listed ('gpumesh status j1'" in short
    assert short.count("\n") < 12
    assert job_summary(status).count(" task t") == 30  # `status JOB` lists them all


def test_env_names_send_the_submitters_values_read_when_the_task_is_sent(monkeypatch):
    options = TaskOptions(env=["GM_A", "GM_B", "GM_A"])
    monkeypatch.setenv("GM_A", "1")
    monkeypatch.setenv("GM_B", "two")
    assert options.spec("fn")["env"] == {"GM_A": "1", "GM_B": "two"}
    monkeypatch.setenv("GM_A", "changed")
    assert options.spec("script")["env"]["GM_A"] == "changed"


def test_env_names_missing_at_call_time_are_named_together(monkeypatch):
    monkeypatch.delenv("GM_GONE_1", raising=False)
    monkeypatch.delenv("GM_GONE_2", raising=False)
    options = TaskOptions(env=["GM_GONE_1", "GM_GONE_2"])  # fine until a task is sent
    with pytest.raises(ConfigError, match="GM_GONE_1, GM_GONE_2 are not set"):
        options.spec("fn")


def test_env_values_given_as_a_dict_travel_as_given_and_survive_option_changes():
    options = TaskOptions(env={"GM_LR": "0.1"})
    assert options.spec("fn")["env"] == {"GM_LR": "0.1"}
    _, item_options = scheduler_options({"x": 1, "cost": 3}, options)
    assert item_options.spec("fn")["env"] == {"GM_LR": "0.1"} and item_options.cost == 3.0
    assert "env" not in TaskOptions().spec("fn")


@pytest.mark.parametrize("env, words", [("GM_A", "not the string"), (["LD_PRELOAD"], "LD_PRELOAD"),
                                        ({"PYTHONPATH": "/x"}, "PYTHONPATH"), (["A B"], "name"),
                                        ([f"V{i}" for i in range(65)], "at most 64"), (3, "int")])
def test_bad_env_is_refused_when_the_options_are_made(env, words):
    with pytest.raises(ConfigError, match=words):
        TaskOptions(env=env)


def test_the_decorators_take_env_and_keep_it_through_to(monkeypatch):
    from gpumesh.client.decorators import DefaultMesh

    monkeypatch.setenv("GM_KEY", "k")
    fn = DefaultMesh()(env=["GM_KEY"], timeout=5)(abs)
    assert fn.options.spec("fn")["env"] == {"GM_KEY": "k"}
    assert fn.to("cuda").options.spec("fn")["env"] == {"GM_KEY": "k"}
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        DefaultMesh()(env={"CUDA_VISIBLE_DEVICES": "0"})(abs)


def test_a_script_name_no_worker_could_use_is_refused_before_sending():
    with pytest.raises(ConfigError, match="control character"):
        script_task("bad\x00name.py", b"", {}, TaskOptions())
    assert script_task("ok.py", b"", {}, TaskOptions())[0]["name"] == "ok.py"


def test_a_decorated_callable_without_a_name_runs_when_verbose(monkeypatch, tmp_path, capsys):
    import functools

    from gpumesh.client.decorators import DefaultMesh

    monkeypatch.setenv("GPUMESH_HOME", str(tmp_path))
    monkeypatch.setenv("GPUMESH_LOCAL", "1")
    monkeypatch.setenv("GPUMESH_VERBOSE", "1")
    fn = DefaultMesh()(functools.partial(pow, 2))
    assert fn(10) == 1024
    assert "running locally" in capsys.readouterr().err


class _RecordingEngine:
    """What ``submit_calls`` hands the engine: the size of each batch, and its futures."""

    def __init__(self):
        self.batches = []
        self.continues = []
        self.futures = []

    def submit(self, items, job, name, *, continues=False):
        from gpumesh.client.engine import TaskFuture

        self.batches.append(len(items))
        self.continues.append(continues)
        made = [TaskFuture() for _ in items]
        self.futures += made
        return made


def _submit(engine, calls):
    from types import SimpleNamespace

    from gpumesh.client.api import GPUMesh

    mesh = SimpleNamespace(_require=lambda: engine, _portable_form=lambda fn: None)
    return GPUMesh.submit_calls(mesh, abs, calls)  # type: ignore[arg-type]


def test_a_big_batch_sends_its_first_calls_before_pickling_the_rest():
    from gpumesh.client.engine import FIRST_CHUNK

    engine = _RecordingEngine()
    futures = _submit(engine, [((i,), {}) for i in range(100)])
    assert engine.batches == [FIRST_CHUNK, 100 - FIRST_CHUNK] and futures == engine.futures
    assert engine.continues == [False, True]  # the rest goes in full SUBMITs
    engine = _RecordingEngine()
    _submit(engine, [((i,), {}) for i in range(2000)])
    assert engine.batches == [FIRST_CHUNK, 2000 - FIRST_CHUNK]  # the rest in one hand-over
    assert len({f.job for f in futures}) == 1 and futures[0].job  # one job
    engine = _RecordingEngine()
    _submit(engine, [((i,), {}) for i in range(10)])
    assert engine.batches == [10] and engine.continues == [False]
    engine = _RecordingEngine()
    _submit(engine, [])
    assert engine.batches == [0]


def test_a_batch_whose_later_call_cannot_pickle_cancels_what_it_sent_and_raises():
    import threading

    from gpumesh.client.engine import FIRST_CHUNK

    calls = [((i,), {}) for i in range(100)]
    calls[70] = ((threading.Lock(),), {})
    engine = _RecordingEngine()
    with pytest.raises(TypeError, match="arguments of abs"):
        _submit(engine, calls)
    assert engine.batches == [FIRST_CHUNK]
    assert all(f.cancelled() for f in engine.futures)


def test_a_module_function_is_pickled_once_and_a_closure_every_call():
    import pickle
    import string

    from gpumesh.client.tasks import PickledFunction

    # An importable module's function pickles as its module and name: made once, shared.
    assert PickledFunction.of(string.capwords) is PickledFunction.of(string.capwords)
    # One that pickles by value may close over state that changed since the last call.
    seen = {"greeting": "hello"}

    def greet() -> str:
        return seen["greeting"]

    first = PickledFunction.of(greet)
    seen["greeting"] = "bonjour"
    second = PickledFunction.of(greet)
    assert second is not first and second.digest != first.digest
    assert pickle.loads(second.frame[0])() == "bonjour"
    # Bound methods carry their object: never cached either.
    words = ["a"]
    assert PickledFunction.of(words.copy) is not PickledFunction.of(words.copy)


def test_a_maps_first_submit_is_small_and_its_later_parts_go_in_full_submits(tmp_path):
    import socket

    from gpumesh.client.engine import CHUNK, FIRST_CHUNK, Engine, TaskFuture, _Submission
    from gpumesh.config import Endpoint, Settings

    with socket.socket() as probe:  # a loopback port nobody listens on: nothing is sent
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    engine = Engine(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}),
                    Endpoint("127.0.0.1", port), "a-token-for-nobody")
    try:
        chunks: list[int] = []
        engine._send_chunk = lambda job, chunk, now: chunks.append(len(chunk))

        def subs(count, leads):
            return [_Submission(seq, {"kind": "fn"}, [b"x"], TaskFuture(), "j1", "m", leads=leads)
                    for seq in range(count)]

        engine._send_submissions(subs(FIRST_CHUNK + CHUNK + 3, leads=True), 0.0)
        assert chunks == [FIRST_CHUNK, CHUNK, 3]
        chunks.clear()
        engine._send_submissions(subs(CHUNK + 3, leads=False), 0.0)  # a later part of it
        assert chunks == [CHUNK, 3]
    finally:
        engine.close()


def test_add_worker_benchmarks_the_machine_as_join_does_unless_told_not_to(monkeypatch):
    from gpumesh.client import api

    calls = []
    monkeypatch.setattr(api, "start_worker", lambda url, token=None, **o: calls.append(o))
    api.GPUMesh.add_worker("tcp://127.0.0.1:1", token="t")
    api.GPUMesh.add_worker("tcp://127.0.0.1:1", token="t", benchmark=False, slots=2)
    assert calls == [{"benchmark": True}, {"benchmark": False, "slots": 2}]
