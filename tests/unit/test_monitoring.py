"""What monitors (the dashboard) read of the coordinator: worker telemetry, traffic, health, and
a client's drain/pause/resume of a worker; with hostile values of every new field."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpumesh.config import Limits, Timing
from gpumesh.coordinator.broker import Broker
from gpumesh.protocol import Command, Heartbeat, Hello, Message, WorkerMode, decode, encode
from gpumesh.protocol.telemetry import MAX_STAT_GPUS, Telemetry, parse_stats
from gpumesh.store import Store
from gpumesh.worker.owner import OwnerControls
from gpumesh.worker.telemetry import (
    MIB,
    CpuMeter,
    Sampler,
    gpu_reader,
    memory,
    parse_smi,
    read_nvidia_smi,
)

W, C = b"worker-routing", b"client-routing"
GOOD = {"cpu": 12.5, "ram": [3 * 2**30, 8 * 2**30],
        "gpus": [{"util": 40.0, "used": 2**30, "total": 2**34}]}


def msg(command: Command, header: dict, payload: list | None = None) -> Message:
    return decode(encode(command, header, payload or []), Limits())


def sent(b: Broker, command: Command) -> list[dict]:
    return [m.header for m in (decode(f, Limits()) for _, f in b.outbox) if m.command is command]


def make_broker(control: bool = True) -> Broker:
    b = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0)
    hello = {"role": "worker", "id": "w1", "slots": 1, "credit": 1, "proto": [1, 1],
             "info": {"python": "3.11", "hostname": "box"}}
    if control:
        hello["control"] = True
    b.handle(W, msg(Command.HELLO, hello), 0.0)
    b.handle(C, msg(Command.HELLO, {"role": "client", "id": "c1", "proto": [1, 1],
                                    "info": {"user": "ann", "host": "lap"}}), 0.0)
    b.outbox.clear()
    return b


def ask(b: Broker, what: str, now: float = 1.0) -> object:
    b.handle(C, msg(Command.QUERY, {"what": what, "qid": 7}), now)
    return sent(b, Command.REPLY)[-1]["data"]


# ----------------------------------------------------------------- stats on the wire

def test_good_stats_round_trip():
    stats = Telemetry.from_mapping(GOOD)
    assert stats.to_dict() == {"cpu": 12.5, "ram": [3 * 2**30, 8 * 2**30],
                               "gpus": [{"util": 40.0, "used": 2**30, "total": 2**34}]}


@pytest.mark.parametrize("bad", [
    "busy", [], {"cpu": 101}, {"cpu": -1}, {"cpu": math.nan}, {"cpu": math.inf}, {"cpu": True},
    {"cpu": "12"}, {"ram": [2, 1]}, {"ram": [1]}, {"ram": [-1, 5]}, {"ram": [0, 2**61]},
    {"ram": [True, 2]}, {"ram": "1GB"}, {"gpus": "x"}, {"gpus": [1]},
    {"gpus": [{"util": 200}]}, {"gpus": [{"used": 5, "total": 1}]},
    {"gpus": [{"used": 0, "total": 1}] * (MAX_STAT_GPUS + 1)},
    {f"k{i}": i for i in range(17)},
])
def test_hostile_stats_are_dropped_and_the_heartbeat_still_counts(bad):
    assert parse_stats({"stats": bad}) is None
    beat = Heartbeat.from_header({"leases": [5], "stats": bad})
    assert beat.leases == (5,) and beat.stats is None


def test_older_peers_without_the_new_fields_still_work():
    assert Heartbeat.from_header({"leases": []}).stats is None
    hello = Hello.from_header({"role": "worker", "id": "w", "slots": 1, "proto": [1, 1]})
    assert hello.control is False


def test_workers_query_shows_the_latest_stats_and_traffic():
    b = make_broker()
    b.handle(W, msg(Command.HEARTBEAT, {"leases": [], "stats": GOOD}), 2.0)
    b.handle(W, msg(Command.HEARTBEAT, {"leases": [], "stats": {"cpu": "x"}}), 3.0)
    b.count_traffic(W, 100, up=True)
    b.count_traffic(W, 40, up=False)
    b.count_traffic(C, 999, up=True)  # a client's traffic is no worker's
    (worker,) = ask(b, "workers", 4.0)
    assert worker["stats"]["cpu"] == 12.5 and worker["stats_at"] == 2.0  # the bad one dropped
    assert worker["traffic"] == {"up_bytes": 100, "down_bytes": 40, "up_msgs": 1,
                                 "down_msgs": 1}


# ----------------------------------------------------------------- health and events

def test_health_reports_queue_journal_uptime_and_clients():
    b = make_broker()
    b.handle(C, msg(Command.SUBMIT, {"tasks": [{"seq": 1, "nf": 1, "kind": "script"}]}, [b"p"]),
             1.0)
    health = ask(b, "health", 11.0)
    assert health["uptime"] == 11.0 and health["clients"] == 1
    assert health["queue"] == {"pending": 1} and health["workers"] == {"alive": 1}
    assert health["journal_bytes"] == 0  # in memory
    assert health["finished_total"] == 0


def test_task_finished_events_carry_latency_and_run_time():
    b = make_broker()
    b.handle(C, msg(Command.SUBMIT, {"tasks": [{"seq": 1, "nf": 1, "kind": "script"}]}, [b"p"]),
             1.0)
    b.dispatch(1.0)
    task = next(iter(b.tasks.values()))
    b.handle(W, msg(Command.RESULT, {"task": task.task_id, "lease": task.lease_id,
                                     "status": "error", "elapsed": 0.5,
                                     "error": {"type": "E", "message": "<b>x</b>"}}), 3.0)
    event = [e for e in b.ledger.events if e.kind == "task_finished"][-1]
    assert event.data["latency"] == 2.0 and event.data["elapsed"] == 0.5
    assert ask(b, "health", 4.0)["finished_total"] == 1


def test_a_tasks_whole_error_is_asked_by_id_and_a_hostile_id_is_refused():
    b = make_broker()
    b.handle(C, msg(Command.SUBMIT, {"tasks": [{"seq": 1, "nf": 1, "kind": "script"}]}, [b"p"]),
             1.0)
    b.dispatch(1.0)
    task = next(iter(b.tasks.values()))
    trace = "Traceback (most recent call last):\n" + "  frame\n" * 5000
    b.handle(W, msg(Command.RESULT, {"task": task.task_id, "lease": task.lease_id,
                                     "status": "error", "elapsed": 0.5,
                                     "error": {"type": "E", "message": "m", "traceback": trace}}),
             3.0)
    b.handle(C, msg(Command.QUERY, {"what": "task", "task": task.task_id, "qid": 9}), 4.0)
    detail = sent(b, Command.REPLY)[-1]["data"]
    assert detail["error"]["traceback"] == trace and detail["worker"] == "w1"
    assert detail["state"] == "failed" and detail["job"] == task.job_id
    b.handle(C, msg(Command.QUERY, {"what": "task", "task": "nope", "qid": 10}), 4.0)
    assert "no longer holds" in sent(b, Command.REPLY)[-1]["data"]["error"]
    b.handle(C, msg(Command.QUERY, {"what": "task", "task": "x" * 65, "qid": 11}), 4.0)
    assert sent(b, Command.ERROR)[-1]["code"] == "malformed"


def test_a_failure_names_its_exception_type_in_its_event_and_its_jobs_list():
    b = make_broker()
    b.handle(C, msg(Command.SUBMIT, {"tasks": [{"seq": 1, "nf": 1, "kind": "script"}]}, [b"p"]),
             1.0)
    b.dispatch(1.0)
    task = next(iter(b.tasks.values()))
    b.handle(W, msg(Command.RESULT, {"task": task.task_id, "lease": task.lease_id,
                                     "status": "error", "elapsed": 0.5,
                                     "error": {"type": "builtins.ValueError",
                                               "message": "task 3 is unhappy"}}), 3.0)
    event = [e for e in b.ledger.events if e.kind == "task_finished"][-1]
    assert event.data["error"] == "ValueError: task 3 is unhappy"
    b.handle(C, msg(Command.QUERY, {"what": "status", "job": task.job_id, "qid": 8}), 4.0)
    (row,) = sent(b, Command.REPLY)[-1]["data"]["tasks"]
    assert (row["error_type"], row["error"]) == ("ValueError", "task 3 is unhappy")


def test_a_cancel_is_logged_and_evented_with_who_asked(caplog):
    b = make_broker()
    b.handle(C, msg(Command.SUBMIT, {"tasks": [{"seq": i, "nf": 1, "kind": "script"}
                                               for i in (1, 2)]}, [b"p", b"q"]), 1.0)
    job = next(iter(b.tasks.values())).job_id
    with caplog.at_level("INFO", logger="gpumesh.coordinator"):
        b.handle(C, msg(Command.CONTROL, {"action": "cancel", "target": job, "qid": 4}), 2.0)
    assert sent(b, Command.REPLY)[-1]["data"]["cancelled"] == 2
    assert f"ann@lap cancelled job {job}" in caplog.text
    (event,) = [e for e in b.ledger.events if e.kind == "job_cancelled"]
    assert event.data == {"job": job, "count": 2, "by": "ann@lap"}


def test_a_drained_worker_is_a_departure_not_a_loss():
    b = make_broker()
    b.handle(W, msg(Command.DISCONNECT, {"reason": "drained"}), 2.0)
    event = b.ledger.events[-1]
    assert event.kind == "worker_lost" and event.data["departed"] == "left"
    assert event.data["reason"] == "drained"
    (worker,) = ask(b, "workers", 3.0)
    assert (worker["state"], worker["reason"]) == ("left", "drained")


# ----------------------------------------------------------------- drain from the mesh

@pytest.mark.parametrize("action", ["drain", "pause", "resume"])
def test_a_client_may_ask_a_worker_to_drain_and_everyone_is_told_who(action):
    b = make_broker()
    b.handle(C, msg(Command.CONTROL, {"action": action, "target": "w1", "qid": 3}), 1.0)
    assert sent(b, Command.CONTROL) == [{"action": action, "by": "ann@lap"}]
    assert sent(b, Command.REPLY)[-1]["data"]["action"] == action
    event = b.ledger.events[-1]
    assert (event.kind, event.data["by"], event.data["action"]) == \
        ("worker_control", "ann@lap", action)


def test_a_worker_that_cannot_take_it_is_named_and_nothing_is_sent():
    b = make_broker(control=False)
    b.handle(C, msg(Command.CONTROL, {"action": "drain", "target": "box", "qid": 3}), 1.0)
    assert "gpumesh drain" in sent(b, Command.REPLY)[-1]["data"]["error"]
    assert sent(b, Command.CONTROL) == []


def test_an_unknown_worker_or_action_is_refused():
    b = make_broker()
    b.handle(C, msg(Command.CONTROL, {"action": "drain", "target": "nobody", "qid": 3}), 1.0)
    assert "no worker" in sent(b, Command.REPLY)[-1]["data"]["error"]
    b.handle(C, msg(Command.CONTROL, {"action": "format-disk", "target": "w1", "qid": 4}), 1.0)
    assert sent(b, Command.ERROR)[-1]["code"] == "unsupported"


class FakeAgent:
    def __init__(self) -> None:
        self.worker_id, self.mode, self.granted, self.received = "w1", WorkerMode.ACTIVE, 1, 0
        self.runners: list = []
        self.queue: list = []
        self.unacked: dict = {}
        self.lines: list[str] = []
        self.url, self.welcomed = "tcp://127.0.0.1:1", True

    def say(self, line: str) -> None:
        self.lines.append(line)

    def free_slots(self) -> int:
        return 1

    def send_credit(self, release=()) -> None:
        pass

    def stop(self) -> None:
        pass

    def read_finished(self, now: float) -> None:
        pass


def test_the_mesh_drains_a_worker_as_its_owner_would_but_never_overrides_the_owner():
    agent = FakeAgent()
    controls = OwnerControls(agent)  # type: ignore[arg-type]
    controls.on_control("drain", 0.0, by="ann@lap")
    assert agent.mode is WorkerMode.DRAINING and "ann@lap" in agent.lines[0]
    controls.on_control("resume", 0.0, by="ann@lap")  # the mesh undoes its own drain
    assert agent.mode is WorkerMode.ACTIVE
    controls.on_control("pause", 0.0)  # the owner pauses here
    controls.on_control("resume", 0.0, by="bob@desk")
    assert agent.mode is WorkerMode.PAUSED and "ignored" in agent.lines[-1]
    controls.on_control("resume", 0.0)
    assert agent.mode is WorkerMode.ACTIVE


# ----------------------------------------------------------------- the worker's sampler

def test_nvidia_smi_lines_parse_and_odd_ones_are_skipped():
    text = "0, 37, 1024, 16384\n1, [N/A], 20000, 10\ngarbage\n"
    first, second = parse_smi(text)
    assert first == {"index": 0, "util": 37.0, "used": 2**30, "total": 16 * 2**30}
    assert second["util"] is None and second["used"] == second["total"] == 10 * 2**20


FAKES = Path(__file__).resolve().parent.parent / "fakes"  # tests/fakes/nvidia-smi


def test_a_fake_nvidia_smi_on_path_is_read_through_the_real_call(monkeypatch):
    monkeypatch.setenv("PATH", f"{FAKES}{os.pathsep}{os.environ.get('PATH', '')}")
    assert gpu_reader() is read_nvidia_smi
    assert read_nvidia_smi()[0] == {"index": 0, "util": 37.0, "used": 6144 * MIB,
                                    "total": 24564 * MIB}
    sample = Sampler([1]).sample()  # a worker pinned to GPU 1 reports only that one
    assert sample["gpus"] == [{"util": 81.0, "used": 20480 * MIB, "total": 24564 * MIB}]
    assert parse_stats({"stats": sample}) is not None


class StandInCuda:
    """``torch.cuda`` as far as the sampler may touch it: NVML-backed calls answer; anything
    that would open a CUDA context (and hold VRAM on every GPU) fails the test."""

    def __init__(self, boards: list[tuple[float, int, int]], available: bool = True) -> None:
        self.boards, self.available = boards, available  # (util %, used, total) per GPU

    def is_available(self) -> bool:
        return self.available

    def device_count(self) -> int:
        return len(self.boards)

    def get_device_properties(self, index: int) -> Any:
        return SimpleNamespace(name=f"Stand-in {index}", total_memory=self.boards[index][2])

    def utilization(self, index: int) -> float:
        return self.boards[index][0]

    def device_memory_used(self, index: int) -> int:
        return self.boards[index][1]

    def __getattr__(self, name: str) -> Any:  # mem_get_info, init, set_device, current_device
        if name.startswith("__"):
            raise AttributeError(name)
        raise AssertionError(f"the sampler called torch.cuda.{name}, which opens a CUDA context")


@pytest.fixture
def no_smi(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi to be found


def test_without_nvidia_smi_gpus_are_read_through_torchs_nvml(no_smi, monkeypatch):
    cuda = StandInCuda([(12.0, 2**30, 2**34), (100.0, 2**35, 2**34)])  # a driver over-reporting
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))
    reader = gpu_reader()
    assert reader is not None
    assert reader() == [{"index": 0, "util": 12.0, "used": 2**30, "total": 2**34},
                        {"index": 1, "util": 100.0, "used": 2**34, "total": 2**34}]
    sample = Sampler([0]).sample()
    assert sample["gpus"] == [{"util": 12.0, "used": 2**30, "total": 2**34}]
    assert parse_stats({"stats": Sampler().sample()}) is not None


@pytest.mark.parametrize("cuda", [
    StandInCuda([(1.0, 1, 2)], available=False),
    SimpleNamespace(is_available=lambda: True, device_count=lambda: 1),  # a torch before NVML calls
])
def test_a_torch_that_cannot_say_reads_no_gpus(no_smi, monkeypatch, cuda):
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))
    assert gpu_reader() is None
    assert Sampler().sample()["gpus"] == []


def test_the_sampler_never_imports_torch_to_read_gpus(no_smi, monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert gpu_reader() is None
    Sampler().sample()
    assert "torch" not in sys.modules


def test_a_gpu_reader_that_fails_costs_the_gpu_figures_once_not_the_sample(no_smi, monkeypatch):
    calls = []

    def broken(index: int) -> int:
        calls.append(index)
        raise RuntimeError("NVML: driver/library version mismatch")

    cuda = StandInCuda([(5.0, 1, 2)])
    cuda.device_memory_used = broken  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))
    sampler = Sampler()
    first, second = sampler.sample(), sampler.sample()
    assert first["gpus"] == second["gpus"] == [] and first["ram"][1] > 0
    assert calls == [0]  # not asked again


def test_a_sample_is_what_the_coordinator_accepts():
    sampler = Sampler()
    sampler._cpu.percent()
    sample = sampler.sample()
    assert parse_stats({"stats": sample}) is not None
    used, total = memory()
    assert 0 < used <= total
    CpuMeter().percent()  # primes without raising


def test_the_agent_sends_its_latest_sample_and_drains_when_the_mesh_asks(tmp_path):
    from test_worker_agent import recording_agent

    for agent in recording_agent(tmp_path):
        assert "stats" not in agent.heartbeat_header()  # nothing sampled yet
        agent.sampler._latest = {"cpu": 5.0, "ram": [1, 2], "gpus": []}
        assert agent.heartbeat_header()["stats"]["cpu"] == 5.0
        agent.session.welcomed = True
        control = encode(Command.CONTROL, {"action": "drain", "by": "ann@lap"})
        agent.session.on_message(decode(control, Limits()), 1.0)
        assert agent.mode is WorkerMode.DRAINING
        credit = [m.header for m in agent.sent if m.command is Command.CREDIT][-1]
        assert credit["mode"] == "draining"
        ignored = encode(Command.CONTROL, {"action": "drain-now", "by": "ann@lap"})
        agent.session.on_message(decode(ignored, Limits()), 1.0)  # not a mesh action: ignored
        assert sum(m.command is Command.CREDIT for m in agent.sent) == 1
