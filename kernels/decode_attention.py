"""Triton kernels: paged decode attention (one query token per sequence), split-KV.

Grid `(batch, num_kv_heads, num_splits)`. A program owns one sequence, one KV head with the
`GROUP = Hq // Hkv` query heads that share it (GQA: the K/V tiles are read once for the whole
group, the group padded to 16 rows for `tl.dot`), and one contiguous range of its context: the
sequence's own length cut `num_splits` ways (`_split_tokens`). It walks that range `BLOCK_N`
tokens at a time, gathering each token's K/V row through the block table, with an online
softmax (float32 running max, sum and accumulator, base-2 exponentials). With one split it
writes the output directly; otherwise it writes a normalised partial output and its
log-sum-exp, and a second kernel (grid `(batch, Hq)`) combines the splits of each sequence
(flash-decoding). An e4m3 cache's V is read as int16 pairs of head dims (`FP8_V_PAIRS`; byte by
byte where it is off).

`_decode_kernel` and its launcher `paged_decode_attention` stay single functions over 60 lines:
one kernel is one launch (a Triton helper is inlined anyway, and splitting the body would cost
registers and scatter one online-softmax loop over several places), and the launcher is the
one place that checks inputs, picks splits and tiling and launches the kernel(s).

The file runs past 400 lines: the split reduction's kernel, the split-length helper both
kernels share and the tilings with their measurements sit beside the one launcher of both.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

import splitserve.settings as settings
from splitserve.kernels.checks import check_decode

LOG2E = 1.4426950408889634
MAX_SPLITS = 64
"""Cap on splits per sequence (the reduce kernel holds all of a head's partials at once)."""


class DecodeConfig(NamedTuple):
    block_n: int = 64  # context tokens per inner step (a multiple of block_size)
    num_warps: int = 4
    num_stages: int = 3
    # Programs one SM runs at once with this tiling: num_splits fills at most one such wave.
    programs_per_sm: int = 4
    min_tokens_per_split: int = 256
    # A cap on registers per thread (Triton's `maxnreg`), None for the compiler's choice: more
    # programs resident per SM, so more K/V bytes in flight (see `FP8_CONFIG`).
    max_registers: int | None = None


DEFAULT_CONFIG = DecodeConfig()
FP8_CONFIG = DecodeConfig(block_n=128)
"""The tiling for an e4m3 KV cache (half the bytes a token) read with `FP8_V_PAIRS`: 128 tokens a
step, 3 stages. One H100, one layer of W's decode step (docs/benchmarks.md, "A step's kernels:
step_kernels.py", 2026-12-05): 133.7 us (82% of copy) against 142.6 for 64 tokens and 134.8 at 5
stages. `benchmarks/step_kernels.py --attention-sweep --kv-cache-dtype fp8` is the sweep to
choose it from."""

FP8_BYTES_CONFIG = DecodeConfig(num_stages=5)
"""The e4m3 tiling where V is read byte by byte (`SPLITSERVE_DECODE_FP8_V=bytes`): 5 stages give
the indirect K/V loads two buffers (at 3-4 Triton's pipeliner gives them one). Same layer:
153-160 us, against 170.5 at 3 stages."""

FP8_DOTS_IN_FP16 = True
"""On an e4m3 cache, a bfloat16 query takes its dots in float16 (see `paged_decode_attention`);
False keeps them in bfloat16 (`benchmarks/step_kernels.py --sweep-fp8-dots` compares the two)."""

V_READ_ENV = settings.DECODE_FP8_V.name


def _v_pairs_from_env() -> bool:
    """`SPLITSERVE_DECODE_FP8_V=bytes` (or ``pairs``, the default): how the decode kernel reads an
    e4m3 cache's V, for measuring the two in a whole engine without editing code. Read once, at
    import."""
    return settings.DECODE_FP8_V.get() == "pairs"


FP8_V_PAIRS = _v_pairs_from_env()
"""On an e4m3 cache, read V as int16 pairs of head dims (see `paged_decode_attention`) instead of
byte by byte. Compiled for sm_90 (Triton 3.6, ptxas) the pairs kernel has no byte-wide
shared-memory loads (64 a tile with bytes) and holds 96 registers a thread against 160. One H100
(docs/benchmarks-history.md, "V read as 16-bit pairs and a 5-stage prefill tile, measured: one
H100 (2026-12-05, night)"): one layer 133.7 us against 154.6 at the best bytes tiling;
engine W with FP8 weights and cache 8,686 / 8,792 tok/s against 8,524 / 8,633. The sweep:
`benchmarks/step_kernels.py --attention-sweep --kv-cache-dtype fp8 --sweep-fp8-v pairs bytes`."""

CONFIG_ENV = settings.DECODE_ATTENTION_CONFIG.name


def _config_from_env() -> DecodeConfig | None:
    """`SPLITSERVE_DECODE_ATTENTION_CONFIG=block_n,num_warps,num_stages[,max_registers]` (e.g.
    ``128,4,3`` or ``64,4,5,128``)
    replaces the default tiling of both KV dtypes: for trying a tiling on other GPUs or shapes
    without editing code. Read once, at import."""
    values = settings.DECODE_ATTENTION_CONFIG.get()
    if values is None:
        return None
    raw = settings.DECODE_ATTENTION_CONFIG.raw()
    block_n, warps, stages = values[:3]
    regs = values[3] if len(values) == 4 else None
    if block_n < 1 or block_n & (block_n - 1) or warps not in (1, 2, 4, 8, 16) or stages < 1:
        raise ValueError(
            f"{CONFIG_ENV}={raw!r}: block_n must be a power of two, num_warps 1/2/4/8/16, "
            "num_stages >= 1"
        )
    if regs is not None and not 24 <= regs <= 255:
        raise ValueError(f"{CONFIG_ENV}={raw!r}: max_registers must be 24-255")
    return DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages, max_registers=regs)


_ENV_CONFIG = _config_from_env()


def default_config(kv_dtype: torch.dtype) -> DecodeConfig:
    """The tiling `paged_decode_attention` uses when given none, by the KV cache's dtype."""
    if _ENV_CONFIG is not None:
        return _ENV_CONFIG
    if kv_dtype != torch.float8_e4m3fn:
        return DEFAULT_CONFIG
    return FP8_CONFIG if FP8_V_PAIRS else FP8_BYTES_CONFIG


@triton.jit
def _split_tokens(seq_len, num_splits, min_split_tokens, BLOCK_N: tl.constexpr):
    """Tokens per split of one sequence: its own length over `num_splits`, a whole number of
    `BLOCK_N` steps and at least `min_split_tokens` (a multiple of `BLOCK_N`). From the length
    read on the device, not from the block table's width: a CUDA graph's table is as wide as
    the longest context allowed, and splits cut from that width would leave all of a short
    context to the first split. The main and the reduce kernel compute it alike."""
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(per_split, min_split_tokens)


# NOTE: no value specialisation of the arguments that change with every batch (table width,
# split length): Triton would otherwise compile a new variant whenever one of them turns 1 or a
# multiple of 16, in the middle of serving.
@triton.jit(do_not_specialize=["min_split_tokens", "num_splits", "stride_bt"])
def _decode_kernel(
    query,
    key_cache,
    value_cache,
    block_table,
    seq_lens,
    out,
    part_out,
    part_lse,
    kv_scales,
    qk_scale,
    min_split_tokens,
    num_splits,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_FP16: tl.constexpr,
    V_PAIRS: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    tokens_per_split = _split_tokens(seq_len, num_splits, min_split_tokens, BLOCK_N)
    start = split * tokens_per_split
    if start >= seq_len:  # nothing here: the reduce kernel reads only splits with tokens
        return
    end = tl.minimum(start + tokens_per_split, seq_len)

    h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + h
    h_mask = h < GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(
        query + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    if DOT_FP16:  # (a 16-bit query on an e4m3 cache: see paged_decode_attention)
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    v_scale = 1.0
    if IS_FP8:  # K's scale folds into the scores', V's into the output
        qk_scale = qk_scale * tl.load(kv_scales)
        v_scale = tl.load(kv_scales + 1)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    bt_row = block_table + b.to(tl.int64) * stride_bt
    k_base = key_cache + kv_head * stride_kh + d[None, :]
    if V_PAIRS:
        # `value_cache` is the e4m3 cache seen as int16, each element two adjacent head dims;
        # the accumulator is kept as its even and odd columns.
        acc_lo = tl.zeros([BLOCK_H, BLOCK_D // 2], tl.float32)
        acc_hi = tl.zeros([BLOCK_H, BLOCK_D // 2], tl.float32)
        v_base = value_cache + kv_head * stride_vh + tl.arange(0, BLOCK_D // 2)[None, :]
    else:
        v_base = value_cache + kv_head * stride_vh + d[None, :]
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        t_mask = tok < end
        blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        off = tok % BLOCK_SIZE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_base + blk[:, None] * stride_kb + off[:, None] * stride_ks, mask=kv_mask, other=0.0
        )
        if not V_PAIRS:
            v = tl.load(
                v_base + blk[:, None] * stride_vb + off[:, None] * stride_vs,
                mask=kv_mask,
                other=0.0,
            )
        if IS_FP8:
            k = k.to(q.dtype)
            if not V_PAIRS:
                v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_PAIRS:  # the low bytes are the even head dims, the high bytes the odd ones
            # (loaded here, not beside K: 96 registers a thread against 118, sm_90 ptxas)
            v2 = tl.load(
                v_base + blk[:, None] * stride_vb + off[:, None] * stride_vs,
                mask=t_mask[:, None],
                other=0,
            )
            v_lo = v2.to(tl.int8).to(tl.float8e4nv, bitcast=True).to(q.dtype)
            v_hi = (v2 >> 8).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(q.dtype)
            p16 = p.to(q.dtype)
            acc_lo = tl.dot(p16, v_lo, acc_lo * alpha[:, None])
            acc_hi = tl.dot(p16, v_hi, acc_hi * alpha[:, None])
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    if V_PAIRS:  # even and odd columns back in order
        acc = tl.reshape(tl.join(acc_lo, acc_hi), [BLOCK_H, BLOCK_D])

    o_mask = h_mask[:, None] & d_mask[None, :]
    if SINGLE_SPLIT:
        o = acc / l_i[:, None] * v_scale
        tl.store(
            out + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
            o.to(out.dtype.element_ty),
            mask=o_mask,
        )
    else:
        row = (b * NUM_HEADS + heads) * num_splits + split
        o = acc / l_i[:, None] * v_scale
        tl.store(part_out + row[:, None] * HEAD_DIM + d[None, :], o, mask=o_mask)
        tl.store(part_lse + row, m_i + tl.log2(l_i), mask=h_mask)


@triton.jit(do_not_specialize=["min_split_tokens", "num_splits"])
def _decode_reduce_kernel(
    part_out,
    part_lse,
    seq_lens,
    out,
    min_split_tokens,
    num_splits,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens + b)
    num_valid = tl.cdiv(seq_len, _split_tokens(seq_len, num_splits, min_split_tokens, BLOCK_N))
    s = tl.arange(0, BLOCK_S)
    s_mask = s < num_valid
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    row = (b * NUM_HEADS + head) * num_splits + s
    lse = tl.load(part_lse + row, mask=s_mask, other=float("-inf"))
    w = tl.where(s_mask, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    o = tl.load(
        part_out + row[:, None] * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out + b * stride_ob + head * stride_oh + d, res.to(out.dtype.element_ty), mask=d_mask)


def _register_cap(config: DecodeConfig, device: torch.device) -> dict[str, int]:
    """The launch option for `config.max_registers` (none for the interpreter, which has no
    registers to cap)."""
    if config.max_registers is None or device.type != "cuda":
        return {}
    return {"maxnreg": config.max_registers}


def _cdiv(x: int, y: int) -> int:
    """``triton.cdiv`` for host ints (Triton's is a constexpr function, typed ``constexpr``)."""
    return (x + y - 1) // y


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # interpreter runs: pretend to be an H100/H200 so the split path is exercised


def choose_num_splits(
    batch: int, num_kv_heads: int, max_context: int, sms: int, config: DecodeConfig
) -> int:
    """Splits per sequence: the most that keep `batch * num_kv_heads * splits` programs within
    one wave of `config.programs_per_sm` programs per SM, each split at least
    `min_tokens_per_split` tokens long; 1 when the batch alone fills the wave.

    NOTE: floor, not ceil. On the H200 (docs/kernels.md) a partial second wave costs more than
    the parallelism it adds: B=16, ctx 4k ran 3.33 TB/s with 512 programs, 2.75 with 640.
    `max_context` is an upper bound known without a device sync (block_table columns *
    block_size); shorter sequences simply leave their trailing splits empty."""
    base = batch * num_kv_heads
    want = config.programs_per_sm * sms // base
    most = math.ceil(max_context / config.min_tokens_per_split)
    return max(1, min(want, most, MAX_SPLITS))


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
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of `kernels.ops.paged_decode_attention` (shapes: `kernels.reference`'s).

    `num_splits` overrides `choose_num_splits` (tests and benchmarks); `config` the tiling
    (default: `default_config` of the cache's dtype)."""
    group = check_decode(
        query, key_cache, value_cache, block_table, seq_lens, scale, out, validate, kv_scales
    )
    out = torch.empty_like(query) if out is None else out
    batch, num_heads, head_dim = query.shape
    config = default_config(key_cache.dtype) if config is None else config
    _, block_size, num_kv_heads, _ = key_cache.shape
    if batch == 0:
        return out
    block_n = max(config.block_n, block_size)
    if block_n % block_size:
        raise ValueError(f"config.block_n {block_n} must be a multiple of block_size {block_size}")
    max_context = block_table.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(
            batch, num_kv_heads, max_context, num_sms(query.device), config
        )
        min_split_tokens = _cdiv(config.min_tokens_per_split, block_n) * block_n
    else:  # as many splits as asked (tests, benchmarks): one BLOCK_N step each at least
        min_split_tokens = block_n
    num_splits = max(1, min(num_splits, MAX_SPLITS, _cdiv(max_context, min_split_tokens)))
    if num_splits > 1:
        part_out = torch.empty(
            (batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            (batch, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
    else:
        part_out = part_lse = out  # unused
    block_d = triton.next_power_of_2(head_dim)
    # NOTE: the launch options (num_warps, num_stages) are not in the kernel's signature, the
    # only call type Triton's annotations give a launch: hence the checker's ignores.
    # NOTE: e4m3 V read as int16 pairs (two adjacent head dims): P @ V's operand wants V's
    # tokens adjacent, and Triton reads an 8-bit tile across its rows one byte at a time; 16-bit
    # elements go through `ldmatrix.trans` instead.
    v_pairs = (
        kv_scales is not None
        and FP8_V_PAIRS
        and head_dim >= 32  # (each half a dot's operand: >= 16 columns)
        and head_dim == triton.next_power_of_2(head_dim)
    )
    v_cache = value_cache.view(torch.int16) if v_pairs else value_cache
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        query,
        key_cache,
        v_cache,
        block_table,
        seq_lens,
        out,
        part_out,
        part_lse,
        seq_lens if kv_scales is None else kv_scales,  # (not read when not FP8)
        scale * LOG2E,
        min_split_tokens,
        num_splits,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SINGLE_SPLIT=num_splits == 1,
        IS_FP8=kv_scales is not None,
        # NOTE: e4m3 pairs convert to float16 in one instruction on sm_89+, to bfloat16 by way
        # of float32: with bfloat16 dots the kernel ran at 59% of copy on an H100 (a bfloat16
        # cache: ~90% on an H200; docs/benchmarks-history.md, "FP8 weights and an FP8 KV cache:
        # speed, one H200 (2026-12-05)"). So a 16-bit query takes its dots in float16
        # against an e4m3 cache: its 10-bit mantissa holds bfloat16's 8, and e4m3 values and
        # softmax weights fit its range (the query is clamped to it).
        DOT_FP16=kv_scales is not None
        and (query.dtype == torch.float16 or (FP8_DOTS_IN_FP16 and query.dtype == torch.bfloat16)),
        V_PAIRS=v_pairs,
        num_warps=config.num_warps,  # pyright: ignore[reportCallIssue]
        num_stages=config.num_stages,  # pyright: ignore[reportCallIssue]
        **_register_cap(config, query.device),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part_out,
            part_lse,
            seq_lens,
            out,
            min_split_tokens,
            num_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_N=block_n,
            num_warps=4,  # pyright: ignore[reportCallIssue]
        )
    return out
