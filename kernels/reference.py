"""Plain-torch references of the kernels, with the signatures and docstrings of the ops.

`kernels.ops` makes each op from its reference here (run on CPU tensors) and the Triton launcher
of the same name (run on CUDA tensors); the Triton kernels are tested against them. Written for
clarity, not speed: a Python loop over sequences, math in float32. Shapes: see `kernels.ops`.
"""

from __future__ import annotations

import torch

from splitserve.kernels import checks


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
    checks.check_reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping, validate, kv_scales
    )
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    key, value = key[valid], value[valid]
    if kv_scales is not None:
        key, value = fp8_quantize(key, kv_scales[0]), fp8_quantize(value, kv_scales[1])
    key_cache[slots // block_size, slots % block_size] = key
    value_cache[slots // block_size, slots % block_size] = value


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` in e4m3, saturated at +-448 (what the cache-write kernel stores)."""
    fp8_max = checks.FP8_MAX
    return (x.float() / scale).clamp(-fp8_max, fp8_max).to(checks.KV_FP8)


def _gather_sequence(
    cache: torch.Tensor, block_row: torch.Tensor, seq_len: int, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The first `seq_len` tokens of one sequence's K or V, [seq_len, Hkv, D] (an FP8 cache's
    values times ``scale``, in float32)."""
    block_size = cache.shape[1]
    num_used = -(-seq_len // block_size)
    blocks = cache[block_row[:num_used].long()]  # [n, block_size, Hkv, D]
    tokens = blocks.reshape(-1, *cache.shape[2:])[:seq_len]
    return tokens if scale is None else tokens.float() * scale


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_pos: torch.Tensor
) -> torch.Tensor:
    """q [M, Hq, D], k/v [N, Hkv, D], query m sees keys 0..q_pos[m]; float32 math."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.float(), k) * scale
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(scores, dim=-1), v)


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
    checks.check_decode(
        query, key_cache, value_cache, block_table, seq_lens, scale, out, validate, kv_scales
    )
    out = torch.empty_like(query) if out is None else out
    ks, vs = (None, None) if kv_scales is None else (kv_scales[0], kv_scales[1])
    for b, seq_len in enumerate(seq_lens.tolist()):
        k = _gather_sequence(key_cache, block_table[b], seq_len, ks)
        v = _gather_sequence(value_cache, block_table[b], seq_len, vs)
        pos = torch.tensor([seq_len - 1], device=query.device)
        out[b] = _attend(query[b : b + 1], k, v, scale, pos)[0].to(out.dtype)
    return out


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
    max_query_len: the largest q_len_b if the caller knows it (saves the Triton launcher a host
    sync; required during CUDA graph capture). Returns (or fills `out`) `[T, Hq, D]`, dtype of
    query.
    """
    del max_query_len  # only the Triton launcher needs it (grid size)
    checks.check_prefill(
        query,
        key_cache,
        value_cache,
        block_table,
        cu_seqlens_q,
        seq_lens,
        scale,
        out,
        validate,
        kv_scales,
    )
    out = torch.empty_like(query) if out is None else out
    ks, vs = (None, None) if kv_scales is None else (kv_scales[0], kv_scales[1])
    cu = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        if start == end:
            continue
        k = _gather_sequence(key_cache, block_table[b], seq_len, ks)
        v = _gather_sequence(value_cache, block_table[b], seq_len, vs)
        pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        out[start:end] = _attend(query[start:end], k, v, scale, pos).to(out.dtype)
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of ``x [T, N]`` times ``weight [N]``. With ``residual``, ``x + residual`` is written
    into ``residual`` first and normalised (the pre-norm decoder's residual stream).

    The same operations in the same order as transformers' LlamaRMSNorm (and its residual add),
    so float32 results are bitwise equal."""
    if residual is not None:
        residual.add_(x)
        x = residual
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` in place by ``cos/sin[positions]``
    (rotate-half layout; transformers' arithmetic)."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    for x in (q, k):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * c + rotated * s)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [T, 2N]`` → ``[T, N]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
