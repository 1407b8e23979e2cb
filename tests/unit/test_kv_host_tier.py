"""The host KV tier on the CPU: its slot bookkeeping (LRU, pins, bounded size, index events), and
an engine whose pool is too small to keep a prefix serving it again from the tier — token-exact
against an engine that computes it, on a float32 and an FP8 pool, with every block and pin
released however the request ends. The same code runs on a GPU with pinned memory and streams
(tests/gpu/test_kv_tiers_gpu.py)."""

import random

import pytest
import torch

from splitserve.engine.core import LLMEngine
from splitserve.engine.kv_tiers import HostTier
from splitserve.kvstore import BlockRemoved, BlockStored, ModelIdentity, hash_request_tokens
from splitserve.kvstore.host_cache import HOST, HostBlockIndex
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
        assert index.num_slots_used <= index.capacity, seed


# ---------------------------------------------------------------- an engine with the tier


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tier") / "m", seed=11)


def _engine(checkpoint, kv_cache_dtype, num_blocks, host_blocks):
    dtype = "float32" if kv_cache_dtype == "auto" else "bfloat16"
    config, model = load_model(checkpoint, dtype=dtype)
    pool_dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.float32
    per_token = config.kv_bytes_per_token(pool_dtype)
    rc = RunnerConfig(kv_cache_bytes=num_blocks * 16 * per_token, kv_cache_dtype=kv_cache_dtype)
    runner = ModelRunner(config, model, rc)
    identity = ModelIdentity(str(checkpoint), kv_cache_dtype=kv_cache_dtype)
    return LLMEngine(runner, identity, host_cache_blocks=host_blocks, enable_kv_events=True)


def _assert_all_released(engine):
    engine.pool.check_invariants()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1
    tier = engine.host_tier
    tier.index.check_invariants()
    assert not tier.index._pins and not tier.num_loading and not engine.scheduler.loading


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_prefix_evicted_from_the_pool_comes_back_from_the_host_tier_token_exact(
    checkpoint, kv_cache_dtype
):
    rng = random.Random()
    prompts = [[rng.randrange(300) for _ in range(rng.randrange(40, 64))] for _ in range(6)]
    # 9 usable blocks: one prompt and its answer at a time, so each evicts the one before.
    plain = _engine(checkpoint, kv_cache_dtype, 10, 0)
    expected = [r.output_token_ids for r in plain.generate(prompts, GREEDY)]
    again = plain.generate(prompts[:1], GREEDY)[0]
    assert again.num_cached_tokens == 0  # evicted: computed again without the tier

    engine = _engine(checkpoint, kv_cache_dtype, 10, 64)
    for prompt in prompts:  # one by one: each evicts the blocks of the one before
        engine.generate([prompt], GREEDY)
    stored = {h for e in engine.host_tier.take_events() if e.tier == HOST for h in e.block_hashes}
    assert len(stored) == engine.host_tier.index.num_committed > 0
    second = engine.generate(prompts, GREEDY)
    assert [r.output_token_ids for r in second] == expected
    for req in second:
        assert req.num_cached_tokens == (len(req.prompt_token_ids) - 1) // 16 * 16
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


def test_a_slot_that_no_longer_holds_its_hash_is_never_loaded(checkpoint):
    engine = _engine(checkpoint, "auto", 10, 64)
    prompt = [random.randrange(300) for _ in range(40)]
    engine.generate([prompt], GREEDY)
    tier = engine.host_tier
    slots = tier.match(engine.pool.cached_hashes()[:1]) or [0]
    with pytest.raises(ValueError, match="no longer holds"):
        tier.load("x", [b"\0" * 32], slots[:1], [1])
    assert not tier.is_loading("x")


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
