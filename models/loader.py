"""Build a model from a Hugging Face checkpoint folder: safetensors (single or sharded) or dummy."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from splitserve.models.config import ModelConfig, parse_dtype
from splitserve.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")

# checkpoint name (after the "model." prefix) → (our parameter, shard index in a fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def load_model(
    path: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    seed: int = 0,
) -> tuple[ModelConfig, LlamaForCausalLM]:
    """Read ``config.json`` and the weights of a checkpoint folder into a model on ``device``.

    dtype: the checkpoint's own (``config.json``'s ``dtype``) when None. load_format ``dummy``
    draws random weights from ``seed`` (for benchmarks: no weight files needed); ``auto`` is
    ``safetensors``. Raises ``ValueError`` naming any missing, unexpected or misshapen tensor.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; use one of {LOAD_FORMATS}")
    config = ModelConfig.from_pretrained(path)
    dtype = config.checkpoint_dtype if dtype is None else parse_dtype(dtype)
    device = torch.device(device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build the parameters in their final dtype, not fp32 first
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config, dtype)
    finally:
        torch.set_default_dtype(previous)
    if load_format == "dummy":
        _init_dummy(model, seed)
    else:
        _load_safetensors(model, Path(path), device)
    model.eval().requires_grad_(False)
    logger.info(
        "loaded %s (%s, %d layers, %.2f GB) on %s as %s",
        path,
        config.architecture,
        config.num_layers,
        sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9,
        device,
        dtype,
    )
    return config, model


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ValueError(f"{path}: shards listed in {index.name} are missing: {missing}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(
        f"{path} has no model.safetensors or model.safetensors.index.json (only safetensors "
        "checkpoints are read; convert with save_pretrained(safe_serialization=True))"
    )


def _iter_checkpoint(files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)


def _target(model: LlamaForCausalLM, name: str) -> tuple[str, int | None] | None:
    """Our parameter name (and fused shard) for a checkpoint tensor name; None if not ours."""
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if name == "model.norm.weight":
        return "norm.weight", None
    if name == "lm_head.weight":
        return ("lm_head.weight", None) if model.lm_head is not None else ("__tied__", None)
    m = _LAYER.match(name)
    if not m:
        return None
    layer, module, kind = m.groups()
    if module in _FUSED:
        fused, shard = _FUSED[module]
        return f"layers.{layer}.{fused}.{kind}", shard
    return f"layers.{layer}.{module}.{kind}", None


def _load_safetensors(model: LlamaForCausalLM, path: Path, device: torch.device) -> None:
    load_weights(model, _iter_checkpoint(_weight_files(path), device), source=str(path))


@torch.no_grad()
def load_weights(
    model: LlamaForCausalLM,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    source: str = "checkpoint",
) -> None:
    """Copy tensors named as in a Hugging Face checkpoint (``model.layers.0.self_attn.q_proj.
    weight`` ...) into ``model``, fusing q/k/v and gate/up, converting to the model's dtype.
    Every parameter must be filled exactly once; raises ``ValueError`` naming what is wrong."""
    params = dict(model.named_parameters())
    cfg = model.config
    shard_sizes = {
        "self_attn.qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
        "mlp.gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size],
    }
    loaded: set[tuple[str, int | None]] = set()
    unexpected = []
    for name, tensor in named_tensors:
        target = _target(model, name)
        if target is None or target[0] not in params:
            if target and target[0] == "__tied__":
                continue  # a tied checkpoint may still store lm_head; embed_tokens is used
            if not _IGNORED.search(name):
                unexpected.append(name)
            continue
        pname, shard = target
        dest = params[pname].data
        if shard is not None:
            sizes = shard_sizes[next(k for k in shard_sizes if k in pname)]
            dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(
                f"{source}: tensor {name} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        loaded.add((pname, shard))
    if unexpected:
        raise ValueError(
            f"{source}: unexpected tensors for {cfg.architecture}: {_first(unexpected)}"
        )
    missing = []
    for pname in params:
        fused = next((k for k in shard_sizes if k in pname), None)
        shards = range(len(shard_sizes[fused])) if fused else [None]
        missing += [
            f"{pname}[{s}]" if s is not None else pname for s in shards if (pname, s) not in loaded
        ]
    if missing:
        raise ValueError(f"{source}: tensors missing for: {_first(missing)}")


def _first(names: list[str], n: int = 8) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


@torch.no_grad()
def _init_dummy(model: LlamaForCausalLM, seed: int) -> None:
    """Norms at 1, everything else N(0, 0.02), drawn on the model's device (fast for 8B)."""
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)
