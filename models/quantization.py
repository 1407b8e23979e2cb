"""FP8 weights: how a checkpoint's quantization is read, and the layers that run it.

``--quantization fp8`` (or a checkpoint published in FP8) makes every linear layer of the decoder
(q/k/v, o, gate/up, down) an FP8 layer: float8_e4m3fn weights with one float32 scale per output
channel, activations quantized per token at run time (``kernels.quant``). The embedding, the norms
and ``lm_head`` stay in the model's dtype (as vLLM and SGLang keep them).

Where the FP8 weights come from (``load_model`` → ``models.loader``):

- a 16/32-bit checkpoint: each weight quantized as it is read (per output channel; under tensor
  parallelism each rank quantizes the part it holds);
- an FP8 checkpoint as published, recognised by its ``config.json``'s ``quantization_config``:
  - ``quant_method: "fp8"`` (transformers' fine-grained FP8, DeepSeek/Qwen style: 128x128 blocks,
    ``weight_scale_inv``; or without ``weight_block_size`` one ``weight_scale`` per tensor);
  - ``quant_method: "compressed-tensors"`` with 8-bit ``float`` weights (llm-compressor's FP8:
    ``strategy`` ``channel``, ``tensor`` or ``block``; ``weight_scale``);
  - ``quant_method: "fbgemm_fp8"`` (per-channel ``weight_scale``).

  Per-channel and per-tensor weights are used bit for bit. Block-scaled weights (a scale per
  128x128 tile) are re-quantized per output channel at load: the GEMM here takes row-wise scales
  only, so a tile whose scale is below its row's largest loses up to one e4m3 rounding (see
  docs/deploy.md, "FP8 weights"). Static activation scales (``input_scale``) are not used:
  activations are always scaled per token, which is at least as accurate. KV-cache scales
  (``self_attn.k_scale``, ``v_scale``) are the scales of an FP8 KV cache (``--kv-cache-dtype
  fp8``), with or without FP8 weights.

The torch-free part (which method a ``config.json`` names) is ``kvstore.hashing.
checkpoint_quantization``: the quantization is part of the model identity the router computes too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from splitserve.kernels import quant
from splitserve.kvstore.hashing import (
    QUANTIZATIONS,
    canonical_quantization,
    checkpoint_quantization,
)

__all__ = [
    "QUANTIZATIONS",
    "Fp8Linear",
    "QuantSpec",
    "resolve_quantization",
    "weight_from_checkpoint",
]

# Checkpoint tensors that only scale others (read beside their weight) or that this engine does
# not use (static activation and KV-cache scales).
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")
UNUSED_SUFFIXES = (".input_scale", ".output_scale", ".kv_scale")
# An FP8 KV cache's per-layer scales as vLLM and llm-compressor write them.
KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """How this model's linear layers are quantized (FP8, the one method) and how the checkpoint
    stores them. ``stored``: ``None`` when the checkpoint holds 16/32-bit weights (quantized at
    load), else the checkpoint's weight scheme: ``channel``, ``tensor`` or ``block``
    (``block``: the tile, rows x columns)."""

    stored: str | None = None
    block: tuple[int, int] | None = None

    def describe(self) -> str:
        if self.stored is None:
            return "fp8 (quantized at load, per output channel)"
        tile = f" {self.block[0]}x{self.block[1]}" if self.block else ""
        return f"fp8 (checkpoint: per-{self.stored}{tile} scales)"


def _checkpoint_scheme(qc: dict[str, Any]) -> QuantSpec:
    """The weight scheme of a ``quantization_config`` that ``checkpoint_quantization`` accepted."""
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block:
            return QuantSpec(stored="block", block=(int(block[0]), int(block[1])))
        return QuantSpec(stored="tensor")
    if method == "fbgemm_fp8":
        return QuantSpec(stored="channel")
    # compressed-tensors: checkpoint_quantization checked every group is 8-bit float.
    weights = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]
    strategies = {w.get("strategy", "tensor") for w in weights}
    if len(strategies) != 1:
        raise ValueError(
            f"compressed-tensors checkpoint mixes weight strategies {sorted(strategies)}; "
            "splitserve reads one of channel, tensor or block per checkpoint"
        )
    strategy = strategies.pop()
    if strategy == "block":
        block = weights[0].get("block_structure") or [128, 128]
        return QuantSpec(stored="block", block=(int(block[0]), int(block[1])))
    if strategy not in ("channel", "tensor"):
        raise ValueError(
            f"compressed-tensors weight strategy {strategy!r} is not supported for FP8; "
            "splitserve reads channel, tensor and block"
        )
    return QuantSpec(stored=strategy)


def resolve_quantization(
    quantization: str | None, hf_config: Any, device: torch.device
) -> QuantSpec | None:
    """The ``QuantSpec`` a model is built with: ``quantization`` (``--quantization``) and the
    checkpoint's own ``quantization_config``; ``ValueError`` saying what to change when they
    disagree, the format is not one this engine reads, or ``device`` is a GPU without FP8."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    stored = checkpoint_quantization({"quantization_config": qc} if qc else {})
    wanted = canonical_quantization(quantization) if quantization else stored
    if stored and wanted != stored:
        raise ValueError(
            f"the checkpoint is quantized as {stored}; --quantization {wanted} cannot serve it"
        )
    if not wanted:
        return None
    if device.type == "cuda":
        ok, why = quant.fp8_supported(device)
        if not ok:
            raise ValueError(
                f"--quantization fp8 needs a GPU with FP8 tensor cores (compute capability 8.9 or "
                f"more: Ada, Hopper, Blackwell): {why}. Serve the model in bfloat16 instead"
            )
    return _checkpoint_scheme(qc) if stored and qc else QuantSpec()


class Fp8Linear(nn.Module):
    """``y = x W^T + b`` with W in FP8 (``weight`` ``[out, in]`` float8_e4m3fn, ``weight_scale``
    ``[out]`` float32) and b (optional) in the model's dtype."""

    weight_scale: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=quant.FP8), requires_grad=False
        )
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor | quant.QuantizedRows) -> torch.Tensor:
        return quant.fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8"


def make_linear(
    in_features: int, out_features: int, bias: bool, spec: QuantSpec | None
) -> nn.Module:
    """An ``nn.Linear``, or its FP8 form when the model is quantized."""
    if spec is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return Fp8Linear(in_features, out_features, bias)


# ---------------------------------------------------------------------------------- loading


def is_fp8(tensor: Any) -> bool:
    """Whether a tensor (or a safetensors slice) holds float8_e4m3fn; ``ValueError`` for another
    8-bit float (e5m2: its values would be read as e4m3's)."""
    if isinstance(tensor, torch.Tensor):
        name = str(tensor.dtype).removeprefix("torch.").upper()
    else:
        name = str(tensor.get_dtype()).upper()
    if name in ("F8_E4M3", "F8_E4M3FN", "FLOAT8_E4M3FN"):
        return True
    if name.startswith(("F8", "FLOAT8")):
        raise ValueError(f"weights stored as {name}: splitserve reads FP8 weights in e4m3 only")
    return False


def block_dequantize(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], rows: slice, cols: slice
) -> torch.Tensor:
    """float32 ``weight[rows, cols]`` of a block-scaled FP8 tensor: ``weight`` is that part
    already (float8), ``scale`` the whole tensor's ``[ceil(N/bn), ceil(K/bk)]`` tile scales."""
    bn, bk = block
    r0, r1 = rows.start, rows.stop
    c0, c1 = cols.start, cols.stop
    tile_rows = torch.arange(r0, r1, device=scale.device) // bn
    tile_cols = torch.arange(c0, c1, device=scale.device) // bk
    if (tile_rows.numel() and int(tile_rows[-1]) >= scale.shape[0]) or (
        tile_cols.numel() and int(tile_cols[-1]) >= scale.shape[1]
    ):
        raise ValueError(
            f"block scales {tuple(scale.shape)} do not cover rows {r0}..{r1} and columns "
            f"{c0}..{c1} in {bn}x{bk} tiles"
        )
    full = scale.float()[tile_rows][:, tile_cols]
    return weight.float() * full.to(weight.device)


def weight_from_checkpoint(
    data: torch.Tensor,
    scale: torch.Tensor | None,
    spec: QuantSpec,
    rows: slice,
    cols: slice,
    total_rows: int,
    name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of a checkpoint weight as (float8 ``[n, k]``, float32 scales ``[n]``).

    ``data``: the part read (rows ``rows``, columns ``cols`` of a ``[total_rows, ...]`` tensor),
    16/32-bit (quantized here) or FP8 with ``scale`` as the checkpoint stores it (the whole
    tensor's: a scalar, ``[N]``/``[N, 1]`` or tile scales)."""
    if not is_fp8(data):
        return quant.quantize_weight(data)
    if scale is None:
        raise ValueError(f"FP8 tensor {name} has no weight_scale or weight_scale_inv beside it")
    scale = scale.float().to(data.device)
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        raise ValueError(f"{name}: its weight scales must be finite and > 0")
    n = data.shape[0]
    if scale.numel() == 1:
        return data, scale.reshape(1).expand(n).contiguous()
    if spec.block is not None and scale.dim() == 2 and scale.shape[1] > 1:
        return quant.quantize_weight(block_dequantize(data, scale, spec.block, rows, cols))
    if scale.numel() == total_rows:
        return data, scale.reshape(-1)[rows].contiguous()
    bn, bk = spec.block or (0, 0)
    raise ValueError(
        f"{name}: weight scale of shape {tuple(scale.shape)} fits neither one scale, one per "
        f"output channel ({total_rows}) nor {bn}x{bk} tiles"
        if spec.block
        else f"{name}: weight scale of shape {tuple(scale.shape)} fits neither one scale nor one "
        f"per output channel ({total_rows})"
    )


def dequantize_checkpoint(
    data: torch.Tensor, scale: torch.Tensor | None, spec: QuantSpec | None, name: str
) -> torch.Tensor:
    """A whole FP8 checkpoint tensor as float32 (for a layer kept in the model's dtype, e.g. an
    ``lm_head`` a checkpoint quantized)."""
    if scale is None:
        raise ValueError(f"FP8 tensor {name} has no weight_scale or weight_scale_inv beside it")
    n, k = data.shape
    if spec is not None and spec.block is not None and scale.dim() == 2 and scale.shape[1] > 1:
        return block_dequantize(data, scale, spec.block, slice(0, n), slice(0, k))
    s = scale.float().to(data.device)
    return data.float() * (s.reshape(1, 1) if s.numel() == 1 else s.reshape(n, 1))
