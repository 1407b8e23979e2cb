"""Checkpoint loading: what is accepted, and the clear errors for what is not."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.models.config import ModelConfig
from splitserve.models.loader import load_model, load_weights
from splitserve.models.runner import ModelRunner, RunnerConfig
from splitserve.models.tiny import build_byte_tokenizer, ensure_tiny_model, write_random_checkpoint


@pytest.fixture
def ckpt(tmp_path):
    return write_random_checkpoint(tmp_path / "m", "LlamaForCausalLM", seed=1)


def _rewrite(path, mutate):
    tensors = load_file(path / "model.safetensors")
    mutate(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.mlp\.gate_up_proj\.weight\[1\]"):
        load_model(ckpt)


def test_unexpected_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(2)))
    with pytest.raises(ValueError, match=r"unexpected tensors.*model\.layers\.0\.extra\.weight"):
        load_model(ckpt)


def test_misshapen_tensor_is_named(ckpt):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][
            :-1
        ].clone()

    _rewrite(ckpt, shrink)
    with pytest.raises(ValueError, match=r"k_proj\.weight has shape \(63, 128\)"):
        load_model(ckpt)


def test_unsupported_architecture_and_missing_files(tmp_path, ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        load_model(ckpt)
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_model(tmp_path / "nowhere")
    empty = tmp_path / "config-only"
    write_random_checkpoint(empty, "LlamaForCausalLM")
    (empty / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no model\.safetensors"):
        load_model(empty)


def test_dtype_choice_dummy_format_and_bad_format(ckpt):
    config, model = load_model(ckpt, dtype="bfloat16")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert config.checkpoint_dtype == torch.float32
    _, dummy = load_model(ckpt, load_format="dummy", seed=5)
    _, again = load_model(ckpt, load_format="dummy", seed=5)
    w = dummy.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(w, again.layers[0].self_attn.qkv_proj.weight)
    assert 0.015 < w.std().item() < 0.025 and torch.all(dummy.norm.weight == 1)
    with pytest.raises(ValueError, match="load_format"):
        load_model(ckpt, load_format="pickle")
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model(ckpt, dtype="int8")


def test_state_dict_loading_fuses_like_the_file_loader(ckpt):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    _, from_file = load_model(ckpt)
    _, from_dict = load_model(ckpt, load_format="dummy")
    load_weights(from_dict, hf.state_dict().items())
    for (name, a), (_, b) in zip(
        from_file.state_dict().items(), from_dict.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    q = hf.model.layers[1].self_attn.q_proj.weight
    assert torch.equal(from_file.layers[1].self_attn.qkv_proj.weight[: q.shape[0]], q)


def test_kv_pool_size_is_reported_and_bounded(ckpt):
    config, model = load_model(ckpt)
    per_block = 16 * config.kv_bytes_per_token(torch.float32)
    runner = ModelRunner(config, model, RunnerConfig(kv_cache_bytes=10 * per_block + 5))
    assert runner.num_blocks == 10
    assert tuple(runner.kv_pool.shape) == (10, 2, 2, 16, 2, 32)
    with pytest.raises(ValueError, match="fewer than 2 blocks"):
        ModelRunner(config, model, RunnerConfig(kv_cache_bytes=per_block))
    with pytest.raises(ValueError, match="must be given"):
        ModelRunner(config, model, RunnerConfig())
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        RunnerConfig(gpu_memory_utilization=1.5)


def test_embedded_tiny_model_is_created_once_and_loads(tmp_path):
    path = ensure_tiny_model(tmp_path)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    config = ModelConfig.from_pretrained(path)
    assert config.architecture == "LlamaForCausalLM" and config.head_dim == 64
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    text = "héllo, wörld ✓"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids == list(text.encode()) and tok.decode(ids) == text
    assert tok.eos_token_id == config.eos_token_ids[0] == 257
    assert len(build_byte_tokenizer()) == 258  # 256 bytes + BOS + EOS


def _config_variants():
    """config.json files as transformers writes them and as checkpoints in the wild spell them:
    (name, architecture, the config class's arguments, keys then changed in the file it saved;
    None: left out)."""
    llama = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=96)
    return [
        ("llama", "LlamaForCausalLM", llama, {}),
        (
            "llama-gqa-bias-tied",
            "LlamaForCausalLM",
            {
                **llama,
                "num_key_value_heads": 2,
                "attention_bias": True,
                "mlp_bias": True,
                "tie_word_embeddings": True,
            },
            {},
        ),
        (
            "llama-eos-list-head-dim",
            "LlamaForCausalLM",
            {**llama, "eos_token_id": [2, 7], "head_dim": 32},
            {},
        ),
        (
            "llama-legacy-keys",
            "LlamaForCausalLM",
            llama,
            {
                "rope_parameters": None,
                "rope_theta": 500000.0,
                "torch_dtype": "bfloat16",
                "dtype": None,
            },
        ),
        ("llama-no-tie-key", "LlamaForCausalLM", llama, {"tie_word_embeddings": None}),
        (
            "llama3-rope",
            "LlamaForCausalLM",
            {
                **llama,
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            },
            {},
        ),
        ("llama-no-kv-heads", "LlamaForCausalLM", llama, {"num_key_value_heads": None}),
        ("qwen2", "Qwen2ForCausalLM", {**llama, "num_key_value_heads": 2}, {}),
        (
            "qwen2-window",
            "Qwen2ForCausalLM",
            {
                **llama,
                "num_key_value_heads": 2,
                "use_sliding_window": True,
                "sliding_window": 48,
                "max_position_embeddings": 128,
            },
            {},
        ),
        (
            "mistral",
            "MistralForCausalLM",
            {
                **llama,
                "num_key_value_heads": 2,
                "sliding_window": 100,
                "max_position_embeddings": 256,
            },
            {},
        ),
        (
            "mistral-no-window",
            "MistralForCausalLM",
            {**llama, "num_key_value_heads": 2, "sliding_window": None},
            {},
        ),
        (
            "mistral-window-unnamed",
            "MistralForCausalLM",
            {**llama, "num_key_value_heads": 2},
            {"sliding_window": None},
        ),
    ]


@pytest.mark.parametrize(
    "name,arch,kwargs,edits", _config_variants(), ids=[v[0] for v in _config_variants()]
)
def test_config_read_without_transformers_agrees_with_autoconfig(
    tmp_path, name, arch, kwargs, edits
):
    """A node reads a plain config.json itself (plain_config: it skips importing transformers,
    half of its start); every field ModelConfig takes must then equal AutoConfig's reading, and
    what it cannot read plainly goes to AutoConfig."""
    import transformers
    from transformers import AutoConfig

    from splitserve.models.config import plain_config

    cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    cls(architectures=[arch], **{"eos_token_id": 2, **kwargs}).save_pretrained(tmp_path)
    file = tmp_path / "config.json"
    raw = json.loads(file.read_text())
    for key, value in edits.items():  # None: the key is left out
        raw.pop(key, None)
        if value is not None:
            raw[key] = value
    file.write_text(json.dumps(raw))

    mine = ModelConfig.from_pretrained(tmp_path)
    theirs = ModelConfig.from_hf_config(AutoConfig.from_pretrained(tmp_path, local_files_only=True))
    for field in ModelConfig.__slots__:
        if field != "hf_config":
            assert getattr(mine, field) == getattr(theirs, field), field
    plain = plain_config(file)
    # The plain reading is taken exactly where the config names every field itself with the
    # default rotary embedding (so the fast path is not silently unused).
    expect_plain = name not in ("llama3-rope", "llama-no-kv-heads", "mistral-window-unnamed")
    assert (plain is not None) == expect_plain
    if plain is not None:
        assert (
            mine.hf_config.rope_parameters["rope_theta"]
            == (theirs.hf_config.rope_parameters["rope_theta"])
        )
