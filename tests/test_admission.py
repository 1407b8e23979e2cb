"""The router's admission queue (router/admission.py): requests wait in arrival order while
every decode node holds its capacity of them, go as slots free, and fail only at the queue's
limit, its timeout or their deadline."""

import asyncio
import time

import grpc
import pytest

from splitserve.router.admission import Admission
from splitserve.router.errors import GenerateError
from splitserve.router.pool import NodePool
from splitserve.runtime.metrics import RouterMetrics


def _setup(capacity=2, **kw):
    pool = NodePool("decode", ["d:1"])
    pool.nodes[0].capacity = capacity
    metrics = RouterMetrics()
    return pool, Admission(pool, metrics, **kw), metrics


def test_requests_wait_in_order_and_go_as_slots_free():
    async def run():
        pool, admission, metrics = _setup()
        node = pool.nodes[0]
        far = time.monotonic() + 30
        order = []

        async def request(name):
            await admission.enter(far)
            pool.acquire(node)  # as the prefill stage does right after entering
            order.append(name)

        await request("a")
        await request("b")  # two slots: both at once
        waiting = [asyncio.create_task(request(n)) for n in ("c", "d", "e")]
        await asyncio.sleep(0.05)
        assert order == ["a", "b"] and len(admission) == 3
        assert metrics.queue_length._value.get() == 3
        pool.release(node)
        await asyncio.sleep(0.05)
        assert order == ["a", "b", "c"]
        pool.release(node)
        pool.release(node)
        await asyncio.sleep(0.05)
        assert order == ["a", "b", "c", "d", "e"]  # arrival order kept
        await asyncio.gather(*waiting)
        assert len(admission) == 0 and metrics.queue_length._value.get() == 0

    asyncio.run(run())


def test_a_full_queue_a_long_wait_and_a_deadline_fail_clearly():
    async def run():
        pool, admission, _ = _setup(capacity=1, max_waiting=1, max_wait_s=0.2)
        pool.acquire(pool.nodes[0])  # the only slot is taken
        first = asyncio.create_task(admission.enter(time.monotonic() + 30))
        await asyncio.sleep(0.01)
        with pytest.raises(GenerateError) as full:
            await admission.enter(time.monotonic() + 30)
        assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max-queue" in str(
            full.value.message
        )
        with pytest.raises(GenerateError) as waited:
            await first
        assert waited.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(GenerateError) as late:
            await admission.enter(time.monotonic() + 0.05)
        assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert len(admission) == 0

    asyncio.run(run())


def test_a_node_joining_lets_waiters_go():
    async def run():
        pool, admission, _ = _setup(capacity=1)
        pool.acquire(pool.nodes[0])
        waiter = asyncio.create_task(admission.enter(time.monotonic() + 30))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        pool.sync(["d:2"])  # discovered: no capacity known yet, so it has room
        await asyncio.wait_for(waiter, 2)

    asyncio.run(run())


def test_no_usable_node_is_not_a_reason_to_wait():
    """Every decode node down (not merely full): the request does not queue; the stage reports
    UNAVAILABLE at once, as before."""

    async def run():
        pool, admission, _ = _setup(capacity=1)
        pool.acquire(pool.nodes[0])
        pool.mark_down(pool.nodes[0], "gone")
        await asyncio.wait_for(admission.enter(time.monotonic() + 30), 0.5)
        assert len(admission) == 0

    asyncio.run(run())
