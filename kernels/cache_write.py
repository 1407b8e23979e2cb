"""Triton kernel: write this step's K/V into their cache slots (`slot_mapping`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels import checks


@triton.jit
def _reshape_and_cache_kernel(
    key,
    value,
    key_cache,
    value_cache,
    slot_mapping,
    kv_scales,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    # One program per token: it copies the token's [Hkv, D] K and V rows into its slot.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value + token * stride_vt + h * stride_vh + d, mask=mask)
    if IS_FP8:  # stored divided by the layer's scale, saturated at e4m3's largest (448)
        k = tl.clamp(k.to(tl.float32) / tl.load(kv_scales), -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) / tl.load(kv_scales + 1), -448.0, 448.0)
        k = k.to(key_cache.dtype.element_ty)
        v = v.to(value_cache.dtype.element_ty)
    tl.store(
        key_cache + block * stride_kcb + offset * stride_kcs + h * stride_kch + d, k, mask=mask
    )
    tl.store(
        value_cache + block * stride_vcb + offset * stride_vcs + h * stride_vch + d, v, mask=mask
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    validate: bool = True,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Triton version of `kernels.ops.reshape_and_cache` (shapes: `kernels.reference`'s)."""
    checks.check_reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping, validate, kv_scales
    )
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    # NOTE: the launch options (num_warps, num_stages) are not in the kernel's signature, the
    # only call type Triton's annotations give a launch: hence the checker's ignores.
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        slot_mapping if kv_scales is None else kv_scales,  # (not read when not FP8)
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        IS_FP8=kv_scales is not None,
        num_warps=4,  # pyright: ignore[reportCallIssue]
    )
