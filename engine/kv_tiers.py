"""HostTier: a node's host-memory KV tier, the bytes behind ``kvstore.host_cache.HostBlockIndex``.

Every full block the accelerator pool registers under a hash is copied into the tier once (write
through: the copy is made while the block is still held, so an eviction never waits for it and
never loses it); the tier keeps them LRU within its size. A prompt whose prefix the pool no
longer holds but the tier does gets new pool blocks, filled by copies from the tier, and joins
the running batch once they are done (``Scheduler``'s loading requests), instead of computing
that prefix again.

On a GPU the tier is pinned host memory, taken slab by slab as it fills (a background thread
pins the next slab before it is needed: pinning hundreds of MB takes longer than a step, and a
step never waits for it; an offload that finds no slab ready is skipped). Copies run on two
streams of their own, device to host after the step that wrote the blocks, host to device for
hits; a block being copied out holds a reference in the pool, so it is not reused until the copy
is done. On the CPU the tier is a second, larger pool in ordinary memory and copies are made at
once: the same bookkeeping, every path tested without a GPU.

A block's bytes are found only through its hash, and a load checks the slot still holds that
hash before it copies (the bytes never leave this process, so no checksum is computed here; the
disk and store tiers, where bytes can tear, will carry one).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import torch

from splitserve.kvstore.block import KVCacheBlock
from splitserve.kvstore.block_pool import BlockPool, KVCacheEvent
from splitserve.kvstore.hashing import BlockHash
from splitserve.kvstore.host_cache import HostBlockIndex

logger = logging.getLogger(__name__)

SLAB_BYTES = 128 << 20  # host memory is taken in slabs of about this size as the tier fills


class TierStats(NamedTuple):
    capacity_blocks: int
    used_blocks: int
    bytes_allocated: int
    offloaded_blocks: int  # copied into the tier since start
    skipped_blocks: int  # not copied: no memory ready yet, or every slot pinned
    loaded_blocks: int  # copied back into the pool (hits) since start
    evicted_blocks: int


class _Offload(NamedTuple):
    done: torch.cuda.Event
    blocks: list[KVCacheBlock]
    slots: list[int]


class _Load(NamedTuple):
    done: torch.cuda.Event | None  # None: made synchronously (CPU)
    slots: list[int]


class HostTier:
    """The host tier of one engine's pool ``kv_pool`` (block-major: ``(num_blocks, ...)``)."""

    def __init__(
        self,
        kv_pool: torch.Tensor,
        pool: BlockPool,
        capacity_blocks: int,
        enable_events: bool = False,
        slab_bytes: int = SLAB_BYTES,
    ) -> None:
        self.index = HostBlockIndex(capacity_blocks, enable_events)
        self._kv_pool = kv_pool
        self._pool = pool
        pool.newly_cached = []
        self.device = kv_pool.device
        self.block_bytes = kv_pool[0].numel() * kv_pool.element_size()
        self.slots_per_slab = max(1, slab_bytes // self.block_bytes)
        self.num_slabs = -(-capacity_blocks // self.slots_per_slab)
        self._slabs: list[torch.Tensor] = []
        self._cuda = self.device.type == "cuda"
        self._offloads: deque[_Offload] = deque()
        self._loads: dict[str, _Load] = {}
        self.offloaded_blocks = self.skipped_blocks = self.loaded_blocks = 0
        self._grower: _SlabGrower | None = None
        if self._cuda:
            self._offload_stream = torch.cuda.Stream(self.device)
            self._load_stream = torch.cuda.Stream(self.device)
            self._grower = _SlabGrower(self._new_slab, self.num_slabs)

    # ---------------------------------------------------------------- memory

    def _slab_len(self, k: int) -> int:
        return min(self.slots_per_slab, self.index.capacity - k * self.slots_per_slab)

    def _new_slab(self, k: int) -> torch.Tensor:
        shape = (self._slab_len(k), *self._kv_pool.shape[1:])
        return torch.empty(shape, dtype=self._kv_pool.dtype, pin_memory=self._cuda)

    def _has_memory(self, slot: int) -> bool:
        """Whether memory stands behind ``slot`` (on the CPU: allocated now if not)."""
        k = slot // self.slots_per_slab
        if k < len(self._slabs):
            return True
        if self._grower is None:
            while len(self._slabs) <= k:
                self._slabs.append(self._new_slab(len(self._slabs)))
            return True
        self._slabs += self._grower.take(k + 1 - len(self._slabs))
        if self._grower.failed is not None:  # pinning failed: the tier stops growing
            return k < len(self._slabs)
        self._grower.want(k + 2)  # keep one slab ahead of the highest slot
        return k < len(self._slabs)

    def _slot(self, slot: int) -> torch.Tensor:
        return self._slabs[slot // self.slots_per_slab][slot % self.slots_per_slab]

    # ---------------------------------------------------------------- offload

    def offload(self) -> None:
        """Copy the blocks the pool registered since the last call into the tier (engine
        thread, after a step's blocks are cached; on a GPU the copies are only queued)."""
        self.reap()
        newly = self._pool.newly_cached
        if not newly:
            return
        self._pool.newly_cached = []
        blocks, slots = [], []
        index = self.index
        for block in newly:
            block_hash = block.block_hash
            if block_hash is None:  # evicted again before this call: its bytes are gone
                continue
            slot = index.reserve(block_hash)
            if slot is None:
                continue
            if not self._has_memory(slot):
                index.cancel(slot)
                self.skipped_blocks += 1
                continue
            blocks.append(block)
            slots.append(slot)
        if not blocks:
            return
        kv = self._kv_pool
        if not self._cuda:
            for block, slot in zip(blocks, slots, strict=True):
                self._slot(slot).copy_(kv[block.block_id])
                index.commit(slot)
            self.offloaded_blocks += len(blocks)
            return
        # NOTE: held until copied, so an allocation cannot hand a block out (and a step
        # overwrite it) while its bytes are on their way out.
        self._pool.touch(blocks)
        written = torch.cuda.Event()
        written.record()  # after every step queued so far: the blocks' writers
        stream = self._offload_stream
        with torch.cuda.stream(stream):
            stream.wait_event(written)
            for block, slot in zip(blocks, slots, strict=True):
                self._slot(slot).copy_(kv[block.block_id], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self._offloads.append(_Offload(done, blocks, slots))

    def reap(self) -> None:
        """Commit the copies out that are done and give their blocks back to the pool."""
        while self._offloads and self._offloads[0].done.query():
            finished = self._offloads.popleft()
            for slot in finished.slots:
                self.index.commit(slot)
            self.offloaded_blocks += len(finished.slots)
            self._pool.free_blocks(finished.blocks)

    # ---------------------------------------------------------------- load

    def match(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Slots of the longest leading run of ``block_hashes`` the tier holds."""
        return self.index.match(block_hashes)

    def load(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        slots: Sequence[int],
        block_ids: Sequence[int],
    ) -> None:
        """Copy ``slots`` (just matched for ``block_hashes``) into pool blocks ``block_ids``,
        which the request holds; ``loaded`` lists it once they are written."""
        if request_id in self._loads:
            raise ValueError(f"request {request_id!r} is loading already")
        for block_hash, slot in zip(block_hashes, slots, strict=True):
            if self.index.slot_hash(slot) != block_hash:  # a match of an earlier step
                raise ValueError(f"host slot {slot} no longer holds {block_hash.hex()[:12]}")
        self.index.pin(slots)
        kv = self._kv_pool
        pairs = list(zip(slots, block_ids, strict=True))
        if not self._cuda:
            for slot, block_id in pairs:
                kv[block_id].copy_(self._slot(slot))
            self._loads[request_id] = _Load(None, list(slots))
        else:
            stream = self._load_stream
            with torch.cuda.stream(stream):
                # NOTE: the blocks' earlier users are all done (a block is handed out only
                # once the steps that read it were read back), so no wait on the compute stream.
                for slot, block_id in pairs:
                    kv[block_id].copy_(self._slot(slot), non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            self._loads[request_id] = _Load(done, list(slots))
        self.loaded_blocks += len(pairs)

    def is_loading(self, request_id: str) -> bool:
        return request_id in self._loads

    def loaded(self) -> list[str]:
        """Requests whose loads are done (each reported once); their slots are unpinned."""
        done = [rid for rid, load in self._loads.items() if load.done is None or load.done.query()]
        for rid in done:
            self.index.unpin(self._loads.pop(rid).slots)
        return done

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    # ---------------------------------------------------------------- index, figures, end

    def take_events(self) -> list[KVCacheEvent]:
        return self.index.take_events()

    def hashes(self) -> list[BlockHash]:
        return self.index.hashes()

    def counters(self) -> dict[str, int]:
        """Monotonic counts since start, as a node exports them (read from any thread)."""
        return {
            "host_tier_offloaded_blocks": self.offloaded_blocks,
            "host_tier_skipped_blocks": self.skipped_blocks,
            "host_tier_loaded_blocks": self.loaded_blocks,
            "host_tier_evicted_blocks": self.index.num_evicted,
        }

    def stats(self) -> TierStats:
        return TierStats(
            self.index.capacity,
            self.index.num_committed,
            sum(s.numel() * s.element_size() for s in self._slabs),
            self.offloaded_blocks,
            self.skipped_blocks,
            self.loaded_blocks,
            self.index.num_evicted,
        )

    def close(self) -> None:
        """Wait for the copies in flight and stop growing (idempotent)."""
        if self._grower is not None:
            self._grower.stop()
        for offload in self._offloads:
            offload.done.synchronize()
        self.reap()


class _SlabGrower:
    """Pins slabs on a thread of its own, up to the number asked for (``want``)."""

    def __init__(self, make, limit: int) -> None:
        self._make, self._limit = make, limit
        self._ready: list[torch.Tensor] = []
        self._made = 0  # slabs made so far (taken or ready)
        self._wanted = 1
        self._cond = threading.Condition()
        self._stopped = False
        self.failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-host-slabs", daemon=True)
        self._thread.start()

    def want(self, num_slabs: int) -> None:
        with self._cond:
            if num_slabs > self._wanted:
                self._wanted = num_slabs
                self._cond.notify()

    def take(self, n: int) -> list[torch.Tensor]:
        """Up to ``n`` ready slabs, in order."""
        with self._cond:
            out, self._ready = self._ready[:n], self._ready[n:]
            return out

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and self._made >= min(self._wanted, self._limit):
                    self._cond.wait()
                if self._stopped:
                    return
                k = self._made
            try:
                slab = self._make(k)
            except BaseException as exc:  # out of pinnable memory: stop growing, say why once
                logger.warning("host KV tier: could not pin slab %d (%s); it grows no more", k, exc)
                self.failed = exc
                return
            with self._cond:
                self._ready.append(slab)
                self._made += 1
