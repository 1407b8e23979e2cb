"""KVCacheManager: the blocks of each request on top of one BlockPool."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from splitserve.kvstore.block import KVCacheBlock
from splitserve.kvstore.block_pool import BlockPool
from splitserve.kvstore.hashing import BlockHash


class ComputedBlocks(NamedTuple):
    """The longest cached prefix of a request: full blocks only."""

    blocks: list[KVCacheBlock]
    num_computed_tokens: int


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters since start: lookups, and tokens asked for vs. found in the local cache
    (``hit_tokens``: in the pool; ``host_hit_tokens``: further, in the host tier)."""

    requests: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    host_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class SlotUsage(NamedTuple):
    """KV slot utilisation of the blocks in use: ``tokens_held / token_slots``.

    ``token_slots``: every block in use (ref count > 0) once, times the block size — a prefix
    block shared by k requests is allocated once and counted once; ``tokens_held``: the tokens
    those blocks hold, also once. Blocks in use are the requests' (running; a prefill node's held
    until shipped; a decode node's transferred in, or being written by a transfer) plus cached
    blocks pinned while a peer reads them (full). A token is held from the allocation of its slot
    (the step that computes it, the reservation a transfer writes into); the engine allocates no
    slot ahead, so between steps that is exactly the tokens whose KV is stored.
    """

    tokens_held: int
    token_slots: int

    @property
    def utilization(self) -> float:
        """``tokens_held / token_slots``; NaN when no block is in use (undefined, not 0 or 1:
        averaging over time, use the ratio of the two sums instead)."""
        return self.tokens_held / self.token_slots if self.token_slots else math.nan


class KVCacheManager:
    """Per-request block tables over a :class:`BlockPool`.

    The life of a request: ``get_computed_blocks`` (prefix-cache lookup) → ``allocate_slots`` (the
    cached prefix plus new blocks for the tokens to compute; all or nothing) → the model writes KV →
    ``cache_blocks`` (newly full blocks become reusable) → more ``allocate_slots`` as it decodes →
    ``free``. Lookup and allocation must happen in the same scheduling step: blocks found free in
    the cache may be evicted by any allocation in between.
    """

    def __init__(self, block_pool: BlockPool, block_size: int, enable_caching: bool = True):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        # Slot utilisation, kept incrementally: the tokens each request's slots are allocated
        # for, and the sum over requests of their blocks' slots not allocated to a token. Only a
        # request's partial tail block has such slots, and a partial block is never cached, so
        # never shared: no slot is counted twice.
        self.num_tokens: dict[str, int] = {}
        self.num_unfilled_slots = 0

    # ---------------------------------------------------------------- lookup

    def get_computed_blocks(
        self, block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> ComputedBlocks:
        """Longest run of leading blocks of a request of ``num_tokens`` tokens found in the cache.

        NOTE: at most ``(num_tokens - 1) // block_size`` blocks, so at least one prompt token is
        left to compute: the first output token needs its logits.
        """
        if not self.enable_caching or num_tokens <= 0:
            return ComputedBlocks([], 0)
        max_blocks = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        lookup = self.block_pool.cached_block_hash_to_block.get
        blocks = []
        for block_hash in block_hashes[:max_blocks]:
            block = lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_computed = len(blocks) * self.block_size
        self.stats.requests += 1
        self.stats.queried_tokens += num_tokens
        self.stats.hit_tokens += num_computed
        return ComputedBlocks(blocks, num_computed)

    # ---------------------------------------------------------------- allocation

    def allocate_slots(
        self,
        request_id: str,
        num_tokens: int,
        computed_blocks: ComputedBlocks | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make the request's blocks cover ``num_tokens`` tokens in all (cached + computed + new).

        ``computed_blocks`` (from ``get_computed_blocks``) are only accepted for a request that has
        no blocks yet. Returns the newly allocated blocks, or ``None`` when the pool is short, in
        which case nothing changed (no partial allocation, no reference taken). Prefix blocks that
        are not this pool's raise ``ValueError``, also with nothing changed.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be non-negative, got {num_tokens}")
        blocks = self.req_to_blocks.get(request_id)
        prefix = computed_blocks.blocks if computed_blocks is not None else []
        if prefix and blocks:
            raise ValueError(
                f"request {request_id!r} already has blocks; cached prefix blocks can only be "
                "given on its first allocation"
            )
        num_held = (len(blocks) if blocks else 0) + len(prefix)
        num_new = -(-num_tokens // self.block_size) - num_held
        pool = self.block_pool
        # NOTE: a cached prefix block that is free sits in the free queue, so touching it uses up
        # free capacity just as a new block does.
        num_free_needed = max(num_new, 0)
        if prefix:
            num_free_needed += sum(1 for b in prefix if b.ref_cnt == 0)
        if num_free_needed > pool.num_free_blocks:
            return None
        if prefix:
            # NOTE: touched before the request gets an entry: ``touch`` checks every block first
            # (another pool's block, the null block: ValueError) and then changes nothing, so a
            # refused prefix leaves no trace of the request here (a decode node would otherwise
            # refuse a retry of the same id as "already on this node"). Touching before
            # ``get_new_blocks`` also keeps that allocation from evicting these free prefix blocks.
            pool.touch(prefix)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
            self.num_cached_blocks[request_id] = 0
        num_before = len(blocks)
        if prefix:
            blocks.extend(prefix)
            self.num_cached_blocks[request_id] = len(prefix)
        new_blocks = pool.get_new_blocks(num_new) if num_new > 0 else []
        blocks.extend(new_blocks)
        held = max(self.num_tokens.get(request_id, 0), num_tokens, len(prefix) * self.block_size)
        self._set_num_tokens(request_id, num_before, len(blocks), held)
        return new_blocks

    def adopt_blocks(
        self, request_id: str, block_hashes: Sequence[BlockHash]
    ) -> list[KVCacheBlock] | None:
        """Start a request from full blocks shipped by another node, addressed by hash.

        Hashes this node caches are touched; the others get new blocks. Returns the blocks whose KV
        the caller must now write (in hash order), or ``None`` when the pool is short (nothing
        changed). Once written, ``cache_blocks(request_id, block_hashes, n * block_size)``
        registers them; until then no other request can find them, and ``free`` drops them.
        """
        if self.req_to_blocks.get(request_id):
            raise ValueError(f"request {request_id!r} already has blocks; adopt before allocating")
        try:
            adoption = self.block_pool.adopt_blocks(block_hashes)
        except ValueError:
            return None
        self.req_to_blocks[request_id] = adoption.blocks
        self.num_cached_blocks[request_id] = 0
        num_blocks = len(adoption.blocks)
        self._set_num_tokens(request_id, 0, num_blocks, num_blocks * self.block_size)
        return [b for b, new in zip(adoption.blocks, adoption.is_new, strict=True) if new]

    # ---------------------------------------------------------------- caching / freeing

    def cache_blocks(
        self, request_id: str, block_hashes: Sequence[BlockHash], num_computed_tokens: int
    ) -> None:
        """Register the request's blocks made full by its first ``num_computed_tokens`` tokens.

        Call after their KV is written. ``block_hashes`` are the request's chained block hashes.
        """
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks[request_id]
        num_cached = self.num_cached_blocks[request_id]
        num_full = min(num_computed_tokens // self.block_size, len(block_hashes))
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(blocks, block_hashes, num_cached, num_full)
        self.num_cached_blocks[request_id] = num_full

    def free(self, request_id: str) -> None:
        """Release a finished, aborted or preempted request's blocks (unknown ids are ignored).

        Tail blocks are freed first, so they are evicted before the prefix blocks that more
        requests are likely to share.
        """
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        if blocks is not None:
            held = self.num_tokens.pop(request_id, 0)
            self.num_unfilled_slots -= len(blocks) * self.block_size - held
        if blocks:
            blocks.reverse()
            self.block_pool.free_blocks(blocks)

    def _set_num_tokens(
        self, request_id: str, num_blocks_before: int, num_blocks: int, num_tokens: int
    ) -> None:
        """The request, which had ``num_blocks_before`` blocks, now has ``num_blocks`` holding
        ``num_tokens`` tokens (at most their slots)."""
        bs = self.block_size
        held = min(num_tokens, num_blocks * bs)
        unfilled_before = num_blocks_before * bs - self.num_tokens.get(request_id, 0)
        self.num_tokens[request_id] = held
        self.num_unfilled_slots += num_blocks * bs - held - unfilled_before

    # ---------------------------------------------------------------- figures

    def slot_usage(self) -> SlotUsage:
        """Tokens held and token slots of the blocks in use, O(1) (see :class:`SlotUsage`).

        Safe to call from another thread than the one allocating: it reads two counters. A read
        racing an allocation may be off by that request's tail block for that once (clamped to
        ``0 <= tokens_held <= token_slots``).
        """
        pool = self.block_pool
        slots = (pool.num_blocks - 1 - pool.num_free_blocks) * self.block_size
        held = slots - self.num_unfilled_slots
        return SlotUsage(min(max(held, 0), slots), slots)

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's blocks in order (a copy; empty when it holds none)."""
        return list(self.req_to_blocks.get(request_id, ()))

    def has_request(self, request_id: str) -> bool:
        return request_id in self.req_to_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    @property
    def num_requests(self) -> int:
        return len(self.req_to_blocks)
