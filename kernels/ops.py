"""Public paged-KV ops. Model code calls only these.

Each op runs the Triton kernel on CUDA tensors and the plain-torch reference (`kernels.reference`,
same signature) on CPU tensors. Launchers check shapes, strides and dtypes (ValueError) before
anything runs. With `validate=True` (default) they also check table contents (block ids inside
the pool, seq_lens that fit the block table, slots): one host sync, skipped during CUDA graph
capture; pass `validate=False` where the contents were checked on the host already (the model
runner checks them once per step, in `ModelRunner.prepare`; see `kernels.checks`).

NOTE: the Triton modules are imported on first CUDA use, so CPU-only processes never load Triton.

Shapes (`T` tokens of this step, `B` sequences, `Hq` query heads, `Hkv` KV heads, `D` head_dim):
- `key_cache` / `value_cache`: one layer's views of the pool, `(num_blocks, block_size, Hkv, D)`,
  from `kernels.layout.layer_kv_views`; any block/token/head strides, innermost dim contiguous.
- `block_table`: `[B, max_blocks]` int32 (int64 accepted), physical block ids of each sequence in
  order, padded with the null block 0.
- `seq_lens`: `[B]` int32, context length of each sequence counting every token whose K/V is in the
  cache (for decode: including the current token, already cached by `reshape_and_cache`).
- dtypes: float16/bfloat16 on CUDA; float32 (also 16-bit) on CPU. Query, caches and out share one,
  or the caches are float8_e4m3fn (an FP8 KV cache) with `kv_scales` (float32 [2]: K's scale,
  V's): each value stored is the computed one divided by its scale.
"""

from __future__ import annotations

import torch

from splitserve.kernels import quant, reference
from splitserve.kernels.quant import QuantizedRows


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
    """Write this step's K/V into the cache.

    key, value: `[T, Hkv, D]`. slot_mapping: `[T]` int32/int64, slot of token t =
    `block_id * block_size + offset`; slots < 0 are padding and skipped. Slots must be distinct
    and outside the null block 0. An FP8 cache (float8_e4m3fn) stores `key / kv_scales[0]` and
    `value / kv_scales[1]`, saturated at +-448.
    """
    if key.is_cuda:
        from splitserve.kernels.cache_write import reshape_and_cache as triton_op

        triton_op(
            key, value, key_cache, value_cache, slot_mapping, validate=validate, kv_scales=kv_scales
        )
    else:
        reference.reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping, validate=validate, kv_scales=kv_scales
        )


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    validate: bool = True,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its whole cached context.

    query: `[B, Hq, D]`, the token at position `seq_lens[b] - 1` (its K/V already cached).
    block_table: `[B, max_blocks]`; seq_lens: `[B]`, each >= 1. Query head h reads KV head
    `h // (Hq // Hkv)`. Returns (or fills `out`) `[B, Hq, D]`, dtype of query.
    """
    if query.is_cuda:
        from splitserve.kernels.decode_attention import paged_decode_attention as triton_op

        return triton_op(
            query,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            scale,
            out,
            validate=validate,
            kv_scales=kv_scales,
        )
    return reference.paged_decode_attention(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        scale,
        out,
        validate=validate,
        kv_scales=kv_scales,
    )


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    *,
    validate: bool = True,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens of a batch of sequences over cached prefix + themselves.

    query: `[T, Hq, D]`, sequence b's new tokens at rows `cu_seqlens_q[b]:cu_seqlens_q[b+1]`
    (`cu_seqlens_q`: `[B+1]` int32, from 0 to T). seq_lens: `[B]`, whole context including the
    new tokens, whose K/V `reshape_and_cache` has already written. New token i of sequence b sits
    at position `seq_lens[b] - q_len_b + i` and sees positions `0..` itself.
    max_query_len: the largest q_len_b if the caller knows it (saves a host sync; required during
    CUDA graph capture). Returns (or fills `out`) `[T, Hq, D]`, dtype of query.
    """
    if query.is_cuda:
        from splitserve.kernels.prefill_attention import paged_prefill_attention as triton_op

        return triton_op(
            query,
            key_cache,
            value_cache,
            block_table,
            cu_seqlens_q,
            seq_lens,
            scale,
            out,
            max_query_len,
            validate=validate,
            kv_scales=kv_scales,
        )
    return reference.paged_prefill_attention(
        query,
        key_cache,
        value_cache,
        block_table,
        cu_seqlens_q,
        seq_lens,
        scale,
        out,
        max_query_len,
        validate=validate,
        kv_scales=kv_scales,
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of ``x [T, N]`` times ``weight [N]``. With ``residual``, ``x + residual`` is written
    into ``residual`` first and normalised (the pre-norm decoder's residual stream)."""
    if x.is_cuda:
        from splitserve.kernels.elementwise import rms_norm as triton_op

        return triton_op(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> QuantizedRows:
    """`rms_norm`, its output quantized per token for an FP8 linear layer: on CUDA in the same
    kernel (the values `quant.quantize_rows` gives for `rms_norm`'s output, one pass less)."""
    if x.is_cuda:
        from splitserve.kernels.elementwise import rms_norm_fp8 as triton_op

        q, scale = triton_op(x, weight, eps, residual, quant.FP8_MAX, quant.MIN_SCALE)
        return QuantizedRows(q, scale, x.dtype)
    return QuantizedRows.of(reference.rms_norm(x, weight, eps, residual))


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` in place by ``cos/sin[positions]``."""
    if q.is_cuda:
        from splitserve.kernels.elementwise import rotary_embedding as triton_op

        triton_op(positions, q, k, cos, sin)
    else:
        reference.rotary_embedding(positions, q, k, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [T, 2N]`` → ``[T, N]``."""
    if gate_up.is_cuda:
        from splitserve.kernels.elementwise import silu_and_mul as triton_op

        return triton_op(gate_up)
    return reference.silu_and_mul(gate_up)


def silu_and_mul_fp8(gate_up: torch.Tensor) -> QuantizedRows:
    """`silu_and_mul`, quantized per token for an FP8 linear layer: on CUDA one kernel that never
    writes the 16-bit activation (the values `quant.quantize_rows` gives for `silu_and_mul`'s)."""
    if gate_up.is_cuda:
        from splitserve.kernels.elementwise import silu_and_mul_fp8 as triton_op

        q, scale = triton_op(gate_up, quant.FP8_MAX, quant.MIN_SCALE)
        return QuantizedRows(q, scale, gate_up.dtype)
    return QuantizedRows.of(reference.silu_and_mul(gate_up))
