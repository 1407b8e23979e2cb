"""Engine-thread releases run whatever cancels their caller (AsyncEngine.call_to_end / acquire /
settle): the cancellation-safety every node's cleanup relies on."""

import asyncio
import threading
from types import SimpleNamespace

import pytest

from splitserve.engine.loop import AsyncEngine, settle


def _idle_engine() -> AsyncEngine:
    """An AsyncEngine around an engine with nothing to step: only the jobs run."""
    core = SimpleNamespace(runner=SimpleNamespace(device=SimpleNamespace(type="cpu")))
    core.has_unfinished = lambda: False
    return AsyncEngine(core)  # type: ignore[arg-type]


def test_a_release_queued_behind_a_step_survives_repeated_cancellation():
    async def main():
        engine = _idle_engine()
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
        engine = _idle_engine()
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


def test_held_outputs_go_when_the_next_forward_is_launched_and_the_last_at_once(tmp_path):
    """On a GPU a step's outputs are handed to the loop once the next step's forward is queued
    (engine.loop); the CPU engine is made to do the same here. Every token arrives, in
    order, the final ones too (no step follows them), each step's after the next launch."""
    from splitserve.models.sampling_params import SamplingParams
    from splitserve.models.tiny import write_random_checkpoint
    from splitserve.runtime.config import NodeConfig
    from splitserve.runtime.node import build_engine

    model = write_random_checkpoint(tmp_path / "model", with_tokenizer=False)
    core, _ = build_engine(NodeConfig(model_path=str(model), kv_cache_mb=16), prefill_only=False)
    launches = []
    execute = core.runner.execute

    def counted(seqs, feed=None):
        launches.append(len(seqs))
        return execute(seqs, feed)

    core.runner.execute = counted
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    reference = [core.generate([[9, 8, 7 + i]], params)[0].output_token_ids for i in range(2)]
    launches.clear()

    async def scenario():
        engine = AsyncEngine(core)
        engine._defer_outputs = True  # as on a GPU
        posted = []  # forwards launched when each step's outputs were posted
        post = engine._post
        engine._post = lambda fn, *args: (posted.append(len(launches)), post(fn, *args))
        engine.start()
        try:
            queues = [engine.subscribe(f"r{i}") for i in range(2)]

            def add_both() -> None:
                # In one job, so both are in before the first step, whatever the machine's
                # speed (added one by one, a slow moment let r0 finish first: its last outputs
                # then rightly went at once, with no step to follow).
                for i in range(2):
                    core.add_request(f"r{i}", [9, 8, 7 + i], params)

            await engine.call(add_both)
            got = [[], []]
            for i, queue in enumerate(queues):
                while True:
                    out = await asyncio.wait_for(queue.get(), 20)
                    got[i].append(out.new_token_id)
                    if out.finish_reason is not None:
                        assert out.finish_reason == "length"
                        break
        finally:
            await engine.stop()
        return got, posted

    got, posted = asyncio.run(scenario())
    assert got == reference
    assert posted[-1] == len(launches)  # the last step's outputs: no launch followed them
    # Every other step's outputs went out during the next step, after its launch.
    assert len(posted) >= 2 and all(n >= i + 2 for i, n in enumerate(posted[:-1])), posted


def test_a_step_floor_makes_every_forward_take_at_least_that_long(tmp_path, monkeypatch):
    """SPLITSERVE_MIN_STEP_MS (load tests on a shared machine): each step that runs a forward
    lasts at least the floor, its tokens unchanged; a bad value is refused with the variable's
    name. (A lower bound only: a slow machine cannot make it fail.)"""
    import time

    from splitserve.engine.loop import min_step_seconds
    from splitserve.models.sampling_params import SamplingParams
    from splitserve.models.tiny import write_random_checkpoint
    from splitserve.runtime.config import NodeConfig
    from splitserve.runtime.node import build_engine

    for bad in ("fast", "-5", "1e9"):
        with pytest.raises(ValueError, match="SPLITSERVE_MIN_STEP_MS"):
            min_step_seconds({"SPLITSERVE_MIN_STEP_MS": bad})
    assert min_step_seconds({}) == 0.0
    assert min_step_seconds({"SPLITSERVE_MIN_STEP_MS": "40"}) == 0.04

    model = write_random_checkpoint(tmp_path / "model", with_tokenizer=False)
    core, _ = build_engine(NodeConfig(model_path=str(model), kv_cache_mb=16), prefill_only=False)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    reference = core.generate([[5, 6, 7]], params)[0].output_token_ids
    monkeypatch.setenv("SPLITSERVE_MIN_STEP_MS", "40")

    async def scenario():
        engine = AsyncEngine(core)
        engine.start()
        try:
            queue = engine.subscribe("r")
            started = time.perf_counter()
            await engine.call(core.add_request, "r", [5, 6, 7], params)
            got = []
            while not got or got[-1][1] is None:
                out = await asyncio.wait_for(queue.get(), 20)
                got.append((out.new_token_id, out.finish_reason))
            return [t for t, _ in got], time.perf_counter() - started, engine.steps
        finally:
            await engine.stop()

    tokens, elapsed, steps = asyncio.run(scenario())
    assert tokens == reference
    assert steps >= 6 and elapsed >= steps * 0.04, (steps, elapsed)
