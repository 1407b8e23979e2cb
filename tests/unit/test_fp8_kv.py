"""An FP8 KV cache (``--kv-cache-dtype fp8``) on CPU: the scales' checks, a checkpoint's
``k_scale``/``v_scale`` loaded (and bad ones refused by name), the identity, and an engine whose
pool is e4m3 (half a bfloat16 pool's bytes) serving, caching prefixes and freeing every block.
The Triton kernels on an FP8 cache: tests/unit/test_kernels_triton.py (interpreter) and
tests/gpu/test_fp8_gpu.py; across processes: tests/cluster/test_fp8_cluster.py."""

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.engine.core import LLMEngine
from splitserve.kernels import ops, reference
from splitserve.kvstore import ModelIdentity
from splitserve.models.loader import load_model
from splitserve.models.runner import ModelRunner, RunnerConfig
from splitserve.models.sampling_params import SamplingParams
from splitserve.models.tiny import write_random_checkpoint

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("kv8"), seed=random.randrange(1 << 30))


def _caches(dtype):
    pool = torch.zeros(4, 1, 2, 16, 2, 32, dtype=dtype)
    return pool[:, 0, 0], pool[:, 0, 1]


def test_the_ops_want_scales_with_an_fp8_cache_and_none_without():
    k, v = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    slots = torch.tensor([16, 17, 40])
    kc, vc = _caches(FP8)
    with pytest.raises(ValueError, match=r"FP8 KV cache needs kv_scales: float32 \[2\]"):
        ops.reshape_and_cache(k, v, kc, vc, slots)
    with pytest.raises(ValueError, match=r"got torch.float32 \(3,\)"):
        ops.reshape_and_cache(k, v, kc, vc, slots, kv_scales=torch.ones(3))
    kc32, vc32 = _caches(torch.float32)
    with pytest.raises(ValueError, match="kv_scales are for an FP8 KV cache"):
        ops.reshape_and_cache(k, v, kc32, vc32, slots, kv_scales=torch.ones(2))
    # A query of the model's dtype reads an FP8 cache; a 16-bit cache still wants its own dtype.
    scales = torch.tensor([0.5, 0.25])
    ops.reshape_and_cache(k, v, kc, vc, slots, kv_scales=scales)
    assert torch.equal(kc[1, 0].float(), (k[0] / 0.5).to(FP8).float())
    table, lens = torch.tensor([[1, 2]]), torch.tensor([25])
    q = torch.randn(1, 4, 32)
    out = ops.paged_decode_attention(q, kc, vc, table, lens, 0.1, kv_scales=scales)
    # The same as attention over the dequantized cache: the scales mean what the write meant.
    kd, vd = kc.float() * 0.5, vc.float() * 0.25
    torch.testing.assert_close(out, reference.paged_decode_attention(q, kd, vd, table, lens, 0.1))
    kc16, vc16 = _caches(torch.bfloat16)
    with pytest.raises(ValueError, match=r"query has dtype torch\.float32 but the KV cache holds"):
        ops.paged_decode_attention(q, kc16, vc16, table, lens, 0.1)


def test_a_checkpoints_kv_scales_are_loaded_and_bad_ones_refused(source, tmp_path):
    tensors = load_file(source / "model.safetensors")
    dst = tmp_path / "scaled"
    dst.mkdir()
    for f in source.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    scaled = {
        **tensors,
        "model.layers.1.self_attn.k_scale": torch.tensor(0.0625),
        "model.layers.1.self_attn.v_scale": torch.tensor([0.03125]),
    }
    save_file(scaled, dst / "model.safetensors")
    _, model = load_model(dst)
    assert model.layers[0].self_attn.kv_scales.tolist() == [1.0, 1.0]
    assert model.layers[1].self_attn.kv_scales.tolist() == [0.0625, 0.03125]
    for bad, message in (
        (torch.tensor(0.0), "one finite number > 0"),
        (torch.tensor(float("nan")), "one finite number > 0"),
        (torch.tensor([1.0, 2.0]), "one finite number > 0"),
    ):
        save_file({**scaled, "model.layers.1.self_attn.v_scale": bad}, dst / "model.safetensors")
        with pytest.raises(
            ValueError, match=f"layers.1.self_attn.v_scale: a KV cache scale is {message}"
        ):
            load_model(dst)
    save_file(
        {**tensors, "model.layers.7.self_attn.k_scale": torch.tensor(1.0)},
        dst / "model.safetensors",
    )
    with pytest.raises(ValueError, match="the model has 2 layers"):
        load_model(dst)


def test_the_kv_cache_dtype_is_part_of_the_identity(source):
    plain = ModelIdentity.for_checkpoint(source)
    fp8 = ModelIdentity.for_checkpoint(source, kv_cache_dtype="fp8")
    assert fp8.kv_cache_dtype == "fp8" and plain.kv_cache_dtype == ""
    assert fp8.root_hash != plain.root_hash
    assert ModelIdentity.for_checkpoint(source, kv_cache_dtype="auto") == plain
    with pytest.raises(ValueError, match="unsupported KV cache dtype 'int8'"):
        ModelIdentity.for_checkpoint(source, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp4'"):
        RunnerConfig(kv_cache_dtype="fp4")


def test_an_engine_on_an_fp8_pool_serves_caches_prefixes_and_frees_every_block(source):
    config, model = load_model(source, dtype="bfloat16")
    budget = 64 * 16 * config.kv_bytes_per_token(torch.bfloat16)
    plain = ModelRunner(config, model, RunnerConfig(kv_cache_bytes=budget))
    runner = ModelRunner(config, model, RunnerConfig(kv_cache_bytes=budget, kv_cache_dtype="fp8"))
    assert runner.kv_pool.dtype == FP8 and runner.num_blocks == 2 * plain.num_blocks
    assert runner.block_bytes * 2 == plain.block_bytes
    engine = LLMEngine(runner, ModelIdentity(str(source), kv_cache_dtype="fp8"))
    rng = random.Random(3)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (5, 16, 33, 47)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = [r.output_token_ids for r in engine.generate(prompts, greedy)]
    again = engine.generate(prompts, greedy)
    assert [r.output_token_ids for r in again] == first
    assert [r.num_cached_tokens for r in again] == [(n - 1) // 16 * 16 for n in (5, 16, 33, 47)]
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1


def test_a_pair_of_pools_of_different_kv_formats_is_refused_not_misread():
    """A bfloat16 pool and an FP8 one: no direct path is chosen between them (only the byte
    path, which checks sizes), and the byte path refuses the other format's blocks."""
    from splitserve.kernels.layout import allocate_kv_pool, read_blocks_bytes
    from splitserve.transfer.chooser import GRPC, choose_path
    from splitserve.transfer.endpoint import local_endpoint
    from splitserve.transfer.grpc_bytes.codec import decode_blocks, encode_blocks

    pools = [allocate_kv_pool(4, 2, 16, 2, 32, dtype, "cpu") for dtype in (torch.bfloat16, FP8)]
    bf16, fp8 = (local_endpoint(f"node-{i}", pool) for i, pool in enumerate(pools))
    assert (bf16.dtype, fp8.dtype) == ("bfloat16", "float8_e4m3fn")
    assert choose_path(fp8, bf16) == GRPC and choose_path(bf16, fp8) == GRPC
    sent = read_blocks_bytes(pools[1], [1, 2])  # FP8 blocks, into a bfloat16 receiver
    bf16_block = pools[0][0].numel() * 2
    with pytest.raises(ValueError, match=f"expected 2 blocks of {bf16_block}"):
        decode_blocks(*encode_blocks([1, 2], sent), bf16_block)
