"""The host KV tier on a CUDA GPU: pinned slabs pinned by a background thread, copies out and
back on streams of their own, asynchronous steps. A block that comes back from the tier holds
the bytes it was computed with, and requests cancelled while their blocks load leak nothing
(skipped without a GPU; CPU counterpart, token-exact on both pool dtypes:
tests/unit/test_kv_host_tier.py)."""

import random

import pytest
import torch

from splitserve.engine.core import LLMEngine
from splitserve.kvstore import ModelIdentity, hash_request_tokens
from splitserve.models.loader import load_model
from splitserve.models.runner import ModelRunner, RunnerConfig
from splitserve.models.sampling_params import SamplingParams
from splitserve.models.tiny import write_random_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA GPU; CPU counterpart: tests/unit/test_kv_host_tier.py",
    ),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    import tempfile
    from pathlib import Path

    path = write_random_checkpoint(
        Path(tempfile.mkdtemp()) / "m",
        seed=5,
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
    )
    return load_model(path, dtype="bfloat16", device="cuda")


@pytest.fixture(params=["auto", "fp8"])
def engine(model, request):
    config, m = model
    dtype = torch.float8_e4m3fn if request.param == "fp8" else torch.bfloat16
    rc = RunnerConfig(
        kv_cache_bytes=12 * 16 * config.kv_bytes_per_token(dtype),
        kv_cache_dtype=request.param,
        use_cuda_graph=False,
    )
    identity = ModelIdentity("m", kv_cache_dtype=request.param)
    return LLMEngine(ModelRunner(config, m, rc), identity, host_cache_blocks=256)


def _drain(engine):
    while engine.has_unfinished():
        engine.step()
    tier = engine.host_tier
    while tier._offloads:  # the last copies out: done on their stream soon after
        tier.reap()
    engine.pool.check_invariants()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1
    tier.index.check_invariants()
    assert not tier.index._pins and not tier.busy and not engine.scheduler.loading


def _blocks(engine, hashes):
    return [engine.pool.cached_block_hash_to_block.get(h) for h in hashes]


def test_a_block_comes_back_from_the_tier_with_the_bytes_it_was_computed_with(engine):
    assert engine.async_scheduling
    rng = random.Random()
    prompt = [rng.randrange(2048) for _ in range(100)]
    hashes = hash_request_tokens(prompt, 16, engine.root_hash)[:6]
    engine.generate([prompt], GREEDY)
    _drain(engine)
    computed = engine.runner.kv_pool[[b.block_id for b in _blocks(engine, hashes)]].clone()
    for _ in range(3):  # other prompts take every block of the pool
        engine.generate([[rng.randrange(2048) for _ in range(170)]], GREEDY)
    _drain(engine)
    assert all(b is None for b in _blocks(engine, hashes)), "still in the pool: nothing to load"
    (again,) = engine.generate([prompt], GREEDY)
    _drain(engine)
    assert again.num_cached_tokens == 96
    loaded = engine.runner.kv_pool[[b.block_id for b in _blocks(engine, hashes)]]
    assert torch.equal(loaded.view(torch.uint8), computed.view(torch.uint8))
    assert engine.host_tier.stats().bytes_allocated > 0


def test_cancelled_while_loading_on_streams_leaks_nothing(engine):
    rng = random.Random()
    prompts = [[rng.randrange(2048) for _ in range(rng.randrange(40, 90))] for _ in range(6)]
    engine.generate(prompts, GREEDY)
    for _ in range(3):
        engine.generate([[rng.randrange(2048) for _ in range(170)]], GREEDY)
    _drain(engine)
    for round_ in range(4):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{round_}-{i}", p, GREEDY)
        for _ in range(rng.randrange(4)):
            engine.step()
        for i in rng.sample(range(len(prompts)), 3):
            engine.abort(f"r{round_}-{i}")
        _drain(engine)
    assert engine.host_tier.loaded_blocks > 0


def test_a_block_from_the_shared_store_has_the_bytes_another_engine_computed(model, tmp_path):
    """Two engines on the GPU, each with its own client of one Mooncake Store (CPU counterpart:
    tests/cluster/test_kv_store.py): the second's pool holds, byte for byte, what the first
    computed, read through pinned host slots."""
    import time

    from splitserve.engine.kv_store import MooncakeStore
    from splitserve.kv_store_service import start_store

    try:
        store = start_store("127.0.0.1", 256, tmp_path, time.monotonic() + 60)
    except (RuntimeError, ImportError) as exc:
        pytest.skip(f"Mooncake Store cannot run here ({exc}): the mooncake extra, libibverbs1")
    config, m = model
    rc = RunnerConfig(kv_cache_bytes=64 * 16 * config.kv_bytes_per_token(torch.bfloat16))
    engines = []
    try:
        for _ in range(2):
            client = MooncakeStore(store.url)
            client.connect()
            engines.append(
                LLMEngine(
                    ModelRunner(config, m, rc),
                    ModelIdentity("m"),
                    host_cache_blocks=256,
                    kv_store=client,
                )
            )
        first, second = engines
        prompt = [random.randrange(2048) for _ in range(100)]
        hashes = hash_request_tokens(prompt, 16, first.root_hash)[:6]
        (expected,) = first.generate([prompt], GREEDY)
        _drain(first)
        deadline = time.monotonic() + 30
        while first.host_tier.store.put_ok < 6:
            assert time.monotonic() < deadline, first.host_tier.store.counters()
            time.sleep(0.01)
        computed = first.runner.kv_pool[[b.block_id for b in _blocks(first, hashes)]].cpu()
        (got,) = second.generate([prompt], GREEDY)
        _drain(second)
        assert got.num_cached_tokens == 96 and second.host_tier.store_hit_blocks == 6
        assert got.output_token_ids == expected.output_token_ids
        loaded = second.runner.kv_pool[[b.block_id for b in _blocks(second, hashes)]].cpu()
        assert torch.equal(loaded.view(torch.uint8), computed.view(torch.uint8))
    finally:
        for engine in engines:
            engine.host_tier.close()
        store.stop()
