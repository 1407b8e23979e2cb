"""Property-based stateful test: random request traffic through KVCacheManager + BlockPool.

After every step the pool's invariants hold, and every reference is accounted for: a block's
ref count equals the number of live requests whose block table holds it.
"""

from collections import Counter

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from splitserve.kvstore import (
    BlockPool,
    BlockStored,
    KVCacheManager,
    ModelIdentity,
    hash_request_tokens,
)

BS = 2
ROOT = ModelIdentity("m", block_size=BS).root_hash
# A tiny vocabulary and a few shared "system prompts" make prefix hits and evictions frequent.
SYSTEM_PROMPTS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9], [7, 7, 7, 7, 7, 7, 7, 7]]
tokens_st = st.lists(st.integers(0, 3), min_size=0, max_size=12)


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 24), events=st.booleans())
    def setup(self, num_blocks, events):
        self.pool = BlockPool(num_blocks, enable_events=events)
        self.mgr = KVCacheManager(self.pool, BS)
        self.tokens: dict[str, list[int]] = {}
        self.next_id = 0
        self.cached_hashes: set[bytes] = set()  # mirrored from events

    def _new_id(self):
        self.next_id += 1
        return f"r{self.next_id}"

    @rule(
        prefix=st.sampled_from(range(len(SYSTEM_PROMPTS) + 1)),
        suffix=tokens_st,
        salt=st.sampled_from([None, None, "t1"]),
    )
    def new_request(self, prefix, suffix, salt):
        tokens = (SYSTEM_PROMPTS[prefix] if prefix < len(SYSTEM_PROMPTS) else []) + suffix
        if not tokens:
            return
        rid = self._new_id()
        hashes = hash_request_tokens(tokens, BS, ROOT, salt)
        computed = self.mgr.get_computed_blocks(hashes, len(tokens))
        free_before = self.pool.num_free_blocks
        new = self.mgr.allocate_slots(rid, len(tokens), computed)
        if new is None:
            assert self.pool.num_free_blocks == free_before
            assert rid not in self.mgr.req_to_blocks
            return
        for hit, block in zip(computed.blocks, self.mgr.req_to_blocks[rid], strict=False):
            assert hit is block
        self.mgr.cache_blocks(rid, hashes, len(tokens))
        self.tokens[rid] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(1, 5))
    def decode(self, data, n):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        grown = self.tokens[rid] + data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
        if self.mgr.allocate_slots(rid, len(grown)) is None:
            return  # a real scheduler would preempt; the request keeps what it had
        self.tokens[rid] = grown
        self.mgr.cache_blocks(rid, hash_request_tokens(grown, BS, ROOT), len(grown))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        del self.tokens[rid]
        self.mgr.free(rid)

    @rule(
        prefix=st.sampled_from(range(len(SYSTEM_PROMPTS))),
        suffix=tokens_st,
        write_arrives=st.booleans(),
    )
    def adopt(self, prefix, suffix, write_arrives):
        tokens = SYSTEM_PROMPTS[prefix] + suffix
        hashes = hash_request_tokens(tokens, BS, ROOT)
        cached = {h for h in hashes if self.pool.get_cached_block(h) is not None}
        rid = self._new_id()
        expected_new = sum(1 for h in set(hashes) if self.pool.get_cached_block(h) is None)
        to_write = self.mgr.adopt_blocks(rid, hashes)
        if to_write is None:
            assert rid not in self.mgr.req_to_blocks
            return
        assert len(to_write) == expected_new
        assert all(self.pool.get_cached_block(h) is None for h in hashes if h not in cached)
        if write_arrives:  # the data came: register the blocks; else the request is dropped
            self.mgr.cache_blocks(rid, hashes, len(hashes) * BS)
            self.tokens[rid] = tokens[: len(hashes) * BS]
        else:
            self.mgr.free(rid)

    @rule(n=st.integers(0, 30))
    def raw_allocate_and_release(self, n):
        """Allocation pressure outside the manager: evicts cached free blocks LRU-first."""
        if n > self.pool.num_free_blocks:
            return
        blocks = self.pool.get_new_blocks(n)
        assert all(b.block_hash is None and b.ref_cnt == 1 and not b.is_null for b in blocks)
        self.pool.free_blocks(blocks)

    @invariant()
    def pool_invariants(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        refs = Counter(b.block_id for blocks in self.mgr.req_to_blocks.values() for b in blocks)
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == refs.get(block.block_id, 0), block
        assert 0 not in refs
        assert set(self.mgr.req_to_blocks) == set(self.tokens)
        for rid, tokens in self.tokens.items():
            assert len(self.mgr.req_to_blocks[rid]) * BS >= len(tokens)

    @invariant()
    def events_mirror_the_hash_map(self):
        if not hasattr(self, "pool") or not self.pool.enable_events:
            return
        for event in self.pool.take_events():
            if isinstance(event, BlockStored):
                assert not self.cached_hashes & set(event.block_hashes)
                self.cached_hashes |= set(event.block_hashes)
            else:
                assert set(event.block_hashes) <= self.cached_hashes
                self.cached_hashes -= set(event.block_hashes)
        assert self.cached_hashes == set(self.pool.cached_block_hash_to_block)


KVCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheMachine = KVCacheMachine.TestCase
