"""FreeKVCacheBlockQueue and BlockPool: each operation, LRU eviction, events, bad input."""

import copy
import random

import pytest

from splitserve.kvstore.block import FreeKVCacheBlockQueue, KVCacheBlock
from splitserve.kvstore.block_pool import BlockPool, BlockRemoved, BlockStored
from splitserve.kvstore.hashing import ModelIdentity, hash_request_tokens

BS = 4


def _hashes(n, salt=None):
    tokens = [random.randrange(50_000) for _ in range(n * BS)]
    return hash_request_tokens(tokens, BS, ModelIdentity("m", block_size=BS).root_hash, salt)


def _snapshot(pool):
    """Everything observable about a pool, to prove a failed call changed nothing."""
    return (
        [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue],
        dict((h, b.block_id) for h, b in pool.cached_block_hash_to_block.items()),
        copy.copy(pool._events),
    )


# ------------------------------------------------------------------------- free queue


def test_free_queue_order_pop_append_remove():
    blocks = [KVCacheBlock(i) for i in range(8)]
    q = FreeKVCacheBlockQueue(blocks)
    assert [b.block_id for b in q] == list(range(8)) and len(q) == 8
    q.remove(blocks[3])
    q.remove(blocks[0])
    q.remove(blocks[7])
    assert [b.block_id for b in q] == [1, 2, 4, 5, 6]
    assert blocks[3].prev_free is None and blocks[3].next_free is None
    popped = q.popleft_n(2)
    assert [b.block_id for b in popped] == [1, 2]
    q.append_n([blocks[3], blocks[0]])
    assert [b.block_id for b in q] == [4, 5, 6, 3, 0] and len(q) == 5
    assert [b.block_id for b in q.popleft_n(5)] == [4, 5, 6, 3, 0]
    assert len(q) == 0 and list(q) == []
    q.append_n([blocks[6]])
    assert [b.block_id for b in q] == [6]


# ------------------------------------------------------------------------- pool basics


def test_null_block_is_reserved():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.num_free_blocks == 4
    got = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in got) == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in got)
    with pytest.raises(ValueError, match="null block"):
        pool.touch([pool.null_block])
    with pytest.raises(ValueError, match="null block"):
        pool.free_blocks([pool.null_block])
    pool.check_invariants()


def test_usage_figures():
    pool = BlockPool(11)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(5)
    assert pool.get_usage() == pytest.approx(0.5) and pool.num_free_blocks == 5
    pool.cache_full_blocks(blocks, _hashes(5), 0, 3)
    assert pool.num_cached_blocks == 3
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0 and pool.num_cached_blocks == 3


def test_free_tail_first_evicts_tail_first():
    pool = BlockPool(9)
    blocks = pool.get_new_blocks(8)
    hashes = _hashes(8)
    pool.cache_full_blocks(blocks, hashes, 0, 8)
    pool.free_blocks(reversed(blocks))  # a request's tail is evicted first
    evicted = pool.get_new_blocks(3)
    assert [b.block_id for b in evicted] == [b.block_id for b in blocks[::-1][:3]]
    assert all(b.block_hash is None for b in evicted)
    # The head of the prefix is still cached.
    for h, b in zip(hashes[:5], blocks[:5], strict=True):
        assert pool.get_cached_block(h) is b
    for h in hashes[5:]:
        assert pool.get_cached_block(h) is None
    pool.check_invariants()


def test_touch_revives_a_free_cached_block_and_protects_it_from_eviction():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    hashes = _hashes(4)
    pool.cache_full_blocks(blocks, hashes, 0, 4)
    pool.free_blocks(blocks)
    hit = pool.get_cached_block(hashes[0])
    assert hit is blocks[0] and hit.ref_cnt == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 3
    pool.touch([hit])
    assert hit.ref_cnt == 2
    others = pool.get_new_blocks(3)
    assert hit not in others
    assert pool.get_cached_block(hashes[0]) is hit
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 0
    pool.check_invariants()


def test_cache_full_blocks_range_and_duplicate_hash():
    pool = BlockPool(10)
    a = pool.get_new_blocks(3)
    hashes = _hashes(3)
    pool.cache_full_blocks(a, hashes, 0, 2)
    assert pool.num_cached_blocks == 2 and a[2].block_hash is None
    pool.cache_full_blocks(a, hashes, 2, 3)
    assert pool.get_cached_block(hashes[2]) is a[2]
    # A second request that computed the same content: the first block keeps the hash.
    b = pool.get_new_blocks(3)
    pool.cache_full_blocks(b, hashes, 0, 3)
    assert all(blk.block_hash is None for blk in b)
    assert [pool.get_cached_block(h) for h in hashes] == a
    with pytest.raises(ValueError, match="full blocks"):
        pool.cache_full_blocks(b, hashes, 0, 4)
    pool.check_invariants()


def test_events_report_stores_and_evictions():
    pool = BlockPool(4, enable_events=True)
    blocks = pool.get_new_blocks(3)
    hashes = _hashes(3)
    pool.cache_full_blocks(blocks, hashes, 0, 3)
    assert pool.take_events() == [BlockStored(hashes)]
    assert pool.take_events() == []
    pool.free_blocks(blocks)
    pool.get_new_blocks(2)
    assert pool.take_events() == [BlockRemoved(hashes[:2])]
    silent = BlockPool(4)
    silent.cache_full_blocks(silent.get_new_blocks(3), hashes, 0, 3)
    assert silent.take_events() == []


def test_adopt_touches_cached_and_allocates_missing_unregistered():
    pool = BlockPool(8, enable_events=True)
    hashes = _hashes(5)
    owner = pool.get_new_blocks(2)
    pool.cache_full_blocks(owner, hashes, 0, 2)
    pool.free_blocks(owner[1:])  # hashes[1] is cached but free
    pool.take_events()
    adoption = pool.adopt_blocks(hashes)
    assert adoption.is_new == [False, False, True, True, True]
    assert adoption.blocks[:2] == owner
    assert owner[0].ref_cnt == 2 and owner[1].ref_cnt == 1
    # Blocks whose data has not arrived are not findable yet.
    assert [pool.get_cached_block(h) for h in hashes[2:]] == [None] * 3
    assert pool.take_events() == []
    pool.check_invariants()
    # Data written: registering them makes them findable (and tells the index).
    pool.cache_full_blocks(adoption.blocks, hashes, 0, 5)
    assert [pool.get_cached_block(h) for h in hashes] == adoption.blocks
    assert pool.take_events() == [BlockStored(hashes[2:])]
    pool.check_invariants()


def test_adopt_never_evicts_a_block_it_reuses():
    """With the pool nearly full, allocating for the missing hashes must not evict a free cached
    block that the same adoption hits (it would then come back empty, marked as not new)."""
    pool = BlockPool(4)
    hashes = _hashes(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, hashes, 0, 3)
    pool.free_blocks(blocks)  # all three cached and free, block of hashes[0] first to evict
    new_hash = _hashes(1, salt="x")[0]
    adoption = pool.adopt_blocks([new_hash, hashes[0], hashes[1]])
    assert adoption.is_new == [True, False, False]
    assert adoption.blocks[1:] == blocks[:2]
    assert pool.get_cached_block(hashes[2]) is None  # the one block that had to go
    pool.check_invariants()


# ------------------------------------------------------------------------- bad input


def test_bad_input_raises_and_leaves_pool_unchanged():
    pool = BlockPool(6, enable_events=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, _hashes(3), 0, 2)
    pool.free_blocks([blocks[2]])
    before = _snapshot(pool)

    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([blocks[0], blocks[1], blocks[2]])  # blocks[2] is already free
    assert _snapshot(pool) == before
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([blocks[0], blocks[0]])  # ref 1, freed twice in one call
    assert _snapshot(pool) == before

    stranger = BlockPool(6).blocks[1]
    with pytest.raises(ValueError, match="does not belong"):
        pool.touch([blocks[0], stranger])
    with pytest.raises(ValueError, match="does not belong"):
        pool.touch([KVCacheBlock(99)])
    assert _snapshot(pool) == before

    with pytest.raises(ValueError, match="cannot allocate 6 blocks"):
        pool.get_new_blocks(6)
    with pytest.raises(ValueError, match="cannot allocate"):
        pool.get_new_blocks(-1)
    with pytest.raises(ValueError, match="cannot adopt"):
        pool.adopt_blocks(_hashes(5, salt="other"))
    assert _snapshot(pool) == before
    pool.check_invariants()
    # The next good call still works.
    assert len(pool.get_new_blocks(3)) == 3


def test_pool_needs_two_blocks():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)
