"""BlockPool: every KV block of one node, with ref counts, an LRU free queue and a hash index."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from splitserve.kvstore.block import FreeKVCacheBlockQueue, KVCacheBlock
from splitserve.kvstore.hashing import BlockHash

DEVICE = "device"  # the accelerator's KV pool: the tier a step reads (kvstore.host_cache: "host")


class BlockStored(NamedTuple):
    """Blocks whose KV is complete and now findable by these hashes (in chain order), in
    ``tier``."""

    block_hashes: list[BlockHash]
    tier: str = DEVICE


class BlockRemoved(NamedTuple):
    """Hashes no longer held in ``tier`` (evicted for reuse, or dropped)."""

    block_hashes: list[BlockHash]
    tier: str = DEVICE


KVCacheEvent = BlockStored | BlockRemoved


def append_event(events: list[KVCacheEvent], event: KVCacheEvent) -> None:
    """Add ``event`` to ``events``, into the last one when it is of the same kind and tier (one
    event per run: a tier that stores blocks one at a time publishes them together)."""
    last = events[-1] if events else None
    if last is not None and type(last) is type(event) and last.tier == event.tier:
        last.block_hashes.extend(event.block_hashes)
    else:
        events.append(event)


class Adoption(NamedTuple):
    """Result of :meth:`BlockPool.adopt_blocks`: one block per hash, and which ones need data."""

    blocks: list[KVCacheBlock]
    is_new: list[bool]


class BlockPool:
    """All KV blocks of one node.

    A block is *in use* while ``ref_cnt > 0`` and *free* otherwise. A free block may still hold a
    cached prefix (its hash stays registered) until it is evicted: ``get_new_blocks`` takes the
    least recently freed blocks first and drops their hash. Block 0 is the null block: it pads
    block tables, is never handed out and is never free.

    Invariants (checked by ``check_invariants`` in tests):
    ``num_free_blocks + in-use blocks == num_blocks - 1``; a block is in the free queue iff its
    ``ref_cnt == 0``; ref counts are never negative; a hash maps to at most one block and a
    block's ``block_hash`` is set iff it is that hash's entry.
    """

    def __init__(self, num_blocks: int, enable_events: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"a BlockPool needs at least 2 blocks (one is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.enable_events = enable_events
        self._events: list[KVCacheEvent] = []
        # Blocks newly registered under a hash, for a second tier to copy (engine.kv_tiers sets
        # it to a list and drains it; None: nobody copies, nothing is collected).
        self.newly_cached: list[KVCacheBlock] | None = None

    # ---------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_block_hash_to_block)

    def get_usage(self) -> float:
        """Fraction of the usable blocks (null block excluded) held by running requests."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash with a cached block (a snapshot)."""
        return list(self.cached_block_hash_to_block)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    # ---------------------------------------------------------------- allocation

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks (ref_cnt 1), evicting cached ones LRU-first."""
        num_free = self.free_block_queue.num_free_blocks
        if num_blocks < 0 or num_blocks > num_free:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: {num_free} of {self.num_blocks - 1} "
                "usable blocks are free; free some requests or start the node with more KV blocks"
            )
        # NOTE: popleft_n, eviction and ref counting fused into one pass: this is the hot path
        # of every allocation.
        queue = self.free_block_queue
        head = queue.head
        cached = self.cached_block_hash_to_block
        evicted: list[BlockHash] = []
        blocks: list[KVCacheBlock | None] = [None] * num_blocks
        # NOTE: a free block's links are never None (sentinels at each end), which the links'
        # type cannot say; an assert per block would cost here, hence the checker's ignores.
        block = head.next_free
        for i in range(num_blocks):
            blocks[i] = block
            block_hash = block.block_hash  # pyright: ignore[reportOptionalMemberAccess]
            if block_hash is not None:
                # A free block with a hash is a cached prefix; reusing it is the eviction.
                del cached[block_hash]
                block.block_hash = None  # pyright: ignore[reportOptionalMemberAccess]
                evicted.append(block_hash)
            block.ref_cnt = 1  # pyright: ignore[reportOptionalMemberAccess]
            # NOTE: the links of a block in use are stale, not cleared: they are only read while
            # ref_cnt == 0, and two stores per block are measurable here.
            block = block.next_free  # pyright: ignore[reportOptionalMemberAccess]
        head.next_free = block
        block.prev_free = head  # pyright: ignore[reportOptionalMemberAccess]
        queue.num_free_blocks = num_free - num_blocks
        if evicted and self.enable_events:
            self._events.append(BlockRemoved(evicted))
        return blocks  # type: ignore[return-value]

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take one more reference on each block (a cache hit); free ones leave the free queue."""
        for block in blocks:
            self._check_owned(block)
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block. Blocks reaching 0 join the back of the free queue in
        the given order, so the caller passes the blocks to evict first first (a request frees its
        blocks tail-first so that the shared prefix heads are evicted last)."""
        blocks = ordered_blocks if type(ordered_blocks) is list else list(ordered_blocks)
        # NOTE: one pass drops the references and links newly free blocks at the back of the
        # queue; a block that is not in use is rare, so it is handled by undoing afterwards.
        queue = self.free_block_queue
        tail = queue.tail
        last: KVCacheBlock = tail.prev_free  # pyright: ignore[reportAssignmentType] (never None)
        num_freed = 0
        for i, block in enumerate(blocks):
            ref_cnt = block.ref_cnt
            if ref_cnt == 1:
                block.ref_cnt = 0
                block.prev_free = last
                last.next_free = block
                last = block
                num_freed += 1
            elif ref_cnt > 1:
                block.ref_cnt = ref_cnt - 1
            else:
                last.next_free = tail
                tail.prev_free = last
                queue.num_free_blocks += num_freed
                self._undo_free(blocks[:i])
                what = "the null block" if block.is_null else f"block {block.block_id}"
                raise ValueError(f"cannot free {what}: it is not in use (double free?)")
        last.next_free = tail
        tail.prev_free = last
        queue.num_free_blocks += num_freed

    def _undo_free(self, blocks: list[KVCacheBlock]) -> None:
        for block in reversed(blocks):
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    # ---------------------------------------------------------------- prefix caching

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` under the matching hashes.

        Call it only once the blocks' KV is written: from then on other requests may reuse them.
        A hash already held by another block keeps that block (the new one stays unhashed and is
        recycled normally), so a hash never maps to two blocks.
        """
        if num_full_blocks > len(block_hashes) or num_full_blocks > len(blocks):
            raise ValueError(
                f"cannot cache {num_full_blocks} full blocks with {len(blocks)} blocks and "
                f"{len(block_hashes)} hashes"
            )
        cached = self.cached_block_hash_to_block
        claim = cached.setdefault
        pairs = zip(
            blocks[num_cached_blocks:num_full_blocks],
            block_hashes[num_cached_blocks:num_full_blocks],
            strict=True,
        )
        stored = [] if self.enable_events else None
        newly = self.newly_cached
        for block, block_hash in pairs:
            if block.block_hash is not None:
                assert block.block_hash == block_hash, f"{block} re-cached under another hash"
            elif claim(block_hash, block) is block:
                block.block_hash = block_hash
                if stored is not None:
                    stored.append(block_hash)
                if newly is not None:
                    newly.append(block)
            # else: another block already holds this content; this one stays unhashed.
        if stored:
            self._events.append(BlockStored(stored))

    def adopt_blocks(self, block_hashes: Sequence[BlockHash]) -> Adoption:
        """Take one reference per hash for blocks shipped from another node.

        A hash this pool already caches is touched (never stored twice); for any other a new block
        is allocated, *not* yet registered: the caller writes its KV, then registers it with
        ``cache_full_blocks`` (so no other request can find a block whose data has not arrived; a
        failed transfer just frees the blocks). All or nothing: when the pool is short,
        ``ValueError`` and no change.
        """
        cached = self.cached_block_hash_to_block
        need, seen = 0, set()
        for block_hash in block_hashes:
            if block_hash in seen:
                continue
            seen.add(block_hash)
            hit = cached.get(block_hash)
            # A hit on a free block leaves the free queue just like a fresh allocation does.
            if hit is None or hit.ref_cnt == 0:
                need += 1
        if need > self.num_free_blocks:
            raise ValueError(
                f"cannot adopt {len(seen)} blocks: {need} free blocks needed, "
                f"{self.num_free_blocks} free"
            )
        # Touch every hit before allocating, so an allocation never evicts a block this very
        # adoption is about to reuse.
        blocks: list[KVCacheBlock | None] = []
        missing: dict[BlockHash, int] = {}
        for block_hash in block_hashes:
            hit = cached.get(block_hash)
            if hit is not None:
                self.touch((hit,))
            elif block_hash in missing:
                missing[block_hash] += 1
            else:
                missing[block_hash] = 1
            blocks.append(hit)
        new_blocks = dict(zip(missing, self.get_new_blocks(len(missing)), strict=True))
        for block_hash, block in new_blocks.items():
            block.ref_cnt = missing[block_hash]
        is_new, out = [], []
        for block_hash, hit in zip(block_hashes, blocks, strict=True):
            if hit is None:
                hit = new_blocks[block_hash]
                # Only the first occurrence of a repeated hash needs its data written.
                is_new.append(missing.pop(block_hash, None) is not None)
            else:
                is_new.append(False)
            out.append(hit)
        return Adoption(out, is_new)

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the stored/removed events collected since the last call."""
        events, self._events = self._events, []
        return events

    # ---------------------------------------------------------------- checks

    def _check_owned(self, block: KVCacheBlock) -> None:
        bid = block.block_id
        if not (0 <= bid < self.num_blocks and self.blocks[bid] is block):
            raise ValueError(f"{block} does not belong to this BlockPool")
        if block.is_null:
            raise ValueError("the null block cannot be touched: it pads block tables only")

    def check_invariants(self) -> None:
        """Assert every documented invariant; O(num_blocks), for tests and debugging."""
        free_ids = [b.block_id for b in self.free_block_queue]
        assert len(free_ids) == self.num_free_blocks
        assert len(set(free_ids)) == len(free_ids), "a block is in the free queue twice"
        assert 0 not in free_ids, "the null block is in the free queue"
        free = set(free_ids)
        in_use = 0
        for block in self.blocks[1:]:
            assert block.ref_cnt >= 0, f"{block} has a negative ref count"
            assert (block.ref_cnt == 0) == (block.block_id in free), (
                f"{block}: in free queue={block.block_id in free}"
            )
            in_use += block.ref_cnt > 0
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block
        assert self.num_free_blocks + in_use == self.num_blocks - 1
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, f"{block} indexed under a stale hash"
        assert self.null_block.block_hash is None
