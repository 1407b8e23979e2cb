"""FP8 on a GPU with FP8 (compute capability 8.9+): the linear layers' ``torch._scaled_mm``
against the float32 emulation at real shapes, the KV cache's kernels on an e4m3 cache against the
references (the cache write's rounding byte for byte), and FP8 models served with CUDA graphs
giving the tokens of the same model run eagerly (skipped without such a GPU; the CPU
counterparts: tests/unit/test_fp8_weights.py, which checks the emulation against transformers,
tests/unit/test_fp8_kv.py and the interpreter's kernel tests in test_kernels_triton.py)."""

import random

import pytest
import torch
from support.ties import assert_same_choice

from splitserve.engine.core import LLMEngine
from splitserve.kernels import quant
from splitserve.kvstore import ModelIdentity
from splitserve.models.loader import load_model
from splitserve.models.runner import ModelRunner, RunnerConfig, SequenceInput
from splitserve.models.sampling_params import SamplingParams
from splitserve.models.tiny import write_random_checkpoint


def _has_fp8() -> bool:
    return torch.cuda.is_available() and quant.fp8_supported(torch.device("cuda", 0))[0]


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not _has_fp8(),
        reason="no CUDA GPU with FP8 (compute capability >= 8.9); CPU counterparts: "
        "tests/unit/test_fp8_weights.py, tests/unit/test_fp8_kv.py, test_kernels_triton.py",
    ),
]


@pytest.mark.parametrize("m", [1, 7, 64, 257, 2048])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_scaled_mm_matches_the_emulation(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(m * n + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    qw, sw = quant.quantize_weight(w)
    native = quant.fp8_linear(x, qw, sw, native=True)
    emulated = quant.fp8_linear(x.float(), qw, sw, native=False)
    assert native.dtype == torch.bfloat16
    # The same FP8 products; the sums' order and the bfloat16 output rounding differ.
    rel = ((native.float() - emulated).norm() / emulated.norm()).item()
    assert rel < 1e-2, rel


@pytest.mark.parametrize("t, k", [(1, 4096), (240, 4096), (240, 14336), (3000, 4096), (5, 100)])
def test_the_quantize_kernel_gives_torch_s_fp8_values_bit_for_bit(t, k):
    gen = torch.Generator(device="cuda").manual_seed(t + k)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 3
    x[0] = 0
    q, s = quant.quantize_rows(x)  # the Triton kernel on CUDA
    want_q, want_s = quant.quantize_rows(x, native=False)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("t", [1, 240, 3000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quantized_in_its_kernel_gives_the_unfused_bytes(t, with_residual):
    """The norm's FP8 form (what feeds qkv and gate_up) against the norm kernel then torch's
    quantization of its output, bit for bit, at Llama-3-8B's width."""
    from splitserve.kernels import ops

    gen = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16, generator=gen) + 0.5
    res = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    res_fused = res.clone()
    fused = ops.rms_norm_fp8(x, w, 1e-5, res_fused if with_residual else None)
    normed = ops.rms_norm(x, w, 1e-5, res if with_residual else None)
    want_q, want_s = quant.quantize_rows(normed, native=False)
    assert fused.dtype == torch.bfloat16 and torch.equal(fused.scale, want_s)
    assert torch.equal(fused.data.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(res_fused, res)


@pytest.mark.parametrize("t", [1, 240, 3000])
def test_silu_and_mul_quantized_in_its_kernel_gives_the_unfused_bytes(t):
    """SiLU-and-mul's FP8 form (the down projection's input) against the activation kernel then
    torch's quantization, bit for bit, at Llama-3-8B's intermediate width (14,336)."""
    from splitserve.kernels import ops

    gen = torch.Generator(device="cuda").manual_seed(t)
    gate_up = torch.randn(t, 2 * 14336, device="cuda", dtype=torch.bfloat16, generator=gen) * 3
    fused = ops.silu_and_mul_fp8(gate_up)
    want_q, want_s = quant.quantize_rows(ops.silu_and_mul(gate_up), native=False)
    assert torch.equal(fused.scale, want_s)
    assert torch.equal(fused.data.view(torch.uint8), want_q.view(torch.uint8))


def _fp8_checkpoint(tmp_path, seed):
    return write_random_checkpoint(
        tmp_path, seed=seed, vocab_size=2048, hidden_size=1024, intermediate_size=2816,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        initializer_range=0.02,
    )  # fmt: skip


def _graph_replay_against_eager(path, quantization=None, kv_cache_dtype=None):
    """One decode step of five sequences replayed from a CUDA graph against the eager forward
    (the check of tests/gpu/test_model_gpu.py, on an FP8 model/cache), then the same runner
    serving through an engine with every block back at the end."""
    config, model = load_model(path, dtype="bfloat16", device="cuda", quantization=quantization)
    rc = RunnerConfig(
        use_cuda_graph=True, kv_cache_bytes=1 << 30, max_num_seqs=64,
        graph_batch_sizes=(1, 2, 4, 8, 16, 32, 64), kv_cache_dtype=kv_cache_dtype or "auto",
    )  # fmt: skip
    runner = ModelRunner(config, model, rc)
    assert runner.graphs is not None and runner.graphs.can_run(5)
    rng = random.Random(7)
    seqs, nxt = [], 1
    for n in (1, 17, 100, 250, 33):
        blocks = list(range(nxt, nxt + n // 16 + 1))
        nxt += len(blocks)
        seqs.append(SequenceInput([rng.randrange(2048) for _ in range(n)], 0, blocks))
    runner.execute(seqs)  # prefill, eager
    step = [SequenceInput([rng.randrange(2048)], len(s.token_ids), s.block_ids) for s in seqs]
    graph_logits = runner.execute(step).float().clone()
    ids, pos, meta, is_decode = runner.prepare(step)
    assert is_decode
    with torch.inference_mode():
        eager = runner.model.compute_logits(runner.model(ids, pos, runner.kv_pool, meta)).float()
    # The decode kernel's split count differs (the graph fixes it for the longest context); an
    # activation one ulp apart can round to the neighbouring e4m3 value, so the logits agree to
    # FP8's resolution, not bf16's (test_model_gpu.py's bound is 1e-2).
    rel = ((graph_logits - eager).norm() / eager.norm()).item()
    assert rel < 3e-2, rel
    assert_same_choice(graph_logits, eager)  # (near-ties may go either way)
    identity = ModelIdentity(
        str(path),
        dtype="bfloat16",
        quantization=quantization or "",
        kv_cache_dtype=kv_cache_dtype or "",
    )
    engine = LLMEngine(runner, identity)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[(7 * i + j) % 2048 for j in range(n)] for i, n in enumerate((5, 33, 100, 250))]
    results = engine.generate(prompts, greedy)
    assert [len(r.output_token_ids) for r in results] == [24] * 4
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1


def test_an_fp8_model_replays_its_decode_step_from_a_cuda_graph(tmp_path):
    _graph_replay_against_eager(_fp8_checkpoint(tmp_path, 5), quantization="fp8")


# ------------------------------------------------------------------ an FP8 KV cache


def test_cache_write_rounds_as_torch_does():
    """Every e4m3 rounding case (the interpreter on CPU cannot check these: its float8
    conversion mis-rounds carries), saturation included."""
    from splitserve.kernels import layout, reference
    from splitserve.kernels.cache_write import reshape_and_cache

    pool = torch.zeros(8, 2, 2, 16, 8, 128, dtype=torch.float8_e4m3fn, device="cuda")
    want = pool.clone()
    k, v = layout.layer_kv_views(pool, 1)
    wk, wv = layout.layer_kv_views(want, 1)
    gen = torch.Generator(device="cuda").manual_seed(0)
    key = torch.randn(64, 8, 128, device="cuda", generator=gen, dtype=torch.bfloat16) * 3
    value = torch.randn(64, 8, 128, device="cuda", generator=gen, dtype=torch.bfloat16) * 3
    key[0, 0, :2] = torch.tensor([1e4, -1e4])
    scales = torch.tensor([0.01, 0.02], device="cuda")
    slots = torch.arange(16, 80, device="cuda")
    reference.reshape_and_cache(key, value, wk, wv, slots, kv_scales=scales)
    reshape_and_cache(key, value, k, v, slots, kv_scales=scales)
    assert torch.equal(pool.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("lens", [[1, 17, 300, 4000], [8192] * 4])
def test_attention_kernels_read_an_fp8_cache_at_real_shapes(lens):
    from support.paged_kv import make_paged_kv

    from splitserve.kernels import layout, reference
    from splitserve.kernels.decode_attention import paged_decode_attention
    from splitserve.kernels.prefill_attention import paged_prefill_attention

    kv = make_paged_kv(lens, 8, 128, 16, torch.bfloat16, "cuda", torch.Generator().manual_seed(1))
    gen = torch.Generator(device="cuda").manual_seed(len(lens))
    scales = torch.tensor([0.01, 0.004], device="cuda")
    pool = torch.empty_like(kv.kv_pool, dtype=torch.float8_e4m3fn)
    for i in (0, 1):
        pool[:, :, i] = reference.fp8_quantize(kv.kv_pool[:, :, i], scales[i])
    k8, v8 = layout.layer_kv_views(pool, 1)
    q = torch.randn(len(lens), 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    want = reference.paged_decode_attention(
        q, k8, v8, kv.block_table, kv.seq_lens, 128**-0.5, kv_scales=scales
    )
    got = paged_decode_attention(
        q, k8, v8, kv.block_table, kv.seq_lens, 128**-0.5, kv_scales=scales
    )
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    new = [min(n, 512) for n in lens]
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    qp = torch.randn(sum(new), 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    want = reference.paged_prefill_attention(
        qp, k8, v8, kv.block_table, cu, kv.seq_lens, 128**-0.5, kv_scales=scales
    )
    got = paged_prefill_attention(
        qp, k8, v8, kv.block_table, cu, kv.seq_lens, 128**-0.5, kv_scales=scales
    )
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("v_pairs", [True, False])
@pytest.mark.parametrize("fp16_dots", [True, False])
@pytest.mark.parametrize(
    "tiling",
    [(128, 4, 3, None), (64, 4, 5, None), (64, 4, 5, 128), (128, 8, 5, 128), (32, 4, 5, 96)],
)
def test_every_decode_tiling_and_dot_dtype_reads_an_fp8_cache_alike(
    monkeypatch, tiling, fp16_dots, v_pairs
):
    """The tilings and register caps the sweep (benchmarks/step_kernels.py) chooses from, with
    float16 and bfloat16 dots, V read as int16 pairs or bytes: each within the kernels'
    tolerance of the reference."""
    from support.paged_kv import make_paged_kv

    from splitserve.kernels import decode_attention, layout, reference

    monkeypatch.setattr(decode_attention, "FP8_DOTS_IN_FP16", fp16_dots)
    monkeypatch.setattr(decode_attention, "FP8_V_PAIRS", v_pairs)
    lens = [1, 15, 16, 17, 300, 1088, 4000, *range(192, 1088, 37)]
    kv = make_paged_kv(lens, 8, 128, 16, torch.bfloat16, "cuda", torch.Generator().manual_seed(2))
    scales = torch.tensor([0.01, 0.004], device="cuda")
    pool = torch.empty_like(kv.kv_pool, dtype=torch.float8_e4m3fn)
    for i in (0, 1):
        pool[:, :, i] = reference.fp8_quantize(kv.kv_pool[:, :, i], scales[i])
    k8, v8 = layout.layer_kv_views(pool, 1)  # (make_paged_kv fills layer 1, layer 0 is NaN)
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(len(lens), 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    want = reference.paged_decode_attention(
        q, k8, v8, kv.block_table, kv.seq_lens, 128**-0.5, kv_scales=scales
    )
    block_n, warps, stages, regs = tiling
    config = decode_attention.DecodeConfig(block_n, warps, stages, max_registers=regs)
    got = decode_attention.paged_decode_attention(
        q, k8, v8, kv.block_table, kv.seq_lens, 128**-0.5, kv_scales=scales, config=config
    )
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_an_fp8_kv_cache_replays_its_decode_step_from_a_cuda_graph(tmp_path):
    _graph_replay_against_eager(_fp8_checkpoint(tmp_path, 6), kv_cache_dtype="fp8")


def test_fp8_weights_and_kv_cache_replay_their_decode_step_from_a_cuda_graph(tmp_path):
    _graph_replay_against_eager(_fp8_checkpoint(tmp_path, 8), "fp8", "fp8")
