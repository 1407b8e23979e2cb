"""KVPort: the one door into an engine's KV for code that moves blocks between nodes.

Servicers, block shippers and receivers, peer fetch and the Redis publisher use this and nothing
else of the engine's pool and KV cache manager (vLLM V1 keeps the KV cache manager as the only
door into its block pool in the same way). Every method runs on the engine thread
(``AsyncEngine.call``): the engine holds no locks, so nothing here may run concurrently with a
step.

The exception: the figures a node reports (``stats``, ``slot_usage``, ``prefix_stats``, with
the engine's queue lengths and ``LLMEngine.pending_prefill_tokens``) are read from the event
loop (GetStats, the Redis heartbeat) and the metrics server's thread without a job, so that a
scrape never waits for a step: each reads integers, or copies a queue in one call that holds
the GIL, and never iterates a container the engine thread may change meanwhile. A read racing
a step sees that step half done (the figures are a moment's, not a consistent snapshot); none
writes. Anything that iterates the pool, the hash map or a request's blocks (``cache_snapshot``,
``take_events``, ``block_ids``, ...) goes through ``AsyncEngine.call``.

The sequence for blocks that come from elsewhere, whoever sends them, is always
``reserve`` → ``write`` (or a transfer layer writes the reserved ids) → ``register`` → later
``free``; ``adopt`` is that whole sequence for blocks that arrive complete (a peer's prefix).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from splitserve.kvstore import BlockHash, KVCacheBlock
from splitserve.kvstore.block_pool import BlockStored
from splitserve.kvstore.host_cache import DISK, HOST
from splitserve.kvstore.kv_cache_manager import SlotUsage

if TYPE_CHECKING:
    from splitserve.engine.core import LLMEngine
    from splitserve.kvstore.block_pool import KVCacheEvent


class Reserved(NamedTuple):
    """Blocks reserved for a request whose KV comes from elsewhere.

    ``missing``: indices into its block hashes whose data must be written (the others were
    cached here and are now pinned by the request); ``dest``: the block ids that data goes to,
    in order — the missing full blocks, then the partial tail block when ``has_tail``.
    """

    missing: list[int]
    has_tail: bool
    dest: list[int]


class BlockCounts(NamedTuple):
    """The KV pool's blocks: usable, free, and holding a cached prefix."""

    num_blocks: int  # usable blocks (the null block excluded)
    num_free_blocks: int
    num_cached_blocks: int


class KVPort:
    def __init__(self, engine: LLMEngine) -> None:
        self._kv = engine.kv
        self._pool = engine.pool
        self._runner = engine.runner
        self._tier = engine.host_tier
        # The transfer layer maps/sends this tensor (rank 0's heads under tensor parallelism,
        # where only the byte path moves blocks: ``read``/``write`` take every rank's heads).
        self.kv_pool = engine.runner.kv_pool
        self.block_size = engine.block_size
        self.block_nbytes = engine.runner.transfer_block_bytes  # a whole-heads block
        self.num_usable_blocks = self._pool.num_blocks - 1

    # ------------------------------------------------------------------ blocks from elsewhere

    def reserve(
        self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> Reserved | None:
        """Blocks for request ``request_id`` of ``num_tokens`` prompt tokens whose full blocks
        hash to ``block_hashes``: hashes cached here are touched, the others get new blocks
        (unregistered until ``register``), plus the partial tail block. ``None`` when the pool is
        short; then nothing is held for the request."""
        to_write = self._kv.adopt_blocks(request_id, block_hashes)
        if to_write is None or self._kv.allocate_slots(request_id, num_tokens) is None:
            self._kv.free(request_id)
            return None
        blocks = self._kv.get_blocks(request_id)
        new = {id(b) for b in to_write}
        missing = [i for i, b in enumerate(blocks[: len(block_hashes)]) if id(b) in new]
        has_tail = num_tokens % self.block_size != 0
        dest = [blocks[i].block_id for i in missing]
        if has_tail:
            dest.append(blocks[len(block_hashes)].block_id)
        return Reserved(missing, has_tail, dest)

    def write(self, block_ids: Sequence[int], data: bytes) -> None:
        """Write whole blocks' bytes (over all layers and KV heads, block-major) into
        ``block_ids``."""
        self._runner.write_blocks(block_ids, data)

    def register(self, request_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """The request's full blocks now hold their data: make them findable by hash."""
        self._kv.cache_blocks(request_id, block_hashes, len(block_hashes) * self.block_size)

    def adopt(self, block_hashes: Sequence[BlockHash], blocks_data: Sequence[bytes]) -> int:
        """Cache complete blocks that came from elsewhere (``blocks_data[i]`` is the block of
        ``block_hashes[i]``): reserve, write the ones not cached here, register, and leave them
        in the LRU as prefix cache. Returns how many are cached (0: the pool was short)."""
        tmp = f"adopt-{uuid.uuid4().hex}"
        reserved = self.reserve(tmp, block_hashes, len(block_hashes) * self.block_size)
        if reserved is None:
            return 0
        try:
            if reserved.missing:
                self.write(reserved.dest, b"".join(blocks_data[i] for i in reserved.missing))
            self.register(tmp, block_hashes)
        finally:
            self._kv.free(tmp)
        return len(block_hashes)

    # ------------------------------------------------------------------ blocks held here

    def read(self, block_ids: Sequence[int]) -> bytes:
        """The blocks' bytes, over all layers and KV heads, in order."""
        return self._runner.read_blocks(block_ids)

    def read_tier(self, block_hashes: Sequence[BlockHash]) -> list[bytes]:
        """The bytes of the leading run of ``block_hashes`` the host tier holds in memory (as
        ``read`` gives a pool block's), one entry a block; empty without a tier."""
        return self._tier.read_held(block_hashes) if self._tier is not None else []

    def block_ids(self, request_id: str) -> list[int]:
        """The request's blocks in order (empty when it holds none)."""
        return self._kv.get_block_ids(request_id)

    def holds(self, request_id: str) -> bool:
        """Whether blocks are held under ``request_id``."""
        return self._kv.has_request(request_id)

    def free(self, request_id: str) -> None:
        """Release the request's blocks (full ones stay cached); idempotent."""
        self._kv.free(request_id)

    def count_cached(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading ``block_hashes`` are cached here."""
        n = 0
        while n < len(block_hashes) and self._pool.get_cached_block(block_hashes[n]) is not None:
            n += 1
        return n

    def pin(self, block_hashes: Sequence[BlockHash]) -> list[KVCacheBlock]:
        """Take a reference on the longest leading run of ``block_hashes`` cached here, so no
        allocation evicts them while they are read; give them back with ``unpin``."""
        blocks = []
        for block_hash in block_hashes:
            block = self._pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        self._pool.touch(blocks)
        return blocks

    def unpin(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._pool.free_blocks(blocks)

    # ------------------------------------------------------------------ figures and events

    def stats(self) -> BlockCounts:
        """The pool's block counts (a figure: any thread, see the module's docstring)."""
        pool = self._pool
        return BlockCounts(pool.num_blocks - 1, pool.num_free_blocks, pool.num_cached_blocks)

    def slot_usage(self) -> SlotUsage:
        """Tokens held and token slots of the blocks in use (KV slot utilisation; O(1), and,
        unlike the other methods here, safe to read from any thread: see
        ``KVCacheManager.slot_usage``)."""
        return self._kv.slot_usage()

    def tier_block_load_s(self) -> dict[str, float]:
        """Measured seconds per block of a load from each tier behind the pool (a figure: any
        thread; empty without tiers or before the first sample)."""
        return dict(self._tier.block_load_s) if self._tier is not None else {}

    def prefix_stats(self) -> dict[str, float]:
        """Prefix-cache look-ups since start: queries, tokens asked for, tokens found in the
        pool and further in the host tier, and the tier's copies (a figure: any thread, see the
        module's docstring)."""
        stats = self._kv.stats
        return {
            "prefix_queries": stats.requests,
            "prefix_queried_tokens": stats.queried_tokens,
            "prefix_hit_tokens": stats.hit_tokens,
            "prefix_host_hit_tokens": stats.host_hit_tokens,
            **(self._tier.counters() if self._tier is not None else {}),
        }

    def take_events(self) -> list[KVCacheEvent]:
        """Stored/evicted hash events of every tier since the last call (for the Redis
        index)."""
        events = self._pool.take_events()
        if self._tier is not None:
            events += self._tier.take_events()
        return events

    def cache_snapshot(self) -> list[BlockStored]:
        """Every hash cached here, one event per tier (a full snapshot for the Redis index)."""
        held = [BlockStored(self._pool.cached_hashes())]
        if self._tier is not None:
            held.append(BlockStored(self._tier.hashes(), HOST))
            if self._tier.disk is not None:
                held.append(BlockStored(self._tier.disk.hashes(), DISK))
        return held
