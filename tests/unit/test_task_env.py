"""The task environment: spec checks (protocol/taskenv.py), the layers a runner builds
(runner/environment.py), and the runner's handling of one task, in process."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumesh.protocol import serialize
from gpumesh.protocol.taskenv import (
    ENV_DENIED,
    ENV_MAX_BYTES,
    ENV_MAX_ENTRIES,
    check_env_name,
    check_script_name,
    check_task_env,
)
from gpumesh.runner.environment import (
    base_environment,
    runner_process_environment,
    set_environ,
    task_environ,
)
from gpumesh.runner.execute import run_task


@pytest.fixture(autouse=True)
def _process_environment_put_back():
    """A function task run in process leaves ``os.environ`` as its base (what a runner
    wants): put the test process's back, or later tests run with a runner's environment
    (GPUMESH_LOCAL=1 among it: every @mesh call after would run locally)."""
    saved = dict(os.environ)
    yield
    set_environ(saved)


def test_a_well_formed_env_comes_back_as_a_plain_dict():
    assert check_task_env({"HF_HOME": "/data/hf", "_X1": "", "lower": "ü"}) == {
        "HF_HOME": "/data/hf", "_X1": "", "lower": "ü"}


@pytest.mark.parametrize("value, words", [
    (["A"], "must be a map"),
    ("A=1", "must be a map"),
    ({"1A": "x"}, "not an environment variable name"),
    ({"A-B": "x"}, "not an environment variable name"),
    ({"": "x"}, "not an environment variable name"),
    ({"A=B": "x"}, "not an environment variable name"),
    ({3: "x"}, "must be a string"),
    ({"A": 3}, "value must be a string"),
    ({"A": None}, "value must be a string"),
    ({"A": "x\x00y"}, "NUL"),
    ({"A": "\udcff"}, "not valid UTF-8"),
    ({"LD_PRELOAD": "/tmp/x.so"}, "--pass-env"),
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, "devices"),
    ({"GPUMESH_TOKEN": "t"}, "never travels"),
    ({f"V{i}": "" for i in range(ENV_MAX_ENTRIES + 1)}, "at most 64"),
    ({"A": "x" * ENV_MAX_BYTES}, "32 KiB"),
])
def test_a_bad_env_is_refused_naming_the_problem(value, words):
    with pytest.raises(ValueError, match=words):
        check_task_env(value)


def test_the_size_limit_counts_names_and_utf8_bytes():
    check_task_env({"A": "x" * (ENV_MAX_BYTES - 1)})
    with pytest.raises(ValueError):
        check_task_env({"A": "é" * (ENV_MAX_BYTES // 2)})


@given(st.dictionaries(st.text(max_size=8), st.one_of(st.text(max_size=40), st.integers()),
                       max_size=6))
def test_check_task_env_accepts_or_raises_value_error_only(value):
    try:
        env = check_task_env(value)
    except ValueError:
        return
    assert env == value and not set(env) & set(ENV_DENIED)


def test_pass_env_names_are_checked_but_may_be_denied_ones():
    assert check_env_name("LD_LIBRARY_PATH") == "LD_LIBRARY_PATH"
    with pytest.raises(ValueError):
        check_env_name("NO SPACES")


@pytest.mark.parametrize("name, base", [("train.py", "train.py"), ("", "task.py"),
                                        ("dir/sub/run.py", "run.py"), ("..\\evil.py", "evil.py"),
                                        ("日本語.py", "日本語.py")])
def test_a_script_name_becomes_a_base_name(name, base):
    assert check_script_name(name) == base


@pytest.mark.parametrize("name", ["bad\x00name.py", "two\nlines.py", "tab\t.py", "del\x7f.py",
                                  "x" * 253, 7, None])
def test_a_script_name_no_worker_could_use_is_refused(name):
    with pytest.raises(ValueError):
        check_script_name(name)


def test_the_base_environment_is_the_allow_list_plus_what_the_owner_passes():
    worker = {"PATH": "/bin", "HOME": "/h", "LC_TIME": "C", "CUDA_VISIBLE_DEVICES": "1",
              "AWS_SECRET_ACCESS_KEY": "k", "HF_HOME": "/hf", "GPUMESH_TOKEN": "t",
              "PYTHONPATH": "/p", "PYTHONHASHSEED": "0"}
    assert base_environment(worker) == {"PATH": "/bin", "HOME": "/h", "LC_TIME": "C",
                                        "CUDA_VISIBLE_DEVICES": "1", "PYTHONPATH": "/p",
                                        "GPUMESH_LOCAL": "1"}
    assert base_environment(worker, ["HF_HOME", "UNSET"])["HF_HOME"] == "/hf"
    # A @mesh function a task calls runs in place, unless the owner passes a value of its own.
    assert base_environment({**worker, "GPUMESH_LOCAL": "0"}, ["GPUMESH_LOCAL"])[
        "GPUMESH_LOCAL"] == "0"
    # The runner also starts with the interpreter's own variables, and nothing secret.
    started = runner_process_environment(worker, ["HF_HOME"])
    assert started["PYTHONHASHSEED"] == "0" and started["HF_HOME"] == "/hf"
    assert "AWS_SECRET_ACCESS_KEY" not in started and "GPUMESH_TOKEN" not in started


def read_variables(*names):
    return {name: os.environ.get(name) for name in names}


def function_task(fn, *args, env=None):
    header = {"kind": "fn"}
    if env is not None:
        header["env"] = env
    return header, [*serialize.dumps(fn), *serialize.dumps((args, {}))]


def test_a_function_task_runs_with_its_env_and_leaves_none_of_it_behind(monkeypatch):
    monkeypatch.delenv("GM_TASK_VALUE", raising=False)
    base = dict(os.environ)
    header, frames = function_task(read_variables, "GM_TASK_VALUE", env={"GM_TASK_VALUE": "1"})
    result, payload = run_task(header, frames, base)
    assert result == {"status": "ok"}
    assert serialize.loads(payload) == {"GM_TASK_VALUE": "1"}
    assert dict(os.environ) == base


def touch(path):
    open(path, "w").close()


def test_a_refused_env_is_an_error_without_frames_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    header, frames = function_task(touch, str(marker), env={"LD_PRELOAD": "/tmp/x.so"})
    result, payload = run_task(header, frames, dict(os.environ))
    assert result["status"] == "error" and payload == []
    assert "refused the task's env" in result["error"]["message"]
    assert not marker.exists()


def test_a_script_with_a_nul_in_its_name_is_an_error_not_a_crash():
    header = {"kind": "script", "name": "a\x00b.py"}
    result, payload = run_task(header, [b"print(1)", b"{}"], dict(os.environ))
    assert result["status"] == "error" and payload == []
    assert result["error"]["type"] == "gpumesh.ScriptError"
    assert "control character" in result["error"]["message"]


def test_a_script_gets_exactly_its_environment_and_its_own_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = (b"import json, os\n"
              b"print(json.dumps([os.environ.get('GM_ONE'), os.environ.get('GM_TWO'), "
              b"os.environ.get('GM_WORKER'), os.getcwd()]))\n")
    base = {"PATH": os.environ.get("PATH", ""), "GM_ONE": "base", "GM_TWO": "base"}
    header = {"kind": "script", "name": "env.py", "env": {"GM_TWO": "task"}}
    monkeypatch.setenv("GM_WORKER", "not for scripts")
    result, payload = run_task(header, [source, b"{}"], base)
    assert result == {"status": "ok", "encoding": "json"}
    one, two, worker, cwd = json.loads(payload[0])
    assert (one, two, worker) == ("base", "task", None)
    assert os.path.basename(cwd).startswith("gpumesh-script-") and not os.path.exists(cwd)


def test_function_tasks_inherit_the_workers_colour_choice_and_scripts_never_see_it():
    # serve/join --color and --no-color set GPUMESH_COLOR (the spec's "Terminal output").
    base = base_environment({"PATH": os.environ.get("PATH", ""), "GPUMESH_COLOR": "0"})
    header, frames = function_task(read_variables, "GPUMESH_COLOR")
    result, payload = run_task(header, frames, base)
    assert result == {"status": "ok"} and serialize.loads(payload) == {"GPUMESH_COLOR": "0"}
    source = b"import os\nprint(repr(os.environ.get('GPUMESH_COLOR')))\n"
    result, payload = run_task({"kind": "script", "name": "colour.py"}, [source, b"{}"], base)
    assert result["status"] == "ok" and payload[0].strip() == b"None"


def test_the_environment_a_task_changed_is_put_back_even_when_the_one_before_changed_nothing():
    saved = dict(os.environ)
    try:
        base = {"PATH": "/usr/bin", "HOME": "/home/friend"}
        set_environ(base)
        with task_environ(base, {}):
            pass  # nothing changed: the next check is a comparison, not a walk
        with task_environ(base, {}):
            os.environ["LEFT_BEHIND"] = "1"
            os.environ["PATH"] = "/tmp/evil"
        assert dict(os.environ) == base
        with task_environ(base, {"SEED": "7"}):
            assert os.environ["SEED"] == "7"
        assert dict(os.environ) == base
        with task_environ(base, {}):
            assert dict(os.environ) == base
    finally:
        set_environ(saved)
