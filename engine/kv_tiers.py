"""HostTier: a node's host-memory KV tier, the bytes behind ``kvstore.host_cache.HostBlockIndex``.

Every full block the accelerator pool registers under a hash is copied into the tier once (write
through: the copy is made while the block is still held, so an eviction never waits for it and
never loses it); the tier keeps them LRU within its size. A prompt whose prefix the pool no
longer holds but the tier does gets new pool blocks, filled by copies from the tier, and joins
the running batch once they are done (``Scheduler``'s loading requests), instead of computing
that prefix again.

On a GPU the tier is pinned host memory, all of it taken at start (pinning beside running steps
slowed them; see ``__init__``). Copies run on two streams of their own, device to host after the
step that wrote the blocks, host to device for hits; a block being copied out holds a reference
in the pool, so it is not reused until the copy is done, and a block being copied in is held by
its load. On the CPU the tier is a second, larger pool in ordinary memory, taken slab by slab as
it fills (a test machine runs many nodes), and copies are made at once: the same bookkeeping,
every path tested without a GPU.

A block's bytes are found only through its hash: a load matches the hashes and pins their slots
in one go, and a pinned slot is never handed out to another block (the bytes never leave this
process, so no checksum is computed here; the disk tier, where bytes can tear, carries one).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from splitserve.engine.kv_disk import DiskTier, Done
from splitserve.engine.kv_store import Probe, StoreTier
from splitserve.kvstore.block import KVCacheBlock
from splitserve.kvstore.block_pool import BlockPool, KVCacheEvent
from splitserve.kvstore.hashing import BlockHash
from splitserve.kvstore.host_cache import DISK, HOST, STORE, HostBlockIndex

logger = logging.getLogger(__name__)

SLAB_BYTES = 128 << 20  # host memory is taken in slabs of about this size as the tier fills
MAX_SPILLING = 256  # host blocks being written to the disk tier at once (pinned meanwhile)
# A tier's load time per block is sampled from loads of at least this many blocks (fewer say
# more about a step's or a call's overhead than about the tier) and kept as a moving average.
LOAD_SAMPLE_MIN_BLOCKS = 8
LOAD_SAMPLE_WEIGHT = 0.2
# With loads priced (``HostTier.price_loads``), a disk or store measured slower than computing is
# still read for one load in this many, so that its time is measured again (it may recover).
SLOWER_PROBE_EVERY = 16


class TierStats(NamedTuple):
    capacity_blocks: int
    used_blocks: int
    bytes_allocated: int
    offloaded_blocks: int  # copied into the tier since start
    skipped_blocks: int  # not copied: every slot pinned or being written
    loaded_blocks: int  # copied back into the pool (hits) since start
    evicted_blocks: int


class _Offload(NamedTuple):
    done: torch.cuda.Event
    blocks: list[KVCacheBlock]
    slots: list[int]


class _Load:
    """Blocks coming in: ``slots`` (pinned) to copy into pool ``blocks`` in order (each held by
    the load until its copies are done, whatever happens to the request meanwhile); the first
    ``num_ready`` are in host memory, the rest are being read from disk or the store (one
    ``sources`` entry each) until ``deadline``."""

    def __init__(
        self,
        slots: list[int],
        blocks: list[KVCacheBlock],
        num_ready: int,
        tag: Any,
        sources: list[DiskTier | StoreTier],
        deadline: float,
    ) -> None:
        self.slots, self.blocks, self.tag = slots, blocks, tag
        self.block_ids = [b.block_id for b in blocks]
        self.num_ready = num_ready
        self.sources = sources
        self.deadline = deadline
        self.pending = len(slots) - num_ready  # reads not finished
        self.store_reads: dict[int, Any] = {}  # slot index → its store read (to abandon)
        self.first_bad = len(slots)  # the first block whose read failed
        self.read_in: list[int] = []  # slots read in and committed, pinned until the load ends
        self.copied = 0  # blocks whose copy into the pool is queued or done
        self.done: torch.cuda.Event | None = None  # the last queued copy's (None: CPU)
        self.started = time.monotonic()
        # The copies of the blocks already in host memory, timed: (start, end, blocks) events
        # on a GPU, (seconds, blocks) on the CPU (None: too few to say)
        self.host_timing: Any = None


class HostTier:
    """The host tier of one engine's pool ``kv_pool`` (block-major: ``(num_blocks, ...)``)."""

    def __init__(
        self,
        kv_pool: torch.Tensor,
        pool: BlockPool,
        capacity_blocks: int,
        enable_events: bool = False,
        slab_bytes: int = SLAB_BYTES,
        disk: DiskTier | None = None,
        store: StoreTier | None = None,
    ) -> None:
        self.index = HostBlockIndex(capacity_blocks, enable_events)
        self.disk = disk
        self.store = store
        self._spilling: dict[int, BlockHash] = {}  # slot → its hash, being written to disk
        self._putting: dict[int, BlockHash] = {}  # slot → its hash, being put in the store
        # (at most a quarter of the tier waits for the store: a slow one costs puts, not slots)
        self._max_putting = min(MAX_SPILLING, max(1, capacity_blocks // 4))
        self._kv_pool = kv_pool
        self._pool = pool
        pool.newly_cached = []
        self.block_bytes = kv_pool[0].numel() * kv_pool.element_size()
        self.slots_per_slab = max(1, slab_bytes // self.block_bytes)
        self.num_slabs = -(-capacity_blocks // self.slots_per_slab)
        self._slabs: list[torch.Tensor] = []
        self._slot_views: list[torch.Tensor] = []  # slot → its block-shaped view
        self._kv_blocks = kv_pool.unbind(0)  # block id → its view
        self._cuda = kv_pool.device.type == "cuda"
        self._offloads: deque[_Offload] = deque()
        self._loads: dict[int, _Load] = {}  # by a number of their own (the disk's jobs say it)
        self._next_load = 0
        self.offloaded_blocks = self.skipped_blocks = self.loaded_blocks = 0
        self.disk_hit_blocks = self.store_hit_blocks = 0
        # Measured seconds per block a load takes from each tier ("host": the copy into the
        # pool; "disk", "store": the reads into host memory), a moving average: what the router
        # prices a prefix held there at (GetStats' tier_block_load_s). Absent: not measured.
        self.block_load_s: dict[str, float] = {}
        # What computing a block takes here (the engine's measured prefill time per token times
        # the block size; None: not measured). With ``price_loads`` a block on disk or in the
        # store whose tier is measured slower than that is computed instead of read: over TCP
        # on a fast GPU the store is (docs/benchmarks.md, "The KV tiers in one engine:
        # kv_tiers.py"). On by default on a GPU; on the CPU device the tiers are always read (a
        # test machine's timings are too noisy to decide by).
        self.compute_block_s: float | None = None
        self.price_loads = self._cuda
        self.slower_skipped_blocks = 0
        self._slower_seen: dict[str, int] = {}
        if self._cuda:
            self._offload_stream = torch.cuda.Stream(kv_pool.device)
            self._load_stream = torch.cuda.Stream(kv_pool.device)
            # NOTE: pinned now, not as the tier fills: pinning hundreds of MB beside running
            # steps slowed them by a fifth to a third on an H100, and blocks cached before
            # their slab was ready were never copied (docs/benchmarks-history.md, "KV tiers:
            # the host and disk tiers and the shared store behind the pool (2026-12-06)").
            try:
                seconds = self.reserve_memory()
            except (RuntimeError, MemoryError) as exc:  # pinnable memory ran out: keep what is
                got = sum(len(slab) for slab in self._slabs)
                self.index.capacity = got
                self.num_slabs = len(self._slabs)
                logger.warning(
                    "host KV tier: could not pin %d blocks (%s); it keeps the %d pinned so far "
                    "(--kv-host-cache-mb to choose)",
                    capacity_blocks,
                    exc,
                    got,
                )
            else:
                logger.info(
                    "host KV tier: %.1f GiB of pinned memory taken in %.1f s",
                    self.stats().bytes_allocated / 2**30,
                    seconds,
                )

    # ---------------------------------------------------------------- memory

    def _slab_len(self, k: int) -> int:
        return min(self.slots_per_slab, self.index.capacity - k * self.slots_per_slab)

    def _new_slab(self, k: int) -> torch.Tensor:
        shape = (self._slab_len(k), *self._kv_pool.shape[1:])
        return torch.empty(shape, dtype=self._kv_pool.dtype, pin_memory=self._cuda)

    def _ensure_memory(self, slot: int) -> None:
        """Memory behind ``slot``: on the CPU allocated now if not there yet (its pages only
        touched as blocks are written); on a GPU all of it was pinned at start."""
        k = slot // self.slots_per_slab
        while len(self._slabs) <= k:
            self._add_slabs([self._new_slab(len(self._slabs))])

    def _add_slabs(self, slabs: list[torch.Tensor]) -> None:
        for slab in slabs:
            self._slabs.append(slab)
            self._slot_views += slab.unbind(0)  # (views made once: a copy per block is hot)

    def reserve_memory(self) -> float:
        """Take the tier's whole memory now instead of as it fills (seconds it took); on a GPU
        the pinning then never runs beside steps."""
        t0 = time.perf_counter()
        while len(self._slabs) < self.num_slabs:
            self._add_slabs([self._new_slab(len(self._slabs))])
        return time.perf_counter() - t0

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
                if block_hash not in index:  # every slot pinned or being written
                    self.skipped_blocks += 1
                continue
            self._ensure_memory(slot)
            blocks.append(block)
            slots.append(slot)
        if not blocks:
            return
        kv = self._kv_pool
        if not self._cuda:
            for block, slot in zip(blocks, slots, strict=True):
                self._slot_views[slot].copy_(kv[block.block_id])
                self._commit(slot)
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
            views, blocks_of = self._slot_views, self._kv_blocks
            for block, slot in zip(blocks, slots, strict=True):
                views[slot].copy_(blocks_of[block.block_id], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self._offloads.append(_Offload(done, blocks, slots))

    def reap(self) -> None:
        """Commit the copies out that are done and give their blocks back to the pool; take
        the disk's finished writes and reads."""
        while self._offloads and self._offloads[0].done.query():
            finished = self._offloads.popleft()
            for slot in finished.slots:
                self._commit(slot)
            self.offloaded_blocks += len(finished.slots)
            self._pool.free_blocks(finished.blocks)
        self._below_done()

    def _commit(self, slot: int) -> None:
        """A computed block's bytes are in: findable, written on to the disk tier unless it is
        there already or the disk lags too far behind, and put in the store unless it is known
        there (the slot pinned until each has its bytes)."""
        self.index.commit(slot)
        disk, store = self.disk, self.store
        if disk is None and store is None:
            return
        block_hash = self.index.slot_hash(slot)
        assert block_hash is not None
        if disk is not None:
            if block_hash in disk:
                disk.touch(block_hash)
            elif len(self._spilling) < MAX_SPILLING:
                self.index.pin([slot])
                self._spilling[slot] = block_hash
                disk.write(block_hash, self._slot_views[slot], slot)
        if store is not None and block_hash not in store:
            if len(self._putting) >= self._max_putting:
                store.put_skipped += 1
            elif store.write(block_hash, self._slot_views[slot], slot):
                self.index.pin([slot])
                self._putting[slot] = block_hash

    def _below_done(self) -> None:
        """Take the disk's and the store's finished jobs; abandon store reads past their load's
        deadline (their blocks are computed)."""
        for below, writing in ((self.disk, self._spilling), (self.store, self._putting)):
            if below is None:
                continue
            for done in below.completed():
                if done.kind == "write":
                    slot = done.tag
                    assert isinstance(slot, int)
                    del writing[slot]
                    self.index.unpin([slot])
                    if done.ok and isinstance(below, DiskTier):
                        below.added(done.block_hash)
                    continue
                number, i = done.tag  # pyright: ignore[reportGeneralTypeIssues]
                self._read_done(self._loads[number], i, done)
        if self.store is not None:
            now = time.monotonic()
            for load in list(self._loads.values()):
                if not load.pending or now < load.deadline:
                    continue
                for i, job in list(load.store_reads.items()):
                    if self.store.abandon(job):
                        self._read_done(load, i, Done("read", job.block_hash, False, None))

    def _read_done(self, load: _Load, i: int, done: Done) -> None:
        load.pending -= 1
        load.store_reads.pop(i, None)
        slot = load.slots[i]
        if done.ok:
            # A host block now, like any other; pinned until the load ends, whether or not an
            # earlier block fails after it (disk and store reads finish in any order).
            self.index.commit(slot)
            self.index.pin([slot])
            load.read_in.append(slot)
        else:
            self.index.cancel(slot)
            load.sources[i - load.num_ready].drop(done.block_hash)
            load.first_bad = min(load.first_bad, i)
        if load.pending == 0:
            self._sample_reads(load)
            self._copy_in(load, load.first_bad)

    def _sample(self, tier: str, seconds: float, blocks: int) -> None:
        per_block = seconds / blocks
        old = self.block_load_s.get(tier)
        w = LOAD_SAMPLE_WEIGHT
        self.block_load_s[tier] = per_block if old is None else (1 - w) * old + w * per_block

    def _sample_reads(self, load: _Load) -> None:
        """A load whose reads from disk or the store all came in: their time per block (from the
        load's start: the reads run side by side), for the tier they all came from."""
        n = len(load.sources)
        if n < LOAD_SAMPLE_MIN_BLOCKS or load.first_bad < len(load.slots):
            return  # (a failed read ends early: its time says nothing of the tier's speed)
        kinds = {self._tier_name(source) for source in load.sources}
        if len(kinds) == 1:
            self._sample(kinds.pop(), time.monotonic() - load.started, n)

    # ---------------------------------------------------------------- load

    def match(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading ``block_hashes`` the tier holds, in host memory or further on disk
        or in the store (as far as its probes have told)."""
        n = len(self.index.match(block_hashes))
        return n + self._held_below(block_hashes[n:])

    def probe(self, block_hashes: Sequence[BlockHash]) -> Probe | None:
        """Ask the store about ``block_hashes`` past what it is known to hold (None: no store,
        or nothing to ask)."""
        if self.store is None:
            return None
        n = self.store.match(block_hashes)
        return self.store.probe(block_hashes[n:]) if n < len(block_hashes) else None

    def load(
        self, block_hashes: Sequence[BlockHash], blocks: Sequence[KVCacheBlock], tag: Any
    ) -> None:
        """Copy the blocks of ``block_hashes`` (just matched) into pool ``blocks`` (new blocks a
        request holds); ``loaded`` lists ``tag`` once they are written. The load holds a
        reference on each block until then, so a request aborted meanwhile frees its blocks as
        usual and no one else gets them while a copy may still land. Blocks on disk or in the
        store are read into host slots first; one that cannot be read (or gets no slot, or
        does not come from the store in time) ends the run there, and ``loaded`` says how many
        came in."""
        index, disk, store = self.index, self.disk, self.store
        slots = index.match(block_hashes)
        index.pin(slots)
        num_ready = len(slots)
        below: list[DiskTier | StoreTier] = []
        for block_hash in block_hashes[num_ready:]:
            source = (
                disk
                if disk is not None and block_hash in disk
                else store
                if store is not None and block_hash in store
                else None
            )
            if source is not None and not below and not self._worth_reading(source):
                # (decided once per load: the rest of the run is computed)
                self.slower_skipped_blocks += self._held_below(block_hashes[num_ready:])
                break
            slot = index.reserve(block_hash) if source is not None else None
            if source is None or slot is None:
                break
            self._ensure_memory(slot)
            slots.append(slot)
            below.append(source)
        held = list(blocks[: len(slots)])
        self._pool.touch(held)
        number = self._next_load
        self._next_load += 1
        timeout = store.timeout_s if store is not None else 0.0
        load = _Load(slots, held, num_ready, tag, below, time.monotonic() + timeout)
        self._loads[number] = load
        for i, source in enumerate(below, num_ready):
            block_hash = block_hashes[i]
            job = source.read(block_hash, self._slot_views[slots[i]], (number, i))
            if source is store:
                load.store_reads[i] = job
        self._copy_in(load, num_ready)

    def read_held(self, block_hashes: Sequence[BlockHash]) -> list[bytes]:
        """The bytes of the leading run of ``block_hashes`` the tier holds in host memory (not
        on disk or in the store), in order, in the pool's block layout: what a peer fetching
        them is sent (engine thread: the copies are made now, so no slot can change under
        them)."""
        return [
            self._slot_views[slot].view(torch.uint8).numpy().tobytes()
            for slot in self.index.match(block_hashes)
        ]

    def _held_below(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading ``block_hashes`` the disk or the store holds."""
        n = 0
        for block_hash in block_hashes:
            if not (
                (self.disk is not None and block_hash in self.disk)
                or (self.store is not None and block_hash in self.store)
            ):
                break
            n += 1
        return n

    def _tier_name(self, source: DiskTier | StoreTier) -> str:
        return STORE if source is self.store else DISK

    def _worth_reading(self, source: DiskTier | StoreTier) -> bool:
        """Reading from ``source`` beats computing, as far as measured (``price_loads``); a tier
        measured slower is still read once in SLOWER_PROBE_EVERY decisions, to measure again."""
        if not self.price_loads or self.compute_block_s is None:
            return True
        tier = self._tier_name(source)
        load_s = self.block_load_s.get(tier)
        if load_s is None or load_s <= self.compute_block_s:
            return True
        seen = self._slower_seen[tier] = self._slower_seen.get(tier, 0) + 1
        return seen % SLOWER_PROBE_EVERY == 0

    def _copy_in(self, load: _Load, upto: int) -> None:
        """Queue the copies of the load's slots ``[copied, upto)`` into its pool blocks."""
        kv = self._kv_pool
        first = load.copied
        pairs = list(zip(load.slots[first:upto], load.block_ids[first:upto], strict=True))
        load.copied = max(load.copied, upto)
        if not pairs:
            return
        # The first copies of a load are of blocks that were in host memory: timed, for the
        # router's price of a host hit (``block_load_s``).
        timed = first == 0 and len(pairs) >= LOAD_SAMPLE_MIN_BLOCKS
        if not self._cuda:
            t0 = time.perf_counter()
            for slot, block_id in pairs:
                kv[block_id].copy_(self._slot_views[slot])
            if timed:
                load.host_timing = (time.perf_counter() - t0, len(pairs))
        else:
            stream = self._load_stream
            # NOTE: after everything queued on the compute stream: a preempted request's
            # blocks are handed out again at once, while the step in flight may still write
            # them (the wait costs a load at most that step).
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                start = torch.cuda.Event(enable_timing=True) if timed else None
                if start is not None:
                    start.record(stream)
                views, blocks_of = self._slot_views, self._kv_blocks
                for slot, block_id in pairs:
                    blocks_of[block_id].copy_(views[slot], non_blocking=True)
                load.done = torch.cuda.Event(enable_timing=timed)
                load.done.record(stream)
                if start is not None:
                    load.host_timing = (start, load.done, len(pairs))
        self.loaded_blocks += len(pairs)

    def loaded(self) -> list[tuple[Any, int]]:
        """Loads that are done, each once, as (its tag, how many of its blocks came in: a
        leading run); their slots are unpinned and their blocks released."""
        self._below_done()
        done = [
            number
            for number, load in self._loads.items()
            if not load.pending and (load.done is None or load.done.query())
        ]
        out = []
        for number in done:
            load = self._loads.pop(number)
            if (timing := load.host_timing) is not None:
                if self._cuda:
                    start, end, blocks = timing
                    self._sample(HOST, start.elapsed_time(end) / 1e3, blocks)
                else:
                    self._sample(HOST, *timing)
            self.index.unpin(load.slots[: load.num_ready])
            self.index.unpin(load.read_in)
            self._pool.free_blocks(load.blocks)
            for source in load.sources[: max(load.copied - load.num_ready, 0)]:
                if source is self.store:
                    self.store_hit_blocks += 1
                else:
                    self.disk_hit_blocks += 1
            out.append((load.tag, load.copied))
        return out

    @property
    def busy(self) -> bool:
        """Copies or disk writes under way (pool blocks or host slots held until they end)."""
        return bool(self._loads or self._offloads or self._spilling or self._putting)

    # ---------------------------------------------------------------- index, figures, end

    def take_events(self) -> list[KVCacheEvent]:
        events = self.index.take_events()
        if self.disk is not None:
            events += self.disk.take_events()
        return events

    def hashes(self) -> list[BlockHash]:
        return self.index.hashes()

    def counters(self) -> dict[str, int]:
        """Monotonic counts since start, as a node exports them (read from any thread)."""
        return {
            "host_tier_offloaded_blocks": self.offloaded_blocks,
            "host_tier_skipped_blocks": self.skipped_blocks,
            "host_tier_loaded_blocks": self.loaded_blocks,
            "host_tier_evicted_blocks": self.index.num_evicted,
            # blocks on disk or in the store computed instead: their tier measured slower
            "host_tier_slower_skipped_blocks": self.slower_skipped_blocks,
            **(self.disk.counters() if self.disk is not None else {}),
            **(self.store.counters() if self.store is not None else {}),
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
        """Wait for the copies out in flight, take them in, then stop the disk's thread."""
        for offload in self._offloads:
            offload.done.synchronize()
        self.reap()
        if self.disk is not None:
            self.disk.close()
        if self.store is not None:
            self.store.close()
