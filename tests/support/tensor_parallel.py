"""Tensor-parallel test models and helpers shared by the TP test files."""

from __future__ import annotations

from splitserve.client import AsyncClient

SHAPES = {
    # 8 heads over 4 KV heads; every bias Llama can have; tied embeddings; 321 rows: TP 2 pads.
    "llama-bias-tied": (
        "LlamaForCausalLM",
        dict(
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=16,
            vocab_size=321,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
        ),
    ),
    # Qwen2 (q/k/v biases): 2 KV heads, so at TP 4 each is held by two ranks.
    "qwen2-gqa": (
        "Qwen2ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=322),
    ),
}


async def greedy(address: str, prompt: list[int], max_tokens: int) -> list[int]:
    async with AsyncClient(address) as client:
        out = await client.generate(
            prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
        return list(out.token_ids)


def tp_flags(n: int) -> tuple[str, ...]:
    return ("--tensor-parallel-size", str(n))
