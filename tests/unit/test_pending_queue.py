"""The pending queue: one heap per placement class, walked class by class so that a class no
worker can take now costs one look per dispatch pass, however many tasks it holds."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpumesh.config import Limits, Timing
from gpumesh.coordinator.broker import Broker
from gpumesh.coordinator.pending import PendingQueue
from gpumesh.coordinator.state import TaskState
from gpumesh.protocol import Command, decode, encode
from gpumesh.scheduler import (
    DEFAULT_COST,
    Gpu,
    Requirements,
    TaskView,
    WorkerView,
    choose,
    placement_class,
)
from gpumesh.store import Store


def drain(queue: PendingQueue, blocked: set) -> list[str]:
    """Take entries in order, passing over the classes in ``blocked``."""
    walk, taken = queue.walk(), []
    while (entry := walk.peek()) is not None:
        placement = next(k for k, heap in queue.classes.items() if heap and heap[0] is entry)
        if placement in blocked:
            walk.pass_over()
        else:
            walk.take()
            taken.append(entry[2])
    return taken


def test_a_walk_takes_entries_in_priority_then_arrival_order_across_classes():
    queue = PendingQueue()
    queue.push("cpu", (0, 1, "a"))
    queue.push("gpu", (0, 2, "b"))
    queue.push("cpu", (-5, 3, "urgent"))
    queue.push("gpu", (0, 4, "c"))
    assert len(queue) == 4
    assert drain(queue, set()) == ["urgent", "a", "b", "c"]
    assert not queue and queue.classes == {}  # empty classes do not linger


def test_a_passed_over_class_keeps_its_entries_for_the_next_pass():
    queue = PendingQueue()
    for order in range(5):
        queue.push("gpu", (0, order, f"g{order}"))
    queue.push("cpu", (0, 9, "c"))
    assert drain(queue, {"gpu"}) == ["c"]
    assert len(queue) == 5 and sorted(e[2] for e in queue) == [f"g{i}" for i in range(5)]
    assert drain(queue, set()) == [f"g{i}" for i in range(5)]


# ----------------------------------------------------------------- the scheduler's side of it

GPUS = st.sampled_from([(), (Gpu("NVIDIA A100", 80 * 10**9),), (Gpu("Tesla T4", 16 * 10**9),)])
WORKERS = st.lists(st.builds(
    WorkerView, worker_id=st.sampled_from(["w1", "w2", "w3"]), free=st.integers(0, 2),
    cores=st.integers(1, 16), memory=st.sampled_from([0, 8 * 10**9, 64 * 10**9]), gpus=GPUS,
    python=st.sampled_from(["3.11", "3.12"]), straggler=st.booleans()), max_size=4)
REQUIREMENTS = st.builds(
    Requirements, gpu=st.sampled_from([None, True, "A100"]), cores=st.sampled_from([None, 8]),
    memory=st.sampled_from([None, 16 * 10**9]), python=st.sampled_from([None, "3.11"]))
COSTS = st.floats(0.01, 100.0)


@given(REQUIREMENTS, st.booleans(), COSTS, COSTS, st.frozensets(st.sampled_from(["w1", "w2"])),
       WORKERS)
def test_tasks_of_one_placement_class_are_placeable_on_the_same_workers(
        requirements, portable, cost, other_cost, excluded, workers):
    if placement_class(requirements, portable, cost) != \
            placement_class(requirements, portable, other_cost):
        return  # another class: nothing is promised
    one = TaskView("t1", requirements, cost=cost, portable=portable)
    other = TaskView("t2", requirements, cost=other_cost, excluded=excluded, portable=portable)
    assert (choose(one, workers) is None) == (choose(other, workers) is None)


def test_the_cost_bracket_is_part_of_the_class():
    plain = placement_class(Requirements(), False, DEFAULT_COST)
    assert plain == placement_class(Requirements(), False, 0.5)
    assert plain != placement_class(Requirements(), False, 2.0)  # stragglers may not take it


# ----------------------------------------------------------------- in the broker

def msg(command, header, payload=None):
    return decode(encode(command, header, payload or []), Limits())


def test_tasks_that_can_run_are_not_stuck_behind_thousands_that_cannot():
    # Before: a pass gave up after putting back 1,000 unplaceable tasks, so the CPU tasks
    # queued behind 3,000 tasks for a busy GPU waited for every one of them.
    broker = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0)
    broker.handle(b"gpu", msg(Command.HELLO, {
        "role": "worker", "id": "gpu-worker", "slots": 1, "credit": 1, "proto": [1, 1],
        "info": {"python": "3.11", "gpus": [{"name": "A100", "vram": 40 * 10**9}]}}), 0.0)
    broker.handle(b"client", msg(Command.HELLO, {"role": "client", "id": "c", "proto": [1, 1]}), 0.0)
    for start in range(1, 3001, 500):
        specs = [{"seq": seq, "nf": 1, "kind": "script", "req": {"gpu": True}}
                 for seq in range(start, start + 500)]
        broker.handle(b"client", msg(Command.SUBMIT, {"tasks": specs}, [b"p"] * 500), 0.0)
    assert broker.dispatch(0.0) == 1  # the GPU worker is busy from now on
    broker.handle(b"cpu", msg(Command.HELLO, {
        "role": "worker", "id": "cpu-worker", "slots": 4, "credit": 4, "proto": [1, 1],
        "info": {"python": "3.11"}}), 0.1)
    cpu = [{"seq": 5000 + i, "nf": 1, "kind": "script"} for i in range(4)]
    broker.handle(b"client", msg(Command.SUBMIT, {"tasks": cpu}, [b"p"] * 4), 0.1)
    assert broker.dispatch(0.2) == 4
    leased = [t for t in broker.tasks.values() if t.state is TaskState.LEASED]
    assert sorted(t.worker_id for t in leased) == ["cpu-worker"] * 4 + ["gpu-worker"]
    assert len(broker.ledger.pending) == 2999  # the GPU tasks still queued, in their order


def test_an_entry_pushed_ahead_during_a_pass_does_not_cost_the_one_taken_its_place():
    queue = PendingQueue()
    queue.push("cpu", (0, 5, "first"))
    walk = queue.walk()
    assert walk.peek() == (0, 5, "first")
    queue.push("cpu", (-1, 6, "urgent"))  # a retry queued while the pass runs
    walk.take()
    assert sorted(queue) == [(-1, 6, "urgent")] and len(queue) == 1


def test_a_pass_looks_at_a_bounded_number_of_unplaceable_classes(monkeypatch):
    # Each distinct memory size is a class of its own: 1,500 classes no worker can take.
    from gpumesh.coordinator import broker as broker_module

    broker = Broker(Store(":memory:"), Timing(), Limits(), epoch=1, now=0.0)
    broker.handle(b"w", msg(Command.HELLO, {
        "role": "worker", "id": "small", "slots": 1, "credit": 1, "proto": [1, 1],
        "info": {"python": "3.11", "memory": 10**9}}), 0.0)
    broker.handle(b"client", msg(Command.HELLO, {"role": "client", "id": "c", "proto": [1, 1]}), 0.0)
    specs = [{"seq": i + 1, "nf": 1, "kind": "script", "req": {"memory": 2 * 10**9 + i}}
             for i in range(1500)]
    for start in range(0, 1500, 500):
        part = specs[start:start + 500]
        broker.handle(b"client", msg(Command.SUBMIT, {"tasks": part}, [b"p"] * 500), 0.0)
    looks = []
    real_choose = broker_module.scheduler.Placer.choose
    monkeypatch.setattr(broker_module.scheduler.Placer, "choose",
                        lambda placer, task, **options: looks.append(task)
                        or real_choose(placer, task, **options))
    assert broker.dispatch(0.1) == 0
    assert len(looks) == broker_module.MAX_PASSED_OVER < 1500


def test_an_entry_pushed_ahead_during_a_pass_of_several_classes_is_kept_too():
    queue = PendingQueue()
    queue.push("cpu", (0, 5, "first"))
    queue.push("gpu", (0, 7, "gpu"))
    walk = queue.walk()
    assert walk.peek() == (0, 5, "first")
    queue.push("cpu", (-1, 6, "urgent"))
    walk.take()
    assert sorted(queue) == [(-1, 6, "urgent"), (0, 7, "gpu")] and len(queue) == 2
