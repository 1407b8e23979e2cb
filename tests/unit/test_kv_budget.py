"""The router's per-decode-node KV ledger (router/kv_budget.py): shared prompt blocks counted
once, private blocks per request, growth past the reserve, the limit and its headroom."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.router.kv_budget import KVDemand, KVLedger


def _prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def test_a_shared_prefix_is_counted_once_and_private_blocks_per_request():
    prefix = _prompt(64, 1)  # 4 full blocks
    a = KVDemand.of(prefix + _prompt(40, 2), "", 8, 16, 256)  # 6 full, tail 8 + 8 out = 1
    b = KVDemand.of(prefix + _prompt(40, 3), "", 8, 16, 256)
    assert len(a.hashes) == 6 and a.private_blocks == 1
    ledger = KVLedger()
    ledger.take(a)
    assert ledger.used == 7
    assert ledger.added(b) == 2 + 1  # its 2 own full blocks and its private one
    ledger.take(b)
    assert ledger.used == 10
    ledger.give_back(a)
    assert ledger.used == 7  # b still holds the shared prefix
    ledger.give_back(b)
    assert ledger.used == 0


def test_another_salt_shares_nothing():
    prompt = _prompt(64, 4)
    ledger = KVLedger()
    ledger.take(KVDemand.of(prompt, "tenant-a", 1, 16, 256))
    assert ledger.added(KVDemand.of(prompt, "tenant-b", 1, 16, 256)) == 5
    assert ledger.added(KVDemand.of(prompt, "tenant-a", 1, 16, 256)) == 1


def test_the_output_is_reserved_up_to_the_cap_and_charged_as_it_grows():
    d = KVDemand.of(_prompt(32, 5), "", 1000, 16, reserve_tokens=32)
    assert d.private_blocks == 2  # 32 output tokens: two blocks past the prompt's two
    ledger = KVLedger()
    ledger.take(d)
    ledger.grow(d, 20)  # within the reserve: nothing more
    assert ledger.used == 4
    ledger.grow(d, 40)  # 32 + 41 tokens: 5 blocks in all
    assert ledger.used == 5 and d.private_blocks == 3
    ledger.give_back(d)
    assert ledger.used == 0


def test_the_limit_keeps_the_headroom_and_a_large_request_goes_alone():
    ledger = KVLedger(headroom=0.1)
    assert ledger.fits(KVDemand.of(_prompt(5000, 6), "", 1, 16, 256))  # capacity not known yet
    ledger.num_blocks = 100
    assert ledger.limit == 90
    big = KVDemand.of(_prompt(95 * 16, 7), "", 1, 16, 256)  # 96 blocks: over the budget
    assert ledger.fits(big) and ledger.can_ever_fit(big)  # empty: it goes alone
    ledger.take(KVDemand.of(_prompt(16, 8), "", 1, 16, 256))
    assert not ledger.fits(big)
    huge = KVDemand.of(_prompt(101 * 16, 9), "", 1, 16, 256)
    assert not ledger.can_ever_fit(huge)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 200), st.booleans()), max_size=30))
def test_the_ledger_is_the_union_of_what_is_held(ops):
    """Whatever the order of takes and give-backs, ``used`` is the number of distinct prompt
    blocks held plus the private ones, and returns to 0."""
    prefixes = [_prompt(48, 100 + i) for i in range(4)]
    ledger = KVLedger()
    held = []
    for i, (prefix, tail, give) in enumerate(ops):
        if give and held:
            ledger.give_back(held.pop(i % len(held)))
        else:
            d = KVDemand.of(prefixes[prefix] + _prompt(tail, i), "", 4, 16, 256)
            ledger.take(d)
            held.append(d)
        distinct = {h for d in held for h in d.hashes}
        assert ledger.used == len(distinct) + sum(d.private_blocks for d in held)
    for d in held:
        ledger.give_back(d)
    assert ledger.used == 0


def test_a_router_with_a_capacity_share_fills_only_its_share_of_the_node():
    """Two routers in front of one decode node, each with half: together they never charge
    more than the node holds; a prompt larger than a share but not than the node still goes
    alone."""
    from splitserve.router.kv_budget import KVDemand, KVLedger

    ledgers = [KVLedger(share=0.5), KVLedger(share=0.5)]
    for ledger in ledgers:
        ledger.num_blocks = 100
    taken = 0
    for i in range(200):
        ledger = ledgers[i % 2]
        demand = KVDemand.of([i] * 40, f"s{i}", 8, 16, 8)  # 3 blocks, none shared
        if ledger.fits(demand):
            ledger.take(demand)
            taken += demand.total_blocks
    assert taken <= 100 and all(ledger.used <= 50 for ledger in ledgers)
    big = KVDemand.of(list(range(16 * 70)), "big", 1, 16, 1)  # 71 blocks: over a share of 50
    alone = KVLedger(share=0.5)
    alone.num_blocks = 100
    assert alone.fits(big) and alone.can_ever_fit(big)
