"""The router's node choice: least loaded, cache-aware within the imbalance guard, down nodes;
and the route choice (disaggregated or direct, router.dispatch.choose_route)."""

from __future__ import annotations

import pytest

from splitserve.kvstore.redis_index import Held
from splitserve.router.dispatch import DIRECT, DISAGGREGATED, DispatchPolicy, choose_route
from splitserve.router.pool import MAX_IMBALANCE, DecodePool, PrefillPool, prompt_tokens_to_compute
from splitserve.router.prefix import CachedPrefix, block_worth


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pick_least_loaded_with_round_robin_among_ties():
    pool = DecodePool(["a:1", "b:2", "c:3"], clock=FakeClock())
    a, b, c = pool.nodes
    picked = [pool.pick() for _ in range(6)]
    assert [n.address for n in picked] == ["a:1", "b:2", "c:3"] * 2
    pool.acquire(a)
    pool.acquire(b)
    assert pool.pick() is c
    pool.acquire(c)
    pool.acquire(c)
    assert {pool.pick(), pool.pick()} == {a, b}
    pool.release(a)
    assert pool.pick() is a
    assert pool.pick(exclude={a}) is b


def test_cache_aware_pick_on_decode_keeps_within_the_imbalance_guard():
    pool = DecodePool(["a:1", "b:2"], clock=FakeClock())
    a, b = pool.nodes
    cached = {"a:1": 5}
    for _ in range(MAX_IMBALANCE):
        assert pool.pick(cached=cached) is a
        pool.acquire(a)
    assert pool.pick(cached=cached) is a  # at the guard's limit: still the node with the blocks
    pool.acquire(a)
    assert pool.pick(cached=cached) is b  # beyond it: the burst goes elsewhere


def test_prefill_pick_weighs_cached_prefix_against_queued_work():
    pool = PrefillPool(["a:1", "b:2"], clock=FakeClock())
    a, b = pool.nodes
    cached = {"a:1": 18}  # a holds 288 of the prompt's 320 tokens: 32 to compute there
    order = []
    for _ in range(12):
        node = pool.pick(cached=cached, prompt_tokens=320)
        work = prompt_tokens_to_compute(320, cached.get(node.address, 0), 16)
        pool.acquire(node, work)
        order.append(node.address)
    # a takes requests until its queue (9 x 32 = 288 tokens) plus 32 reaches b's 320; then b.
    assert order[:9] == ["a:1"] * 9 and "b:2" in order[9:11]
    assert b.queued_tokens == 320 and a.queued_tokens == 32 * order.count("a:1")
    pool.release(b, 320)
    assert b.queued_tokens == 0
    # Without an index: the node with less queued work, whatever the request counts.
    assert pool.pick(prompt_tokens=100) is b
    assert prompt_tokens_to_compute(320, 20, 16) == 1  # the last token is always computed


def test_down_nodes_are_skipped_then_tried_again():
    clock = FakeClock()
    pool = PrefillPool(["a:1", "b:2"], clock=clock, down_s=3.0)
    a, b = pool.nodes
    pool.acquire(b)  # b is busier, but a is down
    pool.mark_down(a, "UNAVAILABLE: connection refused")
    assert all(pool.pick() is b for _ in range(3))
    assert "a:1 (down: UNAVAILABLE" in pool.describe()
    clock.now += 3.0
    assert pool.pick() is a  # back after the down period
    pool.mark_down(a, "again")
    clock.now += 1.0
    pool.mark_down(b, "b too")
    assert pool.pick() is a  # all down: the oldest failure is tried rather than none
    assert pool.pick(exclude={a, b}) is None
    pool.mark_up(b)
    assert pool.pick() is b


def test_route_direct_without_a_usable_prefill_node_or_for_a_short_uncached_prompt():
    clock = FakeClock()
    prefill = PrefillPool(["p:1", "p:2"], clock=clock)
    (d,) = DecodePool(["d:1"], clock=clock).nodes
    off, short = DispatchPolicy(), DispatchPolicy(direct_prefill_tokens=32)

    def route(policy, n, cached=None, exclude=()):
        return choose_route(policy, prefill, d, cached or {}, n, 16, exclude)

    assert route(off, 1) == DISAGGREGATED  # 0: never, however short
    assert route(short, 32) == DIRECT
    assert route(short, 33) == DISAGGREGATED
    # The uncached part on the chosen decode node counts (a prefix on a prefill node does not).
    assert route(short, 80, {"d:1": 3}) == DIRECT
    assert route(short, 80, {"d:1": 2, "p:1": 5}) == DISAGGREGATED
    # No usable prefill node: direct whatever the policy.
    assert route(off, 500, exclude=prefill.nodes[:1]) == DISAGGREGATED
    assert route(off, 500, exclude=prefill.nodes) == DIRECT
    prefill.mark_down(prefill.nodes[0], "gone")
    assert route(off, 500, exclude=prefill.nodes[1:]) == DIRECT
    assert choose_route(off, PrefillPool([]), d, {}, 500, 16) == DIRECT


def test_route_direct_when_every_prefill_node_is_backlogged_and_the_decode_node_has_a_slot():
    prefill = PrefillPool(["p:1", "p:2"])
    (d,) = DecodePool(["d:1"]).nodes
    policy = DispatchPolicy(direct_prefill_backlog_tokens=1000)
    p1, p2 = prefill.nodes
    prefill.acquire(p1, 1500)
    assert choose_route(policy, prefill, d, {}, 500, 16) == DISAGGREGATED  # p2 is free
    prefill.acquire(p2, 1000)
    assert choose_route(policy, prefill, d, {}, 500, 16) == DISAGGREGATED  # slots unknown
    d.slots = 2
    assert choose_route(policy, prefill, d, {}, 500, 16) == DIRECT
    d.in_flight = 2  # no free batch slot
    assert choose_route(policy, prefill, d, {}, 500, 16) == DISAGGREGATED
    assert choose_route(DispatchPolicy(), prefill, d, {}, 500, 16) == DISAGGREGATED


class _Rates:
    """A node's figures as the router keeps them: tier load times and a prefill rate."""

    def __init__(self, load_s: dict[str, float], rate: float | None) -> None:
        self.tier_block_load_s, self._rate = load_s, rate

    def prefill_tokens_per_s(self) -> float | None:
        return self._rate


def test_a_prefix_in_a_slower_tier_is_worth_what_its_load_saves():
    # 16-token blocks at 16,000 tokens/s: 1 ms to compute a block.
    fast = _Rates({"host": 0.0001, "disk": 0.0005}, 16_000.0)
    slow = _Rates({"host": 0.0001, "disk": 0.003}, 16_000.0)  # a disk slower than computing
    assert block_worth("host", fast, 16) == pytest.approx(0.9)
    assert block_worth("disk", fast, 16) == pytest.approx(0.5)
    assert block_worth("disk", slow, 16) == 0.0
    # Not measured (no load yet, or no prefill rate yet): as good as the pool, as before.
    assert block_worth("disk", _Rates({}, 16_000.0), 16) == 1.0
    assert block_worth("host", _Rates({"host": 0.0001}, None), 16) == 1.0
    assert block_worth("host", None, 16) == 1.0
    held = {"a": Held(device=4, host=10), "b": Held(disk=10), "c": Held(device=2, disk=8)}
    cached = CachedPrefix(held, {"a": fast, "b": slow, "c": fast}, 16)
    assert cached == pytest.approx({"a": 13.0, "b": 0.0, "c": 6.0})
    # What a peer can send: its pool's and its host tier's blocks, not its disk's.
    assert cached.peer_blocks("a") == 14 and cached.peer_blocks("c") == 2
    assert cached.peer_blocks("x") == 0


def test_prefill_pick_prices_each_tier_against_computing():
    """Two idle prefill nodes hold the same 18 blocks of a 320-token prompt: one in its pool,
    one on a disk slower than computing. The pool's holder takes the prompt; with the disk as
    fast as the pool would be, the choice is a tie (round robin)."""
    pool = PrefillPool(["a:1", "b:2"], clock=FakeClock())
    a, b = pool.nodes
    held = {"a:1": Held(disk=18), "b:2": Held(device=18)}
    for node in (a, b):
        node.tier_block_load_s = {"disk": 0.003}
        node.rate = _MeasuredRate(16_000.0)  # type: ignore[assignment]
    cached = CachedPrefix(held, {n.address: n for n in pool.nodes}, 16)
    assert [pool.pick(cached=cached, prompt_tokens=320) for _ in range(3)] == [b] * 3
    a.tier_block_load_s = {"disk": 0.0}
    cached = CachedPrefix(held, {n.address: n for n in pool.nodes}, 16)
    assert {pool.pick(cached=cached, prompt_tokens=320) for _ in range(2)} == {a, b}
    # The work a node is charged with is whole tokens: what its loads do not save.
    assert prompt_tokens_to_compute(320, 0.5, 16) == 312


class _MeasuredRate:
    def __init__(self, rate: float) -> None:
        self._rate = rate

    def rate(self) -> float:
        return self._rate


def test_a_nodes_reported_tier_times_are_checked_before_use():
    """GetStats comes from another process: unknown tiers, NaN, negative or absurd times are
    dropped (the tier then counts as unmeasured), the rest kept."""
    from splitserve.router.registry import tier_times
    from splitserve.v1 import nodes_pb2

    stats = nodes_pb2.GetStatsResponse(
        tier_block_load_s={
            "host": 0.0001,
            "disk": float("nan"),
            "store": -1.0,
            "gpu0": 0.5,
            "x" * 1000: 1.0,
        }
    )
    assert tier_times(stats) == {"host": 0.0001}
    stats = nodes_pb2.GetStatsResponse(tier_block_load_s={"disk": 1e9, "store": 0.002})
    assert tier_times(stats) == {"store": 0.002}
