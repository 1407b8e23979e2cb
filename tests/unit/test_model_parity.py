"""Token-exact parity with transformers, fp32 on CPU, on random checkpoints saved with
save_pretrained and loaded through the real loading code (safetensors, single and sharded)."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from splitserve.engine.core import LLMEngine
from splitserve.kvstore import ModelIdentity
from splitserve.models.loader import load_model
from splitserve.models.runner import ModelRunner, RunnerConfig, SequenceInput
from splitserve.models.sampling_params import SamplingParams
from splitserve.models.tiny import write_random_checkpoint

MAX_NEW = 8
VARIANTS = {
    "llama-gqa2": ("LlamaForCausalLM", {}),
    "llama-mha-tied-3layers": (
        "LlamaForCausalLM",
        dict(num_key_value_heads=4, tie_word_embeddings=True, num_hidden_layers=3),
    ),
    "llama3-rope-hd64-gqa4-sharded": (
        "LlamaForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        ),
    ),
    "qwen2-bias": (
        "Qwen2ForCausalLM",
        dict(num_key_value_heads=1, head_dim=16, num_attention_heads=8),
    ),
    "mistral": ("MistralForCausalLM", dict(num_hidden_layers=1)),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    shard = "150KB" if "sharded" in request.param else None
    write_random_checkpoint(
        path, arch, seed=random.randrange(1 << 30), max_shard_size=shard, **overrides
    )
    if shard:
        assert (path / "model.safetensors.index.json").is_file()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # generate then runs like ignore_eos=True
    return path, hf


def _engine(path, num_blocks=96, **kw):
    config, model = load_model(path, dtype="float32")
    rc = RunnerConfig(kv_cache_bytes=num_blocks * 16 * config.kv_bytes_per_token(torch.float32))
    runner = ModelRunner(config, model, rc)
    return LLMEngine(runner, ModelIdentity(str(path), block_size=16), **kw)


def _hf_greedy(hf, prompt, n=MAX_NEW):
    ids = torch.tensor([prompt])
    # No eos (see the fixture); min_new_tokens would instead mask eos and change the argmax.
    config = GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        # An explicit mask: generate would otherwise mask every token equal to pad_token_id.
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt) :].tolist()


def _prompts(vocab, lengths):
    return [[random.randrange(vocab) for _ in range(n)] for n in lengths]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def test_prefill_logits_match_transformers(checkpoint):
    path, hf = checkpoint
    engine = _engine(path)
    runner = engine.runner
    tokens = _prompts(hf.config.vocab_size, [45])[0]
    ids, pos, meta, _ = runner.prepare([SequenceInput(tokens, 0, [5, 2, 9])])
    with torch.inference_mode():
        ours = runner.model.compute_logits(runner.model(ids, pos, runner.kv_pool, meta))
        ref = hf(torch.tensor([tokens])).logits[0].float()
    rel = ((ours - ref).norm() / ref.norm()).item()
    assert rel < 1e-4, rel


def test_greedy_batch_equals_transformers_then_cached_then_chunked(checkpoint):
    path, hf = checkpoint
    lengths = [1, 15, 16, 17, 33, 40]
    prompts = _prompts(hf.config.vocab_size, lengths)
    expected = [_hf_greedy(hf, p) for p in prompts]

    engine = _engine(path)
    first = engine.generate(prompts, GREEDY)
    assert [r.output_token_ids for r in first] == expected

    # Same prompts again: their full blocks now come from the prefix cache.
    again = engine.generate(prompts, GREEDY)
    assert [r.output_token_ids for r in again] == expected
    # Every full block but the one holding the last prompt token is reused.
    assert [r.num_cached_tokens for r in again] == [(n - 1) // 16 * 16 for n in lengths]

    # A fresh engine with a 7-token budget: every prompt is prefilled in chunks.
    chunked = _engine(path, max_num_batched_tokens=7)
    assert [r.output_token_ids for r in chunked.generate(prompts, GREEDY)] == expected


def test_preemption_under_a_small_pool_gives_the_same_output(checkpoint):
    path, hf = checkpoint
    prompts = _prompts(hf.config.vocab_size, [30, 31, 29, 28])
    expected = [_hf_greedy(hf, p) for p in prompts]
    # 9 usable blocks: four 38-token sequences (3 blocks each) cannot all run at once.
    engine = _engine(path, num_blocks=10)
    got = engine.generate(prompts, GREEDY)
    assert [r.output_token_ids for r in got] == expected
    assert engine.num_preemptions > 0
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1
