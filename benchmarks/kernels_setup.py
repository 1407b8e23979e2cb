"""Shapes, timing and the paged KV copies benchmarks/attention_kernels.py measures on."""

from __future__ import annotations

import torch
from triton.testing import do_bench

from splitserve.kernels import layout

HQ, HKV, D, BS = 32, 8, 128, 16
SCALE = D**-0.5
DTYPE = torch.bfloat16


def bench(fn) -> float:
    """Median milliseconds."""
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def graphed(fn):
    """Capture `fn` (already warmed up) in a CUDA graph; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def paged_copy(batch: int, ctx: int, contiguous: bool = True):
    """A 2-layer pool holding `batch` sequences of `ctx` random tokens in shuffled blocks, and
    the same K/V contiguous as SDPA wants them ([B, Hkv, ctx, D])."""
    per_seq = ctx // BS
    num_blocks = 1 + batch * per_seq
    pool = layout.allocate_kv_pool(num_blocks, 2, BS, HKV, D, DTYPE, "cuda")
    pool.normal_()
    key_cache, value_cache = layout.layer_kv_views(pool, 1)
    ids = torch.randperm(num_blocks - 1, device="cuda") + 1
    block_table = ids.view(batch, per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")

    def to_sdpa(cache):
        return cache[block_table.long()].reshape(batch, ctx, HKV, D).transpose(1, 2).contiguous()

    if not contiguous:
        return pool, key_cache, value_cache, block_table, seq_lens, None, None
    sdpa_k, sdpa_v = to_sdpa(key_cache), to_sdpa(value_cache)
    return pool, key_cache, value_cache, block_table, seq_lens, sdpa_k, sdpa_v


def paged_mix(lengths: list[int]):
    """A 2-layer pool holding one sequence of each length (random K/V, shuffled blocks, the
    table padded with the null block 0) and each sequence's K/V contiguous as SDPA wants them
    ([1, Hkv, length, D])."""
    per_seq = [-(-n // BS) for n in lengths]
    num_blocks = 1 + sum(per_seq)
    pool = layout.allocate_kv_pool(num_blocks, 2, BS, HKV, D, DTYPE, "cuda")
    pool.normal_()
    key_cache, value_cache = layout.layer_kv_views(pool, 1)
    ids = (torch.randperm(num_blocks - 1, device="cuda") + 1).to(torch.int32)
    block_table = torch.zeros(len(lengths), max(per_seq), dtype=torch.int32, device="cuda")
    start = 0
    for row, n in enumerate(per_seq):
        block_table[row, :n] = ids[start : start + n]
        start += n
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    contiguous = []
    for row, (n, blocks) in enumerate(zip(lengths, per_seq, strict=True)):
        table = block_table[row, :blocks].long()
        k, v = (
            c[table].reshape(-1, HKV, D)[:n].transpose(0, 1)[None] for c in (key_cache, value_cache)
        )
        contiguous.append((k.contiguous(), v.contiguous()))
    return pool, key_cache, value_cache, block_table, seq_lens, contiguous
