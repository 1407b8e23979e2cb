"""FP8 checkpoints in the layouts they are published in, made from a 16/32-bit checkpoint that
``save_pretrained`` wrote, and transformers twins that compute what an FP8 model means.

The quantization here is plain torch, written from the formats' definitions (not splitserve's
code), so a loader that reads a layout wrongly disagrees with it:

- ``compressed-tensors`` (llm-compressor's FP8): ``weight`` float8_e4m3fn, ``weight_scale``
  float32 ``[N, 1]`` (``channel``) or ``[1]`` (``tensor``), optional static ``input_scale``;
- ``fp8`` without blocks (AutoFP8 / vLLM's per-tensor layout): ``weight_scale`` a scalar;
- ``fine-grained`` (transformers' FineGrainedFP8, DeepSeek/Qwen FP8 releases): written by
  transformers' own ``Fp8Quantize`` op: ``weight_scale_inv`` ``[N/bn, K/bk]``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")


def quantize_per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 weight and float32 ``[N, 1]`` scales: each row's amax maps to 448."""
    scale = w.float().abs().amax(dim=1, keepdim=True) / FP8_MAX
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().amax() / FP8_MAX
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.reshape(())


def _copy_side_files(src: Path, dst: Path) -> dict:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model.safetensors") and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    return json.loads((src / "config.json").read_text())


def write_compressed_tensors(src: Path, dst: Path, strategy: str = "channel") -> Path:
    """``src`` (one model.safetensors) as a compressed-tensors FP8 checkpoint at ``dst``."""
    config = _copy_side_files(src, dst)
    tensors = {}
    for name, w in load_file(src / "model.safetensors").items():
        if LINEAR.match(name):
            q, s = quantize_per_row(w) if strategy == "channel" else quantize_per_tensor(w)
            stem = name.removesuffix(".weight")
            tensors[name] = q
            tensors[f"{stem}.weight_scale"] = s if strategy == "channel" else s.reshape(1)
            tensors[f"{stem}.input_scale"] = torch.tensor([0.05])  # static: not used
        else:
            tensors[name] = w
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": strategy,
                    "symmetric": True,
                    "dynamic": False,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "tensor",
                    "dynamic": False,
                },
            }
        },
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def write_per_tensor_fp8(src: Path, dst: Path) -> Path:
    """``src`` as a ``quant_method: fp8`` checkpoint with one scale per tensor (no blocks)."""
    config = _copy_side_files(src, dst)
    tensors = {}
    for name, w in load_file(src / "model.safetensors").items():
        if LINEAR.match(name):
            q, s = quantize_per_tensor(w)
            tensors[name] = q
            tensors[name.removesuffix(".weight") + ".weight_scale"] = s
        else:
            tensors[name] = w
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def write_fine_grained(src: Path, dst: Path, block: tuple[int, int]) -> Path:
    """``src`` as transformers' fine-grained FP8 checkpoint, quantized by transformers' op."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    qconfig = FineGrainedFP8Config(weight_block_size=list(block))

    class _Quantizer:  # what the op reads of its HfQuantizer
        quantization_config = qconfig

    op = Fp8Quantize(_Quantizer())
    config = _copy_side_files(src, dst)
    tensors = {}
    for name, w in load_file(src / "model.safetensors").items():
        tensors.update(op.convert({name: w}) if LINEAR.match(name) else {name: w})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"] = qconfig.to_dict()
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def block_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """What a fine-grained checkpoint's weight means: each tile times its ``weight_scale_inv``."""
    n, k = weight.shape
    bn, bk = -(-n // scale_inv.shape[0]), -(-k // scale_inv.shape[1])
    full = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return weight.float() * full


def fake_quant_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` quantized to e4m3 per row (its last dim) and back: what an FP8 GEMM's input is."""
    # times float32(1 / 448), as kernels.quant.quantize_rows computes activation scales
    scale = x.float().abs().amax(dim=-1, keepdim=True) * (1.0 / FP8_MAX)
    return ((x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale).to(x.dtype)


def fp8_twin(hf_model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``hf_model`` (a transformers Llama, in place) made to compute what the FP8 model means:
    each decoder linear layer's weight replaced by ``weights[checkpoint name]`` (dequantized
    float32) and its input quantized per token to e4m3 and back."""
    with torch.no_grad():
        for name, module in hf_model.named_modules():
            key = f"{name}.weight"
            if isinstance(module, torch.nn.Linear) and LINEAR.match(key):
                module.weight.copy_(weights[key].to(module.weight.dtype))
                module.register_forward_pre_hook(lambda _m, args: (fake_quant_rows(args[0]),))
    return hf_model
