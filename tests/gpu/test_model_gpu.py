"""The model runner on a CUDA GPU in bf16 against transformers (skipped without a GPU; the fp32
CPU counterpart is tests/test_model_parity.py)."""

import random

import pytest
import torch

from kvstore import ModelIdentity
from models.engine import LLMEngine
from models.loader import load_model
from models.runner import ModelRunner, RunnerConfig, SequenceInput
from models.sampler import SamplingParams
from models.tiny import write_random_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA GPU; CPU counterpart: tests/test_model_parity.py",
    ),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = write_random_checkpoint(
        tmp_path_factory.mktemp("gpu-llama"),
        "LlamaForCausalLM",
        seed=3,
        vocab_size=2048,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=4096,
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    hf.generation_config.eos_token_id = None
    return path, hf


def _runner(path, graphs):
    config, model = load_model(path, dtype="bfloat16", device="cuda")
    rc = RunnerConfig(
        kv_cache_bytes=1 << 30,
        use_cuda_graph=graphs,
        max_num_seqs=64,
        graph_batch_sizes=(1, 2, 4, 8, 16, 32, 64),
    )
    return ModelRunner(config, model, rc)


def test_bf16_prefill_logits_as_close_to_fp32_as_transformers_bf16(checkpoint):
    """bf16 error against the fp32 reference is a property of the dtype; ours must not add to
    it: at most 1.5x the error of transformers' own bf16 forward of the same checkpoint."""
    path, hf = checkpoint
    runner = _runner(path, graphs=False)
    tokens = [random.randrange(2048) for _ in range(300)]
    ids, pos, meta, _ = runner.prepare([SequenceInput(tokens, 0, random.sample(range(1, 200), 19))])
    x = torch.tensor([tokens], device="cuda")
    with torch.inference_mode():
        ours = runner.model.compute_logits(runner.model(ids, pos, runner.kv_pool, meta))
        ref = hf(x).logits[0].float()
        hf_bf16 = hf.to(torch.bfloat16)(x).logits[0].float()
        hf.float()
    rel = ((ours - ref).norm() / ref.norm()).item()
    rel_hf = ((hf_bf16 - ref).norm() / ref.norm()).item()
    print(f"bf16 logits rel. error vs fp32: ours {rel:.2e}, transformers {rel_hf:.2e}")
    assert rel < 1.5 * rel_hf + 1e-3, (rel, rel_hf)


def test_graph_replay_equals_eager_and_greedy_follows_transformers(checkpoint):
    path, hf = checkpoint
    prompts = [[random.randrange(2048) for _ in range(n)] for n in (1, 17, 100, 250, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    eager = LLMEngine(_runner(path, graphs=False), ModelIdentity("g", dtype="bfloat16"))
    graph = LLMEngine(_runner(path, graphs=True), ModelIdentity("g", dtype="bfloat16"))
    assert graph.runner.graphs is not None
    out_eager = [r.output_token_ids for r in eager.generate(prompts, params)]
    out_graph = [r.output_token_ids for r in graph.generate(prompts, params)]
    assert out_graph == out_eager
    agreeing = []
    for prompt, ours in zip(prompts, out_graph, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            ref = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=12,
                do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        agreeing.append(
            next((i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b), 12)
        )
    # bf16 rounding makes long greedy runs drift from fp32; the first token must agree.
    print("greedy tokens agreeing with fp32 transformers:", agreeing)
    assert min(agreeing) >= 1, agreeing
