"""What the model runner needs to know about a checkpoint: its config.json, read directly where
every field is plain, else through transformers' AutoConfig."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Architecture → bias layout. Qwen2 has q/k/v biases; Llama may have them through
# `attention_bias` (then o_proj has one too) and `mlp_bias`.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use float32, float16 or bfloat16")
        return dtype
    try:
        return _DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use float32, float16 or bfloat16") from None


def _supported_architecture(hf_config: Any) -> str:
    """The checkpoint's architecture name, or ``ValueError`` for anything this decoder does not
    compute exactly (another architecture, rope type or activation)."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or hf_config.model_type!r}; splitserve runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}; Llama-family models use 'silu'")
    return arch


def _max_model_len(hf_config: Any, arch: str) -> int:
    max_len = hf_config.max_position_embeddings
    window = getattr(hf_config, "sliding_window", None)
    uses_window = arch == "MistralForCausalLM" or getattr(hf_config, "use_sliding_window", False)
    if window is not None and uses_window and window < max_len:
        # NOTE: sliding-window attention is not implemented; below the window it is plain
        # causal attention, so capping the context keeps outputs exact.
        logger.warning(
            "sliding_window=%d < max_position_embeddings=%d: context capped at %d",
            window,
            max_len,
            window,
        )
        max_len = window
    return max_len


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a Llama-family decoder, independent of where its weights come from."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_model_len: int
    checkpoint_dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    # transformers' PreTrainedConfig, or plain_config's reading of config.json: the rotary and
    # quantization parameters
    hf_config: Any

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.kv_size * dtype.itemsize

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> ModelConfig:
        arch = _supported_architecture(hf_config)
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads {num_heads} is not a multiple of "
                f"num_key_value_heads {num_kv_heads}"
            )
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        ckpt_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=attention_bias and arch != "Qwen2ForCausalLM",
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            max_model_len=_max_model_len(hf_config, arch),
            checkpoint_dtype=parse_dtype(ckpt_dtype) if ckpt_dtype else torch.float32,
            eos_token_ids=eos_ids,
            hf_config=hf_config,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` of a local checkpoint folder (never a hub download): directly when
        it names every field itself (``plain_config``), else through AutoConfig."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is not a model folder: it has no config.json")
        plain = plain_config(path / "config.json")
        if plain is not None:
            return cls.from_hf_config(plain)
        from transformers import AutoConfig

        return cls.from_hf_config(AutoConfig.from_pretrained(path, local_files_only=True))


# The fields a supported checkpoint's config.json must name itself to be read without
# transformers: their defaults differ between the architectures' config classes (e.g.
# num_key_value_heads: None for Llama, 32 for Qwen2, 8 for Mistral), so a missing one is left to
# AutoConfig, which knows them.
_PLAIN_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "eos_token_id",
)


def plain_config(file: Path) -> SimpleNamespace | None:
    """``config.json`` as the attributes ``ModelConfig.from_hf_config`` reads, or None where
    AutoConfig must read it. Importing transformers and its config classes is half of a node's
    start (~1.6 s of CPU); a checkpoint written by ``save_pretrained`` for a supported
    architecture with the default rotary embedding names every field this needs, and those
    fields mean the same without transformers' normalisation. Anything else (another or a
    remote-code architecture, scaled rotary embeddings, a missing field, a dtype spelt otherwise)
    goes to AutoConfig: tests/unit/test_model_loader.py checks both readings agree."""
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # (AutoConfig's error then says what is wrong)
    if not isinstance(raw, dict) or "auto_map" in raw:
        return None
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        return None
    if any(raw.get(key) is None for key in _PLAIN_REQUIRED):
        return None
    rope = raw.get("rope_parameters")
    if raw.get("rope_scaling") is not None or (rope is not None and not isinstance(rope, dict)):
        return None
    rope = dict(rope or {})
    theta = rope.get("rope_theta", raw.get("rope_theta"))
    if rope.get("rope_type", "default") != "default" or not isinstance(theta, int | float):
        return None
    uses_window = "MistralForCausalLM" in archs or raw.get("use_sliding_window")
    if uses_window and "sliding_window" not in raw:
        return None
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    if dtype is not None and dtype not in _DTYPES:
        return None
    fields = dict(raw)
    fields.update(
        rope_parameters={"rope_theta": theta, "rope_type": "default"},
        dtype=dtype,
        sliding_window=raw.get("sliding_window") if uses_window else None,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )
    return SimpleNamespace(**fields)
