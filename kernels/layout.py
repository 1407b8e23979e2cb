"""KV pool layout and block transfer.

The pool of one node is a single block-major tensor

    kv_pool: (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)   # [:, :, 0] = K

NOTE: block-major on purpose. The FlashAttention-style per-layer layout
`(2, num_blocks, block_size, kv_heads, head_dim)` scatters one block over `2 * num_layers`
places, so shipping a block to a peer needs a gather kernel. Here everything a block holds, over
all layers, is one contiguous slice of `num_layers * 2 * block_size * kv_heads * head_dim`
elements: gather/scatter for transfer are plain index copies (one memcpy per block, or one for a
run of consecutive blocks). The attention kernels see each layer through a strided view whose
inner `(block_size, kv_heads, head_dim)` layout is the usual one; only the block stride grows,
and the kernels take strides as arguments, so nothing is ever made contiguous.
"""

from __future__ import annotations

import torch

NULL_BLOCK_ID = 0
"""Block 0 is reserved: block tables are padded with it and nothing is ever written to it."""


def allocate_kv_pool(
    num_blocks: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Allocate an (uninitialised) block-major KV pool.

    Returns a tensor of shape `(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)`.
    `num_blocks` counts the null block 0, so at most `num_blocks - 1` blocks are usable.
    """
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
    for name, value in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if block_size < 16 or block_size % 16:
        raise ValueError(f"block_size must be a positive multiple of 16, got {block_size}")
    return torch.empty(
        (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
    )


def _check_pool(kv_pool: torch.Tensor) -> None:
    if kv_pool.dim() != 6 or kv_pool.shape[2] != 2:
        raise ValueError(
            "kv_pool must have shape (num_blocks, num_layers, 2, block_size, num_kv_heads, "
            f"head_dim), got {tuple(kv_pool.shape)}"
        )
    if not kv_pool.is_contiguous():
        raise ValueError("kv_pool must be contiguous (allocate it with allocate_kv_pool)")


def layer_kv_views(kv_pool: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views `(key_cache, value_cache)` of one layer, each `(num_blocks, block_size, kv_heads,
    head_dim)`, sharing memory with the pool. They are not contiguous: their block stride is
    `num_layers * 2 * block_size * kv_heads * head_dim`; the inner three dims are contiguous."""
    _check_pool(kv_pool)
    num_layers = kv_pool.shape[1]
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer must be in [0, {num_layers}), got {layer}")
    return kv_pool[:, layer, 0], kv_pool[:, layer, 1]


def _check_block_ids(kv_pool: torch.Tensor, block_ids: torch.Tensor, what: str) -> torch.Tensor:
    if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"block_ids must be a 1-D int32/int64 tensor, got {block_ids.dtype} "
            f"of shape {tuple(block_ids.shape)}"
        )
    block_ids = block_ids.to(device=kv_pool.device, dtype=torch.int64)
    if block_ids.numel():
        lo, hi = (int(x) for x in torch.stack([block_ids.min(), block_ids.max()]).tolist())
        if lo < 0 or hi >= kv_pool.shape[0]:
            raise ValueError(
                f"{what}: block ids must be in [0, {kv_pool.shape[0]}), got min {lo}, max {hi}"
            )
    return block_ids


def check_block_ids(kv_pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``block_ids`` as int64 on the pool's device, or ``ValueError`` if any is outside it."""
    return _check_block_ids(kv_pool, block_ids, "block ids")


def indexable(t: torch.Tensor) -> torch.Tensor:
    """``t``, or its bytes for a one-byte float (an FP8 pool): torch has no CPU index kernels for
    float8, and copying blocks is copying bytes either way."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def gather_blocks(
    kv_pool: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy blocks `block_ids` (any order, [n] int) of the pool into one contiguous buffer.

    Returns (or fills `out`, which may live on another device, e.g. pinned host memory)
    `(n, num_layers, 2, block_size, kv_heads, head_dim)`, row i holding block `block_ids[i]`,
    byte for byte. With the block-major pool this is a plain index copy, no kernel of ours.
    """
    _check_pool(kv_pool)
    block_ids = _check_block_ids(kv_pool, block_ids, "gather_blocks")
    shape = (block_ids.numel(), *kv_pool.shape[1:])
    if out is not None and (
        tuple(out.shape) != shape or out.dtype != kv_pool.dtype or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous {kv_pool.dtype} tensor of shape {shape}, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    if out is not None and out.device != kv_pool.device:
        indexable(out).copy_(indexable(kv_pool).index_select(0, block_ids))
        return out
    if out is not None:
        torch.index_select(indexable(kv_pool), 0, block_ids, out=indexable(out))
        return out
    return torch.index_select(indexable(kv_pool), 0, block_ids).view(kv_pool.dtype)


def scatter_blocks(kv_pool: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor) -> None:
    """Write `buffer` `(n, num_layers, 2, block_size, kv_heads, head_dim)` (as made by
    `gather_blocks`, possibly on another device) into blocks `block_ids` ([n] int, distinct,
    never the null block 0) of the pool, byte for byte."""
    _check_pool(kv_pool)
    block_ids = _check_block_ids(kv_pool, block_ids, "scatter_blocks")
    shape = (block_ids.numel(), *kv_pool.shape[1:])
    if tuple(buffer.shape) != shape or buffer.dtype != kv_pool.dtype:
        raise ValueError(
            f"buffer must be a {kv_pool.dtype} tensor of shape {shape}, "
            f"got {buffer.dtype} {tuple(buffer.shape)}"
        )
    if block_ids.numel():
        if bool((block_ids == NULL_BLOCK_ID).any()):
            raise ValueError("scatter_blocks: block 0 is the reserved null block; never write it")
        if torch.unique(block_ids).numel() != block_ids.numel():
            raise ValueError("scatter_blocks: block_ids must be distinct")
    source = indexable(buffer.to(kv_pool.device, non_blocking=True))
    indexable(kv_pool).index_copy_(0, block_ids, source)


def host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy: a writable view that file and socket
    calls (``os.preadv``, ``recv_into``) fill and read in place. A tensor that is not contiguous
    raises (a copy would take the reads)."""
    array = t.view(torch.uint8).view(-1).numpy()
    return memoryview(array)  # pyright: ignore[reportArgumentType] (an ndarray is a buffer)


def read_blocks_bytes(kv_pool: torch.Tensor, block_ids: list[int]) -> bytes:
    """The raw bytes of blocks ``block_ids`` over all layers, in order (what a peer ships)."""
    ids = torch.tensor(block_ids, device=kv_pool.device)
    return gather_blocks(kv_pool, ids).view(torch.uint8).cpu().numpy().tobytes()


def write_blocks_bytes(kv_pool: torch.Tensor, block_ids: list[int], data: bytes) -> None:
    """Write ``len(block_ids)`` blocks' raw bytes (as ``read_blocks_bytes`` makes them)."""
    buffer = torch.frombuffer(bytearray(data), dtype=kv_pool.dtype)
    buffer = buffer.view(len(block_ids), *kv_pool.shape[1:]).to(kv_pool.device)
    scatter_blocks(kv_pool, torch.tensor(block_ids, device=kv_pool.device), buffer)
