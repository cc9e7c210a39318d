"""Tasks through the real fabric: values, exceptions, scripts, spreading, ordering."""

from __future__ import annotations

import os
import sys
import textwrap

import numpy as np
import pytest
from conftest import require, wait_for
from gates import wait_gate

from gpumesh import RemoteError


class Custom(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"custom failure {code}")
        self.code = code


def echo(value):
    return value


def raise_custom(code):
    raise Custom(code)


def whoami(i):
    return {"i": i, "pid": os.getpid()}


def raise_huge(size, text="x"):
    raise ValueError(text * size)


def test_values_come_back_unchanged(mesh_env):
    mesh_env.start_coordinator()
    mesh_env.add_worker()
    client = mesh_env.client()
    big = np.arange(1_000_000, dtype=np.float64)  # 8 MB: travels as an out-of-band frame
    values = [{"a": [1, 2, {"b": None}]}, b"bytes", np.float32(0.12), big, (1, "two", 3.0)]
    results = client.map(echo, [(v,) for v in values])
    assert results[0] == values[0]
    assert results[1] == b"bytes"
    assert isinstance(results[2], np.float32) and results[2] == np.float32(0.12)
    assert np.array_equal(results[3], big)
    assert results[4] == (1, "two", 3.0)
    assert client.submit(lambda x, y=1: x * 10 + y, 4, y=2).result(timeout=30) == 42


def test_remote_exception_keeps_type_and_traceback(mesh_env):
    mesh_env.start_coordinator()
    mesh_env.add_worker()
    client = mesh_env.client()
    with pytest.raises(Custom) as info:
        client.submit(raise_custom, 7).result(timeout=30)
    assert info.value.code == 7
    assert "raise_custom" in info.value.remote_traceback
    if sys.version_info >= (3, 11):
        assert any("Remote traceback" in note for note in info.value.__notes__)


def test_unpicklable_exception_becomes_remote_error(mesh_env):
    mesh_env.start_coordinator()
    mesh_env.add_worker()
    client = mesh_env.client()

    def raise_local_class():
        class Unpicklable(Exception):
            def __reduce__(self):
                raise TypeError("no")
        raise Unpicklable("deep trouble")

    with pytest.raises(RemoteError) as info:
        client.submit(raise_local_class).result(timeout=30)
    assert "deep trouble" in str(info.value)
    assert "Unpicklable" in info.value.remote_type


def test_map_spreads_over_workers_in_input_order(mesh_env):
    mesh_env.start_coordinator(self_worker=True, slots=1)
    mesh_env.add_worker()
    mesh_env.add_worker()
    client = mesh_env.client()
    assert len(mesh_env.wait_workers(3, client)) == 3
    futures = client.submit_calls(whoami, [((i,), {}) for i in range(200)])
    results = client.gather(futures)
    assert [r["i"] for r in results] == list(range(200))
    assert len({f.worker for f in futures}) > 1
    assert len({r["pid"] for r in results}) > 1


def test_script_task_reads_json_and_returns_stdout(mesh_env, tmp_path):
    mesh_env.start_coordinator()
    mesh_env.add_worker(env={"WORKER_SECRET": "s3cret"})
    client = mesh_env.client()
    script = tmp_path / "grid.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        payload = json.load(sys.stdin)
        print(json.dumps({"lr": payload["lr"], "double": payload["lr"] * 2,
                          "sees_secret": "WORKER_SECRET" in os.environ}))
    """))
    job = client.submit(name="grid", script=script, payloads=[{"lr": 0.1}, {"lr": 0.3}])
    results = [f.result(timeout=30) for f in client.job_futures(job)]
    assert results == [{"lr": 0.1, "double": 0.2, "sees_secret": False},
                       {"lr": 0.3, "double": 0.6, "sees_secret": False}]


def test_a_detached_jobs_big_outputs_are_read_back_whole_by_the_api_and_the_cli(mesh_env,
                                                                              tmp_path):
    # `status` shows an output up to 4 KiB; a detached submit's bigger ones were held for 24 h
    # and nothing could read them: the CLI's status, the API's wait_job, task_detail.
    import json
    import subprocess

    mesh_env.start_coordinator()
    mesh_env.add_worker()
    script = tmp_path / "big.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        n = json.load(sys.stdin)["n"]
        print(json.dumps({"n": n, "k": "z" * n}))
    """))
    submitter = mesh_env.client()
    sizes = [10, 50_000, 2_500_000]  # the last over a frame's limit: it travels in pieces
    job = submitter.submit(name="bigjson", script=script, payloads=[{"n": n} for n in sizes])
    submitter.close()  # detached: nobody collects the results
    reader = mesh_env.client()
    done = reader.wait_job(job, timeout=60)
    assert [("result" in t) for t in done["tasks"]] == [True, False, False]
    # Left out, but not without a word: its size says there is one to read with `results`.
    assert [t.get("result_bytes") for t in done["tasks"]] == [
        None, *(len(json.dumps({"n": n, "k": "z" * n})) for n in sizes[1:])]
    answer = reader.job_results("bigjson")
    assert [t["result"] for t in answer["tasks"]] == [{"n": n, "k": "z" * n} for n in sizes]
    token_file = tmp_path / "token"
    token_file.write_text(mesh_env.token)
    token_file.chmod(0o600)
    assert mesh_env.coordinator is not None
    cli = subprocess.run([sys.executable, "-m", "gpumesh", "results", job, "--json", "--url",
                          mesh_env.coordinator.url, "--token-file", str(token_file)],
                         env={**os.environ, **mesh_env.env}, capture_output=True, text=True,
                         timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["tasks"][1]["result"]["k"] == "z" * 50_000
    human = subprocess.run([sys.executable, "-m", "gpumesh", "results", "bigjson", "--url",
                            mesh_env.coordinator.url, "--token-file", str(token_file)],
                           env={**os.environ, **mesh_env.env}, capture_output=True, text=True,
                           timeout=60)
    assert human.returncode == 0 and "z" * 50_000 in human.stdout, human.stderr


def test_the_submitters_own_job_results_list_what_it_collected(mesh_env, tmp_path):
    # A Python client collects its job's results as they come, and the coordinator gives them
    # up: its job_results read {'collected': 2, 'tasks': []} while the outputs were here.
    mesh_env.start_coordinator()
    mesh_env.add_worker()
    script = tmp_path / "big.py"
    script.write_text("import json, sys\nn = json.load(sys.stdin)['n']\n"
                      "print(json.dumps({'k': 'z' * n}))\n")
    client = mesh_env.client()
    job = client.submit(name="mine", script=script, payloads=[{"n": 10}, {"n": 50_000}])
    [f.result(timeout=30) for f in client.job_futures(job)]
    wait_for(lambda: client.job_results(job)["collected"] == 0
             and len(client.job_results(job)["tasks"]) == 2, timeout=30,
             what="both results listed")
    answer = client.job_results("mine")
    assert sorted(len(t["result"]["k"]) for t in answer["tasks"]) == [10, 50_000]
    assert all(t["state"] == "done" for t in answer["tasks"])


def test_an_exception_with_a_huge_message_comes_back_once_its_text_cut_to_the_limits(mesh_env):
    # Its message and traceback (600 KB each) once made a RESULT header over the 1 MiB limit:
    # the coordinator refused it, the worker sent it again on every reconnect, and the caller
    # waited forever. The worker now cuts the text to the protocol's limits; the exception
    # itself (pickled, in the frames) comes back whole.
    mesh_env.start_coordinator()
    mesh_env.add_worker()
    client = mesh_env.client()
    for size, text in ((600_000, "x"), (300_000, "\U0001f525")):  # 4 bytes a character
        with pytest.raises(ValueError) as info:
            client.submit(raise_huge, size, text).result(timeout=30)
        assert str(info.value) == text * size
        assert 1000 < len(info.value.remote_traceback.encode()) <= 256 * 1024
    assert client.submit(echo, 5).result(timeout=30) == 5  # the worker is still there


def test_script_failure_is_an_error_with_output(mesh_env, tmp_path):
    mesh_env.start_coordinator()
    mesh_env.add_worker()
    client = mesh_env.client()
    script = tmp_path / "bad.py"
    script.write_text("import sys\nprint('partial')\nprint('step 1 ok', file=sys.stderr)\n"
                      "raise ValueError('bad input 7')\n")
    job = client.submit(script=script, payloads=[{}])
    with pytest.raises(RemoteError) as info:
        client.job_futures(job)[0].result(timeout=30)
    assert "exited with code 1: ValueError: bad input 7" in str(info.value)
    assert "step 1 ok" in info.value.remote_traceback  # stderr, kept for the report
    assert 'raise ValueError' in info.value.remote_traceback
    detail = client.status(job)["tasks"][0]["detail"]
    assert detail.rstrip().endswith("ValueError: bad input 7")


def test_a_script_runs_in_its_own_temporary_directory_which_is_removed(mesh_env, tmp_path):
    mesh_env.start_coordinator()
    mesh_env.add_worker()
    client = mesh_env.client()
    script = tmp_path / "where.py"
    script.write_text(textwrap.dedent("""
        import json, os
        open("scratch.txt", "w").write("left behind?")
        print(json.dumps({"cwd": os.path.realpath(os.getcwd()),
                          "script_dir": os.path.dirname(os.path.realpath(__file__)),
                          "files": sorted(os.listdir("."))}))
    """))
    job = client.submit(script=script, payloads=[{}])
    seen = client.job_futures(job)[0].result(timeout=30)
    assert seen["cwd"] == seen["script_dir"] != os.path.realpath(os.getcwd())
    assert seen["files"] == ["scratch.txt", "where.py"]
    assert not os.path.exists(seen["cwd"])  # removed before the result was sent


def test_a_script_name_with_a_nul_fails_once_with_a_clear_error(mesh_env):
    from gpumesh.client.tasks import TaskOptions, script_task
    from gpumesh.errors import SubmitRejected

    mesh_env.start_coordinator()
    mesh_env.add_worker()
    mesh_env.add_worker()  # a crash would be retried here: it must not be
    client = mesh_env.client()
    mesh_env.wait_workers(2, client)
    spec, frames = script_task("fine.py", b"print(1)\n", {}, TaskOptions())
    spec["name"] = "bad\x00name.py"  # what a client other than gpumesh's could send
    future, = client._require().submit([(spec, frames)], "nuljob01", "nul")
    # Refused by the coordinator at submit, or by the worker as the task's error: once.
    with pytest.raises((RemoteError, SubmitRejected), match="control character") as info:
        future.result(timeout=30)
    if isinstance(info.value, RemoteError):
        task, = client.status("nuljob01")["tasks"]
        assert task["state"] == "failed" and task["attempts"] == 1
    # The runner survived: the worker still runs tasks.
    assert client.submit(echo, 5).result(timeout=30) == 5


def test_the_client_refuses_a_script_name_no_worker_could_use(mesh_env, tmp_path):
    from gpumesh.errors import ConfigError

    mesh_env.start_coordinator()
    client = mesh_env.client()
    script = tmp_path / "two\nlines.py"  # a legal file name here, and a forged log line there
    script.write_text("print(1)\n")
    with pytest.raises(ConfigError, match="control character"):
        client.submit(script=script, payloads=[{}])


def test_task_output_reaches_the_caller(mesh_env):
    mesh_env.start_coordinator()
    mesh_env.add_worker()
    seen = []
    client = mesh_env.client()
    engine = client._get_engine()
    engine.on_output = lambda worker, stream, data, task: seen.append((worker, stream, data, task))

    def chatty():
        print("hello from the task", flush=True)
        return 1

    assert client.submit(chatty).result(timeout=30) == 1
    wait_for(lambda: any(b"hello from the task" in d for _, _, d, _ in seen), what="task output")
    assert seen[0][1] == "out" and len(seen[0][0]) == 8 and len(seen[0][3]) == 12  # its task id


def tensor_stats(t):
    return {"sum": float(t.sum()), "doubled": t * 2}


def test_torch_tensors_round_trip(mesh_env):
    torch = require("torch")
    mesh_env.start_coordinator()
    mesh_env.add_worker()
    client = mesh_env.client()
    tensor = torch.arange(300_000, dtype=torch.float32)  # 1.2 MB: out-of-band
    out = client.submit(tensor_stats, tensor).result(timeout=60)
    assert out["sum"] == float(tensor.sum())
    assert torch.equal(out["doubled"], tensor * 2)


def nap(seconds):
    import time

    time.sleep(seconds)
    return seconds


def hold(gate):
    """Runs until the test makes the ``gate`` file (a minute at most)."""
    wait_gate(gate)
    return gate


def test_a_future_cancelled_before_its_submit_was_accepted_never_runs(mesh_env, tmp_path):
    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=1)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    gate = str(tmp_path / "gate")
    # The first holds the only slot until the cancel has been handled, however slow this is.
    first, second = client.submit_calls(hold, [((gate,), {}), ((gate,), {})])
    assert second.cancel()  # before ACCEPTED has had time to arrive
    wait_for(lambda: (lambda c: c.get("running") == 1 and not c.get("pending"))(
        client.status(first.job, tasks=False)["counts"]), what="only the first task left")
    open(gate, "w").close()
    assert first.result(timeout=30) == gate
    status = wait_for(lambda: (lambda s: s if s["status"] == "finished" else None)(
        client.status(first.job)), what="the job to finish")
    # Cancelled in flight (the usual case) or before it was even sent: either way it never ran.
    assert status["counts"] in ({"done": 1, "cancelled": 1}, {"done": 1})


def test_a_status_query_right_after_a_submission_sees_its_job(mesh_env):
    mesh_env.start_coordinator()
    client = mesh_env.client()
    assert client.workers() == []  # connected
    for _ in range(5):  # the query must not overtake the SUBMIT on its way out
        (future,) = client.submit_calls(nap, [((0.0,), {})])
        assert client.status(future.job, tasks=False)["counts"] == {"pending": 1}


def test_waiting_with_no_worker_says_so_once(mesh_env, capsys):
    from gpumesh import GPUMesh
    from gpumesh.errors import MeshTimeout

    mesh_env.start_coordinator()
    client = GPUMesh(mesh_env.coordinator.url, mesh_env.token, settings=mesh_env.settings)
    mesh_env.clients.append(client)
    with pytest.raises(MeshTimeout):
        client.map(echo, [1, 2], timeout=10)  # notice at 3 s, then a status query: room for both
    err = capsys.readouterr().err
    assert err.count("2 task(s) waiting: no worker is connected") == 1
    assert "gpumesh join" in err and mesh_env.token not in err


def test_a_map_of_a_big_closure_journals_and_sends_its_function_once(mesh_env):
    import sqlite3

    mesh_env.start_coordinator()
    client = mesh_env.client()
    table = bytes(range(256)) * 1200  # 300 KiB the function closes over (a lookup table, say)

    def lookup(i):
        return table[i * 1000]

    futures = client.submit_calls(lookup, [((i,), {}) for i in range(60)])
    wait_for(lambda: all(f.task_id for f in futures), what="the map to be accepted")
    raw = sqlite3.connect(f"file:{mesh_env.db}?mode=ro", uri=True)
    try:
        (functions,) = raw.execute("SELECT count(*) FROM functions").fetchone()
        (biggest,) = raw.execute("SELECT max(length(payload)) FROM tasks").fetchone()
        (blobs,) = raw.execute("SELECT count(*) FROM tasks WHERE payload_ref IS NOT NULL"
                               ).fetchone()
    finally:
        raw.close()
    # 60 rows of arguments (no blob file each for the function) and one function.
    assert functions == 1 and biggest < 1000 and blobs == 0
    mesh_env.add_worker(slots=2)
    assert client.gather(futures, timeout=60) == [table[i * 1000] for i in range(60)]


def test_queries_faster_than_the_coordinators_rate_wait_their_turn(mesh_env, monkeypatch):
    # The coordinator answers a client's 21st request within a second "ask again later"
    # (QUERY_RATE): the client asks again shortly instead of failing the caller.
    from gpumesh.client import engine
    from gpumesh.coordinator.clients import QUERY_RATE
    from gpumesh.protocol import Command, ErrorCode

    refused = []
    on_error = engine._HANDLERS[Command.ERROR]

    def counting(self, msg, now):
        if msg.header.get("code") == ErrorCode.BUSY.value:
            refused.append(msg.header.get("qid"))
        on_error(self, msg, now)

    monkeypatch.setitem(engine._HANDLERS, Command.ERROR, counting)
    mesh_env.start_coordinator()
    client = mesh_env.client()
    answers = [client.workers() for _ in range(int(QUERY_RATE * 3))]
    assert answers == [[]] * int(QUERY_RATE * 3)
    assert refused  # the coordinator did refuse some: they were asked again, and answered


def test_a_callback_that_submits_while_the_mesh_closes_opens_no_new_connection(mesh_env):
    """close() joins the I/O thread, where done-callbacks run: one that submits more (joblib's
    next batch, a chained call) waited for close()'s lock, then made a new connection from the
    dying thread, on a mesh its user had just closed."""
    import threading

    from gpumesh.errors import MeshError

    mesh_env.start_coordinator()
    mesh_env.add_worker(slots=1)
    client = mesh_env.client()
    mesh_env.wait_workers(1, client)
    in_callback, closing = threading.Event(), threading.Event()
    said: list[BaseException] = []

    def chain(_future):
        in_callback.set()
        closing.wait(30)
        try:
            client.submit(abs, -1)
        except MeshError as exc:
            said.append(exc)

    client.submit(abs, -2).add_done_callback(chain)
    assert in_callback.wait(30)
    closer = threading.Thread(target=client.close)
    closer.start()
    wait_for(lambda: client._closed_thread is not None, what="close() under way")
    closing.set()
    closer.join(30)
    assert not closer.is_alive()
    assert client._engine is None and said and "closed" in str(said[0])
