"""KVCacheManager: prefix lookup, all-or-nothing allocation, caching, freeing, adoption."""

import random

import pytest

from splitserve.kvstore import (
    BlockPool,
    ComputedBlocks,
    KVCacheManager,
    ModelIdentity,
    hash_request_tokens,
)

BS = 4
ROOT = ModelIdentity("m", block_size=BS).root_hash


def _prompt(n):
    return [random.randrange(30_000) for _ in range(n)]


def _run_prefill(mgr, rid, tokens, salt=None):
    """What a node does for a new prompt: lookup, allocate, 'compute', cache."""
    hashes = hash_request_tokens(tokens, BS, ROOT, salt)
    computed = mgr.get_computed_blocks(hashes, len(tokens))
    new = mgr.allocate_slots(rid, len(tokens), computed)
    if new is None:
        return None, computed
    mgr.cache_blocks(rid, hashes, len(tokens))
    return hashes, computed


def test_prefix_hit_reuses_blocks_and_counts():
    mgr = KVCacheManager(BlockPool(64), BS)
    system = _prompt(3 * BS)
    a = system + _prompt(2 * BS + 1)
    b = system + _prompt(BS + 2)
    _run_prefill(mgr, "a", a)
    _, computed = _run_prefill(mgr, "b", b)
    assert computed.num_computed_tokens == 3 * BS
    assert mgr.get_block_ids("b")[:3] == mgr.get_block_ids("a")[:3]
    assert mgr.get_block_ids("b")[3:] != mgr.get_block_ids("a")[3:4]
    assert mgr.stats.requests == 2
    assert mgr.stats.queried_tokens == len(a) + len(b)
    assert mgr.stats.hit_tokens == 3 * BS
    for bid in mgr.get_block_ids("a")[:3]:
        assert mgr.block_pool.blocks[bid].ref_cnt == 2


def test_full_hit_still_leaves_one_token_to_compute():
    mgr = KVCacheManager(BlockPool(64), BS)
    tokens = _prompt(4 * BS)
    _run_prefill(mgr, "a", tokens)
    mgr.free("a")
    _, computed = _run_prefill(mgr, "again", tokens)
    assert computed.num_computed_tokens == 3 * BS  # last block recomputed for the logits


def test_prefix_survives_free_until_evicted():
    pool = BlockPool(9)
    mgr = KVCacheManager(pool, BS)
    tokens = _prompt(4 * BS + 1)
    _run_prefill(mgr, "a", tokens)
    mgr.free("a")
    assert pool.num_free_blocks == 8 and pool.num_cached_blocks == 4
    _, computed = _run_prefill(mgr, "b", tokens)
    assert computed.num_computed_tokens == 4 * BS
    mgr.free("b")
    # Another request takes every block: the cached prefix is evicted.
    assert mgr.allocate_slots("big", 8 * BS) is not None
    assert pool.num_cached_blocks == 0
    mgr.free("big")
    _, computed = _run_prefill(mgr, "c", tokens)
    assert computed.num_computed_tokens == 0


def test_decode_growth_allocates_one_block_per_block_size_tokens():
    mgr = KVCacheManager(BlockPool(32), BS)
    tokens = _prompt(2 * BS - 1)
    _run_prefill(mgr, "r", tokens)
    assert len(mgr.get_block_ids("r")) == 2
    assert mgr.allocate_slots("r", 2 * BS) == []
    new = mgr.allocate_slots("r", 2 * BS + 1)
    assert len(new) == 1 and len(mgr.get_block_ids("r")) == 3
    tokens += _prompt(2)
    hashes = hash_request_tokens(tokens, BS, ROOT)
    mgr.cache_blocks("r", hashes, len(tokens))
    assert mgr.num_cached_blocks["r"] == 2
    assert mgr.block_pool.get_cached_block(hashes[1]).block_id == mgr.get_block_ids("r")[1]


def test_allocation_is_all_or_nothing():
    pool = BlockPool(9)
    mgr = KVCacheManager(pool, BS)
    tokens = _prompt(3 * BS + 1)
    _run_prefill(mgr, "a", tokens)
    mgr.free("a")  # 3 cached free blocks + 5 plain free blocks
    hashes = hash_request_tokens(tokens + _prompt(5 * BS), BS, ROOT)
    computed = mgr.get_computed_blocks(hashes, 8 * BS + 1)
    assert computed.num_computed_tokens == 3 * BS
    # needs 3 touched free blocks + 6 new = 9 > 8 free: refused, nothing taken
    before = [(b.ref_cnt, b.block_hash) for b in pool.blocks]
    assert mgr.allocate_slots("b", 9 * BS, computed) is None
    assert [(b.ref_cnt, b.block_hash) for b in pool.blocks] == before
    assert mgr.get_block_ids("b") == [] and mgr.num_requests == 0
    pool.check_invariants()
    assert mgr.allocate_slots("b", 8 * BS, computed) is not None
    assert pool.num_free_blocks == 0


@pytest.mark.parametrize("bad", ["foreign", "null"])
def test_refused_prefix_leaves_no_trace_of_the_request(bad):
    pool = BlockPool(16)
    mgr = KVCacheManager(pool, BS)
    _run_prefill(mgr, "other", _prompt(2 * BS + 1))  # some blocks in use, some cached
    tokens = _prompt(random.randrange(2 * BS + 1, 5 * BS))
    if bad == "foreign":
        elsewhere = KVCacheManager(BlockPool(16), BS)
        hashes, _ = _run_prefill(elsewhere, "x", tokens)
        computed = elsewhere.get_computed_blocks(hashes, len(tokens))
        assert computed.blocks  # really blocks of the other pool
    else:
        computed = ComputedBlocks([pool.null_block], BS)
    before = [(b.ref_cnt, b.block_hash) for b in pool.blocks]
    num_free = pool.num_free_blocks
    with pytest.raises(ValueError):
        mgr.allocate_slots("r", len(tokens), computed)
    assert not mgr.has_request("r") and mgr.get_blocks("r") == [] and mgr.num_requests == 1
    assert [(b.ref_cnt, b.block_hash) for b in pool.blocks] == before
    assert pool.num_free_blocks == num_free
    pool.check_invariants()
    # The same id is then allocated normally, from this pool's own lookup.
    hashes, computed = _run_prefill(mgr, "r", tokens)
    assert hashes is not None and mgr.has_request("r")
    assert len(mgr.get_block_ids("r")) == -(-len(tokens) // BS)
    mgr.free("r")
    mgr.free("other")
    pool.check_invariants()
    assert pool.num_free_blocks == 15


def test_free_is_idempotent_for_unknown_ids_and_returns_everything():
    pool = BlockPool(16)
    mgr = KVCacheManager(pool, BS)
    for i in range(3):
        _run_prefill(mgr, f"r{i}", _prompt(random.randrange(1, 4 * BS)))
    for i in range(3):
        mgr.free(f"r{i}")
    mgr.free("never-seen")
    assert pool.num_free_blocks == 15 and mgr.num_requests == 0
    pool.check_invariants()


def test_salted_requests_never_share():
    mgr = KVCacheManager(BlockPool(64), BS)
    tokens = _prompt(4 * BS + 1)
    _run_prefill(mgr, "a", tokens, salt="tenant-a")
    _, computed = _run_prefill(mgr, "b", tokens, salt="tenant-b")
    assert computed.num_computed_tokens == 0
    _, computed = _run_prefill(mgr, "a2", tokens, salt="tenant-a")
    assert computed.num_computed_tokens == 4 * BS


def test_adopt_shipped_blocks_then_decode():
    pool = BlockPool(16, enable_events=True)
    mgr = KVCacheManager(pool, BS)
    tokens = _prompt(5 * BS + 2)
    _hashes, _ = _run_prefill(mgr, "local", tokens[: 2 * BS + 1])
    pool.take_events()
    shipped = hash_request_tokens(tokens, BS, ROOT)
    to_write = mgr.adopt_blocks("remote", shipped)
    assert len(to_write) == 3  # the first two blocks were already here
    assert mgr.get_block_ids("remote")[:2] == mgr.get_block_ids("local")[:2]
    new_tail = mgr.allocate_slots("remote", len(tokens))
    assert len(new_tail) == 1
    with pytest.raises(ValueError, match="already has blocks"):
        mgr.adopt_blocks("remote", shipped)
    assert mgr.adopt_blocks("too-big", hash_request_tokens(_prompt(40 * BS), BS, ROOT)) is None
    assert "too-big" not in mgr.req_to_blocks
    mgr.free("remote")
    mgr.free("local")
    pool.check_invariants()
    assert pool.num_free_blocks == 15


def test_caching_disabled():
    mgr = KVCacheManager(BlockPool(16), BS, enable_caching=False)
    tokens = _prompt(3 * BS + 1)
    _run_prefill(mgr, "a", tokens)
    _, computed = _run_prefill(mgr, "b", tokens)
    assert computed.num_computed_tokens == 0 and mgr.block_pool.num_cached_blocks == 0


def test_bad_arguments():
    mgr = KVCacheManager(BlockPool(16), BS)
    with pytest.raises(ValueError, match="non-negative"):
        mgr.allocate_slots("r", -1)
    tokens = _prompt(2 * BS + 1)
    _run_prefill(mgr, "a", tokens)
    computed = mgr.get_computed_blocks(hash_request_tokens(tokens, BS, ROOT), len(tokens))
    with pytest.raises(ValueError, match="first allocation"):
        mgr.allocate_slots("a", len(tokens) + BS, computed)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(BlockPool(4), 0)
