"""The host and disk KV tiers on the CPU: the host tier's slot bookkeeping (LRU, pins, bounded
size, index events), and an engine whose pool is too small to keep a prefix serving it again from
the tiers — token-exact against an engine that computes it, on a float32 and an FP8 pool, with
every block and pin released however the request ends; the disk tier's restart, its checks (a
corrupt or missing file is computed, never served), a failing disk, its size bound, and salt
isolation in every tier. The same code runs on a GPU with pinned memory and streams
(tests/gpu/test_kv_tiers_gpu.py)."""

import random
import threading
import time

import pytest
import torch

from splitserve.engine.core import LLMEngine
from splitserve.engine.kv_tiers import HostTier
from splitserve.kvstore import BlockRemoved, BlockStored, ModelIdentity, hash_request_tokens
from splitserve.kvstore.host_cache import DISK, HOST, HostBlockIndex
from splitserve.models.loader import load_model
from splitserve.models.runner import ModelRunner, RunnerConfig
from splitserve.models.sampling_params import SamplingParams
from splitserve.models.tiny import write_random_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def _h(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


# ---------------------------------------------------------------- the bookkeeping


def test_the_index_is_lru_bounded_and_never_hands_out_a_pinned_slot():
    index = HostBlockIndex(3, enable_events=True)
    slots = []
    for i in range(3):
        slot = index.reserve(_h(i))
        assert slot is not None
        index.commit(slot)
        slots.append(slot)
    assert index.reserve(_h(1)) is None  # already here: touched (most recent), not copied
    assert index.match([_h(0), _h(1), _h(2), _h(9)]) == slots
    index.pin([slots[0]])  # a load reads 0: 2 is now the least recently used unpinned
    fourth = index.reserve(_h(3))
    assert fourth == slots[2] and _h(2) not in index
    index.commit(fourth)
    assert index.num_slots_used == 3 and index.num_committed == 3
    # Everything pinned or being written: no slot, nothing evicted, the size holds.
    index.pin([slots[1], fourth])
    assert index.reserve(_h(4)) is None
    index.check_invariants()
    events = index.take_events()
    assert events[0] == BlockStored([_h(0), _h(1), _h(2)], HOST)
    assert events[1] == BlockRemoved([_h(2)], HOST)
    assert events[2] == BlockStored([_h(3)], HOST)


def test_a_dropped_slot_is_reused_only_after_its_last_reader():
    index = HostBlockIndex(1)
    slot = index.reserve(_h(0))
    index.commit(slot)
    index.pin([slot])
    index.drop(_h(0))
    assert index.match([_h(0)]) == [] and index.reserve(_h(1)) is None
    index.check_invariants()
    index.unpin([slot])
    assert index.reserve(_h(1)) == slot
    index.check_invariants()


def test_random_operations_keep_every_invariant():
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    index = HostBlockIndex(rng.randrange(1, 8))
    writing, pinned = [], []
    for _ in range(400):
        op = rng.randrange(6)
        if op == 0:
            slot = index.reserve(_h(rng.randrange(12)))
            if slot is not None:
                writing.append(slot)
        elif op == 1 and writing:
            index.commit(writing.pop(rng.randrange(len(writing))))
        elif op == 2 and writing:
            index.cancel(writing.pop(rng.randrange(len(writing))))
        elif op == 3:
            run = index.match([_h(rng.randrange(12)) for _ in range(2)])
            index.pin(run)
            pinned += run
        elif op == 4 and pinned:
            index.unpin([pinned.pop(rng.randrange(len(pinned)))])
        elif op == 5:
            index.drop(_h(rng.randrange(12)))
        index.check_invariants()
        for slot in pinned:  # a pinned slot keeps its block (or, dropped, is handed out to none)
            assert slot not in writing, seed


# ---------------------------------------------------------------- an engine with the tier


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tier") / "m", seed=11)


def _engine(checkpoint, kv_cache_dtype, num_blocks, host_blocks, disk=None, disk_blocks=64):
    dtype = "float32" if kv_cache_dtype == "auto" else "bfloat16"
    config, model = load_model(checkpoint, dtype=dtype)
    pool_dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.float32
    per_token = config.kv_bytes_per_token(pool_dtype)
    rc = RunnerConfig(kv_cache_bytes=num_blocks * 16 * per_token, kv_cache_dtype=kv_cache_dtype)
    runner = ModelRunner(config, model, rc)
    identity = ModelIdentity(str(checkpoint), kv_cache_dtype=kv_cache_dtype)
    disk_bytes = disk_blocks * (runner.block_bytes + 64)
    return LLMEngine(
        runner,
        identity,
        host_cache_blocks=host_blocks,
        enable_kv_events=True,
        disk_cache_dir=disk,
        disk_cache_bytes=disk_bytes,
    )


def _assert_all_released(engine):
    engine.pool.check_invariants()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1
    tier = engine.host_tier
    tier.index.check_invariants()
    assert not tier.index._pins and not tier.busy and not engine.scheduler.loading


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_prefix_evicted_from_the_pool_comes_back_from_the_host_tier_token_exact(
    checkpoint, kv_cache_dtype
):
    rng = random.Random()
    prompts = [[rng.randrange(300) for _ in range(rng.randrange(40, 64))] for _ in range(6)]
    # 9 usable blocks: one prompt and its answer at a time, so each evicts the one before.
    plain = _engine(checkpoint, kv_cache_dtype, 10, 0)
    for prompt in prompts:
        plain.generate([prompt], GREEDY)
    again = plain.generate(prompts[:1], GREEDY)[0]
    assert again.num_cached_tokens == 0  # evicted: computed again without the tier

    # The reference keeps every prefix in a pool large enough, and serves the same requests in
    # the same order one at a time: the same computations step for step, so its tokens are the
    # ones the tier's copies must give (bit for bit, in bfloat16 too: no argmax near a tie can
    # go the other way).
    reference = _engine(checkpoint, kv_cache_dtype, 64, 0)
    engine = _engine(checkpoint, kv_cache_dtype, 10, 64)
    for prompt in prompts:  # one by one: in the engine each evicts the blocks of the one before
        reference.generate([prompt], GREEDY)
        engine.generate([prompt], GREEDY)
    stored = {h for e in engine.host_tier.take_events() if e.tier == HOST for h in e.block_hashes}
    assert len(stored) == engine.host_tier.index.num_committed > 0
    expected = [reference.generate([p], GREEDY)[0] for p in prompts]
    second = [engine.generate([p], GREEDY)[0] for p in prompts]
    assert [r.output_token_ids for r in second] == [r.output_token_ids for r in expected]
    for req, ref in zip(second, expected, strict=True):
        full = (len(req.prompt_token_ids) - 1) // 16 * 16
        assert req.num_cached_tokens == ref.num_cached_tokens == full
    stats = engine.kv.stats
    assert stats.host_hit_tokens > 0 and engine.host_tier.loaded_blocks > 0
    _assert_all_released(engine)


def test_cancelled_while_loading_releases_every_block_and_pin(checkpoint):
    rng = random.Random()
    prompt = [rng.randrange(300) for _ in range(60)]
    engine = _engine(checkpoint, "auto", 10, 64)
    first = engine.generate([prompt], GREEDY)[0].output_token_ids
    for cancel_after in range(4):
        engine.generate([[rng.randrange(300) for _ in range(130)]], GREEDY)  # evicts it
        assert not engine.kv.get_computed_blocks(
            hash_request_tokens(prompt, 16, engine.root_hash), 60
        ).blocks
        engine.add_request("r", prompt, GREEDY)
        for _ in range(cancel_after):
            engine.step()
        engine.abort("r")
        while engine.has_unfinished():
            engine.step()
        _assert_all_released(engine)
    assert engine.host_tier.loaded_blocks >= 3 * 3  # cancelled while loading, or after
    (again,) = engine.generate([prompt], GREEDY)
    assert again.output_token_ids == first and again.num_cached_tokens == 48
    _assert_all_released(engine)


def test_a_hash_the_tier_no_longer_holds_is_never_loaded(checkpoint):
    engine = _engine(checkpoint, "auto", 10, 64)
    engine.generate([[random.randrange(300) for _ in range(40)]], GREEDY)
    tier, kv = engine.host_tier, engine.runner.kv_pool
    blocks = engine.pool.get_new_blocks(1)
    before = kv[blocks[0].block_id].clone()
    tier.load([b"\0" * 32], blocks, "x")
    assert tier.loaded() == [("x", 0)]
    assert torch.equal(kv[blocks[0].block_id], before) and tier.loaded_blocks == 0
    engine.pool.free_blocks(blocks)
    tier.index.check_invariants()
    engine.pool.check_invariants()


def test_the_tier_takes_memory_as_it_fills_and_never_more_than_its_size(checkpoint):
    engine = _engine(checkpoint, "auto", 10, 0)
    block_bytes = engine.runner.block_bytes
    # Slabs of 2 blocks, 5 blocks in all: 2 + 2 + 1.
    tier = HostTier(engine.runner.kv_pool, engine.pool, 5, slab_bytes=2 * block_bytes)
    engine.host_tier = engine.scheduler.tier = tier
    assert tier.stats().bytes_allocated == 0
    rng = random.Random()
    engine.generate([[rng.randrange(300) for _ in range(20)]], GREEDY)  # 1 full block
    assert tier.stats().bytes_allocated == 2 * block_bytes
    for _ in range(4):
        engine.generate([[rng.randrange(300) for _ in range(60)]], GREEDY)
        stats = tier.stats()
        assert stats.bytes_allocated <= 5 * block_bytes and stats.used_blocks <= 5
    assert tier.stats().bytes_allocated == 5 * block_bytes and tier.stats().evicted_blocks > 0
    _assert_all_released(engine)
    tier.reserve_memory()  # (all of it at once: already all taken here, nothing more)
    assert tier.stats().bytes_allocated == 5 * block_bytes


# ---------------------------------------------------------------- the disk tier behind it


def _settle(engine):
    """Step to the end, then wait for the disk's writes (a thread) to be taken in."""
    while engine.has_unfinished():
        engine.step()
    tier = engine.host_tier
    deadline = time.monotonic() + 30
    while tier._spilling:
        assert time.monotonic() < deadline, "disk writes did not finish"
        tier.reap()
        time.sleep(0.001)


def _prompts(n, length=60):
    rng = random.Random()
    return [[rng.randrange(300) for _ in range(length)] for _ in range(n)]


def test_blocks_past_the_host_tier_come_back_from_disk_token_exact(checkpoint, tmp_path):
    prompts = _prompts(5)
    plain = _engine(checkpoint, "auto", 10, 0)
    expected = [r.output_token_ids for r in plain.generate(prompts, GREEDY)]
    # 8 host blocks: two prompts' worth; the disk holds them all.
    engine = _engine(checkpoint, "auto", 10, 8, disk=tmp_path)
    for prompt in prompts:
        engine.generate([prompt], GREEDY)
        _settle(engine)
    disk = engine.host_tier.disk
    assert len(disk) >= 5 * 3 and len(list(disk.dir.glob("*.kv"))) == len(disk)
    again = [engine.generate([p], GREEDY)[0] for p in prompts]
    _settle(engine)
    assert [r.output_token_ids for r in again] == expected
    assert [r.num_cached_tokens for r in again] == [48] * 5
    assert engine.host_tier.disk_hit_blocks >= 3 * 3 and disk.read_ok >= 9
    _assert_all_released(engine)


def test_a_restarted_node_finds_its_blocks_on_disk_and_publishes_them(checkpoint, tmp_path):
    prompts = _prompts(3)
    first = _engine(checkpoint, "auto", 10, 64, disk=tmp_path)
    expected = [first.generate([p], GREEDY)[0].output_token_ids for p in prompts]
    _settle(first)
    written = set(first.host_tier.disk.hashes())
    first.host_tier.close()

    restarted = _engine(checkpoint, "auto", 10, 64, disk=tmp_path)
    snapshot = {e.tier: set(e.block_hashes) for e in restarted.kv_port.cache_snapshot()}
    assert snapshot[DISK] == written and not snapshot[HOST] and not snapshot["device"]
    again = [restarted.generate([p], GREEDY)[0] for p in prompts]
    assert [r.output_token_ids for r in again] == expected
    assert [r.num_cached_tokens for r in again] == [48] * 3
    _settle(restarted)
    _assert_all_released(restarted)
    # Another model identity sharing the folder sees none of it.
    other = LLMEngine(
        restarted.runner,
        ModelIdentity("another"),
        host_cache_blocks=64,
        disk_cache_dir=str(tmp_path),
        disk_cache_bytes=1 << 20,
    )
    assert len(other.host_tier.disk) == 0


def test_a_corrupt_or_missing_file_is_computed_never_served(checkpoint, tmp_path):
    prompts = _prompts(2)
    plain = _engine(checkpoint, "auto", 10, 0)
    expected = [r.output_token_ids for r in plain.generate(prompts, GREEDY)]
    engine = _engine(checkpoint, "auto", 10, 64, disk=tmp_path)
    for p in prompts:
        engine.generate([p], GREEDY)
    _settle(engine)
    engine.host_tier.close()
    restarted = _engine(checkpoint, "auto", 10, 64, disk=tmp_path)
    disk = restarted.host_tier.disk
    hashes = [hash_request_tokens(p, 16, restarted.root_hash)[:3] for p in prompts]
    # Prompt 0: its second block's payload has one bit flipped; prompt 1: its first block gone.
    path = disk.path(hashes[0][1])
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x10
    path.write_bytes(data)
    disk.path(hashes[1][0]).unlink()
    again = [restarted.generate([p], GREEDY)[0] for p in prompts]
    assert [r.output_token_ids for r in again] == expected
    assert [r.num_cached_tokens for r in again] == [16, 0]
    assert disk.read_failed == 2
    _settle(restarted)
    # Computed again, those blocks were written again: the files now hold the right bytes.
    block = torch.empty_like(restarted.runner.kv_pool[0])
    assert all(disk._read(h, block) for h in (hashes[0][1], hashes[1][0]))
    _assert_all_released(restarted)


def test_a_disk_that_fails_every_write_degrades_to_computing(checkpoint, tmp_path):
    engine = _engine(checkpoint, "auto", 10, 4, disk=tmp_path)
    disk = engine.host_tier.disk
    disk.dir.rmdir()
    disk.dir.write_text("not a folder")  # every write and read now fails
    prompts = _prompts(4)
    plain = _engine(checkpoint, "auto", 10, 0)
    expected = [r.output_token_ids for r in plain.generate(prompts, GREEDY)]
    for _ in range(2):
        got = [engine.generate([p], GREEDY)[0].output_token_ids for p in prompts]
        _settle(engine)
        assert got == expected
    assert disk.write_failed > 0 and disk.written == 0 and len(disk) == 0
    _assert_all_released(engine)


def test_tenants_of_two_salts_never_share_a_block_in_any_tier(checkpoint, tmp_path):
    engine = _engine(checkpoint, "auto", 10, 8, disk=tmp_path)
    prompt = _prompts(1)[0]
    engine.add_request("a", prompt, GREEDY, cache_salt="tenant-a")
    _settle(engine)
    for other in _prompts(4):  # out of the pool and the host tier: on disk only
        engine.generate([other], GREEDY)
        _settle(engine)
    for rid, salt, cached in (("b", "tenant-b", 0), ("a2", "tenant-a", 48), ("n", None, 0)):
        req = engine.add_request(rid, prompt, GREEDY, cache_salt=salt)
        _settle(engine)
        assert req.num_cached_tokens == cached, salt
    _assert_all_released(engine)


def test_cancelled_while_reading_from_disk_releases_every_block_and_pin(checkpoint, tmp_path):
    engine = _engine(checkpoint, "auto", 10, 4, disk=tmp_path)
    prompts = _prompts(4)
    for p in prompts:
        engine.generate([p], GREEDY)
        _settle(engine)
    for round_ in range(6):
        for p in _prompts(2, 130):  # out of the pool and the host tier: on disk
            engine.generate([p], GREEDY)
        _settle(engine)
        engine.add_request(f"r{round_}", prompts[round_ % 4], GREEDY)
        for _ in range(round_ % 3):
            engine.step()
        engine.abort(f"r{round_}")
        _settle(engine)
        _assert_all_released(engine)
    assert engine.host_tier.disk.read_ok > 0


def test_the_disk_tier_never_holds_more_than_its_size(checkpoint, tmp_path):
    engine = _engine(checkpoint, "auto", 10, 4, disk=tmp_path, disk_blocks=6)
    disk = engine.host_tier.disk
    for p in _prompts(5):
        engine.generate([p], GREEDY)
        _settle(engine)
    deadline = time.monotonic() + 30
    while len(list(disk.dir.glob("*.kv"))) > 6:  # (deletes are the thread's, in order)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert disk.evicted > 0 and set(disk.hashes()) == {
        bytes.fromhex(p.name[:64]) for p in disk.dir.glob("*.kv")
    }


class _Gate:
    """Holds the disk tier's reads until ``open``: a load stays under way as long as a test
    wants (the reads run on the tier's thread)."""

    def __init__(self, disk) -> None:
        self.event = threading.Event()
        self._read = disk._read
        disk._read = self.read

    def read(self, block_hash, dst):
        assert self.event.wait(30), "the gate was never opened"
        return self._read(block_hash, dst)

    def open(self) -> None:
        self.event.set()


def _on_disk_only(engine, prompts):
    """Serve ``prompts``, then push them out of the pool and the (small) host tier."""
    for p in prompts:
        engine.generate([p], GREEDY)
        _settle(engine)
    for p in _prompts(3, 130):
        engine.generate([p], GREEDY)
        _settle(engine)


def test_a_request_ended_while_its_blocks_load_never_lets_the_copy_land_in_anothers(
    checkpoint, tmp_path
):
    """The decode node's end of a request (``_end_request``: abort, then free whatever the id
    holds) while its blocks are still being read: the late copies must not land in blocks
    another request got meanwhile."""
    from splitserve.engine.local import _end_request

    prompts = _prompts(2)
    plain = _engine(checkpoint, "auto", 10, 0)
    expected = plain.generate(prompts[1:], GREEDY)[0].output_token_ids
    engine = _engine(checkpoint, "auto", 10, 4, disk=tmp_path)
    _on_disk_only(engine, prompts[:1])
    gate = _Gate(engine.host_tier.disk)
    engine.add_request("r", prompts[0], GREEDY)
    engine.step()  # its blocks are allocated and their reads queued, held at the gate
    assert engine.scheduler.loading and engine.host_tier.busy
    _end_request(engine, "r")
    other = engine.add_request("z", prompts[1], GREEDY)
    engine.step()  # z computes into whatever blocks it gets
    gate.open()
    _settle(engine)
    assert other.output_token_ids == expected
    _assert_all_released(engine)


def test_loading_requests_count_against_max_num_seqs(checkpoint, tmp_path):
    prompts = _prompts(2)
    engine = _engine(checkpoint, "auto", 16, 4, disk=tmp_path)
    _on_disk_only(engine, prompts)
    engine.scheduler.max_num_seqs = 2
    gate = _Gate(engine.host_tier.disk)
    engine.add_request("a", prompts[0], GREEDY)
    engine.add_request("b", prompts[1], GREEDY)
    engine.step()
    assert len(engine.scheduler.loading) == 2
    # A transferred request (its KV adopted under its id) waits for a place in the batch.
    tokens = prompts[0][:20]
    assert engine.kv.allocate_slots("t", len(tokens)) is not None
    engine.add_transferred("t", tokens, 7, GREEDY)
    assert not engine.running and len(engine.ready) == 1
    gate.open()
    while engine.has_unfinished():
        engine.step()
        assert len(engine.running) + len(engine.scheduler.loading) <= 2
    _settle(engine)
    _assert_all_released(engine)


def test_the_default_host_tier_is_a_share_of_what_the_host_or_its_container_leaves(tmp_path):
    from splitserve.runtime.config import auto_host_cache_mb

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 67108864 kB\nMemAvailable: 33554432 kB\n")  # 32 GiB free
    none = tmp_path / "no-cgroup"
    assert auto_host_cache_mb(1, str(meminfo), str(none)) == 8192  # a quarter
    assert auto_host_cache_mb(4, str(meminfo), str(none)) == 2048  # up's nodes share it
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{8 << 30}\n")  # a container limited to 8 GiB, 2 used
    (v2 / "memory.current").write_text(f"{2 << 30}\n")
    assert auto_host_cache_mb(1, str(meminfo), str(v2)) == 1536
    (v2 / "memory.max").write_text("max\n")
    assert auto_host_cache_mb(1, str(meminfo), str(v2)) == 8192
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{4 << 30}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text("0\n")
    assert auto_host_cache_mb(1, str(meminfo), str(v1)) == 1024
    (tmp_path / "bad").write_text("no such field\n")
    assert auto_host_cache_mb(1, str(tmp_path / "bad"), str(none)) == 0


# ---------------------------------------------------------------- reads finishing out of order


class _Below:
    """A disk or store stand-in whose reads finish when the test says (the real ones run on
    threads of their own: a disk read and a store read of one load finish in either order)."""

    timeout_s = 60.0

    def __init__(self, hashes):
        self.hashes, self.jobs, self.done, self.dropped = set(hashes), {}, [], []

    def __contains__(self, block_hash):
        return block_hash in self.hashes

    def read(self, block_hash, dst, tag):
        from types import SimpleNamespace

        self.jobs[block_hash] = (dst, tag)
        return SimpleNamespace(block_hash=block_hash)

    def finish(self, block_hash, ok):
        from splitserve.engine.kv_disk import Done

        dst, tag = self.jobs.pop(block_hash)
        dst.fill_(7.0)
        self.done.append(Done("read", block_hash, ok, tag))

    def completed(self):
        out, self.done = self.done, []
        return out

    def drop(self, block_hash):
        self.dropped.append(block_hash)
        self.hashes.discard(block_hash)

    def abandon(self, job):
        return self.jobs.pop(job.block_hash, None) is not None


@pytest.mark.parametrize("later_first", [True, False])
def test_a_load_from_disk_and_store_releases_every_pin_whatever_order_its_reads_end(later_first):
    from splitserve.kvstore.block_pool import BlockPool

    pool = BlockPool(8)
    kv_pool = torch.zeros(8, 2, 4)
    disk, store = _Below([_h(0), _h(2)]), _Below([_h(1)])
    tier = HostTier(kv_pool, pool, 6, disk=disk, store=store)  # pyright: ignore[reportArgumentType]
    blocks = pool.get_new_blocks(3)
    tier.load([_h(0), _h(1), _h(2)], blocks, "req")
    order = [(store, _h(1), True), (disk, _h(2), True), (disk, _h(0), False)]
    if not later_first:
        order.reverse()
    for source, block_hash, ok in order:
        source.finish(block_hash, ok)
        tier.reap()
    assert tier.loaded() == [("req", 0)]  # block 0 failed: nothing of the run came in
    assert disk.dropped == [_h(0)]
    # Blocks 1 and 2 were read whole: host blocks now, unpinned, found by the next prompt.
    assert not tier.index._pins and tier.index.match([_h(1), _h(2)]) != []
    tier.index.check_invariants()
    pool.free_blocks(blocks)
    pool.check_invariants()


def test_a_store_read_past_its_deadline_is_abandoned_and_the_load_ends():
    from splitserve.kvstore.block_pool import BlockPool

    pool = BlockPool(8)
    disk, store = _Below([_h(0)]), _Below([_h(1)])
    store.timeout_s = 0.0
    tier = HostTier(torch.zeros(8, 2, 4), pool, 6, disk=disk, store=store)  # pyright: ignore[reportArgumentType]
    blocks = pool.get_new_blocks(2)
    tier.load([_h(0), _h(1)], blocks, "req")
    disk.finish(_h(0), True)
    assert tier.loaded() == [("req", 1)]  # block 1 never came: abandoned, the run ends at 1
    assert store.dropped == [_h(1)] and not store.jobs
    assert not tier.index._pins and not tier.busy
    tier.index.check_invariants()
    pool.free_blocks(blocks)
    pool.check_invariants()


def test_each_tier_measures_its_load_time_per_block_for_the_router(checkpoint, tmp_path):
    """A load of enough blocks samples its tier's time per block (GetStats' tier_block_load_s,
    what the router prices a prefix held there at): the host tier's copy into the pool, the
    disk's reads into host memory."""
    from splitserve.engine.kv_tiers import LOAD_SAMPLE_MIN_BLOCKS
    from splitserve.engine.local import engine_figures

    prompts = _prompts(4, length=LOAD_SAMPLE_MIN_BLOCKS * 16 + 12)  # 8 full blocks each
    engine = _engine(checkpoint, "auto", 20, 64)  # the pool holds two of them
    assert engine.host_tier.block_load_s == {} and engine_figures(engine).tier_block_load_s == {}
    for prompt in prompts:
        engine.generate([prompt], GREEDY)
    again = engine.generate(prompts[:1], GREEDY)[0]
    assert again.num_cached_tokens == LOAD_SAMPLE_MIN_BLOCKS * 16  # from the host tier
    host = engine.host_tier.block_load_s["host"]
    assert 0 < host < 1 and set(engine.host_tier.block_load_s) == {"host"}
    assert engine_figures(engine).tier_block_load_s == {"host": host}
    _assert_all_released(engine)

    disk = _engine(checkpoint, "auto", 20, 12, disk=tmp_path)  # host: one prompt and a half
    for prompt in prompts:
        disk.generate([prompt], GREEDY)
        _settle(disk)
    again = disk.generate(prompts[:1], GREEDY)[0]
    _settle(disk)
    assert again.num_cached_tokens == LOAD_SAMPLE_MIN_BLOCKS * 16
    assert disk.host_tier.disk_hit_blocks == LOAD_SAMPLE_MIN_BLOCKS
    assert 0 < disk.host_tier.block_load_s["disk"] < 5
    _assert_all_released(disk)


def test_a_tier_measured_slower_than_computing_is_computed_instead_and_probed_now_and_then(
    checkpoint, tmp_path
):
    """With loads priced (a GPU's default), a prefix on a disk (or in a store) measured slower
    than computing it is computed, token-exact, and counted; one load in SLOWER_PROBE_EVERY
    still reads, to measure the tier again; a tier as fast as computing is read. The engine
    measures what computing a block costs from its long prefills."""
    from splitserve.engine.kv_tiers import SLOWER_PROBE_EVERY

    prompts = _prompts(2)
    plain = _engine(checkpoint, "auto", 10, 0)
    expected = [r.output_token_ids for r in plain.generate(prompts, GREEDY)]
    roomy = _engine(checkpoint, "auto", 32, 64)
    assert not roomy.host_tier.price_loads  # (the CPU device's default: always read)
    roomy.generate([_prompts(1, 300)[0]], GREEDY)  # a step of 300 prompt tokens, then decodes
    assert roomy.host_tier.compute_block_s is not None and roomy.host_tier.compute_block_s > 0
    engine = _engine(checkpoint, "auto", 10, 4, disk=tmp_path)
    tier = engine.host_tier
    _on_disk_only(engine, prompts)
    tier.price_loads = True
    tier.compute_block_s = 1e-6
    tier.block_load_s["disk"] = 1.0  # far slower than computing
    reads = tier.disk_hit_blocks
    got = engine.generate(prompts[:1], GREEDY)[0]
    assert got.output_token_ids == expected[0] and got.num_cached_tokens == 0
    assert tier.disk_hit_blocks == reads and tier.slower_skipped_blocks == 3
    for _ in range(SLOWER_PROBE_EVERY - 2):  # (decisions only: nothing generated)
        assert not tier._worth_reading(tier.disk)
    assert tier._worth_reading(tier.disk)  # the probe: measured again
    tier.block_load_s["disk"] = 1e-7  # as fast as the pool would be
    got = engine.generate(prompts[1:], GREEDY)[0]
    _settle(engine)
    assert got.output_token_ids == expected[1] and got.num_cached_tokens == 48
    assert tier.disk_hit_blocks == reads + 3
    _assert_all_released(engine)
