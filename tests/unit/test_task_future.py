"""A TaskFuture tells its engine when it is cancelled: once, and only if the cancel took."""

from __future__ import annotations

import asyncio

import pytest

from gpumesh.client.engine import TaskFuture


def test_a_cancel_that_takes_is_passed_on_once_and_marked_for_the_engine_thread():
    told = []
    future = TaskFuture(told.append)
    assert not future.cancel_requested
    assert future.cancel() and future.cancelled()
    assert future.cancel_requested and told == [future]
    assert future.cancel()  # cancelling again changes nothing and tells nobody again
    assert told == [future]


def test_a_finished_task_cannot_be_cancelled_and_the_engine_hears_nothing():
    told = []
    future = TaskFuture(told.append)
    future.set_result(42)
    assert not future.cancel()
    assert not future.cancel_requested and told == []


def test_cancelling_the_awaiting_coroutine_cancels_the_task_on_the_mesh():
    told = []
    future = TaskFuture(told.append)

    async def main():
        waiting = asyncio.ensure_future(_wait(future))
        await asyncio.sleep(0)  # it awaits the task's future now
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)

    asyncio.run(main())
    assert told == [future] and future.cancelled()


async def _wait(future):
    return await future


def test_a_result_that_arrives_as_its_caller_cancels_is_dropped_quietly():
    from gpumesh.client.engine import _settle

    future = TaskFuture()
    assert future.cancel()
    _settle(future.set_result, 42)  # the engine thread lost the race: no InvalidStateError
    _settle(future.set_exception, RuntimeError("late"))
    assert future.cancelled()


def test_it_sets_everything_a_future_sets_with_the_same_starting_values():
    # TaskFuture leaves out Future.__init__ (its Condition): a Python whose Future starts
    # with another attribute must fail here, not in a user's thread.
    import concurrent.futures

    plain, ours = vars(concurrent.futures.Future()), vars(TaskFuture())
    assert plain.keys() <= ours.keys()
    assert {k: v for k, v in plain.items() if k != "_condition"} == \
        {k: ours[k] for k in plain if k != "_condition"}


def _in_thread(call):
    """Run ``call`` in a thread; (started event, finished event, [outcome])."""
    import threading

    started, finished, outcome = threading.Event(), threading.Event(), []

    def run():
        started.set()
        try:
            outcome.append(("value", call()))
        except BaseException as exc:  # noqa: BLE001 - the test looks at what it was
            outcome.append(("raised", exc))
        finished.set()

    threading.Thread(target=run, daemon=True).start()
    assert started.wait(5)
    return finished, outcome


def test_a_thread_waiting_for_a_result_wakes_for_its_own_task_only():
    mine, others = TaskFuture(), [TaskFuture() for _ in range(50)]
    finished, outcome = _in_thread(lambda: mine.result(timeout=10))
    for other in others:
        other.set_result(None)
    assert not finished.wait(0.2)  # still waiting: the others are not its task
    mine.set_result(7)
    assert finished.wait(5) and outcome == [("value", 7)]


def test_each_future_has_a_lock_of_its_own_so_mixed_waits_cannot_deadlock():
    # concurrent.futures.wait takes its futures' locks in order of id(): two threads waiting
    # on a plain Future and TaskFutures on either side of it deadlocked while all TaskFutures
    # shared one lock (each thread held one lock the other wanted).
    import concurrent.futures
    import threading

    # A plain Future with TaskFutures on both sides of it in id() order. Where each lands is
    # the allocator's choice (the two types may come from different memory pools), so the
    # two kinds are made interleaved until one plain Future sits between two of ours.
    kept: list[object] = []
    for _ in range(20):
        ours = [TaskFuture() for _ in range(250)]
        plains = [concurrent.futures.Future() for _ in range(250)]
        kept += [ours, plains]
        lowest, highest = min(map(id, ours)), max(map(id, ours))
        between = [f for f in plains if lowest < id(f) < highest]
        if between:
            break
    else:
        pytest.skip("the allocator never put a plain Future between two TaskFutures")
    plain = between[0]
    assert len({id(f._condition) for f in ours}) == len(ours)
    low = next(f for f in ours if id(f) < id(plain))
    high = next(f for f in ours if id(f) > id(plain))
    stop = threading.Event()

    def waiting(futures):
        while not stop.is_set():
            concurrent.futures.wait(futures, timeout=0)

    threads = [threading.Thread(target=waiting, args=(fs,), daemon=True)
               for fs in ([plain, high], [low, plain])]
    for thread in threads:
        thread.start()
    stop.wait(0.5)
    stop.set()
    for thread in threads:
        thread.join(5)
    assert not any(thread.is_alive() for thread in threads), "the two waits deadlocked"


def test_a_callback_that_cancels_its_future_again_is_harmless():
    # A done-callback that cancels every future of a batch (its own included) runs inside the
    # first cancel: the second must answer True, not find the state half changed.
    told = []
    futures = [TaskFuture(told.append), TaskFuture(told.append)]
    futures[0].add_done_callback(lambda _: [f.cancel() for f in futures])
    assert futures[0].cancel()
    assert all(f.cancelled() for f in futures) and sorted(map(id, told)) == sorted(map(id, futures))


def test_an_executor_s_notify_step_on_a_cancelled_future_answers_as_for_any_future():
    import concurrent.futures

    ours, plain = TaskFuture(), concurrent.futures.Future()
    for future in (ours, plain):
        assert future.cancel()
        assert future.set_running_or_notify_cancel() is False


def test_two_threads_cancelling_one_future_tell_the_engine_once():
    import threading

    for _ in range(200):
        told = []
        future = TaskFuture(told.append)
        threads = [threading.Thread(target=future.cancel) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(5)
        assert future.cancelled() and told == [future]


def test_a_waiter_hears_of_a_failure_a_cancel_and_a_timeout():
    import concurrent.futures

    failing = TaskFuture()
    finished, outcome = _in_thread(lambda: failing.result(timeout=10))
    failing.set_exception(ValueError("task 3 is unhappy"))
    assert finished.wait(5) and isinstance(outcome[0][1], ValueError)

    cancelled = TaskFuture()
    finished, outcome = _in_thread(lambda: cancelled.exception(timeout=10))
    assert cancelled.cancel()
    assert finished.wait(5) and isinstance(outcome[0][1], concurrent.futures.CancelledError)

    silent = TaskFuture()
    try:
        silent.result(timeout=0.05)
    except concurrent.futures.TimeoutError:
        pass
    else:
        raise AssertionError("a result that never came must time out")
    assert not silent.done()


def test_wait_and_as_completed_of_the_standard_library_work_with_them():
    import concurrent.futures

    futures = [TaskFuture() for _ in range(3)]
    finished, outcome = _in_thread(
        lambda: [f.result() for f in concurrent.futures.as_completed(futures, timeout=10)])
    for value, future in enumerate(futures):
        future.set_result(value)
    assert finished.wait(5) and sorted(outcome[0][1]) == [0, 1, 2]
    done, pending = concurrent.futures.wait(futures, timeout=1)
    assert done == set(futures) and not pending


def test_the_standard_librarys_waits_in_a_done_callback_are_refused_not_hung():
    # A done-callback runs on the engine's I/O thread: waiting there for another mesh result
    # waits for the thread that would deliver it.
    import concurrent.futures
    import threading

    from gpumesh.client import engine

    pending, done = TaskFuture(), TaskFuture()
    done.set_result(1)

    def in_a_callback():
        engine._IO_THREADS.add(threading.current_thread())
        outcomes = []
        for wait in (lambda: concurrent.futures.wait([pending, done], timeout=30),
                     lambda: list(concurrent.futures.as_completed([pending], timeout=30))):
            try:
                wait()
            except RuntimeError as exc:
                outcomes.append(str(exc))
        # What would not block is still answered there, as_completed's waiter on finished
        # futures included.
        outcomes.append(concurrent.futures.wait([done], timeout=30).done == {done}
                        and list(concurrent.futures.as_completed([done])) == [done])
        return outcomes

    finished, outcome = _in_thread(in_a_callback)
    assert finished.wait(10), "a wait in a done-callback hung"
    first, second, answered = outcome[0][1]
    assert "from a done-callback would wait forever" in first
    assert "concurrent.futures.wait or as_completed" in second and answered is True
    pending.set_result(2)  # and an ordinary thread's wait is as before
    assert concurrent.futures.wait([pending], timeout=1).done == {pending}


def test_a_queued_task_holds_few_objects_for_the_garbage_collector(tmp_path):
    # Every object a queued task keeps is scanned again by each full collection while a .map
    # runs, in the user's process: 18 of them a task made those collections cost 40-120 ms per
    # 5,000 tasks in a process holding numpy, Ray and Dask. A handful now: a plain lock per
    # future instead of a Condition, no bound method per future, one spec for the batch.
    import gc
    import socket

    from gpumesh.client.engine import Engine
    from gpumesh.client.tasks import PickledFunction, TaskOptions
    from gpumesh.config import Endpoint, Settings

    with socket.socket() as probe:  # a loopback port nobody listens on: it never connects
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = Settings.from_env({"GPUMESH_HOME": str(tmp_path)})
    engine = Engine(settings, Endpoint("127.0.0.1", port), "a-token-for-nobody")
    try:
        pickled = PickledFunction.of(abs)
        spec = pickled.spec(TaskOptions())
        items = [pickled.task((i,), {}, spec) for i in range(2000)]
        gc.collect()
        before = len(gc.get_objects())
        futures = engine.submit(items)
        del items
        for _ in range(500):  # the engine thread files them as submissions
            if len(engine._outstanding) == 2000:
                break
            engine._closing.wait(0.01)
        assert len(engine._outstanding) == 2000
        gc.collect()
        per_task = (len(gc.get_objects()) - before) / len(futures)
        assert per_task <= 8, f"{per_task:.1f} objects tracked per queued task"
    finally:
        engine.close()


def test_a_submit_racing_close_fails_its_futures_instead_of_leaving_them_pending(tmp_path):
    import socket

    from gpumesh.client.engine import Engine, TaskFuture, _Batch
    from gpumesh.config import Endpoint, Settings
    from gpumesh.errors import MeshError

    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    engine = Engine(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}),
                    Endpoint("127.0.0.1", port), "a-token-for-nobody")
    engine.close()
    assert not engine._thread.is_alive()
    # What submit() does once past its _check_usable(), after close() finished.
    future = TaskFuture()
    batch = _Batch("j1")
    batch.items.append(({"kind": "fn"}, [b"x"], future))
    engine._command(batch)
    with pytest.raises(MeshError, match="closed"):
        future.result(timeout=5)


class _StandInSource:
    """A MeshFunction's source whose mesh hands out TaskFutures the test settles itself."""

    def __init__(self, submit):
        from types import SimpleNamespace

        self._mesh = SimpleNamespace(submit_calls=submit, endpoint="tcp://127.0.0.1:1",
                                     connect=lambda: True)
        self._settings = SimpleNamespace(verbose=False, local_only=False)

    def settings(self):
        return self._settings

    def mesh(self):
        return self._mesh

    def has_worker(self, mesh):
        return True


def test_amap_yields_every_result_once_as_it_finishes_and_cancels_the_rest_when_left():
    import threading

    from gpumesh.client.decorators import MeshFunction
    from gpumesh.client.tasks import TaskOptions

    futures: list[TaskFuture] = []

    def submit(fn, calls, options):
        futures.extend(TaskFuture() for _ in calls)
        return list(futures)

    fn = MeshFunction(abs, _StandInSource(submit), TaskOptions())

    async def main():
        seen = []
        stream = fn.amap(range(6))
        settler = None
        async for index, value in stream:
            seen.append((index, value))
            if settler is None:  # the rest finish on another thread, in reverse order
                def settle():
                    for i in (5, 3, 1):
                        futures[i].set_result(-i)
                settler = threading.Thread(target=settle)
                settler.start()
            if len(seen) == 4:
                break
        await stream.aclose()
        return seen

    async def first():
        while not futures:
            await asyncio.sleep(0.001)
        futures[2].set_result(-2)

    async def both():
        results = await asyncio.gather(main(), first())
        return results[0]

    seen = asyncio.run(both())
    assert seen[0] == (2, -2) and sorted(seen[1:]) == [(1, -1), (3, -3), (5, -5)]
    assert [f.cancelled() for f in futures] == [True, False, False, False, True, False]


def test_amap_cancelled_while_its_items_are_sent_cancels_what_was_sent():
    import threading

    from gpumesh.client.decorators import MeshFunction
    from gpumesh.client.tasks import TaskOptions

    release = threading.Event()
    sent: list[TaskFuture] = []

    def submit(fn, calls, options):  # slow to pickle: the caller gives up meanwhile
        release.wait(5)
        sent.extend(TaskFuture() for _ in calls)
        return list(sent)

    fn = MeshFunction(abs, _StandInSource(submit), TaskOptions())

    async def consume():
        async for _ in fn.amap(range(3)):
            pass

    async def main():
        consumer = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        # The loop ran on while the items were sent (pickling off the loop thread).
        assert not sent
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        release.set()
        for _ in range(500):
            if sent and all(f.cancelled() for f in sent):
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert len(sent) == 3 and all(f.cancelled() for f in sent)


def test_waking_the_engine_never_blocks_the_thread_that_wakes_it(tmp_path):
    """Every cancel and submit writes a byte to wake the I/O thread. A done-callback (on that
    very thread) that cancelled or submitted a few hundred tasks filled the pair, and a
    blocking write then stopped the only thread that empties it: the client hung for good."""
    import socket

    from gpumesh.client.engine import Engine
    from gpumesh.config import Endpoint, Settings

    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    engine = Engine(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}),
                    Endpoint("127.0.0.1", port), "a-token-for-nobody")
    try:
        # Non-blocking: a full pair raises BlockingIOError, which _wake takes as "awake".
        assert not engine._wake_w.getblocking()
        for _ in range(20_000):  # far more than a socket pair holds, drained or not
            engine._wake()
    finally:
        engine.close()
