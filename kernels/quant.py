"""FP8 (e4m3) linear layers: weights quantized per output channel, activations per token.

``y = (q_x · q_w^T) * s_x * s_w (+ bias)``, where ``q_w`` is the weight in float8_e4m3fn with one
float32 scale per output channel (``s_w``: ``[N]``) and ``q_x`` the input quantized per token at
run time (``s_x``: ``[T, 1]``, each row's amax / 448). On a GPU with FP8 tensor cores (compute
capability 8.9 or more: Ada, Hopper) the product is one ``torch._scaled_mm`` with row-wise scales;
elsewhere (CPU, or shapes it does not take) the same quantities are computed in float32: the FP8
values are exactly representable there, so the emulation differs from the GPU's only in the order
of the float32 sums.

The per-token quantization of the activations is one Triton kernel on CUDA
(``kernels.elementwise.quantize_rows_fp8``, the same values as the eight torch kernels of the
reference below, which CPU tensors take); Triton is imported on first CUDA use only, so a CPU-only
process never loads it. Where the kernel before a linear layer can quantize its own output
(RMSNorm, SiLU-and-mul: ``kernels.ops.rms_norm_fp8`` / ``silu_and_mul_fp8``), the layer takes
``QuantizedRows`` and the separate pass goes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# A row of zeros gets this scale (its values quantize to 0 either way), not 0 (a division by 0).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


class QuantizedRows(NamedTuple):
    """Activations already quantized per token (by a kernel that produced them: RMSNorm's or
    SiLU-and-mul's FP8 form, kernels/ops.py), for `fp8_linear`: ``data`` float8_e4m3fn
    ``[T, K]``, ``scale`` float32 ``[T, 1]``, ``dtype`` the dtype they had (the output's)."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @classmethod
    def of(cls, x: torch.Tensor) -> QuantizedRows:
        """``x [T, K]`` quantized by `quantize_rows` (the Triton kernel on CUDA, else torch)."""
        q, scale = quantize_rows(x)
        return cls(q, scale, x.dtype)


def fp8_supported(device: torch.device | str) -> tuple[bool, str]:
    """Whether FP8 GEMMs run natively on ``device``, and if not, why (for a message). CPU: False
    (emulated)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"{device.type} has no FP8 GEMM (emulated in float32)"
    if not hasattr(torch, "_scaled_mm"):
        return False, f"torch {torch.__version__} has no torch._scaled_mm"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return False, f"{name} (compute capability {major}.{minor}) has no FP8 tensor cores"
    return True, ""


def quantize_rows(
    x: torch.Tensor, *, native: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., K]`` → (float8_e4m3fn ``[..., K]``, float32 scales ``[..., 1]``): each row
    scaled so that its largest magnitude maps to 448. ``native`` None: the Triton kernel for a
    CUDA tensor, torch otherwise; False: torch (the reference)."""
    if native is None:
        native = x.is_cuda
    if native and x.dim() >= 1:
        from splitserve.kernels.elementwise import quantize_rows_fp8

        k = x.shape[-1]
        q, scale = quantize_rows_fp8(x.reshape(-1, k).contiguous(), FP8_MAX, MIN_SCALE)
        return q.view(x.shape), scale.view(*x.shape[:-1], 1)
    xf = x.float()
    # times float32(1 / 448), not / 448: what torch on CUDA computes for a division by a number
    # (a reciprocal), so that CPU, CUDA and the Triton kernel agree bit for bit.
    scale = xf.abs().amax(dim=-1, keepdim=True).mul_(1.0 / FP8_MAX).clamp_(min=MIN_SCALE)
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[N, K]`` weight → (float8 ``[N, K]``, float32 per-output-channel scales ``[N]``): each
    row's amax / 448, an IEEE division on every device (as quantization tools write the scales of
    published checkpoints; a tensor by a tensor, which torch on CUDA does not turn into a
    reciprocal), so a checkpoint quantized at load is the same on CPU and GPU."""
    w = weight.float()
    amax = w.abs().amax(dim=-1, keepdim=True)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_(min=MIN_SCALE)
    return (w / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale.squeeze(-1)


def dequantize_weight(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """float8 ``[N, K]`` with ``[N]`` scales → ``dtype`` ``[N, K]`` (the weight the GEMM means)."""
    return (weight.float() * scale.float().view(-1, 1)).to(dtype)


def _scaled_mm_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # cuBLAS's FP8 GEMM wants K and N in multiples of 16 (every served model's are).
    return x.is_cuda and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def fp8_linear(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    native: bool | None = None,
) -> torch.Tensor:
    """``x`` ``[..., K]`` (16/32-bit) times an FP8 weight ``[N, K]`` with scales ``[N]``:
    ``[..., N]`` in ``x``'s dtype. ``x`` may come quantized already (`QuantizedRows`, ``[T, K]``).
    ``native`` None: ``torch._scaled_mm`` where the device and the shapes take it, else the
    float32 emulation; False forces the emulation (the reference)."""
    if weight.dtype != FP8 or weight.dim() != 2:
        raise ValueError(
            f"fp8_linear: weight must be a 2-D {FP8}, got {weight.dtype} {weight.dim()}-D"
        )
    n, k = weight.shape
    if x.shape[-1] != k or weight_scale.shape != (n,):
        raise ValueError(
            f"fp8_linear: x [..., {x.shape[-1]}], weight {tuple(weight.shape)} and scale "
            f"{tuple(weight_scale.shape)} do not fit (want x [..., {k}], scale ({n},))"
        )
    lead = x.shape[:-1]
    if isinstance(x, QuantizedRows):
        if x.data.dim() != 2 or x.data.dtype != FP8 or x.scale.shape != (x.data.shape[0], 1):
            raise ValueError(
                f"fp8_linear: quantized rows must be {FP8} [T, K] with float32 scales [T, 1], "
                f"got {x.data.dtype} {tuple(x.data.shape)} and {tuple(x.scale.shape)}"
            )
        qx, sx, dtype = x.data, x.scale, x.dtype
    else:
        x2 = x.reshape(-1, k)
        if x2.shape[0] == 0:
            return x.new_empty(*lead, n)
        # The reference (native False) quantizes with torch too.
        qx, sx = quantize_rows(x2, native=None if native is not False else False)
        dtype = x.dtype
    if qx.shape[0] == 0:
        return torch.empty(*lead, n, dtype=dtype, device=qx.device)
    if native is None:
        native = _scaled_mm_takes(qx, weight)
    if native:
        out = torch._scaled_mm(  # pyright: ignore[reportPrivateImportUsage]
            qx,
            weight.t(),
            scale_a=sx,
            scale_b=weight_scale.view(1, n),
            out_dtype=torch.bfloat16,  # row-wise scales: cuBLAS writes bfloat16
        )
        out = out.to(dtype)
    else:
        out = (qx.float() @ weight.float().t()).mul_(sx).mul_(weight_scale.float().view(1, n))
        out = out.to(dtype)
    if bias is not None:
        out = out + bias
    return out.view(*lead, n)
