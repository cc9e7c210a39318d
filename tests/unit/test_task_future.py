"""A TaskFuture tells its engine when it is cancelled: once, and only if the cancel took."""

from __future__ import annotations

import asyncio

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
