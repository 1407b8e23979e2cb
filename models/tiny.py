"""Small random-weight checkpoints written with transformers' ``save_pretrained``.

``ensure_tiny_model()`` gives the embedded default model: a deterministic two-layer Llama with a
byte-level tokenizer built locally (no download), created on first use and cached on disk.
``write_random_checkpoint`` makes the same kind of folder for any supported architecture; tests
use it to compare against transformers on real checkpoint files.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

# v2: the tokenizer has a chat template.
TINY_MODEL_NAME = "splitserve-tiny-llama-v2"
BYTE_VOCAB = 256
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# A plain chat template (Jinja, as transformers renders them): one "role: content" line per
# message after BOS, and "assistant:" to prompt the next turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "splitserve"


def build_byte_tokenizer():
    """A byte-level tokenizer: token id = byte value (0..255), then BOS=256 and EOS=257."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in enumerate(_byte_level_chars())}
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _byte_level_chars() -> list[str]:
    """The printable character that byte-level pre-tokenizers use for each byte 0..255: the
    byte's own character when printable, else one from U+0100 upward, in byte order."""
    printable = (
        set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    )
    chars, extra = [], 0
    for byte in range(BYTE_VOCAB):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(0x100 + extra))
            extra += 1
    return chars


_ARCH_CONFIGS = {
    "LlamaForCausalLM": "LlamaConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "MistralForCausalLM": "MistralConfig",
}


def write_random_checkpoint(
    path: str | Path,
    architecture: str = "LlamaForCausalLM",
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    with_tokenizer: bool = False,
    **config: Any,
) -> Path:
    """Save a random-weight model of ``architecture`` to ``path`` (safetensors).

    ``config`` overrides the small defaults (hidden 128, 2 layers, 4 heads, 2 KV heads,
    head_dim 32, vocab 320). ``max_shard_size`` (e.g. "200KB") writes a sharded checkpoint.
    """
    import torch
    import transformers

    defaults: dict[str, Any] = dict(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        bos_token_id=BYTE_VOCAB,
        eos_token_id=BYTE_VOCAB + 1,
        tie_word_embeddings=False,
        # NOTE: a wider init than the usual 0.02 gives peaked logits, so greedy decoding rarely
        # meets near-ties that rounding could flip.
        initializer_range=0.1,
    )
    if architecture == "MistralForCausalLM":
        defaults["sliding_window"] = None
    cfg_cls = getattr(transformers, _ARCH_CONFIGS[architecture])
    cfg = cfg_cls(**{**defaults, **config})
    cfg.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(cfg).to(getattr(torch, dtype))
    path = Path(path)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    if with_tokenizer:
        build_byte_tokenizer().save_pretrained(path)
    return path


def ensure_tiny_model(cache_dir: str | Path | None = None) -> Path:
    """The default model's folder, written on first use (atomically: concurrent first uses are
    safe) and reused afterwards."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / TINY_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_MODEL_NAME}-", dir=root))
    try:
        write_random_checkpoint(
            tmp,
            "LlamaForCausalLM",
            seed=1234,
            with_tokenizer=True,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=4096,
        )
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # lost the race only if it is complete
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
