"""Unit tests for gpumesh.scheduler: placement rules (pure values in, choices out)."""

from __future__ import annotations

import pytest

from gpumesh.scheduler import (
    DEFAULT_COST,
    Gpu,
    Requirements,
    TaskView,
    WorkerView,
    choose,
    could_ever_run,
    eligible,
    explain_unschedulable,
    parse_size,
    stragglers,
    unmet,
)

GB = 10**9
GiB = 1024**3


def worker(wid: str, **kw) -> WorkerView:
    kw.setdefault("free", 1)
    return WorkerView(worker_id=wid, **kw)


def task(cost: float = DEFAULT_COST, excluded=(), **req) -> TaskView:
    return TaskView("t1", Requirements(**req), cost=cost, excluded=frozenset(excluded))


A100 = Gpu("NVIDIA A100-SXM4-80GB", vram=80 * GB)
RTX = Gpu("NVIDIA GeForce RTX 3090", vram=24 * GB)
T4 = Gpu("Tesla T4", vram=16 * GB)

# --------------------------------------------------------------------------- parse_size


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("16GB", 16 * 10**9),
        ("16gb", 16 * 10**9),
        ("512MiB", 512 * 1024**2),
        ("512mib", 512 * 1024**2),
        ("2g", 2 * 10**9),
        ("2G", 2 * 10**9),
        ("1.5GB", 1_500_000_000),
        ("1KiB", 1024),
        ("1k", 1000),
        ("3TiB", 3 * 1024**4),
        ("1T", 10**12),
        ("100", 100),
        ("100B", 100),
        (" 8 GB ", 8 * 10**9),
        ("4Gi", 4 * 1024**3),
        (1024, 1024),
        (0, 0),
        (2.5e9, 2_500_000_000),
    ],
)
def test_parse_size(value, expected: int) -> None:
    result = parse_size(value)
    assert result == expected
    assert isinstance(result, int)


@pytest.mark.parametrize(
    "value",
    ["", "lots", "GB", "16 GBs", "16XB", "-5GB", "1.2.3", "16 G B", True, False, None, [16]],
)
def test_parse_size_rejects(value) -> None:
    with pytest.raises(ValueError):
        parse_size(value)


# --------------------------------------------------------------------------- Requirements


def test_requirements_from_mapping_reads_all_keys() -> None:
    req = Requirements.from_mapping(
        {"gpu": "A100", "cores": 8, "memory": "32GB", "vram": "40GiB", "python": "3.11", "other": 1}
    )
    assert req == Requirements(gpu="A100", cores=8, memory=32 * GB, vram=40 * GiB, python="3.11")
    assert req.to_mapping() == {
        "gpu": "A100",
        "cores": 8,
        "memory": 32 * GB,
        "vram": 40 * GiB,
        "python": "3.11",
    }
    assert Requirements.from_mapping(req.to_mapping()) == req


def test_requirements_from_empty_mapping() -> None:
    req = Requirements.from_mapping({})
    assert req == Requirements()
    assert req.to_mapping() == {}
    assert req.describe() == "nothing"


@pytest.mark.parametrize("gpu", [False, ""])
def test_requirements_false_or_empty_gpu_means_none(gpu) -> None:
    assert Requirements.from_mapping({"gpu": gpu}).gpu is None


def test_requirements_gpu_true_is_kept() -> None:
    assert Requirements.from_mapping({"gpu": True}).gpu is True


def test_requirements_numeric_sizes() -> None:
    req = Requirements.from_mapping({"memory": 1024, "vram": 2048})
    assert (req.memory, req.vram) == (1024, 2048)


@pytest.mark.parametrize(
    "data",
    [
        {"gpu": 1},
        {"gpu": ["A100"]},
        {"cores": 0},
        {"cores": -2},
        {"cores": 2.0},
        {"cores": "4"},
        {"cores": True},
        {"memory": "lots"},
        {"vram": "big"},
        {"memory": True},
    ],
)
def test_requirements_from_mapping_rejects(data) -> None:
    with pytest.raises(ValueError):
        Requirements.from_mapping(data)


def test_requirements_describe() -> None:
    assert Requirements(gpu=True).describe() == "a GPU"
    text = Requirements(gpu="A100", cores=4, memory=16 * GB, vram=40 * GB, python="3.11").describe()
    assert text == "gpu='A100', cores>=4, memory>=16.0GB, vram>=40.0GB, Python 3.11"


# --------------------------------------------------------------------------- unmet


def test_unmet_gpu_substring_match_is_case_insensitive() -> None:
    w = worker("w", gpus=(A100,))
    assert unmet(w, Requirements(gpu="A100")) == []
    assert unmet(w, Requirements(gpu="a100")) == []
    assert unmet(w, Requirements(gpu="nvidia")) == []
    assert unmet(w, Requirements(gpu="H100")) == ["has no H100 GPU"]
    assert unmet(worker("cpu"), Requirements(gpu="A100")) == ["has no A100 GPU"]


def test_unmet_gpu_true_needs_any_gpu() -> None:
    assert unmet(worker("w", gpus=(T4,)), Requirements(gpu=True)) == []
    assert unmet(worker("cpu"), Requirements(gpu=True)) == ["has no GPU"]


def test_unmet_gpu_matches_any_of_several_gpus() -> None:
    w = worker("w", gpus=(T4, RTX))
    assert unmet(w, Requirements(gpu="3090")) == []
    assert unmet(w, Requirements(gpu="A100")) == ["has no A100 GPU"]


def test_unmet_cores() -> None:
    w = worker("w", cores=8)
    assert unmet(w, Requirements(cores=8)) == []
    assert unmet(w, Requirements(cores=4)) == []
    assert unmet(w, Requirements(cores=16)) == ["has 8 cores"]


def test_unmet_memory() -> None:
    w = worker("w", memory=16 * GB)
    assert unmet(w, Requirements(memory=16 * GB)) == []
    assert unmet(w, Requirements(memory=32 * GB)) == ["has 16.0GB RAM"]


def test_unmet_vram_is_per_gpu() -> None:
    w = worker("w", gpus=(T4, RTX))  # 16 + 24 GB, but no single GPU with 32
    assert unmet(w, Requirements(vram=24 * GB)) == []
    assert unmet(w, Requirements(vram=32 * GB)) == ["has too little VRAM"]
    assert unmet(worker("cpu"), Requirements(vram=1)) == ["has no GPU"]


def test_a_gpu_model_and_its_vram_are_met_by_one_gpu() -> None:
    # A task runs on one GPU (its slot's): a T4 beside a 3090 is no 24 GB T4.
    w = worker("w", gpus=(T4, RTX))
    assert unmet(w, Requirements(gpu="T4", vram=24 * GB)) == ["has no T4 GPU with that much VRAM"]
    assert unmet(w, Requirements(gpu="3090", vram=24 * GB)) == []
    assert unmet(w, Requirements(gpu="T4", vram=16 * GB)) == []


def test_unmet_python() -> None:
    w = worker("w", python="3.11")
    assert unmet(w, Requirements(python="3.11")) == []
    assert unmet(w, Requirements(python="3.12")) == ["runs Python 3.11"]
    assert unmet(worker("unknown"), Requirements(python="3.12")) == ["runs Python ?"]


def test_unmet_lists_every_miss() -> None:
    w = worker("w", cores=2, memory=4 * GB, python="3.10")
    missing = unmet(w, Requirements(gpu="A100", cores=4, memory=8 * GB, vram=1, python="3.11"))
    assert missing == [
        "has no A100 GPU",  # no GPU at all: its VRAM goes without saying
        "has 2 cores",
        "has 4.0GB RAM",
        "runs Python 3.10",
    ]


def test_no_requirements_are_met_by_anyone() -> None:
    assert unmet(worker("bare"), Requirements()) == []


# --------------------------------------------------------------------------- choose


def test_choose_filters_by_gpu_model() -> None:
    workers = [worker("cpu"), worker("t4", gpus=(T4,)), worker("a100", gpus=(A100,))]
    assert choose(task(gpu="A100"), workers).worker_id == "a100"
    assert choose(task(gpu="T4"), workers).worker_id == "t4"
    assert choose(task(gpu="H100"), workers) is None


def test_choose_gpu_true_skips_cpu_only_workers() -> None:
    workers = [worker("cpu", last_assigned=0), worker("gpu", gpus=(T4,), last_assigned=5)]
    assert choose(task(gpu=True), workers).worker_id == "gpu"
    assert choose(task(), workers).worker_id == "cpu"


def test_choose_filters_by_cores_memory_vram_python() -> None:
    small = worker("small", cores=2, memory=8 * GB, gpus=(T4,), python="3.10")
    big = worker("big", cores=32, memory=256 * GB, gpus=(A100,), python="3.11", last_assigned=9)
    workers = [small, big]
    assert choose(task(cores=4), workers) is big
    assert choose(task(memory=64 * GB), workers) is big
    assert choose(task(vram=40 * GB), workers) is big
    assert choose(task(python="3.11"), workers) is big
    assert choose(task(python="3.10"), workers) is small
    assert choose(task(cores=64), workers) is None


def test_choose_prefers_least_load_ratio() -> None:
    workers = [
        worker("busy", load=3, capacity=4, free=1),
        worker("idle", load=0, capacity=4, free=4, last_assigned=100),
        worker("half", load=2, capacity=4, free=2),
    ]
    assert choose(task(), workers).worker_id == "idle"


def test_choose_load_is_relative_to_capacity() -> None:
    workers = [
        worker("small", load=1, capacity=2, free=1),  # 50 %
        worker("large", load=2, capacity=8, free=6, last_assigned=10),  # 25 %
    ]
    assert choose(task(), workers).worker_id == "large"


def test_choose_breaks_ties_by_least_recently_used() -> None:
    workers = [
        worker("recent", load=1, capacity=2, last_assigned=30),
        worker("oldest", load=1, capacity=2, last_assigned=10),
        worker("middle", load=1, capacity=2, last_assigned=20),
    ]
    assert choose(task(), workers).worker_id == "oldest"
    assert choose(task(), list(reversed(workers))).worker_id == "oldest"


def test_choose_light_task_ignores_score() -> None:
    workers = [
        worker("strong", score=100.0, load=1, capacity=2),
        worker("weak", score=1.0, load=0, capacity=2),
    ]
    assert choose(task(), workers).worker_id == "weak"
    assert choose(task(cost=DEFAULT_COST), workers).worker_id == "weak"


def test_choose_heavy_task_goes_to_highest_score() -> None:
    workers = [
        worker("weak", score=1.0, load=0, capacity=2),
        worker("strong", score=100.0, load=1, capacity=2, last_assigned=50),
        worker("medium", score=10.0, load=0, capacity=2),
    ]
    assert choose(task(cost=2.0), workers).worker_id == "strong"
    assert choose(task(cost=1.01), workers).worker_id == "strong"


def test_choose_heavy_task_score_tie_uses_load_then_lru() -> None:
    workers = [
        worker("a", score=5.0, load=1, capacity=2, last_assigned=1),
        worker("b", score=5.0, load=0, capacity=2, last_assigned=9),
        worker("c", score=5.0, load=0, capacity=2, last_assigned=3),
    ]
    assert choose(task(cost=3.0), workers).worker_id == "c"


def test_choose_avoids_excluded_worker_when_another_is_eligible() -> None:
    workers = [
        worker("failed-before", load=0, capacity=4, last_assigned=0, score=100.0),
        worker("other", load=3, capacity=4, last_assigned=99, score=1.0),
    ]
    assert choose(task(excluded={"failed-before"}), workers).worker_id == "other"
    assert choose(task(cost=5.0, excluded={"failed-before"}), workers).worker_id == "other"
    # Without the exclusion the better one wins.
    assert choose(task(), workers).worker_id == "failed-before"


def test_choose_uses_excluded_worker_when_it_is_the_only_one() -> None:
    only = worker("failed-before")
    assert choose(task(excluded={"failed-before"}), [only]) is only


def test_choose_excluded_only_eligible_worker_is_used() -> None:
    workers = [worker("failed-before", gpus=(A100,)), worker("cpu")]
    chosen = choose(task(gpu="A100", excluded={"failed-before"}), workers)
    assert chosen.worker_id == "failed-before"


@pytest.mark.parametrize("free", [0, -1])
def test_choose_never_picks_worker_without_free_slot(free: int) -> None:
    full = worker("full", free=free, load=0, capacity=4, score=100.0)
    assert choose(task(), [full]) is None
    assert choose(task(cost=5.0), [full]) is None
    other = worker("other", free=1, load=3, capacity=4, last_assigned=99)
    assert choose(task(), [full, other]) is other


def test_choose_with_no_workers() -> None:
    assert choose(task(), []) is None
    assert choose(task(), iter([])) is None


def test_choose_accepts_an_iterator() -> None:
    ws = [worker("a", last_assigned=2), worker("b", last_assigned=1)]
    assert choose(task(), iter(ws)).worker_id == "b"


def test_stragglers_never_get_heavy_tasks() -> None:
    slow = worker("slow", score=100.0, straggler=True)
    fast = worker("fast", score=1.0, load=1, capacity=2)
    assert choose(task(cost=2.0), [slow, fast]) is fast
    assert choose(task(cost=2.0), [slow]) is None
    assert not eligible(slow, task(cost=2.0))
    # Default-cost (and cheaper) work is still fine for them.
    assert eligible(slow, task())
    assert choose(task(), [slow]) is slow
    assert choose(task(cost=0.5), [slow]) is slow


# --------------------------------------------------------------------------- could_ever_run


def test_could_ever_run_ignores_free_slots() -> None:
    busy_a100 = worker("a100", gpus=(A100,), free=0, load=8, capacity=8)
    cpu = worker("cpu")
    assert choose(task(gpu="A100"), [busy_a100, cpu]) is None
    assert could_ever_run(task(gpu="A100"), [busy_a100, cpu]) is True
    assert could_ever_run(task(gpu="H100"), [busy_a100, cpu]) is False
    assert could_ever_run(task(), []) is False
    assert could_ever_run(task(), [cpu]) is True


# --------------------------------------------------------------------------- explain_unschedulable


def test_explain_unschedulable_names_requirement_and_closest_workers() -> None:
    workers = [
        worker("w1", label="alice-laptop", gpus=(T4,)),
        worker("w2", label="bob-desktop", gpus=(RTX,), score=9.0),
        worker("w3", label="", gpus=()),
    ]
    text = explain_unschedulable(Requirements(gpu="A100"), workers)
    assert "A100" in text
    assert "alice-laptop" in text
    assert "bob-desktop" in text
    assert "w3" in text  # no label: the worker id stands in
    assert "has no A100 GPU" in text
    # Equal misses: higher score first.
    assert text.index("bob-desktop") < text.index("alice-laptop")


def test_explain_unschedulable_ranks_by_fewest_misses_and_keeps_three() -> None:
    req = Requirements(gpu="A100", cores=16, memory=64 * GB)
    workers = [
        worker("far", label="far-away", cores=1, memory=1 * GB),  # 3 misses
        worker("near", label="nearly-there", gpus=(A100,), cores=16, memory=8 * GB),  # 1 miss
        worker("mid", label="middling", gpus=(A100,), cores=2, memory=8 * GB),  # 2 misses
        worker("mid2", label="middling-two", cores=16, memory=8 * GB),  # 2 misses
    ]
    text = explain_unschedulable(req, workers)
    assert "far-away" not in text
    assert text.index("nearly-there") < text.index("middling")
    assert "nearly-there [near] has 8.0GB RAM" in text  # the id tells same-named hosts apart


def test_explain_unschedulable_without_workers() -> None:
    text = explain_unschedulable(Requirements(gpu=True, cores=4), [])
    assert "no worker is connected" in text
    assert "a GPU" in text
    assert "cores>=4" in text


# --------------------------------------------------------------------------- stragglers


def test_stragglers_over_twice_the_median() -> None:
    assert stragglers({"a": 1.0, "b": 1.1, "c": 5.0}) == {"c"}
    assert stragglers({"a": 1.0, "b": 1.0, "c": 1.0, "d": 2.5, "e": 9.0}) == {"d", "e"}


def test_stragglers_exactly_twice_is_not_a_straggler() -> None:
    assert stragglers({"a": 1.0, "b": 1.0, "c": 2.0}) == set()


def test_stragglers_need_three_workers() -> None:
    assert stragglers({}) == set()
    assert stragglers({"a": 1.0}) == set()
    assert stragglers({"a": 1.0, "b": 100.0}) == set()


def test_stragglers_with_zero_median() -> None:
    assert stragglers({"a": 0.0, "b": 0.0, "c": 0.0, "d": 5.0}) == set()


def test_stragglers_none_when_all_similar() -> None:
    assert stragglers({str(i): 1.0 + i / 10 for i in range(8)}) == set()


def test_the_placer_chooses_as_choose_does_over_a_whole_pass():
    """The dispatcher's Placer (a heap per placement class) against choose() (a scan of every
    worker per task), over random workers and tasks, each placement recorded as dispatch does."""
    import copy
    import random

    from gpumesh.scheduler import Placer

    rng = random.Random(7)
    kinds = [Requirements(), Requirements(gpu=True), Requirements(cores=8),
             Requirements(python="3.11"), Requirements(gpu="A100", vram=40 * 10**9)]
    for _round in range(30):
        workers = []
        for i in range(rng.randint(1, 40)):
            gpus = (Gpu("NVIDIA A100", 80 * 10**9),) if rng.random() < 0.3 else (
                (Gpu("RTX 3090", 24 * 10**9),) if rng.random() < 0.3 else ())
            workers.append(WorkerView(
                f"w{i}", free=rng.randint(0, 4), load=rng.randint(0, 4), capacity=rng.randint(1, 4),
                score=rng.choice([1.0, 2.0, 5.0]), cores=rng.choice([2, 8, 16]), gpus=gpus,
                python=rng.choice(["3.11", "3.12"]), last_assigned=rng.randrange(10**6) * 40 + i,
                straggler=rng.random() < 0.2))
        scanned, placer = copy.deepcopy(workers), Placer(workers)
        clock = 10**8
        for _task in range(rng.randint(1, 150)):
            task = TaskView("t", rng.choice(kinds), cost=rng.choice([1.0, 1.0, 4.0]),
                            excluded=frozenset({"w0"}) if rng.random() < 0.1 else frozenset(),
                            portable=rng.random() < 0.3)
            stragglers_too = rng.random() < 0.2
            expected = choose(task, scanned, stragglers_too=stragglers_too)
            got = placer.choose(task, stragglers_too=stragglers_too)
            assert (got and got.worker_id) == (expected and expected.worker_id)
            clock += 1
            for chosen in (expected, got):
                if chosen is not None:
                    chosen.free -= 1
                    chosen.load += 1
                    chosen.last_assigned = clock


def test_a_vram_requirement_on_a_cpu_worker_says_it_has_no_gpu() -> None:
    # "has too little VRAM" for a worker with no GPU at all sent users looking for a smaller
    # model instead of a GPU worker.
    from gpumesh.scheduler import unmet

    cpu = worker("cpu", gpus=())
    assert unmet(cpu, Requirements(vram=24 * GB)) == ["has no GPU"]
    assert unmet(cpu, Requirements(gpu=True, vram=24 * GB)) == ["has no GPU"]
    assert unmet(cpu, Requirements(gpu="A100", vram=24 * GB)) == ["has no A100 GPU"]
    assert unmet(worker("gpu", gpus=(T4,)), Requirements(vram=80 * GB)) == ["has too little VRAM"]
    elsewhere = unmet(cpu, Requirements(vram=24 * GB), local_only=True)  # another miss first
    assert elsewhere[-1] == "has no GPU" and len(elsewhere) == 2
