"""Argument checks shared by the Triton launchers and the references.

Shape, dtype and stride checks are free (host metadata) and always run. Checks of tensor
*contents* (block ids inside the pool, sequence lengths that fit the block table, slots inside
the cache) cost a device-to-host sync and some small kernels (~0.1-0.4 ms on an H200 in eager
mode); they run when `validate=True` (the default) unless a CUDA graph is being captured, where
no sync is allowed. The model runner checks its tables on the host once per step
(`ModelRunner.prepare`) and passes `validate=False` to every layer's ops: a sync in a layer would
stall the launch of the rest of the forward.
"""

from __future__ import annotations

import itertools
import math

import torch

GPU_DTYPES = (torch.float16, torch.bfloat16)
CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
# An FP8 KV cache (``--kv-cache-dtype fp8``): e4m3 values times a float32 scale per layer for K
# and one for V (``kv_scales``, [2]); queries, keys and values computed in the model's dtype.
KV_FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def contents_checkable(t: torch.Tensor, validate: bool = True) -> bool:
    """Whether to check tensor contents: asked for, and no CUDA graph being captured."""
    return validate and not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Check a layer's K/V cache views; returns (num_blocks, block_size, num_kv_heads, head_dim)."""
    if key_cache.dim() != 4 or value_cache.dim() != 4:
        raise ValueError(
            "key_cache/value_cache must be (num_blocks, block_size, num_kv_heads, head_dim), got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ"
        )
    if key_cache.dtype != value_cache.dtype or key_cache.device != value_cache.device:
        raise ValueError("key_cache and value_cache must share dtype and device")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the innermost (head_dim) dimension of the caches must be contiguous")
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if block_size < 16 or block_size % 16:
        raise ValueError(f"block_size must be a positive multiple of 16, got {block_size}")
    return num_blocks, block_size, num_kv_heads, head_dim


def check_dtype(name: str, t: torch.Tensor, cache: torch.Tensor) -> None:
    if t.dtype != cache.dtype and cache.dtype != KV_FP8:
        raise ValueError(f"{name} has dtype {t.dtype} but the KV cache holds {cache.dtype}")
    allowed = GPU_DTYPES if t.is_cuda else CPU_DTYPES
    if t.dtype not in allowed:
        raise ValueError(f"{name}: dtype {t.dtype} not supported on {t.device.type} ({allowed})")
    if t.device != cache.device:
        raise ValueError(f"{name} is on {t.device} but the KV cache is on {cache.device}")


def check_kv_scales(cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    """An FP8 cache takes its ``kv_scales`` (float32 [2]: K's, V's, on the cache's device); a
    16/32-bit cache none."""
    if cache.dtype != KV_FP8:
        if kv_scales is not None:
            raise ValueError(f"kv_scales are for an FP8 KV cache; this one holds {cache.dtype}")
        return
    if (
        kv_scales is None
        or kv_scales.dtype != torch.float32
        or tuple(kv_scales.shape) != (2,)
        or kv_scales.device != cache.device
    ):
        got = "none" if kv_scales is None else f"{kv_scales.dtype} {tuple(kv_scales.shape)}"
        raise ValueError(
            f"an FP8 KV cache needs kv_scales: float32 [2] (K's scale, V's) on {cache.device}, "
            f"got {got}"
        )


def check_heads(query: torch.Tensor, num_kv_heads: int, head_dim: int) -> int:
    """Check `query (..., Hq, D)` against the cache; returns the GQA group size Hq // Hkv."""
    num_heads, d = query.shape[-2], query.shape[-1]
    if d != head_dim:
        raise ValueError(f"query head_dim {d} != cache head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})"
        )
    if query.stride(-1) != 1:
        raise ValueError("query's innermost (head_dim) dimension must be contiguous")
    return num_heads // num_kv_heads


def check_index(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if t.dim() and t.stride(-1) != 1:
        raise ValueError(f"{name}'s last dimension must be contiguous (stride 1)")


def check_out(out: torch.Tensor | None, like: torch.Tensor) -> None:
    if out is None:
        return
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(
            f"out must be {like.dtype} {tuple(like.shape)} on {like.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if out.stride(-1) != 1:
        raise ValueError("out's innermost dimension must be contiguous")


def check_scale(scale: float) -> None:
    if not (isinstance(scale, int | float) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite float (usually head_dim**-0.5): {scale}")


def check_block_table_contents(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_blocks: int,
    block_size: int,
    min_seq_lens: torch.Tensor | None = None,
) -> None:
    """Contents checks (one host sync): 1 <= seq_lens (>= min_seq_lens), seq_lens fits in the
    block table, and every block id the sequences use is inside the pool."""
    if not contents_checkable(block_table) or block_table.numel() == 0:
        return
    max_blocks = block_table.shape[1]
    used = torch.arange(max_blocks, device=block_table.device)[None, :] * block_size
    used = used < seq_lens[:, None]
    ids = torch.where(used, block_table, 0)
    lower = seq_lens.new_ones(()) if min_seq_lens is None else min_seq_lens.clamp(min=1)
    stats = torch.stack(
        [
            (seq_lens < lower).any(),
            (seq_lens > max_blocks * block_size).any(),
            ((ids < 0) | (ids >= num_blocks)).any(),
        ]
    ).tolist()
    if stats[0]:
        raise ValueError(
            "seq_lens must be >= 1 and at least the number of new query tokens, got "
            f"{seq_lens.tolist()[:16]}"
        )
    if stats[1]:
        raise ValueError(
            f"block_table has {max_blocks} columns ({max_blocks * block_size} tokens at "
            f"block_size {block_size}), too short for seq_lens max {int(seq_lens.max())}"
        )
    if stats[2]:
        bad = ids[(ids < 0) | (ids >= num_blocks)]
        raise ValueError(
            f"block_table holds block ids outside the pool [0, {num_blocks}): {bad.tolist()[:8]}"
        )


def check_reshape_and_cache(
    key, value, key_cache, value_cache, slot_mapping, validate: bool = True, kv_scales=None
) -> None:
    """Checks of `reshape_and_cache`'s arguments (see `kernels.ops`)."""
    num_blocks, block_size, num_kv_heads, head_dim = check_cache(key_cache, value_cache)
    check_kv_scales(key_cache, kv_scales)
    num_tokens = key.shape[0]
    expected = (num_tokens, num_kv_heads, head_dim)
    if key.dim() != 3 or tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(
            f"key/value must be [T, Hkv, D] = {expected} to match the cache, "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    check_dtype("key", key, key_cache)
    check_dtype("value", value, key_cache)
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key/value innermost (head_dim) dimension must be contiguous")
    check_index("slot_mapping", slot_mapping, (num_tokens,), key.device)
    if contents_checkable(slot_mapping, validate) and num_tokens:
        valid = slot_mapping >= 0
        too_big, null = torch.stack(
            [
                (slot_mapping >= num_blocks * block_size).any(),
                (valid & (slot_mapping < block_size)).any(),
            ]
        ).tolist()
        if too_big:
            raise ValueError(
                f"slot_mapping holds slots >= {num_blocks * block_size} "
                f"(num_blocks {num_blocks} x block_size {block_size})"
            )
        if null:
            raise ValueError("slot_mapping points into the reserved null block 0")


def check_decode(
    query,
    key_cache,
    value_cache,
    block_table,
    seq_lens,
    scale,
    out,
    validate: bool = True,
    kv_scales=None,
) -> int:
    """Checks of `paged_decode_attention`'s arguments; returns the GQA group size."""
    num_blocks, block_size, num_kv_heads, head_dim = check_cache(key_cache, value_cache)
    check_kv_scales(key_cache, kv_scales)
    if query.dim() != 3:
        raise ValueError(f"query must be [B, Hq, D], got {tuple(query.shape)}")
    check_dtype("query", query, key_cache)
    group = check_heads(query, num_kv_heads, head_dim)
    batch = query.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(
            f"block_table must be [B={batch}, max_blocks], got {tuple(block_table.shape)}"
        )
    check_index("block_table", block_table, tuple(block_table.shape), query.device)
    check_index("seq_lens", seq_lens, (batch,), query.device)
    check_out(out, query)
    check_scale(scale)
    if validate:
        check_block_table_contents(block_table, seq_lens, num_blocks, block_size)
    return group


def check_prefill(
    query,
    key_cache,
    value_cache,
    block_table,
    cu_seqlens_q,
    seq_lens,
    scale,
    out,
    validate: bool = True,
    kv_scales=None,
) -> int:
    """Checks of `paged_prefill_attention`'s arguments; returns the GQA group size."""
    num_blocks, block_size, num_kv_heads, head_dim = check_cache(key_cache, value_cache)
    check_kv_scales(key_cache, kv_scales)
    if query.dim() != 3:
        raise ValueError(f"query must be [T, Hq, D], got {tuple(query.shape)}")
    check_dtype("query", query, key_cache)
    group = check_heads(query, num_kv_heads, head_dim)
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [B, max_blocks], got {tuple(block_table.shape)}")
    batch = block_table.shape[0]
    check_index("block_table", block_table, tuple(block_table.shape), query.device)
    check_index("seq_lens", seq_lens, (batch,), query.device)
    check_index("cu_seqlens_q", cu_seqlens_q, (batch + 1,), query.device)
    check_out(out, query)
    check_scale(scale)
    if contents_checkable(cu_seqlens_q, validate):
        cu = cu_seqlens_q.tolist()
        if cu[0] != 0 or cu[-1] != query.shape[0] or any(a > b for a, b in itertools.pairwise(cu)):
            raise ValueError(f"cu_seqlens_q must rise from 0 to T={query.shape[0]}, got {cu[:16]}")
        q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        check_block_table_contents(
            block_table, seq_lens, num_blocks, block_size, min_seq_lens=q_lens
        )
    return group
