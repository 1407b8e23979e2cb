"""Paged KV-cache kernels: Triton on CUDA, plain-torch references on CPU.

Public surface: the dispatching ops (`kernels.ops`) and the pool layout / block transfer
helpers (`kernels.layout`). See docs/kernels.md.
"""

from splitserve.kernels.layout import (
    NULL_BLOCK_ID,
    allocate_kv_pool,
    gather_blocks,
    layer_kv_views,
    scatter_blocks,
)
from splitserve.kernels.ops import (
    paged_decode_attention,
    paged_prefill_attention,
    reshape_and_cache,
)

__all__ = [
    "NULL_BLOCK_ID",
    "allocate_kv_pool",
    "gather_blocks",
    "layer_kv_views",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reshape_and_cache",
    "scatter_blocks",
]
