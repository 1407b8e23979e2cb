"""Builders of random paged KV batches for the kernel tests (tests/unit/test_kernels_*.py,
tests/gpu/test_kernels_gpu.py); kernels/ keeps only what serving runs.

Everything not holding a real token is poisoned with NaN: the null block, unused blocks, the
unused tail of each sequence's last block and every other layer of the pool. A kernel that reads
a slot it should not, or forgets a mask on V (0 * NaN = NaN), then produces NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from splitserve.kernels import layout


class PagedKV(NamedTuple):
    kv_pool: torch.Tensor  # (num_blocks, num_layers, 2, block_size, Hkv, D)
    key_cache: torch.Tensor  # layer view (num_blocks, block_size, Hkv, D), non-contiguous
    value_cache: torch.Tensor
    block_table: torch.Tensor  # [B, max_blocks] int32, shuffled ids, padded with 0
    seq_lens: torch.Tensor  # [B] int32
    keys: list[torch.Tensor]  # per sequence [seq_len, Hkv, D], the same values, dense
    values: list[torch.Tensor]


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator | None = None,
    num_layers: int = 2,
    layer: int = 1,
    spare_blocks: int = 3,
    extra_columns: int = 2,
) -> PagedKV:
    """A pool holding random K/V for sequences of `seq_lens` tokens in shuffled blocks.

    The block table gets `extra_columns` padding columns (0) and is a column slice of a wider
    tensor, so its row stride is not its width. Random numbers come from `generator` (CPU)."""
    used = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(used) + spare_blocks
    pool = layout.allocate_kv_pool(
        num_blocks, num_layers, block_size, num_kv_heads, head_dim, dtype, device
    )
    pool.fill_(float("nan"))
    key_cache, value_cache = layout.layer_kv_views(pool, layer)
    ids = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    max_blocks = max(used, default=0) + extra_columns
    wide = torch.full((len(seq_lens), max_blocks + 3), -7, dtype=torch.int32)
    table = wide[:, 1 : 1 + max_blocks]
    table.zero_()
    keys, values = [], []
    for b, (n, nb) in enumerate(zip(seq_lens, used, strict=True)):
        row, ids = ids[:nb], ids[nb:]
        table[b, :nb] = torch.tensor(row, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype)
        pos = torch.arange(n)
        blocks = torch.tensor(row, dtype=torch.long)[pos // block_size]
        key_cache[blocks.to(device), (pos % block_size).to(device)] = k.to(device)
        value_cache[blocks.to(device), (pos % block_size).to(device)] = v.to(device)
        keys.append(k.to(device))
        values.append(v.to(device))
    table = wide.to(device)[:, 1 : 1 + max_blocks]
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return PagedKV(pool, key_cache, value_cache, table, seq_lens_t, keys, values)
