"""The Triton kernels themselves, under TRITON_INTERPRET=1 on CPU tensors, against the
references. Small shapes; every output poisoned with NaN first; caches poisoned with NaN
everywhere no real token sits (see tests/support/paged_kv.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from support.paged_kv import make_paged_kv

from splitserve.kernels import layout, reference
from splitserve.kernels.cache_write import reshape_and_cache
from splitserve.kernels.decode_attention import (
    DecodeConfig,
    choose_num_splits,
    paged_decode_attention,
)
from splitserve.kernels.prefill_attention import PrefillConfig, paged_prefill_attention

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py sets it when "
    "unset); the compiled kernels are tested in tests/gpu/",
)

# Tolerances, kernel vs reference (reference: float32 math, output rounded to the input dtype).
# float32: only summation order differs. float16: the kernel also rounds the softmax
# probabilities to float16 before the P·V product, about one float16 ulp of the output.
TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 4e-3, "rtol": 1e-2},
}
# NOTE: bfloat16 is not run here: Triton's interpreter has no bfloat16 dot (numpy has no such
# type); bfloat16 is covered on the GPU (tests/gpu/).
DTYPES = list(TOLERANCES)
BS = 16
EDGE_LENS = [1, BS - 1, BS, BS + 1]


@pytest.fixture(autouse=True, scope="module")
def _interpreter_numpy_fix():
    """Triton 3.6's interpreter calls int() on 1-element arrays, which numpy >= 2.4 refuses
    (triton-lang/triton#9171, fixed after 3.6.0): loops bounded by loaded values then fail.
    Apply the upstream one-line fix for the duration of this module."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(
            tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])
        )

    interpreter._patch_lang_tensor = patched
    yield
    interpreter._patch_lang_tensor = original


@pytest.fixture
def gen(rng) -> torch.Generator:
    seed = rng.randrange(2**31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def _lens(gen: torch.Generator, extra: int) -> list[int]:
    """The edge lengths plus `extra` random ones, shuffled."""
    lens = EDGE_LENS + torch.randint(1, 4 * BS, (extra,), generator=gen).tolist()
    return [lens[i] for i in torch.randperm(len(lens), generator=gen).tolist()]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_kernel(gen, dtype):
    kv = make_paged_kv([BS + 2, 3], 2, 64, BS, dtype, "cpu", gen, spare_blocks=2)
    num_slots = kv.key_cache.shape[0] * BS
    free = [
        s
        for s in range(BS, num_slots)
        if torch.isnan(kv.key_cache.reshape(num_slots, -1)[s].float()).all()
    ]
    pick = torch.randperm(len(free), generator=gen)[:9].tolist()
    slots = torch.tensor([free[i] for i in pick] + [-1, -1, -5])
    slots = slots[torch.randperm(len(slots), generator=gen)]
    key = torch.randn(len(slots), 2, 64, generator=gen).to(dtype)
    value = torch.randn(len(slots), 2, 64, generator=gen).to(dtype)
    want = kv.kv_pool.clone()
    want_k, want_v = want[:, 1, 0], want[:, 1, 1]
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    reshape_and_cache(key, value, kv.key_cache, kv.value_cache, slots)
    # byte-exact over the whole pool: written slots equal, NaN poison elsewhere untouched
    assert torch.equal(kv.kv_pool.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize(
    ("dtype", "heads", "num_splits"),
    [
        (torch.float32, (8, 2, 64), None),  # GQA group 4, split count from the heuristic
        (torch.float32, (8, 2, 64), 1),  # single split writes the output directly
        (torch.float16, (8, 2, 64), 3),  # uneven splits, some empty for short sequences
        (torch.float32, (6, 2, 32), 2),  # group 3 (padded to 16 rows), small head_dim
        (torch.float16, (4, 4, 128), None),  # MHA, head_dim 128
    ],
)
def test_decode_kernel(gen, dtype, heads, num_splits):
    hq, hkv, d = heads
    lens = _lens(gen, 2)
    kv = make_paged_kv(lens, hkv, d, BS, dtype, "cpu", gen)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    scale = d**-0.5
    want = reference.paged_decode_attention(
        q, kv.key_cache, kv.value_cache, kv.block_table, kv.seq_lens, scale
    )
    out = torch.full_like(q, float("nan"))
    got = paged_decode_attention(
        q,
        kv.key_cache,
        kv.value_cache,
        kv.block_table,
        kv.seq_lens,
        scale,
        out=out,
        num_splits=num_splits,
        config=DecodeConfig(block_n=32),
    )
    assert got is out
    torch.testing.assert_close(got, want, **TOLERANCES[dtype])


@pytest.mark.parametrize("num_splits", [None, 5])
def test_decode_splits_follow_each_sequence_not_the_table_width(gen, num_splits):
    """A CUDA graph's block table is as wide as the longest context allowed, and each sequence
    is cut by its own length: exact through such a table with the heuristic's split count and
    with explicit splits, which holds only while the main and the reduce kernel derive the same
    split length (a mismatch drops or double-counts partials). That short contexts now spread
    over several programs is a speed property: benchmarks/attention_kernels.py --wide-only."""
    lens = [1, 31, 32, 33, 95, 160, 161]
    kv = make_paged_kv(lens, 2, 64, BS, torch.float32, "cpu", gen)
    # 60 blocks a row (960 tokens): the columns past each context point at the null block.
    wide = torch.zeros((len(lens), 60), dtype=kv.block_table.dtype)
    wide[:, : kv.block_table.shape[1]] = kv.block_table
    q = torch.randn(len(lens), 8, 64, generator=gen)
    want = reference.paged_decode_attention(
        q, kv.key_cache, kv.value_cache, kv.block_table, kv.seq_lens, 0.125
    )
    out = torch.full_like(q, float("nan"))
    config = DecodeConfig(block_n=32, min_tokens_per_split=32)
    paged_decode_attention(
        q, kv.key_cache, kv.value_cache, wide, kv.seq_lens, 0.125,
        out=out, num_splits=num_splits, config=config,
    )  # fmt: skip
    torch.testing.assert_close(out, want, **TOLERANCES[torch.float32])


def test_decode_kernel_block_size_32(gen):
    lens = [1, 31, 32, 33, 70]
    kv = make_paged_kv(lens, 2, 64, 32, torch.float32, "cpu", gen)
    q = torch.randn(len(lens), 4, 64, generator=gen)
    want = reference.paged_decode_attention(
        q, kv.key_cache, kv.value_cache, kv.block_table, kv.seq_lens, 0.125
    )
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(
        q, kv.key_cache, kv.value_cache, kv.block_table, kv.seq_lens, 0.125, out=out, num_splits=2
    )
    torch.testing.assert_close(out, want, **TOLERANCES[torch.float32])


@pytest.mark.parametrize(
    ("batch", "context", "splits"),
    # 132 SMs x 4 programs = 528: fill one wave, never start a partial second one.
    [(1, 32768, 64), (16, 4096, 4), (64, 4096, 1), (4, 8192, 16), (8, 2048, 8), (1, 100, 1)],
)
def test_split_heuristic(batch, context, splits):
    assert choose_num_splits(batch, 8, context, 132, DecodeConfig()) == splits


def test_decode_tiling_from_the_environment(monkeypatch):
    from splitserve.kernels import decode_attention as da

    monkeypatch.setenv(da.CONFIG_ENV, "128,8,2")
    assert da._config_from_env() == DecodeConfig(block_n=128, num_warps=8, num_stages=2)
    monkeypatch.setenv(da.CONFIG_ENV, "64,4,5,128")
    assert da._config_from_env() == DecodeConfig(
        block_n=64, num_warps=4, num_stages=5, max_registers=128
    )
    monkeypatch.setenv(da.CONFIG_ENV, "")
    assert da._config_from_env() is None
    for bad in ("128,8", "a,b,c", "96,4,3", "64,3,3", "64,4,0", "64,4,3,16", "64,4,3,128,1"):
        monkeypatch.setenv(da.CONFIG_ENV, bad)
        with pytest.raises(ValueError, match=da.CONFIG_ENV):
            da._config_from_env()
    # With no override, each KV dtype gets its own default.
    monkeypatch.setattr(da, "_ENV_CONFIG", None)
    monkeypatch.setattr(da, "FP8_V_PAIRS", True)  # (whatever SPLITSERVE_DECODE_FP8_V says here)
    assert da.default_config(torch.bfloat16) is da.DEFAULT_CONFIG
    assert da.default_config(torch.float8_e4m3fn) is da.FP8_CONFIG
    monkeypatch.setattr(da, "FP8_V_PAIRS", False)  # V byte by byte: its own tiling
    assert da.default_config(torch.float8_e4m3fn) is da.FP8_BYTES_CONFIG
    assert da.default_config(torch.bfloat16) is da.DEFAULT_CONFIG
    monkeypatch.setattr(da, "_ENV_CONFIG", DecodeConfig(block_n=32))
    assert da.default_config(torch.float8_e4m3fn) == DecodeConfig(block_n=32)


def test_fp8_v_read_from_the_environment(monkeypatch):
    from splitserve.kernels import decode_attention as da

    for raw, want in (("pairs", True), ("bytes", False), ("", True), (" bytes ", False)):
        monkeypatch.setenv(da.V_READ_ENV, raw)
        assert da._v_pairs_from_env() is want
    monkeypatch.delenv(da.V_READ_ENV)
    assert da._v_pairs_from_env() is True
    monkeypatch.setenv(da.V_READ_ENV, "int16")
    with pytest.raises(ValueError, match=da.V_READ_ENV):
        da._v_pairs_from_env()


def test_prefill_stages_from_the_environment(monkeypatch):
    from splitserve.kernels import prefill_attention as pa

    monkeypatch.setenv(pa.STAGES_ENV, "5")
    assert pa._stages_from_env() == 5
    for raw in ("", "  "):
        monkeypatch.setenv(pa.STAGES_ENV, raw)
        assert pa._stages_from_env() is None
    for bad in ("0", "9", "-1", "five", "3.5"):
        monkeypatch.setenv(pa.STAGES_ENV, bad)
        with pytest.raises(ValueError, match=pa.STAGES_ENV):
            pa._stages_from_env()
    # Both tilings choose_config picks take the override; none: 5 stages for the 256-row tile
    # of long runs, 3 for the 64 x 64 one.
    monkeypatch.setattr(pa, "_ENV_STAGES", 4)
    assert {pa.choose_config(n).num_stages for n in (1, 200, 4096)} == {4}
    monkeypatch.setattr(pa, "_ENV_STAGES", None)
    assert [pa.choose_config(n).num_stages for n in (1, 200, 4096)] == [3, 3, 5]
    assert pa.choose_config(4096)[:3] == (256, 64, 16)
    assert pa.choose_config(1023)[:3] == pa.choose_config(1)[:3] == (64, 64, 4)


def test_register_cap_is_a_launch_option_on_cuda_only():
    from splitserve.kernels import decode_attention as da

    capped = DecodeConfig(max_registers=128)
    assert da._register_cap(capped, torch.device("cuda")) == {"maxnreg": 128}
    assert da._register_cap(DecodeConfig(), torch.device("cuda")) == {}
    assert da._register_cap(capped, torch.device("cpu")) == {}  # the interpreter has no registers


def _prefill_case(gen, shapes, heads, dtype, block_size=BS):
    """shapes: (context length, new tokens) per sequence."""
    hq, hkv, d = heads
    kv = make_paged_kv([c for c, _ in shapes], hkv, d, block_size, dtype, "cpu", gen)
    cu = torch.tensor([0, *np.cumsum([n for _, n in shapes]).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=gen).to(dtype)
    return kv, cu, q


@pytest.mark.parametrize(
    ("dtype", "heads", "config"),
    [
        (torch.float32, (8, 2, 64), PrefillConfig(block_m=16, block_n=16)),
        (torch.float16, (8, 2, 64), PrefillConfig(block_m=32, block_n=16)),
        (torch.float32, (6, 3, 32), PrefillConfig(block_m=16, block_n=32)),
        (torch.float32, (4, 2, 64), None),  # the launcher's own choice (64x64 tiles here)
    ],
)
def test_prefill_kernel(gen, dtype, heads, config):
    # Fresh prompts of the edge lengths, prompts with a cached prefix (prefix-cache hit or a
    # later prefill chunk), a sequence with no new tokens, and one random shape.
    ctx = int(torch.randint(2, 3 * BS, (1,), generator=gen))
    new = int(torch.randint(1, ctx + 1, (1,), generator=gen))
    shapes = [(n, n) for n in EDGE_LENS] + [(2 * BS + 3, BS + 1), (BS + 7, 1), (BS, 0), (ctx, new)]
    shapes = [shapes[i] for i in torch.randperm(len(shapes), generator=gen).tolist()]
    kv, cu, q = _prefill_case(gen, shapes, heads, dtype)
    scale = heads[2] ** -0.5
    want = reference.paged_prefill_attention(
        q, kv.key_cache, kv.value_cache, kv.block_table, cu, kv.seq_lens, scale
    )
    out = torch.full_like(q, float("nan"))
    got = paged_prefill_attention(
        q,
        kv.key_cache,
        kv.value_cache,
        kv.block_table,
        cu,
        kv.seq_lens,
        scale,
        out=out,
        config=config,
    )
    assert got is out
    torch.testing.assert_close(got, want, **TOLERANCES[dtype])


def test_prefill_kernel_block_size_32_given_max_query_len(gen):
    shapes = [(33, 33), (64, 20), (31, 31)]
    kv, cu, q = _prefill_case(gen, shapes, (4, 2, 64), torch.float32, block_size=32)
    want = reference.paged_prefill_attention(
        q, kv.key_cache, kv.value_cache, kv.block_table, cu, kv.seq_lens, 0.125
    )
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(
        q,
        kv.key_cache,
        kv.value_cache,
        kv.block_table,
        cu,
        kv.seq_lens,
        0.125,
        out=out,
        max_query_len=33,
        config=PrefillConfig(block_m=16, block_n=16),
    )
    torch.testing.assert_close(out, want, **TOLERANCES[torch.float32])


def test_launchers_refuse_bad_input_before_running(gen):
    kv = make_paged_kv([5, 20], 2, 64, BS, torch.float32, "cpu", gen)
    q = torch.randn(2, 4, 64, generator=gen)
    out = torch.full_like(q, float("nan"))
    bad = kv.block_table.clone()
    bad[0, 0] = -3
    caches = (kv.key_cache, kv.value_cache)
    with pytest.raises(ValueError, match="outside the pool"):
        paged_decode_attention(q, *caches, bad, kv.seq_lens, 0.125, out=out)
    with pytest.raises(ValueError, match="too short"):
        paged_decode_attention(q, *caches, kv.block_table[:, :1], kv.seq_lens, 0.125, out=out)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_decode_attention(torch.randn(2, 3, 64), *caches, kv.block_table, kv.seq_lens, 0.1)
    assert out.isnan().all()  # nothing ran
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="dtype"):
        paged_prefill_attention(q.half(), *caches, kv.block_table, cu, kv.seq_lens, 0.125)
    with pytest.raises(ValueError, match="outside the pool"):
        paged_prefill_attention(q, *caches, bad, cu, kv.seq_lens, 0.125, out=out)
    assert out.isnan().all()
    with pytest.raises(ValueError, match="slots >="):
        reshape_and_cache(q[:, :2], q[:, 2:], *caches, torch.tensor([10**5, 20]))


# ------------------------------------------------------------------ an FP8 KV cache


def _fp8_pool(kv, scales):
    """``kv``'s pool in e4m3 (K divided by scales[0], V by scales[1]; NaN poison stays NaN),
    and its layer-1 views."""
    pool = torch.empty_like(kv.kv_pool, dtype=torch.float8_e4m3fn)
    for i in (0, 1):
        pool[:, :, i] = reference.fp8_quantize(kv.kv_pool[:, :, i], scales[i])
    k, v = layout.layer_kv_views(pool, 1)
    return pool, k, v


FP8_SCALES = torch.tensor([0.01, 0.004])  # K and V values up to ~4: e4m3 values up to ~450


@pytest.mark.parametrize(("v_pairs", "head_dim"), [(True, 64), (False, 64), (True, 16)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_kernel_reads_an_fp8_cache(gen, monkeypatch, num_splits, dtype, v_pairs, head_dim):
    # A 16-bit query takes its dots in float16 against the e4m3 cache (DOT_FP16; bfloat16's
    # run on the GPU: tests/gpu/test_fp8_gpu.py). V is read as int16 pairs of head dims
    # (FP8_V_PAIRS, the default) or byte by byte (also head dims < 32 with FP8_V_PAIRS on).
    from splitserve.kernels import decode_attention as da

    monkeypatch.setattr(da, "FP8_V_PAIRS", v_pairs)
    lens = _lens(gen, 2)
    kv = make_paged_kv(lens, 2, head_dim, BS, torch.float32, "cpu", gen)
    _, k8, v8 = _fp8_pool(kv, FP8_SCALES)
    q = torch.randn(len(lens), 8, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    want = reference.paged_decode_attention(
        q.float(), k8, v8, kv.block_table, kv.seq_lens, scale, kv_scales=FP8_SCALES
    )
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k8, v8, kv.block_table, kv.seq_lens, scale, out=out,
                           num_splits=num_splits, config=DecodeConfig(block_n=32),
                           kv_scales=FP8_SCALES)  # fmt: skip
    torch.testing.assert_close(out.float(), want, **TOLERANCES[dtype])


def test_prefill_kernel_reads_an_fp8_cache(gen):
    shapes = [(n, n) for n in EDGE_LENS] + [(2 * BS + 3, BS + 1), (BS + 7, 1), (BS, 0)]
    kv, cu, q = _prefill_case(gen, shapes, (8, 2, 64), torch.float32)
    _, k8, v8 = _fp8_pool(kv, FP8_SCALES)
    want = reference.paged_prefill_attention(
        q, k8, v8, kv.block_table, cu, kv.seq_lens, 0.125, kv_scales=FP8_SCALES
    )
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k8, v8, kv.block_table, cu, kv.seq_lens, 0.125, out=out,
                            config=PrefillConfig(block_m=16, block_n=16),
                            kv_scales=FP8_SCALES)  # fmt: skip
    torch.testing.assert_close(out, want, **TOLERANCES[torch.float32])


def test_cache_write_kernel_stores_fp8_divided_by_the_scales(gen):
    """Byte-exact against the reference. The inputs are e4m3 values times the scales (plus some
    past +-448 x scale, which saturate): Triton 3.6's interpreter rounds a value that carries
    into the next power of two wrongly (31.4 to 16, not 32), a bug of the interpreter's float8
    conversion the GPU does not have; rounding itself is checked on the GPU
    (tests/gpu/test_kernels_gpu.py)."""
    kv = make_paged_kv([BS + 2, 3], 2, 64, BS, torch.float32, "cpu", gen, spare_blocks=2)
    pool, k8, v8 = _fp8_pool(kv, FP8_SCALES)
    num_slots = pool.shape[0] * BS
    free = [
        s for s in range(BS, num_slots) if torch.isnan(k8.reshape(num_slots, -1)[s].float()).all()
    ]
    slots = torch.tensor(
        [free[i] for i in torch.randperm(len(free), generator=gen)[:7].tolist()] + [-1]
    )

    def exact(scale):
        x = (torch.randn(len(slots), 2, 64, generator=gen) * 100).to(torch.float8_e4m3fn)
        x = x.float() * scale
        x[0, 0, :4] = torch.tensor([500.0, -500.0, 1e6, -1e6]) * scale  # saturate at +-448
        return x

    key, value = exact(FP8_SCALES[0]), exact(FP8_SCALES[1])
    want = pool.clone()
    wk, wv = layout.layer_kv_views(want, 1)
    reference.reshape_and_cache(key, value, wk, wv, slots, kv_scales=FP8_SCALES)
    reshape_and_cache(key, value, k8, v8, slots, kv_scales=FP8_SCALES)
    assert torch.equal(pool.view(torch.uint8), want.view(torch.uint8))
    written = k8[slots[0] // BS, slots[0] % BS, 0, :4].float()
    assert written.tolist() == [448.0, -448.0, 448.0, -448.0]


# ------------------------------------------------------------------ FP8 activations


@pytest.mark.parametrize("k", [1, 100, 4096, 5000])
def test_quantize_rows_kernel_matches_the_torch_quantization(gen, k):
    """The per-token FP8 quantization of the linear layers' inputs (one launch on CUDA) against
    `kernels.quant.quantize_rows`'s torch path: the scales bit for bit (IEEE divisions), rows of
    zeros included, and every value the same wherever the quotient is exact (e4m3 values times
    the row's scale). Rounding itself is checked on the GPU, bit for bit
    (tests/gpu/test_fp8_gpu.py): the interpreter's float8 conversion mis-rounds carries into the
    next power of two (see the cache-write test above)."""
    from splitserve.kernels import quant
    from splitserve.kernels.elementwise import quantize_rows_fp8

    rows = 6
    e4m3 = (torch.randn(rows, k, generator=gen) * 100).clamp(-448, 448).to(quant.FP8).float()
    e4m3[:, 0] = 448.0  # each row's amax is 448 x its scale, so every quotient is exact
    row_scales = torch.tensor([1.0, 2.0**-7, 2.0**5, 0.0, 2.0**-3, 1.0]).view(rows, 1)
    x = e4m3 * row_scales  # row 3: all zeros
    x[5] = torch.randn(k, generator=gen) * 3  # a random row: only its scale is compared
    q, scales = quantize_rows_fp8(x, quant.FP8_MAX, quant.MIN_SCALE)
    want_q, want_scales = quant.quantize_rows(x, native=False)
    assert q.dtype == quant.FP8 and q.shape == x.shape and scales.shape == (rows, 1)
    assert torch.equal(scales, want_scales)
    assert torch.equal(q[:5].view(torch.uint8), want_q[:5].view(torch.uint8))
    assert q[3].float().abs().sum() == 0 and scales[3, 0] > 0


def test_quantize_rows_kernel_refuses_a_strided_row():
    from splitserve.kernels import quant
    from splitserve.kernels.elementwise import quantize_rows_fp8

    with pytest.raises(ValueError, match="contiguous last dim"):
        quantize_rows_fp8(torch.zeros(4, 8).t(), quant.FP8_MAX, quant.MIN_SCALE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quantized_in_its_kernel_is_the_norm_then_the_quantization(
    gen, dtype, with_residual
):
    """RMSNorm with its output quantized in the same kernel (what feeds an FP8 projection): the
    bytes and scales of the unfused pair of kernels, and the same residual stream. (Against
    torch's rounding: on the GPU, tests/gpu/test_fp8_gpu.py; the interpreter mis-rounds e4m3
    carries, see the cache-write test above.)"""
    from splitserve.kernels import elementwise, quant

    x = torch.randn(5, 96, generator=gen).to(dtype)
    x[2] = 0  # a row of zeros: the smallest scale, zeros out
    weight = (torch.rand(96, generator=gen) + 0.5).to(dtype)
    res = torch.randn(5, 96, generator=gen).to(dtype) if with_residual else None
    res_fused = res.clone() if res is not None else None
    q, scales = elementwise.rms_norm_fp8(x, weight, 1e-6, res_fused, quant.FP8_MAX, quant.MIN_SCALE)
    normed = elementwise.rms_norm(x, weight, 1e-6, res)
    want_q, want_scales = elementwise.quantize_rows_fp8(normed, quant.FP8_MAX, quant.MIN_SCALE)
    assert q.dtype == quant.FP8 and scales.shape == (5, 1)
    assert torch.equal(scales, want_scales)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    if res is not None:
        assert res_fused is not None and torch.equal(res_fused, res)
    empty_q, empty_scales = elementwise.rms_norm_fp8(x[:0], weight, 1e-6, None, 448.0, 1e-5)
    assert empty_q.shape == (0, 96) and empty_scales.shape == (0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "one_pass_max"), [(40, 16384), (3000, 16384), (3000, 1024)])
def test_silu_and_mul_quantized_in_its_kernel_is_the_activation_then_the_quantization(
    gen, monkeypatch, dtype, n, one_pass_max
):
    """SiLU-and-mul quantized on the way out (the down projection's FP8 input, one launch, the
    16-bit activation never written): the unfused pair's bytes and scales, a row in one pass
    and rows wider than `ONE_PASS_MAX` (two passes of 2048) both."""
    from splitserve.kernels import elementwise, quant

    monkeypatch.setattr(elementwise, "ONE_PASS_MAX", one_pass_max)

    gate_up = (torch.randn(4, 2 * n, generator=gen) * 4).to(dtype)
    q, scales = elementwise.silu_and_mul_fp8(gate_up, quant.FP8_MAX, quant.MIN_SCALE)
    act = elementwise.silu_and_mul(gate_up)
    want_q, want_scales = elementwise.quantize_rows_fp8(act, quant.FP8_MAX, quant.MIN_SCALE)
    assert q.shape == (4, n) and torch.equal(scales, want_scales)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    with pytest.raises(ValueError, match="silu_and_mul_fp8"):
        elementwise.silu_and_mul_fp8(gate_up[:, :-1], quant.FP8_MAX, quant.MIN_SCALE)
