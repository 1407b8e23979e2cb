"""Admission by predicted latency (router/predictor.py, router/admission.py): a request that must
queue and is predicted to miss its TTFT target is refused at once, one whose target passes
while it waits is refused before any node works on it, a decode node takes a request only while
its batch stays within the TPOT target, and the predictor learns from what it sees."""

import asyncio
import random
import time

import pytest
from router_fakes import refused_at_once

from splitserve.router.admission import (
    HEADROOM_DOWN,
    HEADROOM_MIN,
    HEADROOM_RECOVER_S,
    HEADROOM_UP,
    JUDGE_S,
    PROBE_S,
    Admission,
)
from splitserve.router.metrics import RouterMetrics
from splitserve.router.pool import DecodePool, PrefillPool
from splitserve.router.predictor import (
    MIN_SAMPLES,
    WINDOW,
    BusyRate,
    PrefillLoad,
    TPOTLine,
    TTFTPrediction,
    TTFTPredictor,
)
from splitserve.router.request import GenerateError
from splitserve.runtime.failure import Failure
from splitserve.runtime.slo import Slo


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_busy_rate_is_tokens_over_busy_seconds_not_wall_seconds():
    clock = Clock()
    rate = BusyRate(clock)
    rng = random.Random(7)
    tokens_per_s = rng.uniform(2_000, 20_000)
    assert rate.rate() is None
    for _ in range(MIN_SAMPLES + 4):
        clock.now += rng.uniform(0.05, 0.3)  # idle between requests: not counted
        rate.start()
        tokens = rng.randint(50, 500)
        clock.now += tokens / tokens_per_s
        rate.end(tokens)
    # The first sample's tokens are the window's base: the rate is over the rest.
    assert rate.rate() == pytest.approx(tokens_per_s, rel=1e-6)
    clock.now += 60  # old news is forgotten
    assert rate.rate() is None


def test_busy_rate_counts_overlapping_requests_once_in_time():
    clock = Clock()
    rate = BusyRate(clock)
    for _ in range(4 * MIN_SAMPLES):
        rate.start()
        rate.start()  # two at once: the node is busy for 0.1 s and computes both
        clock.now += 0.1
        rate.end(100)
        rate.end(100)
        clock.now += 0.2
    # Within the window's edge (its first sample is the base): 2,000, not 1,000 per request.
    assert rate.rate() == pytest.approx(2_000, rel=0.05)


def test_ttft_prediction_adds_queue_wait_own_prefill_and_a_learned_margin():
    clock = Clock()
    predictor = TTFTPredictor(clock)
    unknown, idle = PrefillLoad(None, 0), PrefillLoad(1_000.0, 0)
    nothing = predictor.predict(5, pace=0.0, tokens_ahead=0, own_tokens=100, load=unknown)
    assert nothing == TTFTPrediction(0.0, 0.0, 0.0)  # nothing learned: nothing predicted
    p = predictor.predict(10, pace=5.0, tokens_ahead=1_000, own_tokens=200, load=idle)
    assert p.wait_s == pytest.approx(2.0) and p.own_s == pytest.approx(0.2)
    p = predictor.predict(10, pace=5.0, tokens_ahead=4_000, own_tokens=200, load=idle)
    assert p.wait_s == pytest.approx(4.0)  # the queued prompt tokens, when the longer wait
    busy = PrefillLoad(1_000.0, 1_500)  # the nodes hold 1.5 s of prompts let go before it
    p = predictor.predict(0, pace=5.0, tokens_ahead=0, own_tokens=200, load=busy)
    assert p.wait_s == 0.0 and p.own_s == pytest.approx(1.7)
    # Requests take 0.5 s more than predicted: the base learns it, and until it has, the margin
    # covers it; once the window holds only errors made since, the margin is their spread.
    rng = random.Random(3)
    for _ in range(WINDOW + MIN_SAMPLES):
        guess = predictor.predict(0, 0.0, 0, 300, idle)
        actual = 0.3 + 0.5 + rng.uniform(0, 0.1)
        predictor.observe(guess, queued_s=0.0, first_token_s=actual, own_tokens=300, load=idle)
    p = predictor.predict(0, 0.0, 0, 300, idle)
    assert 0.8 <= p.own_s <= 0.9 and p.margin_s < 0.1  # learned: no systematic error left
    assert 0.8 <= p.ttft_s <= 1.0


def test_the_margin_covers_recent_underestimates_and_is_forgotten():
    clock = Clock()
    predictor = TTFTPredictor(clock)
    guess = TTFTPrediction(1.0, 0.5, 0.0)
    for i in range(2 * MIN_SAMPLES):
        late = 0.0 if i % 10 else 3.0  # one in ten is 3 s late
        predictor.observe(
            guess, 1.0, first_token_s=1.5 + late, own_tokens=0, load=PrefillLoad(0, 0)
        )
    assert predictor.margin_s() == pytest.approx(3.0)
    clock.now += 120
    assert predictor.margin_s() == 0.0 and predictor.base_s() == 0.0


def test_each_client_gets_the_margin_of_its_own_errors():
    """A heavy client whose requests wait far longer than predicted must not give a light one,
    whose requests are on time, its margin (the light one's requests would be refused)."""
    clock = Clock()
    predictor = TTFTPredictor(clock)
    guess = TTFTPrediction(0.2, 0.5, 0.0)
    for _ in range(4 * MIN_SAMPLES):
        predictor.observe(guess, 0.2, 3.7, 0, PrefillLoad(0, 0), client="heavy")  # 3 s late
    for _ in range(MIN_SAMPLES):
        predictor.observe(guess, 0.2, 0.7, 0, PrefillLoad(0, 0), client="light")  # on time
    assert predictor.margin_s("heavy") == pytest.approx(3.0)
    assert predictor.margin_s("light") == pytest.approx(0.0)
    assert predictor.margin_s("new") == pytest.approx(3.0)  # too few of its own: everyone's
    assert predictor.margin_s() == pytest.approx(3.0)
    # A refused wait counts for its client too.
    predictor.expired(guess, 5.0, client="new")
    assert predictor.predict(0, 0.0, 0, 0, PrefillLoad(0, 0), client="light").margin_s == 0.0


def test_tpot_line_predicts_from_recent_batches():
    clock = Clock()
    line = TPOTLine(clock)
    rng = random.Random(11)
    for _ in range(2 * MIN_SAMPLES):
        batch = rng.randint(1, 40)
        line.add(batch, 0.010 + 0.002 * batch + rng.uniform(-1e-4, 1e-4))
    assert line.predict(50) == pytest.approx(0.110, abs=0.002)
    same = TPOTLine(clock)
    for _ in range(2 * MIN_SAMPLES):
        same.add(8, 0.05)
    assert same.predict(50) is None  # one batch size says nothing about others


def _pools(capacity: int = 1):
    decode = DecodePool(["d:1"])
    decode.nodes[0].capacity = capacity
    prefill = PrefillPool(["p:1"])
    return decode, prefill


def _teach_pace(admission: Admission, per_s: float) -> None:
    now = time.monotonic()
    for i in range(32):
        admission._departures.append(now - (31 - i) / per_s)


def _full_admission(pace_per_s: float) -> tuple[DecodePool, RouterMetrics, Admission]:
    """An admission whose one decode slot is taken (everything queues), taught a pace."""
    decode, prefill = _pools()
    metrics = RouterMetrics()
    admission = Admission(decode, metrics, prefill=prefill)
    decode.acquire(decode.nodes[0])
    _teach_pace(admission, pace_per_s)
    return decode, metrics, admission


def test_a_request_predicted_to_miss_its_ttft_is_refused_at_arrival():
    async def run():
        decode, prefill = _pools()
        metrics = RouterMetrics()
        admission = Admission(decode, metrics, prefill=prefill)
        decode.acquire(decode.nodes[0])  # full
        far = time.monotonic() + 60
        waiting = [asyncio.create_task(admission.enter(far, work=100)) for _ in range(9)]
        await asyncio.sleep(0.01)
        _teach_pace(admission, 2.0)  # 2/s with 9 ahead: ~5 s of queue
        with pytest.raises(GenerateError) as refused:
            admission.check_arrival(far, Slo(ttft_s=2.0))
        assert refused.value.code == Failure.REFUSED
        assert "TTFT target" in refused.value.message
        assert refused.value.retry_after_s is not None and refused.value.retry_after_s >= 3
        # At once: before it ever waited (it never suspends), whatever the machine's speed.
        refused_at_once(admission.enter(far, work=100, slo=Slo(ttft_s=2.0)))
        assert metrics.refused.labels(reason="slo_ttft")._value.get() == 2
        # A target the queue can meet waits its turn; no target waits as before.
        ok = asyncio.create_task(admission.enter(far, work=100, slo=Slo(ttft_s=30.0)))
        plain = asyncio.create_task(admission.enter(far, work=100))
        await asyncio.sleep(0.01)
        assert len(admission) == 11 and not ok.done() and not plain.done()
        for task in [*waiting, ok, plain]:
            task.cancel()
        await asyncio.gather(*waiting, ok, plain, return_exceptions=True)
        assert len(admission) == 0

    asyncio.run(run())


def test_a_queued_request_whose_ttft_target_passes_is_refused_before_any_node_works():
    async def run():
        decode, prefill = _pools()
        metrics = RouterMetrics()
        admission = Admission(decode, metrics, prefill=prefill)
        decode.acquire(decode.nodes[0])
        start = time.monotonic()
        with pytest.raises(GenerateError) as expired:
            await admission.enter(start + 60, work=10, slo=Slo(ttft_s=0.2), arrival=start)
        waited = time.monotonic() - start
        assert 0.15 <= waited < 30  # given up at its target (0.2 s), not at the deadline (60 s)
        assert expired.value.code == Failure.REFUSED
        assert metrics.refused.labels(reason="slo_expired")._value.get() == 1
        assert len(admission) == 0 and decode.nodes[0].in_flight == 1

    asyncio.run(run())


def test_a_waiter_the_queue_can_no_longer_serve_in_time_is_refused_when_that_is_known():
    """Let in on a pace of 2/s, three waiters with a 10 s TTFT target find the queue slowed to
    one every 5 s: the second and third (10 s and 15 s from going, past their targets) and a
    request without a target whose deadline (12 s) falls before its turn are refused at the next
    judgement, well before their limits pass; the first (~5 s from going) keeps waiting; the
    refused waits teach the predictor its margin."""

    async def run():
        decode, metrics, admission = _full_admission(2.0)  # full: everything queues
        start = time.monotonic()
        slo = Slo(ttft_s=10.0)
        tasks = [
            asyncio.create_task(admission.enter(start + 60, work=10, slo=slo, arrival=start))
            for _ in range(3)
        ]
        tasks.append(asyncio.create_task(admission.enter(start + 12, work=10)))
        await asyncio.sleep(0.05)
        assert len(admission) == 4 and not any(t.done() for t in tasks)
        # The pools slow down: the queue now lets one go every 5 s.
        admission._departures.clear()
        _teach_pace(admission, 0.2)
        # (Within 5 s of the pace taught: past that the first would be refused too, rightly,
        # and the pace goes stale; judged every JUDGE_S, they are refused long before.)
        done, _ = await asyncio.wait(tasks[1:], timeout=30 * JUDGE_S)
        assert set(done) == set(tasks[1:]), "not refused when the slower pace became known"
        assert time.monotonic() - start < 5.0  # far from the limits (10 s, 12 s)
        refusals = [t.exception() for t in tasks[1:]]
        assert all(isinstance(r, GenerateError) for r in refusals)
        *late, no_target = refusals
        for r in late:
            assert r.code == Failure.REFUSED
            assert "requests go before it" in r.message and "TTFT target" in r.message
            assert r.retry_after_s is not None and r.retry_after_s >= 10
        assert "deadline" in no_target.message
        assert metrics.refused.labels(reason="slo_expired")._value.get() == 2
        assert metrics.refused.labels(reason="queue_wait")._value.get() == 1
        assert not tasks[0].done() and len(admission) == 1  # ~5 s from going: within 10 s
        # What the refused taught: waits that ran ~10-15 s past a ~0.5-1.5 s prediction.
        errors = admission.predictor._errors.values()
        assert len(errors) == 2 and min(errors) > 8
        tasks[0].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert len(admission) == 0 and decode.waiting == 0

    asyncio.run(run())


def test_a_client_whose_queued_requests_ran_late_is_admitted_to_less_of_its_target():
    """Admission's headroom (HEADROOM_*): a client whose queued request was refused late is then
    admitted only to a share of its TTFT target, so the next ones that would run as late are
    refused at arrival, at once; another client's share stays whole (the fair queue keeps its
    waits short); each request let go in time gives some back, and the share never falls below
    HEADROOM_MIN."""

    async def run():
        decode, metrics, admission = _full_admission(2.0)  # full: everything queues
        far = time.monotonic() + 60
        first = asyncio.create_task(
            admission.enter(far, work=10, slo=Slo(ttft_s=10.0), client="heavy")
        )
        second = asyncio.create_task(
            admission.enter(far, work=10, slo=Slo(ttft_s=10.0), client="heavy")
        )
        await asyncio.sleep(0.05)
        assert admission.headroom("heavy") == 1.0 and len(admission) == 2
        # The queue slows to one every 5 s: the second (~10 s from going) is refused late.
        admission._departures.clear()
        _teach_pace(admission, 0.2)
        done, _ = await asyncio.wait([second], timeout=30 * JUDGE_S)
        assert done == {second} and isinstance(second.exception(), GenerateError)
        refused_at = time.monotonic()
        share = admission.headroom("heavy")
        assert share == pytest.approx(1 - HEADROOM_DOWN, abs=0.01)
        assert admission.headroom("light") == 1.0
        scraped = metrics.registry.get_sample_value("splitserve_router_admission_headroom")
        assert scraped == pytest.approx(share, abs=0.01)
        # Predicted ~10 s (second in line at 0.2/s, taught again: however long the judge took,
        # the pace is fresh): within an 11 s target, but not within its share of it, so
        # refused at arrival, at once, saying so.
        admission._departures.clear()
        _teach_pace(admission, 0.2)
        refused = refused_at_once(
            admission.enter(far, work=10, slo=Slo(ttft_s=11.0), client="heavy")
        )
        assert f"{share:.2f} of its TTFT target of 11 s" in refused.message
        # Another client's request, also ~10 s from going (the fair queue's turns: one of the
        # heavy client's, then its own), within a 10.5 s target: it waits (its share is whole;
        # the heavy client's share of 10.5 s would have refused it).
        light = asyncio.create_task(
            admission.enter(far, work=10, slo=Slo(ttft_s=10.5), client="light")
        )
        await asyncio.sleep(0.05)
        assert not light.done() and len(admission) == 2
        # Both let go in time: the heavy client's share grows back by HEADROOM_UP.
        # (Admission only lets them go; nothing here takes the slot, so both go.)
        decode.release(decode.nodes[0])
        await asyncio.wait_for(asyncio.gather(first, light), 5)
        # (and time: all of it over HEADROOM_RECOVER_S; the share is read before the clock, so
        # the time that passes between the two only widens the bound)
        grown = admission.headroom("heavy")
        elapsed = time.monotonic() - refused_at
        assert share + HEADROOM_UP <= grown <= share + HEADROOM_UP + elapsed / HEADROOM_RECOVER_S
        assert admission.headroom("light") == 1.0
        # However many run late, the share stops at HEADROOM_MIN.
        for _ in range(50):
            admission._refused_late("heavy")
        assert admission.headroom("heavy") == pytest.approx(HEADROOM_MIN, abs=0.01)
        # A client that stops running late is admitted to all of it again in time.
        admission._headroom["heavy"] = (HEADROOM_MIN, time.monotonic() - HEADROOM_RECOVER_S)
        assert admission.headroom("heavy") == 1.0

    asyncio.run(run())


def test_room_by_count_is_not_enough_when_the_nodes_backlog_is_past_the_target():
    """Nothing waits at the router and every pool has room by count, but the prefill nodes
    already hold 3 s of prompts: a 1 s target is refused at once, a 5 s one waits at the router.
    One request a PROBE_S still goes whatever the prediction (the predictor learns only from
    requests it lets go)."""

    async def run():
        decode, prefill = _pools(capacity=64)
        p = prefill.nodes[0]
        clock = Clock()
        clock.now = time.monotonic() - 2.0
        p.rate = BusyRate(clock)
        for _ in range(MIN_SAMPLES + 1):  # p computes 1,000 tokens per busy second
            p.rate.start()
            clock.now += 0.1
            p.rate.end(100)
        admission = Admission(decode, RouterMetrics(), prefill=prefill)
        far = time.monotonic() + 60
        first = await asyncio.wait_for(admission.enter(far, work=10, slo=Slo(ttft_s=1.0)), 0.5)
        assert first.prediction is not None and first.prediction.ttft_s < 1.0
        prefill.acquire(p, 3_000)  # requests let go earlier: 3 s of work on the node
        with pytest.raises(GenerateError) as refused:
            await admission.enter(far, work=10, slo=Slo(ttft_s=1.0))
        assert refused.value.code == Failure.REFUSED
        assert "TTFT target" in refused.value.message and len(admission) == 0
        # A 5 s target could wait out the backlog, but not in the node's FIFO: it waits here
        # (fairly between clients) until the node holds at most a quarter of its target.
        patient = asyncio.create_task(admission.enter(far, work=10, slo=Slo(ttft_s=5.0)))
        await asyncio.sleep(0.05)
        assert not patient.done() and len(admission) == 1
        prefill.release(p, 3_000, computed=3_000)
        await asyncio.wait_for(patient, 0.5)
        await asyncio.wait_for(admission.enter(far, work=10), 0.5)  # no target: no prediction
        # Room, nothing queued, but the predictor has learned that first tokens take 10 s: a 1 s
        # target is refused, except one request per PROBE_S, which goes whatever the prediction.
        for _ in range(2 * MIN_SAMPLES):
            admission.predictor.observe(TTFTPrediction(0, 0, 0), 0.0, 10.0, 0, PrefillLoad(0, 0))
        with pytest.raises(GenerateError):
            await admission.enter(far, work=10, slo=Slo(ttft_s=1.0))
        admission._admitted -= PROBE_S  # nothing let go for PROBE_S: the next one probes
        probe = await asyncio.wait_for(admission.enter(far, work=10, slo=Slo(ttft_s=1.0)), 0.5)
        assert probe.prediction is not None and probe.prediction.own_s >= 9.0

    asyncio.run(run())


def test_a_decode_node_takes_requests_only_while_its_batch_meets_the_tpot_target():
    async def run():
        decode, prefill = _pools(capacity=64)
        node = decode.nodes[0]
        for batch in range(1, 2 * MIN_SAMPLES + 1):
            node.tpot.add(batch, 0.01 * batch)  # 10 ms per request in the batch
        admission = Admission(decode, RouterMetrics(), prefill=prefill)
        far = time.monotonic() + 60
        for _ in range(4):
            await asyncio.wait_for(admission.enter(far, slo=Slo(tpot_s=0.05)), 0.5)
            decode.acquire(node)
        # A fifth makes a batch of 5 (50 ms): still within; a sixth would not be.
        await asyncio.wait_for(admission.enter(far, slo=Slo(tpot_s=0.05)), 0.5)
        decode.acquire(node)
        sixth = asyncio.create_task(admission.enter(far, slo=Slo(tpot_s=0.05)))
        loose = asyncio.create_task(admission.enter(far, slo=Slo(tpot_s=1.0)))
        await asyncio.sleep(0.05)
        assert not sixth.done() and not loose.done()  # in arrival order: behind the sixth
        decode.release(node)
        await asyncio.wait_for(sixth, 0.5)
        decode.acquire(node)
        await asyncio.wait_for(loose, 0.5)
        assert decode.pick(tpot_s=0.05) is node  # the only node: picked when all are full

    asyncio.run(run())


# ---------------------------------------------------------------- fair share between clients


def test_a_burst_of_one_client_does_not_take_the_turns_of_another():
    async def run():
        decode, prefill = _pools(capacity=1)
        node = decode.nodes[0]
        admission = Admission(decode, RouterMetrics(), prefill=prefill, weights={"gold": 2})
        decode.acquire(node)  # full: everything queues
        far = time.monotonic() + 60
        order: list[str] = []

        async def request(client: str) -> None:
            await admission.enter(far, work=100, client=client)
            order.append(client)

        tasks = [asyncio.create_task(request("heavy")) for _ in range(12)]
        await asyncio.sleep(0.01)
        tasks += [asyncio.create_task(request("light")) for _ in range(3)]
        tasks += [asyncio.create_task(request("gold")) for _ in range(4)]
        await asyncio.sleep(0.01)
        # A newcomer of a client with nothing queued stands near the front, not behind 19.
        assert admission._queue.position("other") == 5  # 1 / its share (weights 1+1+2+1)
        for _ in range(19):
            decode.release(node)  # one slot frees: the head goes and takes it
            await asyncio.sleep(0.005)
            decode.acquire(node)
        await asyncio.gather(*tasks)
        # heavy came first but shares by weight (1:1:2): within 10 turns light's 3 and gold's 4
        # have all gone, heavy has had 3, not the first 12
        first_ten = order[:10]
        assert first_ten.count("light") == 3 and first_ten.count("gold") == 4, order
        assert order.count("heavy") == 12 and len(admission) == 0

    asyncio.run(run())


def test_one_client_alone_keeps_arrival_order():
    async def run():
        decode, prefill = _pools(capacity=1)
        node = decode.nodes[0]
        admission = Admission(decode, RouterMetrics(), prefill=prefill)
        decode.acquire(node)
        far = time.monotonic() + 60
        order: list[int] = []

        async def request(i: int) -> None:
            await admission.enter(far, work=random.randint(1, 500), client="only")
            order.append(i)

        tasks = []
        for i in range(8):
            tasks.append(asyncio.create_task(request(i)))
            await asyncio.sleep(0.002)
        for _ in range(8):
            decode.release(node)
            await asyncio.sleep(0.005)
            decode.acquire(node)
        await asyncio.gather(*tasks)
        assert order == list(range(8))

    asyncio.run(run())


def test_a_deadline_leaves_its_request_the_time_decoding_takes():
    """Served requests took 10 s from their first token to their end: one with 10.3 s left
    before its deadline must have its first token within 0.3 s, whatever its 20 s TTFT target
    (it is refused near 0.3 s, far from the 10.3 s of its deadline: no bet on the machine)."""

    async def run():
        decode, prefill = _pools()
        metrics = RouterMetrics()
        admission = Admission(decode, metrics, prefill=prefill)
        for _ in range(MIN_SAMPLES):
            admission.note_decoded(10.0)
        decode.acquire(decode.nodes[0])  # full: it queues
        start = time.monotonic()
        with pytest.raises(GenerateError):
            await admission.enter(start + 10.3, work=10, slo=Slo(ttft_s=20.0), arrival=start)
        assert 0.15 <= time.monotonic() - start < 5.0
        assert metrics.refused.labels(reason="slo_expired")._value.get() == 1

    asyncio.run(run())


def test_the_fair_queue_forgets_clients_that_left():
    """Many clients come once and go: the queue does not keep a virtual time for each forever."""
    from dataclasses import dataclass

    from splitserve.router.fair_queue import FairQueue

    @dataclass
    class W:
        client: str
        cost: int
        since: float

    queue: FairQueue[W] = FairQueue()
    steady = W("steady", 10, 0.0)
    queue.append(steady)
    steady_turns = 0
    for i in range(2_000):
        queue.append(W(f"c{i}", 10, float(i)))  # a client that comes once
        head = queue.head()
        assert head is not None
        queue.let_go(head)
        queue.remove(head)
        if head is steady:  # it always has one more waiting
            steady_turns += 1
            steady = W("steady", 10, float(i))
            queue.append(steady)
    assert steady_turns >= 10  # not kept behind the stream of newcomers for good
    assert len(queue._vtime) <= 2 * len(queue) + 65  # the ones that left are forgotten
