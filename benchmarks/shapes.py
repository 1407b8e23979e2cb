"""Model shapes the benchmarks share (imported by the scripts in this folder)."""

from __future__ import annotations


def llama3_8b_config(num_layers: int = 32, **overrides):
    """A transformers LlamaConfig of Llama-3-8B's shape (weights are drawn at random)."""
    from transformers import LlamaConfig

    fields = dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=num_layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        dtype="bfloat16",
        eos_token_id=128001,
    )
    return LlamaConfig(**{**fields, **overrides})


def llama3_70b_config(num_layers: int = 80, **overrides):
    """Llama-3-70B's shape (140 GB of bf16 weights: more than one H200 holds with room for KV;
    run it at --tensor-parallel-size 2 or more)."""
    fields = dict(
        hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8
    )
    return llama3_8b_config(num_layers, **{**fields, **overrides})
