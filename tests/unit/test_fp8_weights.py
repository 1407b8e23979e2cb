"""FP8 weights (``--quantization fp8``, models/quantization.py, kernels/quant.py) on CPU: the
quantization's error bounds, the emulated GEMM against its definition, checkpoints in the layouts
they are published in read bit for bit (or within one re-rounding for block scales), tensor
parallel shards, a tiny FP8 model's logits against a transformers twin computing the same FP8
arithmetic, and every bad input refused with a message that says what is wrong.

On a GPU the same layers run ``torch._scaled_mm``: tests/gpu/test_fp8_gpu.py checks it against
the emulation tested here."""

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import fp8_checkpoints as ckpts
from transformers import AutoModelForCausalLM

from splitserve.engine.core import LLMEngine
from splitserve.kernels import quant
from splitserve.kvstore import ModelIdentity
from splitserve.kvstore.hashing import checkpoint_quantization
from splitserve.models import quantization
from splitserve.models.loader import load_model
from splitserve.models.parallel import TPGroup
from splitserve.models.runner import ModelRunner, RunnerConfig, SequenceInput
from splitserve.models.sampling_params import SamplingParams
from splitserve.models.tiny import write_random_checkpoint

E4M3_REL = 2.0**-4  # half a unit in the last place of e4m3's 3-bit mantissa
E4M3_SUB = 2.0**-10  # half the smallest subnormal step (2^-9), in units of the scale


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A random fp32 Llama written by save_pretrained (dims multiples of 16, as real ones are)."""
    return write_random_checkpoint(tmp_path_factory.mktemp("src"), seed=random.randrange(1 << 30))


# ------------------------------------------------------------------------------ the arithmetic


def test_quantize_rows_error_is_within_one_e4m3_rounding():
    x = torch.randn(64, 96) * torch.logspace(-3, 3, 64).unsqueeze(1)
    x[3] = 0.0  # a row of zeros quantizes to zeros, not NaN
    x[1] *= 1e-3 / x[1].abs().amax()  # below 448 * MIN_SCALE (1/512): its scale is the floor
    q, s = quant.quantize_rows(x)
    assert q.dtype == quant.FP8 and s.shape == (64, 1)
    back = q.float() * s
    assert torch.equal(back[3], torch.zeros(96))
    assert ((back - x).abs() <= E4M3_REL * x.abs() + E4M3_SUB * s + 1e-12).all()
    # Each row's largest magnitude lands on 448 exactly, but for rows so small that their scale
    # stops at MIN_SCALE (row 1 always, the zero row, a row of randn * 1e-3 sometimes): there it
    # lands where amax / MIN_SCALE rounds to in e4m3.
    amax = x.abs().amax(1)
    floored = amax * (1.0 / quant.FP8_MAX) < quant.MIN_SCALE
    assert floored[1] and (s[floored] == quant.MIN_SCALE).all()
    landed = q.float().abs().amax(1)
    assert (landed[~floored] == 448.0).all()
    assert torch.equal(landed[floored], (amax[floored] / quant.MIN_SCALE).to(quant.FP8).float())


def test_emulated_fp8_linear_is_the_product_of_the_dequantized_operands():
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5, 64), torch.randn(48, 64) * 0.1, torch.randn(48)
    qw, sw = quant.quantize_weight(w)
    out = quant.fp8_linear(x, qw, sw, b)
    assert out.shape == (3, 5, 48) and out.dtype == x.dtype
    ref = torch.nn.functional.linear(
        ckpts.fake_quant_rows(x), quant.dequantize_weight(qw, sw, torch.float32), b
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # ... and close to the unquantized product (two e4m3 roundings per term).
    exact = torch.nn.functional.linear(x, w, b)
    assert ((out - exact).norm() / exact.norm()).item() < 0.06
    # bfloat16 input: bfloat16 output. No rows: no work.
    assert quant.fp8_linear(x.bfloat16(), qw, sw).dtype == torch.bfloat16
    assert quant.fp8_linear(x[:, :0], qw, sw).shape == (3, 0, 48)


def test_fp8_linear_refuses_what_does_not_fit():
    qw, sw = quant.quantize_weight(torch.randn(32, 16))
    with pytest.raises(ValueError, match="want x"):
        quant.fp8_linear(torch.randn(4, 17), qw, sw)
    with pytest.raises(ValueError, match="want x"):
        quant.fp8_linear(torch.randn(4, 16), qw, sw[:31])
    with pytest.raises(ValueError, match="2-D"):
        quant.fp8_linear(torch.randn(4, 16), qw.float(), sw)


# ------------------------------------------------------------------------------- checkpoints


def _fp8_parts(model):
    """{our parameter name: (fp8 weight, scale)} of an FP8 model."""
    return {
        name: (m.weight, m.weight_scale)
        for name, m in model.named_modules()
        if getattr(m, "weight_scale", None) is not None
    }


def _expected(src, quantize):
    """The fused q/k/v and gate/up of a checkpoint quantized per tensor by ``quantize``."""
    tensors = load_file(src / "model.safetensors")
    out = {}
    for layer in range(2):
        pre = f"model.layers.{layer}."
        for fused, parts in (
            ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
            ("self_attn.o_proj", ("self_attn.o_proj",)),
            ("mlp.down_proj", ("mlp.down_proj",)),
        ):
            qs = [quantize(tensors[f"{pre}{p}.weight"]) for p in parts]
            weight = torch.cat([q for q, _ in qs])
            scale = torch.cat([s.float().reshape(-1).expand(q.shape[0]) for q, s in qs])
            out[f"layers.{layer}.{fused}"] = (weight, scale)
    return out


@pytest.mark.parametrize(
    "layout",
    ["at-load", "compressed-tensors-channel", "compressed-tensors-tensor", "fp8-per-tensor"],
)
def test_weights_and_scales_are_the_checkpoints_bit_for_bit(source, tmp_path, layout):
    if layout == "at-load":
        path, quantize = source, ckpts.quantize_per_row
    elif layout == "fp8-per-tensor":
        path, quantize = ckpts.write_per_tensor_fp8(source, tmp_path), ckpts.quantize_per_tensor
    else:
        strategy = layout.rpartition("-")[2]
        path = ckpts.write_compressed_tensors(source, tmp_path, strategy)
        quantize = ckpts.quantize_per_row if strategy == "channel" else ckpts.quantize_per_tensor
    _, model = load_model(path, quantization="fp8" if layout == "at-load" else None)
    assert model.quant is not None
    got, want = _fp8_parts(model), _expected(source, quantize)
    assert sorted(got) == sorted(want)
    for name, (weight, scale) in want.items():
        assert torch.equal(got[name][0].view(torch.uint8), weight.view(torch.uint8)), name
        assert torch.equal(got[name][1], scale), name
    # Everything else is the checkpoint's, unquantized.
    _, plain = load_model(source)
    assert torch.equal(model.lm_head.weight, plain.lm_head.weight)
    assert torch.equal(model.embed_tokens.weight, plain.embed_tokens.weight)


def test_fine_grained_blocks_are_read_as_transformers_means_them(source, tmp_path):
    path = ckpts.write_fine_grained(source, tmp_path, block=(16, 32))
    stored = load_file(path / "model.safetensors")
    assert stored["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (128 // 16, 256 // 32)
    _, model = load_model(path)
    assert model.quant is not None and model.quant.block == (16, 32)
    got = _fp8_parts(model)
    for layer in range(2):
        pre = f"model.layers.{layer}."
        for ours, theirs, rows in (
            ("self_attn.o_proj", "self_attn.o_proj", slice(None)),
            ("mlp.down_proj", "mlp.down_proj", slice(None)),
            ("self_attn.qkv_proj", "self_attn.k_proj", slice(128, 192)),
            ("mlp.gate_up_proj", "mlp.up_proj", slice(256, 512)),
        ):
            meant = ckpts.block_dequantize(
                stored[f"{pre}{theirs}.weight"], stored[f"{pre}{theirs}.weight_scale_inv"]
            )
            weight, scale = got[f"layers.{layer}.{ours}"]
            mine = weight[rows].float() * scale[rows].unsqueeze(1)
            # Re-quantized per output channel: within one e4m3 rounding of what the tiles mean.
            bound = E4M3_REL * meant.abs() + E4M3_SUB * scale[rows].unsqueeze(1) + 1e-9
            assert ((mine - meant).abs() <= bound).all(), (layer, ours)


def test_an_fp8_model_computes_what_a_transformers_twin_doing_fp8_arithmetic_computes(tmp_path):
    """The FP8 model (a compressed-tensors checkpoint) against transformers' Llama given the
    dequantized weights and per-token e4m3 inputs: logits of whole prompts far closer to the twin
    than the unquantized model is. Not token-exact over many steps: the two sum in different
    orders, and an activation one float32 ulp apart can round to the neighbouring e4m3 value, so
    on some random models greedy paths part at near-ties (about half, tried over seeds). The
    engine's greedy tokens are the same from the published checkpoint and from the same weights
    quantized at load (bit-for-bit equal weights: test above), every block freed."""
    source = write_random_checkpoint(
        tmp_path / "src", seed=random.randrange(1 << 30), initializer_range=0.02
    )  # real models' scale: one flipped rounding is not amplified layer after layer
    path = ckpts.write_compressed_tensors(source, tmp_path / "ct", "channel")
    stored = load_file(path / "model.safetensors")
    weights = {
        name: stored[name].float() * stored[name.removesuffix(".weight") + ".weight_scale"]
        for name in stored
        if ckpts.LINEAR.match(name)
    }
    twin = ckpts.fp8_twin(
        AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), weights
    )
    plain = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    config, model = load_model(path, dtype="float32")
    kv = RunnerConfig(kv_cache_bytes=96 * 16 * config.kv_bytes_per_token(torch.float32))
    runner = ModelRunner(config, model, kv)
    rng = random.Random(7)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (1, 9, 16, 23, 40)]
    for tokens in prompts:
        ids, pos, meta, _ = runner.prepare([SequenceInput(tokens, 0, [1, 2, 3])])
        with torch.inference_mode():
            ours = model.compute_logits(model(ids, pos, runner.kv_pool, meta))
            theirs = twin(torch.tensor([tokens])).logits[0]
            unquantized = plain(torch.tensor([tokens])).logits[0]
        # Measured over seeds: ours vs the twin <= 5e-3 (1e-6 where no rounding flips); the
        # unquantized model vs the twin >= 5e-2 (FP8's own effect).
        assert _rel(ours, theirs) < 2e-2, (len(tokens), _rel(ours, theirs))
        assert _rel(unquantized, theirs) > 3e-2, (len(tokens), _rel(unquantized, theirs))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = []
    for served, how in ((path, None), (source, "fp8")):
        config_, model_ = load_model(served, dtype="float32", quantization=how)
        engine = LLMEngine(ModelRunner(config_, model_, kv), ModelIdentity(str(served)))
        outs.append([r.output_token_ids for r in engine.generate(prompts, greedy)])
        assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1
    assert outs[0] == outs[1]


def test_the_norms_and_the_activation_hand_fp8_projections_rows_already_quantized(
    source, monkeypatch
):
    """In an FP8 model the two RMSNorms and SiLU-and-mul quantize their own output (one kernel
    each on GPU, no separate quantization pass): qkv, gate_up and down receive `QuantizedRows`,
    o_proj (after attention) quantizes its input itself; the logits are those of quantizing
    inside every projection."""
    from splitserve.kernels import quant

    config, model = load_model(source, quantization="fp8")
    kv = RunnerConfig(kv_cache_bytes=32 * 16 * config.kv_bytes_per_token(torch.float32))
    runner = ModelRunner(config, model, kv)
    ids, pos, meta, _ = runner.prepare([SequenceInput([5, 9, 2, 7, 1, 3], 0, [1])])
    real = quant.fp8_linear
    kinds: list[tuple[int, bool]] = []

    def spy(x, weight, *args, **kwargs):
        kinds.append((weight.shape[0], isinstance(x, quant.QuantizedRows)))
        return real(x, weight, *args, **kwargs)

    monkeypatch.setattr(quant, "fp8_linear", spy)
    with torch.inference_mode():
        fused = model.compute_logits(model(ids, pos, runner.kv_pool, meta))
    attn = model.layers[0].self_attn
    mlp = model.layers[0].mlp
    qkv, o = attn.qkv_proj.weight.shape[0], attn.o_proj.weight.shape[0]
    gate_up, down = mlp.gate_up_proj.weight.shape[0], mlp.down_proj.weight.shape[0]
    assert kinds[:4] == [(qkv, True), (o, False), (gate_up, True), (down, True)]
    assert len(kinds) == 4 * config.num_layers
    # The same model handing every projection plain rows (each quantizes them itself).
    from splitserve.kernels import ops

    for layer in model.layers:
        layer.input_layernorm.fp8_out = layer.post_attention_layernorm.fp8_out = False
    monkeypatch.setattr(ops, "silu_and_mul_fp8", ops.silu_and_mul)
    kinds.clear()
    with torch.inference_mode():
        plain = model.compute_logits(model(ids, pos, runner.kv_pool, meta))
    assert not any(pre for _, pre in kinds) and len(kinds) == 4 * config.num_layers
    assert torch.equal(fused, plain)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("n", [2, 4])
def test_tensor_parallel_ranks_hold_the_shards_of_the_fp8_weights(source, tmp_path, n):
    path = ckpts.write_compressed_tensors(source, tmp_path, "channel")
    _, whole = load_model(path)
    ranks = [load_model(path, tp=TPGroup(r, n, backend=object()))[1] for r in range(n)]
    full, parts = _fp8_parts(whole), [_fp8_parts(m) for m in ranks]
    for name, (weight, scale) in full.items():
        if name.endswith(("o_proj", "down_proj")):  # row-parallel: columns split, scales whole
            cat = torch.cat([p[name][0].view(torch.uint8) for p in parts], dim=1)
            assert torch.equal(cat, weight.view(torch.uint8)), name
            assert all(torch.equal(p[name][1], scale) for p in parts), name
    # Column-parallel: each rank's rows of gate and of up, with their scales.
    gate_up = torch.cat([p["layers.0.mlp.gate_up_proj"][0].view(torch.uint8) for p in parts])
    w, s = full["layers.0.mlp.gate_up_proj"]
    per = 256 // n
    want = torch.cat(
        [
            torch.cat([w[r * per : (r + 1) * per], w[256 + r * per : 256 + (r + 1) * per]])
            for r in range(n)
        ]
    )
    assert torch.equal(gate_up, want.view(torch.uint8))
    want_s = torch.cat(
        [
            torch.cat([s[r * per : (r + 1) * per], s[256 + r * per : 256 + (r + 1) * per]])
            for r in range(n)
        ]
    )
    assert torch.equal(torch.cat([p["layers.0.mlp.gate_up_proj"][1] for p in parts]), want_s)


def test_dummy_weights_are_quantized_too(source):
    _, model = load_model(source, load_format="dummy", quantization="fp8")
    weight, scale = _fp8_parts(model)["layers.1.mlp.down_proj"]
    assert weight.dtype == quant.FP8 and (scale > 0).all()
    assert weight.float().abs().amax(dim=1).eq(448).all()


# ---------------------------------------------------------------------- identity and refusals


def test_the_quantization_is_part_of_the_model_identity(source, tmp_path):
    plain = ModelIdentity.for_checkpoint(source)
    at_load = ModelIdentity.for_checkpoint(source, quantization="fp8")
    assert plain.quantization == "" and at_load.quantization == "fp8"
    assert plain.root_hash != at_load.root_hash
    # An unquantized identity hashes as it did before the field existed (no index is orphaned).
    assert (
        plain.root_hash
        == ModelIdentity(
            plain.name, plain.revision, plain.dtype, plain.block_size, plain.kv_layout
        ).root_hash
    )
    published = ckpts.write_compressed_tensors(source, tmp_path, "channel")
    assert ModelIdentity.for_checkpoint(published).quantization == "fp8"
    with pytest.raises(ValueError, match="quantized as fp8"):
        ModelIdentity.for_checkpoint(published, quantization="none")


def _with_quant_config(source, tmp_path, qc):
    dst = tmp_path / "q"
    ckpts._copy_side_files(source, dst)
    shutil.copy(source / "model.safetensors", dst / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "qc, message",
    [
        ({"quant_method": "gptq", "bits": 4}, "quantized with 'gptq'"),
        ({"quant_method": "awq"}, "quantized with 'awq'"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
            },
            "4-bit int weights",
        ),
        ({"quant_method": "compressed-tensors", "config_groups": {}}, "no config_groups"),
    ],
)
def test_checkpoints_in_formats_not_read_are_refused_by_name(source, tmp_path, qc, message):
    path = _with_quant_config(source, tmp_path, qc)
    with pytest.raises(ValueError, match=message):
        checkpoint_quantization(json.loads((path / "config.json").read_text()))
    with pytest.raises(ValueError, match=message):
        load_model(path)
    with pytest.raises(ValueError, match=message):
        ModelIdentity.for_checkpoint(path)


def test_broken_fp8_tensors_are_refused_with_their_name(source, tmp_path):
    path = ckpts.write_compressed_tensors(source, tmp_path / "ok", "channel")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight_scale"
    weight = "model.layers.0.self_attn.o_proj.weight"
    for broken, message in (
        ({k: v for k, v in tensors.items() if k != name}, "up_proj.weight has no weight_scale"),
        ({**tensors, name: tensors[name][:7]}, "weight scale of shape \\(7, 1\\)"),
        ({**tensors, name: -tensors[name]}, "weight scales must be finite and > 0"),
        ({**tensors, name: tensors[name] * float("inf")}, "weight scales must be finite and > 0"),
        ({**tensors, weight: tensors[weight].to(torch.float8_e5m2)}, "FP8 weights in e4m3 only"),
    ):
        save_file(broken, path / "model.safetensors")
        with pytest.raises(ValueError, match=message):
            load_model(path)


def test_a_gpu_without_fp8_is_refused_before_any_weight_loads(source, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    cfg = load_model(source, load_format="dummy")[0].hf_config
    with pytest.raises(ValueError, match=r"A100 \(compute capability 8.0\) has no FP8"):
        quantization.resolve_quantization("fp8", cfg, torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert quantization.resolve_quantization("fp8", cfg, torch.device("cuda", 0)) is not None
    with pytest.raises(ValueError, match="unsupported quantization 'int4'"):
        quantization.resolve_quantization("int4", cfg, torch.device("cpu"))
