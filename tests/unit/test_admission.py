"""The router's admission queue (router/admission.py): requests wait in arrival order while
every decode node holds its capacity of them, go as slots free, and fail only at the queue's
limit, its timeout or their deadline."""

import asyncio
import random
import time

import pytest
from router_fakes import refused_at_once

from splitserve.router.admission import Admission
from splitserve.router.kv_budget import KVDemand
from splitserve.router.metrics import RouterMetrics
from splitserve.router.pool import DecodePool, PrefillPool
from splitserve.router.request import GenerateError
from splitserve.runtime.failure import Failure


def _setup(capacity=2, **kw):
    pool = DecodePool(["d:1"])
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
        assert full.value.code == Failure.REFUSED and "max-queue" in str(full.value.message)
        with pytest.raises(GenerateError) as waited:
            await first
        assert waited.value.code == Failure.REFUSED
        with pytest.raises(GenerateError) as late:
            await admission.enter(time.monotonic() + 0.05)
        assert late.value.code == Failure.DEADLINE
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


# ---------------------------------------------------------------- both pools, KV, early refusals


def _demand(n_prompt, seed=0, salt="", max_tokens=8, block_size=16):
    rng = random.Random(seed)
    prompt = [rng.randrange(256) for _ in range(n_prompt)]
    return KVDemand.of(prompt, salt, max_tokens, block_size, reserve_tokens=256)


def test_a_request_waits_for_kv_blocks_not_only_for_a_slot():
    async def run():
        pool, admission, metrics = _setup(capacity=100)
        node = pool.nodes[0]
        node.kv.num_blocks = 40  # a slot is free for 100 requests, KV for two of these
        far = time.monotonic() + 30
        a, b, c = (_demand(300, seed=i) for i in range(3))  # 19 full blocks + 1 private each
        for d in (a, b):
            await admission.enter(far, d)
            pool.acquire(node, demand=d)
        assert node.kv.used == 40
        third = asyncio.create_task(admission.enter(far, c))
        await asyncio.sleep(0.05)
        assert not third.done() and len(admission) == 1
        pool.release(node, demand=a)
        await asyncio.wait_for(third, 1)
        pool.acquire(node, demand=c)
        pool.release(node, demand=b)
        pool.release(node, demand=c)
        assert node.kv.used == 0 and metrics.refused.labels(reason="queue_full")._value.get() == 0

    asyncio.run(run())


def test_a_request_waits_for_a_prefill_node_with_room():
    async def run():
        decode = DecodePool(["d:1"])
        prefill = PrefillPool(["p:1"])
        prefill.nodes[0].max_queued_tokens = 1000
        admission = Admission(decode, RouterMetrics(), prefill=prefill)
        far = time.monotonic() + 30
        p = prefill.nodes[0]
        prefill.acquire(p, 800)
        # A node with work queued has room only within its bound; one with none always has.
        waiter = asyncio.create_task(admission.enter(far, None, 300))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        prefill.release(p, 800)
        await asyncio.wait_for(waiter, 1)
        prefill.acquire(p, 5000)  # larger than the bound, alone on the node
        prefill.release(p, 5000)

    asyncio.run(run())


def test_a_prompt_larger_than_every_decode_node_is_refused_at_once():
    async def run():
        pool, admission, metrics = _setup(capacity=4)
        pool.nodes[0].kv.num_blocks = 10
        with pytest.raises(GenerateError) as big:
            await asyncio.wait_for(admission.enter(time.monotonic() + 30, _demand(200)), 0.1)
        assert big.value.code == Failure.REFUSED
        assert "13 KV blocks" in big.value.message and "holds 10" in big.value.message
        assert metrics.refused.labels(reason="prompt_too_large")._value.get() == 1
        # Larger than the budget but not than the node: it goes, alone.
        pool.nodes[0].kv.headroom = 0.5
        await asyncio.wait_for(admission.enter(time.monotonic() + 30, _demand(150)), 0.1)

    asyncio.run(run())


def test_a_wait_the_queue_pace_puts_past_the_deadline_is_refused_at_once():
    async def run():
        pool, admission, metrics = _setup(capacity=1)
        node = pool.nodes[0]
        far = time.monotonic() + 30
        pool.acquire(node)

        async def request():
            await admission.enter(far)
            pool.acquire(node)  # as the prefill stage does right after entering

        # 20 requests through the queue, one every ~10 ms: a pace of ~100/s.
        waiters = [asyncio.create_task(request()) for _ in range(40)]
        await asyncio.sleep(0.01)
        for _ in range(20):
            pool.release(node)
            await asyncio.sleep(0.01)
        assert len(admission) == 20
        # 21st in line at ~100/s: ~0.2 s; a request with 0.05 s left is refused at once.
        late = refused_at_once(admission.enter(time.monotonic() + 0.05))
        assert late.code == Failure.REFUSED
        assert "would outlast its deadline" in late.message
        assert late.retry_after_s is not None and late.retry_after_s >= 1
        assert metrics.refused.labels(reason="queue_wait")._value.get() == 1
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert len(admission) == 0

    asyncio.run(run())


def test_a_waiter_that_could_no_longer_be_served_in_time_is_refused_not_let_go():
    async def run():
        pool, admission, metrics = _setup(capacity=1)
        for _ in range(50):
            admission.note_served(10.0)  # requests take ~10 s once let go
        assert 9.0 < admission.service_s <= 10.0
        pool.acquire(pool.nodes[0])
        t0 = time.monotonic()
        with pytest.raises(GenerateError) as late:
            await admission.enter(time.monotonic() + 10.3)
        # Refused once less than ~10 s was left (at ~0.3 s), not at the deadline (10.3 s): the
        # bound sits far from both, so the machine's speed cannot decide it.
        assert time.monotonic() - t0 < 5.0
        assert late.value.code == Failure.REFUSED
        assert metrics.refused.labels(reason="queue_wait")._value.get() == 1

    asyncio.run(run())


def test_the_queue_figures_can_be_read_from_another_thread_while_it_churns():
    """/metrics reads the queue's figures on the metrics server's thread: reading must neither
    raise nor disturb the queue the event loop changes meanwhile."""
    import threading

    from splitserve.router.assembly import Pressure
    from splitserve.router.registry import NodeRegistry

    async def run():
        registry = NodeRegistry([], ["d:1"])
        pool = registry.decode
        metrics = RouterMetrics()
        admission = Admission(pool, metrics)
        pressure = Pressure(registry, admission)
        node = pool.nodes[0]
        node.capacity = 1
        stop, errors = threading.Event(), []

        def scrape():
            while not stop.is_set():
                try:
                    pressure.figures()
                except Exception as exc:  # what the scrape thread would have died of
                    errors.append(exc)

        reader = threading.Thread(target=scrape)
        reader.start()
        far = time.monotonic() + 30

        async def request(i):
            await admission.enter(far, _demand(40, seed=i), 40)
            pool.acquire(node)
            pressure.computed(40)
            await asyncio.sleep(0)
            pool.release(node)

        try:
            await asyncio.wait_for(asyncio.gather(*(request(i) for i in range(400))), 30)
        finally:
            stop.set()
            reader.join(5)
        assert errors == [] and len(admission) == 0 and node.in_flight == 0

    asyncio.run(run())


def test_a_request_that_may_not_queue_is_refused_before_its_prompt_is_read():
    """``check_arrival`` needs only the deadline: the front calls it before parsing the
    request, so a refusal under overload costs the router next to nothing."""

    async def run():
        pool, admission, metrics = _setup(capacity=1, max_waiting=1)
        admission.check_arrival(time.monotonic() + 30)  # nothing waits: never refused here
        pool.acquire(pool.nodes[0])
        waiter = asyncio.create_task(admission.enter(time.monotonic() + 30))
        await asyncio.sleep(0.01)
        with pytest.raises(GenerateError) as full:
            admission.check_arrival(time.monotonic() + 30)
        assert full.value.code == Failure.REFUSED
        assert full.value.retry_after_s >= 1
        assert metrics.refused.labels(reason="queue_full")._value.get() == 1
        pool.release(pool.nodes[0])
        await asyncio.wait_for(waiter, 1)

    asyncio.run(run())


def test_a_router_with_no_decode_node_yet_holds_a_request_until_one_registers():
    """Started before its nodes: a request waits for a node to register (instead of an
    UNAVAILABLE at once), bounded by its deadline; a node that registers lets it go."""

    async def run():
        pool = DecodePool([])
        admission = Admission(pool, RouterMetrics())
        t0 = time.monotonic()
        entering = asyncio.create_task(admission.enter(t0 + 30))
        await asyncio.sleep(0.2)
        assert not entering.done()  # held, not refused
        pool.sync(["d:1"])  # a node registers (discovery)
        admitted = await asyncio.wait_for(entering, 5)
        assert admitted.prediction is not None and time.monotonic() - t0 >= 0.2
        # No node ever comes: back to the caller (who answers UNAVAILABLE) at its deadline.
        empty = DecodePool([])
        t0 = time.monotonic()
        admitted = await Admission(empty, RouterMetrics()).enter(t0 + 0.3)
        assert admitted.prediction is None and 0.25 <= time.monotonic() - t0 < 2

    asyncio.run(run())
