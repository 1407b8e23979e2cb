"""Ground truth for end-to-end tests: greedy generation with transformers on the same checkpoint."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig


@functools.cache
def hf_model(model_dir: str | Path):
    """The checkpoint in fp32 through transformers, never stopping at EOS (cached per folder)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model_dir: str | Path, prompt: list[int], n: int) -> list[int]:
    """The ``n`` tokens transformers' greedy ``generate`` appends to ``prompt``."""
    ids = torch.tensor([prompt])
    config = GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        out = hf_model(model_dir).generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=config
        )
    return out[0, len(prompt) :].tolist()
