"""Engine-thread releases run whatever cancels their caller (AsyncEngine.call_to_end / acquire /
settle): the cancellation-safety every node's cleanup relies on."""

import asyncio
import threading

import pytest

from splitserve.models.engine_loop import AsyncEngine, settle


def test_a_release_queued_behind_a_step_survives_repeated_cancellation():
    async def main():
        engine = AsyncEngine(None)
        step, released = threading.Event(), []

        async def handler():
            try:
                await asyncio.sleep(10)
            finally:
                await engine.call_to_end(released.append, "r")
                released.append("not reached: the cancellation is raised after the release")

        engine_busy = asyncio.ensure_future(engine.call(step.wait))  # a long step
        task = asyncio.ensure_future(handler())
        for _ in range(3):  # into the finally, then twice more while its release waits
            await asyncio.sleep(0.01)
            task.cancel()
        await asyncio.sleep(0.01)
        assert not task.done() and released == []  # waiting behind the step, not abandoned
        step.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine_busy
        await engine.stop()
        return released

    assert asyncio.run(main()) == ["r"]


def test_what_a_cancelled_caller_acquired_is_given_back():
    async def main():
        engine = AsyncEngine(None)
        running, go, undone = threading.Event(), threading.Event(), []

        def pin():
            running.set()
            go.wait()
            return ["block"]

        task = asyncio.ensure_future(engine.acquire(pin, undone.append))
        await asyncio.to_thread(running.wait)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go.set()
        for _ in range(100):  # the undo is submitted once pin is done
            await asyncio.sleep(0.01)
            if undone:
                break
        await engine.stop()
        return undone

    assert asyncio.run(main()) == [["block"]]


def test_settle_waits_for_the_work_through_cancellations():
    async def main():
        go, events = threading.Event(), []

        def work():
            go.wait()
            events.append("done")

        async def caller():
            await settle(asyncio.ensure_future(asyncio.to_thread(work)))
            events.append("not reached")

        task = asyncio.ensure_future(caller())
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.01)
        assert not task.done()  # still waiting for the work
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        return events

    assert asyncio.run(main()) == ["done"]
