"""Triton kernels for the per-token work between matmuls: RMSNorm with a fused residual add,
rotary embedding (in place on q and k) and SiLU-and-multiply.

Unfused, these are ~35 small torch kernels per decoder layer; in a decode step of an 8B model
their launch gaps cost as much as reading the weights (docs/benchmarks-history.md, "Model
runner, Llama-3-8B shape (H200, 2026-11-29)"). Each kernel here does one row (one token) per
program and rounds to the activation dtype at the same points as the torch reference in
`kernels.reference`, which CPU runs use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x,
    residual,
    weight,
    out,
    stride_x,
    stride_r,
    stride_o,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    scales,
    QUANTIZE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    INV_FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    h = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        h = (
            h.to(tl.float32)
            + tl.load(residual + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        ).to(h.dtype)
        tl.store(residual + row * stride_r + cols, h, mask=mask)  # the new residual stream
    hf = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / N + eps)
    normed = (hf * inv).to(h.dtype).to(tl.float32)
    w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
    y = (w * normed).to(h.dtype)
    if QUANTIZE:  # the row is whole in registers: its FP8 form and scale, as _quantize_row does
        _quantize_row(y.to(tl.float32), out, row * stride_o + cols, scales + row, mask,
                      FP8_MAX, INV_FP8_MAX, MIN_SCALE)  # fmt: skip
    else:
        tl.store(out + row * stride_o + cols, y, mask=mask)


@triton.jit
def _quantize_row(v, q, offs, scale_ptr, mask, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr,
                  MIN_SCALE: tl.constexpr):  # fmt: skip
    """Store float32 ``v`` (one whole row, masked lanes 0) as e4m3 at ``q + offs`` and its scale
    at ``scale_ptr``: the arithmetic of `_quantize_rows_kernel`, bit for bit."""
    scale = tl.maximum(tl.max(tl.abs(v), 0) * INV_FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr, scale)
    v = tl.clamp(tl.math.div_rn(v, scale), -FP8_MAX, FP8_MAX)
    tl.store(q + offs, v.to(q.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``weight * normalize(x [+ residual])`` over the last dim of ``x [T, N]``.

    With ``residual`` (same shape), ``x + residual`` is first written back into ``residual`` (the
    residual stream of the next sub-layer) and normalised. Returns a new ``[T, N]`` tensor."""
    return _rms_norm(x, weight, eps, residual, None)[0]


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    fp8_max: float,
    min_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm`, its output quantized per row in the same pass: (float8_e4m3fn ``[T, N]``,
    float32 ``[T, 1]``), the values `quantize_rows_fp8` gives for `rms_norm`'s output."""
    out, scales = _rms_norm(x, weight, eps, residual, (fp8_max, min_scale))
    assert scales is not None
    return out, scales


def _rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    fp8: tuple[float, float] | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(
            f"rms_norm expects x [T, N] with a contiguous last dim and weight [N]; "
            f"got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual must match x {tuple(x.shape)}, got {tuple(residual.shape)}")
    out = torch.empty_like(x, dtype=torch.float8_e4m3fn if fp8 else x.dtype)
    scales = None
    if fp8 is not None:
        # (no fill: the kernel writes every row's scale)
        scales = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    if x.shape[0] == 0:
        return out, scales
    n = x.shape[1]
    block = triton.next_power_of_2(n)
    res = residual if residual is not None else x
    fp8_max, min_scale = fp8 if fp8 is not None else (448.0, 0.0)
    # NOTE: the launch options (num_warps, num_stages) are not in the kernel's signature, the
    # only call type Triton's annotations give a launch: hence the checker's ignores.
    _rms_norm_kernel[(x.shape[0],)](
        x,
        res,
        weight,
        out,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        eps,
        N=n,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        scales=scales if scales is not None else out,  # (not read unless QUANTIZE)
        QUANTIZE=fp8 is not None,
        FP8_MAX=fp8_max,
        INV_FP8_MAX=1.0 / fp8_max,
        MIN_SCALE=min_scale,
        num_warps=min(16, max(1, block // 256)),  # pyright: ignore[reportCallIssue]
    )
    return out, scales


@triton.jit
def _rotate_heads(
    base,
    token,
    stride_t,
    stride_h,
    c,
    s,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    d = tl.arange(0, BLOCK_HALF)
    heads = tl.arange(0, BLOCK_H)
    for h0 in tl.static_range(0, NUM_HEADS, BLOCK_H):  # pyright: ignore[reportGeneralTypeIssues]
        m = ((h0 + heads) < NUM_HEADS)[:, None] & (d < HALF)[None, :]
        ptr = base + token * stride_t + (h0 + heads)[:, None] * stride_h + d[None, :]
        x1 = tl.load(ptr, mask=m, other=0.0)
        x2 = tl.load(ptr + HALF, mask=m, other=0.0)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(ptr, (a * c[None, :] - b * s[None, :]).to(x1.dtype), mask=m)
        tl.store(ptr + HALF, (b * c[None, :] + a * s[None, :]).to(x1.dtype), mask=m)


@triton.jit
def _rotary_kernel(
    q,
    k,
    positions,
    cos,
    sin,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + token).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    c = tl.load(cos + pos * stride_cos + d, mask=d < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin + pos * stride_cos + d, mask=d < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q, token, stride_qt, stride_qh, c, s, NUM_Q_HEADS, HALF, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k, token, stride_kt, stride_kh, c, s, NUM_K_HEADS, HALF, BLOCK_H, BLOCK_HALF)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` in place (rotate-half / NeoX layout).

    ``cos``/``sin``: ``[max_positions, D]`` tables whose two halves are equal (as built by
    `models.layers.RotaryEmbedding`); ``positions [T]``. q and k may be strided views (of a
    fused qkv projection); their last dim must be contiguous."""
    t, hq, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(
            f"rotary_embedding expects q [T, Hq, D], k [T, Hkv, D] with contiguous "
            f"last dims; got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if cos.shape[1] != d or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError(f"cos/sin tables must be [max_positions, {d}], contiguous rows")
    if t == 0:
        return
    half = d // 2
    _rotary_kernel[(t,)](
        q,
        k,
        positions,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        NUM_Q_HEADS=hq,
        NUM_K_HEADS=k.shape[1],
        HALF=half,
        BLOCK_H=min(16, triton.next_power_of_2(max(hq, k.shape[1]))),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4,  # pyright: ignore[reportCallIssue]
    )


@triton.jit
def _silu_and_mul_kernel(gate_up, out, stride_in, stride_out, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < N
    g = tl.load(gate_up + row * stride_in + col, mask=mask, other=0.0)
    u = tl.load(gate_up + row * stride_in + N + col, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(
        out + row * stride_out + col, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2N]`` (gate first) → ``[T, N]``."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(
            f"silu_and_mul expects [T, 2N] with a contiguous last dim, got {tuple(gate_up.shape)}"
        )
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(t, triton.cdiv(n, block))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        N=n,
        BLOCK=block,
        num_warps=4,  # pyright: ignore[reportCallIssue]
    )
    return out


@triton.jit
def _silu_and_mul_quant_kernel(
    gate_up,
    q,
    scales,
    stride_in,
    stride_q,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    INV_FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if ONE_PASS:  # the whole row in registers: read once, SiLU once
        col = tl.arange(0, BLOCK)
        mask = col < N
        v = _silu_mul(gate_up + row * stride_in, col, mask, N)
        _quantize_row(v, q + row * stride_q, col, scales + row, mask, FP8_MAX, INV_FP8_MAX,
                      MIN_SCALE)  # fmt: skip
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, N, BLOCK):
            col = c0 + tl.arange(0, BLOCK)
            v = _silu_mul(gate_up + row * stride_in, col, col < N, N)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.maximum(tl.max(amax, 0) * INV_FP8_MAX, MIN_SCALE)
        tl.store(scales + row, scale)
        for c0 in range(0, N, BLOCK):  # again: the second read of the row comes from L2
            col = c0 + tl.arange(0, BLOCK)
            mask = col < N
            v = _silu_mul(gate_up + row * stride_in, col, mask, N)
            v = tl.clamp(tl.math.div_rn(v, scale), -FP8_MAX, FP8_MAX)
            tl.store(q + row * stride_q + col, v.to(q.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul(base, col, mask, N: tl.constexpr):
    """``silu(gate) * up`` at columns ``col`` of one row, rounded to the input's dtype as
    `_silu_and_mul_kernel` stores it, returned in float32."""
    g = tl.load(base + col, mask=mask, other=0.0)
    u = tl.load(base + N + col, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    return (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype).to(tl.float32)


ONE_PASS_MAX = 16384
"""`silu_and_mul_fp8` quantizes a row of at most this many outputs from registers, in one pass."""


def silu_and_mul_fp8(
    gate_up: torch.Tensor, fp8_max: float, min_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_and_mul`, quantized per row on the way out: (float8_e4m3fn ``[T, N]``, float32
    ``[T, 1]``), the values `quantize_rows_fp8` gives for `silu_and_mul`'s output, in one launch
    that never writes the 16-bit activation."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(
            f"silu_and_mul_fp8 expects [T, 2N] with a contiguous last dim, got "
            f"{tuple(gate_up.shape)}"
        )
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    q = torch.empty((t, n), dtype=torch.float8_e4m3fn, device=gate_up.device)
    scales = torch.empty((t, 1), dtype=torch.float32, device=gate_up.device)  # the kernel fills it
    if t == 0 or n == 0:
        return q, scales.fill_(min_scale)
    # NOTE: a row up to ONE_PASS_MAX wide is held in registers (16 warps, <= 32 values a
    # thread): the two-pass form read each row twice and ran at half the copy rate (Llama-3-8B,
    # 8,192 rows of 14,336: 11.4 ms a prefill step on an H100 against 5.4 for the bf16 kernel).
    one_pass = triton.next_power_of_2(n) <= ONE_PASS_MAX
    block = triton.next_power_of_2(n) if one_pass else 2048
    _silu_and_mul_quant_kernel[(t,)](
        gate_up,
        q,
        scales,
        gate_up.stride(0),
        q.stride(0),
        N=n,
        BLOCK=block,
        FP8_MAX=fp8_max,
        INV_FP8_MAX=1.0 / fp8_max,
        MIN_SCALE=min_scale,
        ONE_PASS=one_pass,
        num_warps=min(16, max(4, block // 1024)) if one_pass else 8,  # pyright: ignore[reportCallIssue]
    )
    return q, scales


@triton.jit
def _quantize_rows_kernel(
    x,
    q,
    scales,
    stride_x,
    stride_q,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    INV_FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        v = tl.load(x + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    # As the reference computes them: amax times float32(1 / 448) (torch on CUDA turns a division
    # by a number into that product), then IEEE divisions (div_rn; Triton's `/` is approximate).
    scale = tl.maximum(tl.max(amax, 0) * INV_FP8_MAX, MIN_SCALE)
    tl.store(scales + row, scale)
    for k0 in range(0, K, BLOCK):  # the second read of the row comes from L1/L2
        cols = k0 + tl.arange(0, BLOCK)
        mask = cols < K
        v = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        v = tl.clamp(tl.math.div_rn(v, scale), -FP8_MAX, FP8_MAX)
        tl.store(q + row * stride_q + cols, v.to(q.dtype.element_ty), mask=mask)


def quantize_rows_fp8(
    x: torch.Tensor, fp8_max: float, min_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` → (float8_e4m3fn ``[T, K]``, float32 ``[T, 1]``): each row divided by
    ``max(amax * (1 / fp8_max), min_scale)`` (rounded to nearest even, saturated): one launch
    for what ``kernels.quant.quantize_rows`` does in eight torch kernels (the same values)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(
            f"quantize_rows_fp8 expects x [T, K] with a contiguous last dim, got "
            f"{tuple(x.shape)} strides {x.stride()}"
        )
    t, k = x.shape
    q = torch.empty((t, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t == 0 or k == 0:
        scales.fill_(min_scale)
        return q, scales
    block = min(4096, triton.next_power_of_2(k))
    _quantize_rows_kernel[(t,)](
        x,
        q,
        scales,
        x.stride(0),
        q.stride(0),
        K=k,
        BLOCK=block,
        FP8_MAX=fp8_max,
        INV_FP8_MAX=1.0 / fp8_max,
        MIN_SCALE=min_scale,
        num_warps=8 if block >= 2048 else 4,  # pyright: ignore[reportCallIssue]
    )
    return q, scales
