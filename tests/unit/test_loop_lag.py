"""The wait before the router's handler runs (``front.LoopLag``): measured as the event loop's
lateness, counted in a request's time to first token, and past ``--max-loop-lag-s`` a reason to
refuse new requests at once. The front against scripted nodes (``router_fakes``)."""

from __future__ import annotations

import asyncio
import time

import pytest
from router_fakes import FakeNodes, all_given_back
from test_router_stages import collect, front_for

from splitserve.router.front import WINDOW, LoopLag
from splitserve.router.request import GenerateError
from splitserve.runtime.failure import Failure


def test_the_probe_measures_a_loop_that_was_held():
    async def main():
        lag = LoopLag(interval_s=0.01)
        probe = asyncio.create_task(lag.run())
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # the loop is held: the probe wakes that much late
        await asyncio.sleep(0.05)
        probe.cancel()
        assert lag.seconds >= 0.25

    asyncio.run(main())


def test_a_router_that_runs_late_refuses_at_once_and_counts_the_wait():
    async def main():
        nodes = FakeNodes()
        front, registry = front_for(nodes, max_loop_lag_s=0.5)
        assert front.loop_lag is not None
        front.loop_lag.note(0.8)
        with pytest.raises(GenerateError) as err:
            await collect(front, prompt="abc")
        assert err.value.code == Failure.REFUSED
        assert err.value.reason == "router_busy" and err.value.retry_after_s
        assert not nodes.prefill_calls and not nodes.generate_calls  # nothing was asked of them
        for _ in range(WINDOW):
            front.loop_lag.note(0.3)  # late, but within the bound
        steps = await collect(front, prompt="abc")
        usage = steps[-1].usage
        assert usage is not None and usage.time_to_first_token_s >= 0.3  # the wait counted
        assert not all_given_back(registry)

    asyncio.run(main())


def test_zero_turns_the_refusal_off():
    async def main():
        front, _ = front_for(FakeNodes(), max_loop_lag_s=0.0)
        assert front.loop_lag is not None
        front.loop_lag.note(5.0)
        steps = await collect(front, prompt="abc")
        assert steps[-1].delta.finish_reason

    asyncio.run(main())
