"""Build a model from a Hugging Face checkpoint folder: safetensors (single or sharded) or dummy."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from splitserve.kernels import quant as fp8
from splitserve.models import quantization as quant_format
from splitserve.models.config import ModelConfig, parse_dtype
from splitserve.models.llama import LlamaForCausalLM
from splitserve.models.parallel import SINGLE, TPGroup
from splitserve.models.quantization import QuantSpec

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
    tp: TPGroup = SINGLE,
    quantization: str | None = None,
) -> tuple[ModelConfig, LlamaForCausalLM]:
    """Read ``config.json`` and the weights of a checkpoint folder into a model on ``device``.

    dtype: the checkpoint's own (``config.json``'s ``dtype``) when None. load_format ``dummy``
    draws random weights from ``seed`` (for benchmarks: no weight files needed); ``auto`` is
    ``safetensors``. ``tp``: this rank's tensor-parallel group; the model then holds this rank's
    shards, each read from the files alone (no rank reads a whole tensor it splits).
    ``quantization``: ``fp8`` runs the decoder's linear layers in FP8 (models/quantization.py);
    None: the checkpoint's own (FP8 if it was published so). Raises ``ValueError`` naming any
    missing, unexpected or misshapen tensor, a parallel size that cannot split this model, or a
    quantization this checkpoint or device cannot take.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; use one of {LOAD_FORMATS}")
    config = ModelConfig.from_pretrained(path)
    device = torch.device(device)
    spec = quant_format.resolve_quantization(quantization, config.hf_config, device)
    if dtype is None:
        dtype = config.checkpoint_dtype
        if spec is not None and dtype == torch.float32 and device.type == "cuda":
            dtype = torch.bfloat16  # an FP8 checkpoint's config may name no dtype at all
    dtype = parse_dtype(dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build the parameters in their final dtype, not fp32 first
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config, dtype, tp, spec)
    finally:
        torch.set_default_dtype(previous)
    if load_format == "dummy":
        _init_dummy(model, seed)
    else:
        _load_safetensors(model, Path(path), device)
    model.eval().requires_grad_(False)
    logger.info(
        "loaded %s (%s, %d layers, %.2f GB%s) on %s as %s%s",
        path,
        config.architecture,
        config.num_layers,
        sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 1e9,
        f", tensor parallel rank {tp.rank} of {tp.size}" if tp.size > 1 else "",
        device,
        dtype,
        f", linear layers {spec.describe()}" if spec is not None else "",
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


def _iter_checkpoint(files: list[Path], device: torch.device) -> Iterator[tuple[str, Any]]:
    """Each tensor of the files as a lazy slice: a rank reads only its shard of it."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_slice(name)


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


class _Place(NamedTuple):
    """Where a checkpoint tensor goes on this rank: rows ``[dest_start, dest_start + length)``
    of the parameter take ``[start, start + length)`` of the tensor along ``dim`` (of ``total``
    there); ``dim`` None: the whole tensor, the whole parameter."""

    dim: int | None
    total: int = 0
    start: int = 0
    length: int = 0
    dest_start: int = 0


def _place(model: LlamaForCausalLM, pname: str, shard: int | None) -> _Place:
    """This rank's part of the checkpoint tensor of ``pname`` (``shard``: of a fused one),
    per models/parallel.py's layout. At tensor parallel size 1 the part is the whole tensor."""
    cfg, sh, hd = model.config, model.shards, model.config.head_dim
    if pname.endswith("qkv_proj.weight") or pname.endswith("qkv_proj.bias"):
        nq, nkv = len(sh.heads) * hd, len(sh.kv_heads) * hd
        if shard == 0:
            return _Place(0, cfg.q_size, sh.heads.start * hd, nq, 0)
        return _Place(0, cfg.kv_size, sh.kv_heads.start * hd, nkv, nq + ((shard or 1) - 1) * nkv)
    if "gate_up_proj." in pname:
        n = len(sh.intermediate)
        return _Place(0, cfg.intermediate_size, sh.intermediate.start, n, (shard or 0) * n)
    if pname.endswith("o_proj.weight"):
        return _Place(1, cfg.q_size, sh.heads.start * hd, len(sh.heads) * hd)
    if pname.endswith("down_proj.weight"):
        n = len(sh.intermediate)
        return _Place(1, cfg.intermediate_size, sh.intermediate.start, n)
    if pname in ("embed_tokens.weight", "lm_head.weight"):
        rows = sh.vocab_rows
        return _Place(0, cfg.vocab_size, rows.start, len(rows))
    return _Place(None)


def _shape(tensor: Any) -> tuple[int, ...]:
    return tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tuple(tensor.get_shape())


def _read(tensor: Any, place: _Place) -> torch.Tensor:
    """The part ``place`` of a tensor or of a safetensors slice (which reads only that part)."""
    if place.dim is None:
        return tensor if isinstance(tensor, torch.Tensor) else tensor[...]  # (0-dim too)
    if isinstance(tensor, torch.Tensor):
        return tensor.narrow(place.dim, place.start, place.length)
    end = place.start + place.length
    return tensor[place.start : end] if place.dim == 0 else tensor[:, place.start : end]


def _read_scales(files: list[Path], device: torch.device) -> dict[str, torch.Tensor]:
    """The weight-scale tensors of the files (small: read whole, before the weights they
    scale)."""
    from safetensors import safe_open

    scales: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if name.endswith(quant_format.SCALE_SUFFIXES):
                    scales[name] = f.get_tensor(name)
    return scales


def _load_safetensors(model: LlamaForCausalLM, path: Path, device: torch.device) -> None:
    files = _weight_files(path)
    scales = _read_scales(files, device) if model.quant is not None else {}
    load_weights(model, _iter_checkpoint(files, device), source=str(path), scales=scales)


@torch.no_grad()
def load_weights(
    model: LlamaForCausalLM,
    named_tensors: Iterable[tuple[str, Any]],
    source: str = "checkpoint",
    scales: dict[str, torch.Tensor] | None = None,
) -> None:
    """Copy tensors named as in a Hugging Face checkpoint (``model.layers.0.self_attn.q_proj.
    weight`` ...) into ``model``, fusing q/k/v and gate/up, converting to the model's dtype.
    Under tensor parallelism each takes only this rank's part (models/parallel.py); a value may
    be a tensor or a safetensors slice (then only that part is read). Every parameter must be
    filled exactly once; raises ``ValueError`` naming what is wrong.

    An FP8 model (``model.quant``) takes 16/32-bit weights (quantized here) or FP8 ones with
    their scales, which ``scales`` holds by checkpoint name (``...weight_scale`` or
    ``...weight_scale_inv``; scale tensors among ``named_tensors`` are taken too, if they come
    before their weight)."""
    params = dict(model.named_parameters())
    cfg = model.config
    fused_parts = {"self_attn.qkv_proj": 3, "mlp.gate_up_proj": 2}
    loaded: set[tuple[str, int | None]] = set()
    unexpected = []
    scales = dict(scales or {})
    for name, tensor in named_tensors:
        if name.endswith(quant_format.SCALE_SUFFIXES):
            if name not in scales:  # (a safetensors checkpoint's are read before: _read_scales)
                scales[name] = _read(tensor, _Place(None))
            continue
        if name.endswith(quant_format.UNUSED_SUFFIXES):
            continue  # static activation scales: not used (models/quantization.py)
        if kv_scale := quant_format.KV_SCALE.match(name):
            _load_kv_scale(model, kv_scale, _read(tensor, _Place(None)), f"{source}: {name}")
            continue
        target = _target(model, name)
        if target is None or target[0] not in params:
            if target and target[0] == "__tied__":
                continue  # a tied checkpoint may still store lm_head; embed_tokens is used
            if not _IGNORED.search(name):
                unexpected.append(name)
            continue
        pname, shard = target
        param = params[pname].data
        place = _place(model, pname, shard)
        dest, full = param, list(param.shape)
        if place.dim is not None:
            if place.dim == 0:
                dest = param.narrow(0, place.dest_start, place.length)
            full = list(dest.shape)
            full[place.dim] = place.total
        shape = _shape(tensor)
        if shape != tuple(full):
            raise ValueError(
                f"{source}: tensor {name} has shape {shape}, the config implies {tuple(full)}"
            )
        if param.dtype == fp8.FP8:
            _load_fp8(model, pname, dest, tensor, place, shape, f"{source}: {name}", scales)
        elif quant_format.is_fp8(tensor):  # e.g. an lm_head the checkpoint quantized
            whole = quant_format.dequantize_checkpoint(
                _read(tensor, _Place(None)), _scale_of(name, scales), model.quant, name
            )
            dest.copy_(_read(whole, place))
        else:
            dest.copy_(_read(tensor, place))
        if pname in ("embed_tokens.weight", "lm_head.weight") and dest.shape != param.shape:
            param[dest.shape[0] :].zero_()  # the padding rows of the last vocabulary shard
        loaded.add((pname, shard))
    if unexpected:
        raise ValueError(
            f"{source}: unexpected tensors for {cfg.architecture}: {_first(unexpected)}"
        )
    missing = []
    for pname in params:
        fused = next((k for k in fused_parts if k in pname), None)
        shards = range(fused_parts[fused]) if fused else [None]
        missing += [
            f"{pname}[{s}]" if s is not None else pname for s in shards if (pname, s) not in loaded
        ]
    if missing:
        raise ValueError(f"{source}: tensors missing for: {_first(missing)}")


def _scale_of(name: str, scales: dict[str, torch.Tensor]) -> torch.Tensor | None:
    stem = name.removesuffix(".weight")
    return scales.get(f"{stem}.weight_scale", scales.get(f"{stem}.weight_scale_inv"))


def _load_kv_scale(model: LlamaForCausalLM, match: Any, value: torch.Tensor, name: str) -> None:
    """A checkpoint's ``self_attn.k_scale``/``v_scale``: the layer's FP8 KV cache scale."""
    layer, which = int(match.group(1)), match.group(2)
    if not 0 <= layer < len(model.layers):
        raise ValueError(f"{name}: the model has {len(model.layers)} layers")
    if value.numel() != 1 or not bool(torch.isfinite(value).all()) or float(value) <= 0:
        raise ValueError(f"{name}: a KV cache scale is one finite number > 0, got {value}")
    scales = model.get_buffer(f"layers.{layer}.self_attn.kv_scales")
    scales[0 if which == "k" else 1] = float(value)


def _scale_buffer(model: LlamaForCausalLM, pname: str) -> torch.Tensor:
    """The ``weight_scale`` of the FP8 layer whose weight is ``pname``."""
    scale = getattr(model.get_submodule(pname.removesuffix(".weight")), "weight_scale", None)
    if not isinstance(scale, torch.Tensor):
        raise RuntimeError(f"{pname} is FP8 but its layer has no weight_scale")
    return scale


def _load_fp8(
    model: LlamaForCausalLM,
    pname: str,
    dest: torch.Tensor,
    tensor: Any,
    place: _Place,
    shape: tuple[int, ...],
    name: str,
    scales: dict[str, torch.Tensor],
) -> None:
    """Fill an FP8 parameter's part ``dest`` and its scales from a checkpoint tensor (``name``:
    ``source: tensor name``, for messages)."""
    spec = model.quant or QuantSpec()
    data = _read(tensor, place)
    rows, cols = slice(0, shape[0]), slice(0, shape[1])
    if place.dim == 0:
        rows = slice(place.start, place.start + place.length)
    elif place.dim == 1:
        cols = slice(place.start, place.start + place.length)
    stem = name.rpartition(": ")[2]
    weight, scale = quant_format.weight_from_checkpoint(
        data, _scale_of(stem, scales), spec, rows, cols, shape[0], name
    )
    dest.copy_(weight)
    scale_dest = _scale_buffer(model, pname)
    if place.dim == 0:
        scale_dest = scale_dest.narrow(0, place.dest_start, place.length)
    scale_dest.copy_(scale)


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
        elif param.dtype == fp8.FP8:  # drawn in float32, then quantized as a checkpoint's is
            drawn = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            weight, scale = fp8.quantize_weight(drawn.normal_(0.0, 0.02, generator=gen))
            param.copy_(weight)
            _scale_buffer(model, name).copy_(scale)
        else:
            param.normal_(0.0, 0.02, generator=gen)
