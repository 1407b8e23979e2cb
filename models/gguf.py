"""GGUF checkpoints (llama.cpp's single-file format) as checkpoint folders the loader reads.

``ensure_converted(file)`` dequantizes the file's tensors once into a safetensors checkpoint
folder under the cache directory, found by the file's SHA-256: ``config.json`` built from the
file's metadata, the weights in float32 (what every supported quantization dequantizes to
exactly), and the tokenizer with its chat template. A second start finds that folder and only
hashes the file. ``config.json`` carries the hash and the folder is named from the file's
metadata (never its file name), so the model identity (and every block hash) follows the file's
content: the same on every host whatever the file is called, different for two files.

Torch-free (numpy, the ``gguf`` package, tokenizers): the router converts a file too when it is
the first component given it.

Over 300 lines on purpose: one format's conversion (metadata to config, weights, tokenizer) and
the cache of converted folders, which are only ever used together.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Bump when the converted folder's content changes: older conversions are then redone.
CONVERTER_VERSION = 1
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM"}
# The tensor types the gguf package dequantizes that this converter was checked with.
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
SHARD_BYTES = 2 << 30  # a safetensors file holds at most this much (memory while converting)

# GGUF name in a block → Hugging Face name in ``model.layers.N``
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# tokenizer.ggml.pre → how text is split before byte-level BPE (as llama.cpp's llama-vocab.cpp).
_GPT2_PRE = ("gpt2", "default")
_DIGITS_PRE = ("smollm", "starcoder", "refact", "codeshell")  # every digit its own piece first
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the one ``.gguf`` file of a folder that
    has no ``config.json``; None for anything else (a checkpoint folder). A folder holding several
    is a ``ValueError`` that lists them."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" or _has_gguf_magic(path) else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise ValueError(f"{path} holds several GGUF files ({names}): give --model one of them")
    return files[0] if files else None


def _has_gguf_magic(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def model_name(file: Path) -> str:
    """A name for the file's model from its metadata alone (base name, size, quantization):
    the same file under another name, or on another host, gets the same folder name, so the
    same model identity."""
    import gguf

    reader = gguf.GGUFReader(file)
    meta = _Metadata(reader, file)
    parts = [meta.get("general.basename", None) or meta.get("general.name", None) or meta.arch]
    parts.append(meta.get("general.size_label", None))
    file_type = meta.get("general.file_type", None)
    if file_type is not None:
        try:
            parts.append(gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_"))
        except ValueError:
            parts.append(f"type{file_type}")
    name = "-".join(str(p) for p in parts if p)
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"


def _converted(sha_dir: Path) -> Path | None:
    done = (
        [d for d in sha_dir.iterdir() if (d / "config.json").is_file()] if sha_dir.is_dir() else []
    )
    return done[0] if done else None


def ensure_converted(file: str | Path, cache_dir: str | Path) -> Path:
    """The checkpoint folder of GGUF ``file`` (``CACHE/gguf-vN/SHA16/NAME``), converted on first
    use (under a lock, written atomically: concurrent first uses convert once) and reused
    afterwards."""
    file = Path(file)
    sha = file_sha256(file)
    sha_dir = Path(cache_dir) / f"gguf-v{CONVERTER_VERSION}" / sha[:16]
    if (found := _converted(sha_dir)) is not None:
        return found
    sha_dir.mkdir(parents=True, exist_ok=True)
    with open(sha_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # NOTE: others wait here, then find the folder
        if (found := _converted(sha_dir)) is not None:
            return found
        target = sha_dir / model_name(file)
        tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=sha_dir))
        try:
            t0 = time.perf_counter()
            convert_gguf(file, tmp, sha)
            tmp.chmod(0o755)  # mkdtemp's 0700 would keep the folder from other users
            os.rename(tmp, target)
            logger.info("converted %s into %s in %.1f s", file, target, time.perf_counter() - t0)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(file: Path, out: Path, sha256: str) -> None:
    """Write the checkpoint folder of GGUF ``file`` into ``out`` (which exists)."""
    import gguf

    reader = gguf.GGUFReader(file)
    meta = _Metadata(reader, file)
    config = _hf_config(meta, reader, file, sha256)
    _write_weights(reader, meta, out, file)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _build_tokenizer(meta, file).save_pretrained(out)


class _Metadata:
    """The file's key/value metadata, read on demand, with errors that name the file."""

    def __init__(self, reader: Any, file: Path) -> None:
        self._fields = reader.fields
        self.file = file
        self.arch = self.get("general.architecture")
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{file}: unsupported GGUF architecture {self.arch!r}; splitserve converts "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama-family) files"
            )

    def get(self, key: str, default: Any = ...) -> Any:
        field = self._fields.get(key)
        if field is None:
            if default is ...:
                raise ValueError(f"{self.file}: GGUF metadata {key!r} is missing")
            return default
        return field.contents()

    def model(self, key: str, default: Any = ...) -> Any:
        return self.get(f"{self.arch}.{key}", default)


def _hf_config(meta: _Metadata, reader: Any, file: Path, sha256: str) -> dict[str, Any]:
    """``config.json`` of the converted folder (a transformers ``LlamaConfig``)."""
    from transformers import LlamaConfig

    hidden = meta.model("embedding_length")
    heads = meta.model("attention.head_count")
    kv_heads = meta.model("attention.head_count_kv", heads)
    head_dim = meta.model("attention.key_length", hidden // heads)
    rotary = meta.model("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ValueError(
            f"{file}: partial rotary embeddings ({rotary} of {head_dim} dims) are not supported"
        )
    rope = {"rope_type": "default", "rope_theta": float(meta.model("rope.freq_base", 10000.0))}
    scaling = meta.model("rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=float(meta.model("rope.scaling.factor")))
    elif scaling != "none":
        raise ValueError(f"{file}: unsupported rope scaling {scaling!r}; supported: linear")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(
            f"{file}: per-dimension rope frequencies (rope_freqs.weight, Llama-3.1 rope "
            "scaling) are not supported"
        )
    vocab = meta.model("vocab_size", None) or len(meta.get("tokenizer.ggml.tokens"))
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=meta.model("feed_forward_length"),
        num_hidden_layers=meta.model("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=meta.model("context_length"),
        rms_norm_eps=float(meta.model("attention.layer_norm_rms_epsilon")),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id", None),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id", None),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id", None),
    )
    cfg.architectures = [SUPPORTED_ARCHITECTURES[meta.arch]]
    config = cfg.to_dict()
    config["dtype"] = "float32"
    # NOTE: part of config.json, so of the digest in every node's model identity.
    config["splitserve_gguf"] = {
        "sha256": sha256,
        "converter": CONVERTER_VERSION,
        "name": meta.get("general.name", ""),
    }
    return config


def _unpermute(w: Any, heads: int) -> Any:
    """Undo llama.cpp's reordering of q/k rows (its rotary pairs adjacent dims, transformers'
    pairs the two halves of each head)."""
    halves = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:])
    return halves.swapaxes(1, 2).reshape(w.shape)


def _iter_weights(reader: Any, meta: _Metadata, file: Path) -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, float32 array) of every tensor, dequantized."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    heads = meta.model("attention.head_count")
    kv_heads = meta.model("attention.head_count_kv", heads)
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, file)
        qtype = GGMLQuantizationType(tensor.tensor_type).name
        if qtype not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(
                f"{file}: tensor {tensor.name} is quantized as {qtype}, which splitserve does "
                f"not convert; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
            )
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the fastest dim first
        data = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        data = data.reshape(shape)
        if name.endswith("q_proj.weight"):
            data = _unpermute(data, heads)
        elif name.endswith("k_proj.weight"):
            data = _unpermute(data, kv_heads)
        yield name, np.ascontiguousarray(data)


def _hf_name(name: str, file: Path) -> str:
    if name in _TOP_TENSORS:
        return _TOP_TENSORS[name]
    prefix, _, rest = name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and suffix in _LAYER_TENSORS:
        return f"model.layers.{layer}.{_LAYER_TENSORS[suffix]}"
    raise ValueError(f"{file}: unexpected tensor {name!r} for a Llama-family model")


def _write_weights(reader: Any, meta: _Metadata, out: Path, file: Path) -> None:
    """Safetensors shards of at most SHARD_BYTES each, with an index when there are several."""
    from safetensors.numpy import save_file

    shards: list[list[str]] = []  # each written shard's tensor names
    pending: dict[str, Any] = {}
    size = 0

    def flush() -> None:
        save_file(pending, str(out / f"part-{len(shards):05d}"), metadata={"format": "pt"})
        shards.append(list(pending))
        pending.clear()

    for name, array in _iter_weights(reader, meta, file):
        if pending and size + array.nbytes > SHARD_BYTES:
            flush()
            size = 0
        pending[name] = array
        size += array.nbytes
    flush()
    if len(shards) == 1:
        (out / "part-00000").rename(out / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(shards):
        shard = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (out / f"part-{i:05d}").rename(out / shard)
        weight_map.update(dict.fromkeys(names, shard))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _build_tokenizer(meta: _Metadata, file: Path) -> Any:
    """A transformers fast tokenizer from the file's vocabulary, merges, special tokens and chat
    template (byte-level BPE, as llama.cpp's ``gpt2`` tokenizer model); other tokenizer models go
    through transformers' own GGUF tokenizer conversion.

    Over 60 lines: one Tokenizer set up part after part (the pre-tokenizer's variants, the BPE
    model, special and user tokens, the BOS template), each a few lines."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    template = meta.get("tokenizer.chat_template", None)
    if kind != "gpt2":
        from transformers import AutoTokenizer

        logger.info("%s: tokenizer model %r converted by transformers", file, kind)
        tok = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        if template and not tok.chat_template:
            tok.chat_template = template
        return tok
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRE:
        pre_tokenizer = byte_level
    elif pre in _DIGITS_PRE:
        pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in _LLAMA3_PRE:
        pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        known = (*_GPT2_PRE, *_DIGITS_PRE, *_LLAMA3_PRE)
        raise ValueError(
            f"{file}: unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: "
            f"{', '.join(known)}"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type", None) or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges")]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True)
         if k == _CONTROL]
    )  # fmt: skip
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=True)
         if k == _USER_DEFINED]
    )  # fmt: skip
    if meta.get("tokenizer.ggml.add_bos_token", False):
        from tokenizers import processors

        bos = tokens[meta.get("tokenizer.ggml.bos_token_id")]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )

    def special(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id", None)
        return tokens[token_id] if token_id is not None else None

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=special("bos"),
        eos_token=special("eos"),
        unk_token=special("unknown"),
        pad_token=special("padding"),
        clean_up_tokenization_spaces=False,
        model_max_length=meta.model("context_length"),
    )
    if template:
        fast.chat_template = template
    return fast
