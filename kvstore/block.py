"""A KV-cache block's metadata and the doubly linked LRU queue of free blocks."""

# NOTE: a block linked in the free queue has both links set (sentinels at each end), which
# `KVCacheBlock | None` cannot say; an assert per link would cost in the pool's hottest loops.
# pyright: reportOptionalMemberAccess=false

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from splitserve.kvstore.hashing import BlockHash


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one physical KV block (the tensor data lives in the KV pool, indexed by id).

    Invariants kept by :class:`~kvstore.block_pool.BlockPool`: the block is linked in the free
    queue iff ``ref_cnt == 0`` (the null block excepted); ``block_hash`` is set iff the block is
    registered in the pool's hash map. ``prev_free``/``next_free`` mean something only while the
    block is free (the pool does not clear them when it hands a block out).
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:12] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: the front is evicted first (least recently used).

    A doubly linked list through the blocks' own ``prev_free``/``next_free`` fields, between two
    sentinel blocks, so that popping the front, appending and removing a block from the middle (a
    cache hit on a free block) are all O(1) with no allocation. ``collections.deque.remove`` would
    be O(n). ``head``/``tail`` are the sentinels; :class:`~kvstore.block_pool.BlockPool` walks them
    directly in its allocate and free loops (one pass per call instead of two).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.num_free_blocks = 0
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.append_n(list(blocks))

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Unlink and return the ``n`` least recently used blocks. ``n`` must be <= the length."""
        assert 0 <= n <= self.num_free_blocks, (n, self.num_free_blocks)
        out: list[KVCacheBlock | None] = [None] * n
        curr = self.head.next_free
        for i in range(n):
            out[i] = curr
            nxt = curr.next_free
            curr.prev_free = curr.next_free = None
            curr = nxt
        self.head.next_free = curr
        curr.prev_free = self.head
        self.num_free_blocks -= n
        return out  # type: ignore[return-value]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block``, which must be in the queue, from wherever it sits."""
        prev, nxt = block.prev_free, block.next_free
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Link ``blocks`` at the back (most recently used), in the given order."""
        if not blocks:
            return
        last = self.tail.prev_free
        for block in blocks:
            block.prev_free = last
            last.next_free = block
            last = block
        last.next_free = self.tail
        self.tail.prev_free = last
        self.num_free_blocks += len(blocks)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        curr = self.head.next_free
        while curr is not self.tail:
            yield curr  # pyright: ignore[reportReturnType]
            curr = curr.next_free

    def __len__(self) -> int:
        return self.num_free_blocks
