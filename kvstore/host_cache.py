"""HostBlockIndex: which block hash sits in which slot of a node's host-memory KV tier.

The host tier keeps full blocks that the accelerator pool may evict, under the same hashes, so a
prefix that left the accelerator is copied back instead of computed again. This module is its
bookkeeping only (no torch): slots, an LRU order over the committed entries, pins, and the index
events. The bytes live in ``engine.kv_tiers.HostTier``, which owns the slabs and the copies.

A slot is *free*, *being written* (reserved for a hash whose copy is in flight: not findable),
or *committed* (findable by its hash). Committed slots are evicted least recently used first,
unless pinned (a load reads them). Slots are handed out from the lowest number up, so the
memory behind them, where the data side allocates it slab by slab (on a CPU), grows only as the
tier fills.

Invariants (``check_invariants``): a hash maps to at most one slot and a committed slot to its
hash; a slot is in exactly one of free / writing / committed / dropped-while-pinned;
``num_slots_used <= capacity``; a pinned slot is never handed out for writing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from splitserve.kvstore.block_pool import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    append_event,
)
from splitserve.kvstore.hashing import BlockHash

HOST = "host"  # the tiers behind the accelerator's pool (kvstore.block_pool.DEVICE), by name
DISK = "disk"
STORE = "store"  # the shared store (not indexed: each node probes it)


class HostBlockIndex:
    """The slots of one host tier of ``capacity`` blocks (``capacity >= 1``)."""

    def __init__(self, capacity: int, enable_events: bool = False) -> None:
        if capacity < 1:
            raise ValueError(f"a host KV tier needs at least 1 block, got {capacity}")
        self.capacity = capacity
        self.enable_events = enable_events
        self._next_slot = 0  # slots [0, _next_slot) have been handed out at least once
        self._free: list[int] = []  # returned slots below _next_slot, reused first
        self._committed: OrderedDict[BlockHash, int] = OrderedDict()  # LRU first
        self._slot_hash: dict[int, BlockHash] = {}  # committed and writing slots
        self._writing: dict[BlockHash, int] = {}  # reserved, copy in flight
        self._limbo: set[int] = set()  # dropped while pinned: free at the last unpin
        self._pins: dict[int, int] = {}
        self._events: list[KVCacheEvent] = []
        self.num_evicted = 0

    # ---------------------------------------------------------------- queries

    @property
    def num_committed(self) -> int:
        return len(self._committed)

    @property
    def num_slots_used(self) -> int:
        """Slots holding or receiving a block (the memory the tier needs now)."""
        return self._next_slot - len(self._free)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._committed or block_hash in self._writing

    def slot_hash(self, slot: int) -> BlockHash | None:
        return self._slot_hash.get(slot)

    def hashes(self) -> list[BlockHash]:
        """Every committed hash (a snapshot, for the index)."""
        return list(self._committed)

    def match(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Slots of the longest leading run of ``block_hashes`` committed here (not touched)."""
        out = []
        for block_hash in block_hashes:
            slot = self._committed.get(block_hash)
            if slot is None:
                break
            out.append(slot)
        return out

    # ---------------------------------------------------------------- reads

    def pin(self, slots: Sequence[int]) -> None:
        """Keep committed ``slots`` from eviction while their bytes are read, and mark them most
        recently used (a hit)."""
        for slot in slots:
            block_hash = self._slot_hash[slot]
            assert self._committed.get(block_hash) == slot, f"slot {slot} is not committed"
            self._committed.move_to_end(block_hash)
            self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slots: Sequence[int]) -> None:
        for slot in slots:
            left = self._pins[slot] - 1
            if left:
                self._pins[slot] = left
                continue
            del self._pins[slot]
            if slot in self._limbo:  # dropped while read: free now that nobody reads it
                self._limbo.remove(slot)
                self._free.append(slot)

    def drop(self, block_hash: BlockHash) -> None:
        """Forget a committed hash whose bytes cannot be trusted; unknown hashes are ignored. A
        pinned slot stays out of use until its last reader unpins it."""
        slot = self._committed.pop(block_hash, None)
        if slot is None:
            return
        del self._slot_hash[slot]
        if slot in self._pins:
            self._limbo.add(slot)
        else:
            self._free.append(slot)
        self._event(BlockRemoved([block_hash], HOST))

    # ---------------------------------------------------------------- writes

    def reserve(self, block_hash: BlockHash) -> int | None:
        """A slot to write ``block_hash``'s bytes into, or None when the hash is here already
        or every slot is pinned or being written. Evicts the least recently used unpinned
        committed block when the tier is full."""
        if block_hash in self._committed:
            self._committed.move_to_end(block_hash)
            return None
        if block_hash in self._writing:
            return None
        if self._free:
            slot = self._free.pop()
        elif self._next_slot < self.capacity:
            slot = self._next_slot
            self._next_slot += 1
        else:
            slot = self._evict_one()
            if slot is None:
                return None
        self._slot_hash[slot] = block_hash
        self._writing[block_hash] = slot
        return slot

    def commit(self, slot: int) -> None:
        """The slot's bytes are written: its hash is findable from now on."""
        block_hash = self._slot_hash[slot]
        del self._writing[block_hash]
        self._committed[block_hash] = slot
        self._event(BlockStored([block_hash], HOST))

    def cancel(self, slot: int) -> None:
        """A reserved slot whose copy was not made: back to the free slots."""
        del self._writing[self._slot_hash.pop(slot)]
        self._free.append(slot)

    def _evict_one(self) -> int | None:
        for block_hash, slot in self._committed.items():
            if slot not in self._pins:
                del self._committed[block_hash]
                del self._slot_hash[slot]
                self.num_evicted += 1
                self._event(BlockRemoved([block_hash], HOST))
                return slot
        return None

    # ---------------------------------------------------------------- events, checks

    def _event(self, event: KVCacheEvent) -> None:
        if self.enable_events:
            append_event(self._events, event)

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def check_invariants(self) -> None:
        assert self.num_slots_used <= self.capacity
        committed = set(self._committed.values())
        writing = set(self._writing.values())
        free = set(self._free)
        assert len(committed) == len(self._committed), "a slot holds two hashes"
        assert len(free) == len(self._free), "a slot is free twice"
        parts = (committed, writing, free, self._limbo)
        assert sum(map(len, parts)) == self._next_slot, "a slot is in two states or none"
        assert set().union(*parts) == set(range(self._next_slot))
        assert set(self._slot_hash) == committed | writing
        for block_hash, slot in [*self._committed.items(), *self._writing.items()]:
            assert self._slot_hash[slot] == block_hash
        assert set(self._pins) <= committed | self._limbo
        assert self._limbo <= set(self._pins)
