"""Triton kernel: paged causal prefill attention over variable-length sequences.

Grid `(num_heads, cdiv(max_query_len, BLOCK_M), batch)`. A program owns `BLOCK_M` new query
tokens of one sequence and one query head (the heads sharing a KV head run side by side, so
their K/V tiles come from L2). Query tile rows sit at positions `seq_len - q_len + i`; keys are
the whole context `[0, seq_len)` - the cached prefix and the new tokens, already written into
the cache - gathered `BLOCK_N` tokens at a time through the block table. The key loop has two
parts: tiles every row of the query tile fully sees (no mask), then the diagonal tiles with the
causal mask. Query tiles are launched last-first, so the longest programs start first.

`_prefill_kernel` and its launcher `paged_prefill_attention` stay single functions over 60
lines: one kernel is one launch (a Triton helper is inlined anyway, and splitting the body would
cost registers and scatter one online-softmax loop over several places), and the launcher is
the one place that checks inputs, picks the tiling and launches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

import splitserve.settings as settings
from splitserve.kernels.checks import check_prefill

LOG2E = 1.4426950408889634


class PrefillConfig(NamedTuple):
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    warp_specialize: bool = False  # Triton's automatic warp specialization of the key loop


STAGES_ENV = settings.PREFILL_ATTENTION_STAGES.name


def _stages_from_env() -> int | None:
    """`SPLITSERVE_PREFILL_ATTENTION_STAGES=N` (1-8) replaces the pipeline depth of every tiling
    `choose_config` picks: for measuring another depth in a whole engine without editing code
    (Triton 3.6 compiles 3 and 4 alike; 5 prefetches, docs/kernels.md). Read once, at import."""
    return settings.PREFILL_ATTENTION_STAGES.get()


_ENV_STAGES = _stages_from_env()


def choose_config(max_query_len: int) -> PrefillConfig:
    """Tiling by the longest new-token run: a 256-row tile for long prompts, 64 x 64 for the
    rest, so that short chunks do not waste a mostly masked big tile. The 256-row tile runs 16
    warps and 5 stages (three K/V buffers: the next tile's load overlaps the whole key step;
    Triton 3.6 compiles 3 and 4 stages alike, with two). One H100 (docs/benchmarks-history.md,
    "V read as 16-bit pairs and a 5-stage prefill tile, measured: one H100 (2026-12-05,
    night)"), head dim 128, 8,192 tokens: 1,298 us against 1,372 for 8 warps and 3 stages;
    2,048: 110.8 against 120.4. One H200 (2026-12-06), one prompt step of the 256-prompt
    workload (14 prompts of 128-1,024 tokens): 64 x 64 with 4 warps 202 us, 128 x 128 with 8
    warps 232, 256 x 64 235-248; at 2,048 tokens 64 x 64 still edges 128 x 128 (117 vs 119 us).
    The small tile keeps 3 stages (5 measured slower).
    `SPLITSERVE_PREFILL_ATTENTION_STAGES` sets the stages of both."""
    if max_query_len >= 1024:
        return PrefillConfig(block_m=256, block_n=64, num_warps=16, num_stages=_ENV_STAGES or 5)
    return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=_ENV_STAGES or 3)


@triton.jit
def _prefill_tile(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    n0,
    k_base,
    v_base,
    bt_row,
    context_len,
    qk_scale,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    tok = n0 + tl.arange(0, BLOCK_N)
    d_mask = tl.arange(0, BLOCK_D)[None, :] < HEAD_DIM
    if CAUSAL:
        t_mask = tok < context_len
        blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
    else:  # every token of this tile lies inside the context
        blk = tl.load(bt_row + tok // BLOCK_SIZE).to(tl.int64)
    off = tok % BLOCK_SIZE
    k_ptrs = k_base + blk[:, None] * stride_kb + off[:, None] * stride_ks
    v_ptrs = v_base + blk[:, None] * stride_vb + off[:, None] * stride_vs
    if CAUSAL:
        # NOTE: slots past the context (rest of the last block, null block 0) hold garbage,
        # possibly NaN; masking the scores is not enough for V since 0 * NaN = NaN.
        k = tl.load(k_ptrs, mask=t_mask[:, None] & d_mask, other=0.0)
        v = tl.load(v_ptrs, mask=t_mask[:, None] & d_mask, other=0.0)
    elif HEAD_DIM == BLOCK_D:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=d_mask, other=0.0)
        v = tl.load(v_ptrs, mask=d_mask, other=0.0)
    if IS_FP8:  # the scales are folded into qk_scale and the output (the caller)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k))
    if CAUSAL:
        s = tl.where((tok[None, :] <= q_pos[:, None]) & t_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


# NOTE: the block table's width changes with every batch; specialising on it (== 1, multiple of
# 16) would compile new variants while serving.
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    query,
    key_cache,
    value_cache,
    block_table,
    cu_seqlens_q,
    seq_lens,
    out,
    kv_scales,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    head = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + b)
    q_len = tl.load(cu_seqlens_q + b + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 >= q_len:
        return
    context_len = tl.load(seq_lens + b)
    prefix = context_len - q_len
    kv_head = head // GROUP

    rows = m0 + tl.arange(0, BLOCK_M)
    r_mask = rows < q_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(
        query + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=r_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = prefix + rows
    v_scale = 1.0
    if IS_FP8:  # K's scale folds into the scores', V's into the output
        qk_scale = qk_scale * tl.load(kv_scales)
        v_scale = tl.load(kv_scales + 1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_table + b.to(tl.int64) * stride_bt
    k_base = key_cache + kv_head * stride_kh + d[None, :]
    v_base = value_cache + kv_head * stride_vh + d[None, :]
    # Keys < prefix + m0 + 1 are visible to every row of the tile.
    full_end = (prefix + m0 + 1) // BLOCK_N * BLOCK_N
    causal_end = tl.minimum(context_len, prefix + m0 + BLOCK_M)
    for n0 in tl.range(0, full_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        acc, l_i, m_i = _prefill_tile(
            acc,
            l_i,
            m_i,
            q,
            q_pos,
            n0,
            k_base,
            v_base,
            bt_row,
            context_len,
            qk_scale,
            stride_kb,
            stride_ks,
            stride_vb,
            stride_vs,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_SIZE,
            BLOCK_N,
            False,
            IS_FP8,
        )
    for n0 in range(full_end, causal_end, BLOCK_N):
        acc, l_i, m_i = _prefill_tile(
            acc,
            l_i,
            m_i,
            q,
            q_pos,
            n0,
            k_base,
            v_base,
            bt_row,
            context_len,
            qk_scale,
            stride_kb,
            stride_ks,
            stride_vb,
            stride_vs,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_SIZE,
            BLOCK_N,
            True,
            IS_FP8,
        )
    o = acc / l_i[:, None] * v_scale
    tl.store(
        out + q_rows[:, None] * stride_ot + head * stride_oh + d[None, :],
        o.to(out.dtype.element_ty),
        mask=r_mask[:, None] & d_mask[None, :],
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
    config: PrefillConfig | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of `kernels.ops.paged_prefill_attention` (shapes: `kernels.reference`'s).

    `config` overrides the tiling `choose_config` picks (tests and benchmarks). Over 60 lines: see
    the module's docstring."""
    group = check_prefill(
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
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, _, _ = key_cache.shape
    batch = block_table.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    if max_query_len is None:
        if query.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ValueError("pass max_query_len when capturing a CUDA graph (no host sync)")
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_query_len <= 0:
        return out
    if config is None:
        config = choose_config(max_query_len)
    block_n = config.block_n
    if block_n % 16 or config.block_m % 16:
        raise ValueError(f"config block sizes must be multiples of 16, got {config}")
    grid = (num_heads, triton.cdiv(max_query_len, config.block_m), batch)
    # NOTE: the launch options (num_warps, num_stages) are not in the kernel's signature, the
    # only call type Triton's annotations give a launch: hence the checker's ignores.
    _prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_table,
        cu_seqlens_q,
        seq_lens,
        out,
        seq_lens if kv_scales is None else kv_scales,  # (not read when not FP8)
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m,
        BLOCK_N=block_n,
        WARP_SPECIALIZE=config.warp_specialize,
        IS_FP8=kv_scales is not None,
        num_warps=config.num_warps,  # pyright: ignore[reportCallIssue]
        num_stages=config.num_stages,  # pyright: ignore[reportCallIssue]
    )
    return out
