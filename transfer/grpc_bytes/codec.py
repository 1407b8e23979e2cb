"""Wire codec of shipped KV blocks: msgpack metadata + raw bytes, checked before anything is used.

One message carries whole blocks (over all layers; with the block-major pool a block is one
contiguous slice), batched so a message is about ``TARGET_MESSAGE_BYTES`` — never one tiny message
per (layer, block).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import msgpack

TARGET_MESSAGE_BYTES = 4 << 20


class BlockBatch(NamedTuple):
    indices: list[int]  # positions in the transfer's block list
    tail: bool  # the partial last block (no hash); then indices == [-1]
    data: bytes


def encode_blocks(indices: Sequence[int], data: bytes, tail: bool = False) -> tuple[bytes, bytes]:
    """(meta, data) of one message."""
    meta = msgpack.packb({"indices": list(indices), "tail": tail, "crc32": zlib.crc32(data)})
    # NOTE: msgpack's types allow None (Packer.pack without autoreset); packb returns bytes.
    return meta, data  # pyright: ignore[reportReturnType]


def decode_blocks(meta: bytes, data: bytes, block_nbytes: int) -> BlockBatch:
    """Parse and check one message; ``ValueError`` with the reason if anything is off."""
    try:
        fields = msgpack.unpackb(meta)
        indices, tail, crc = fields["indices"], bool(fields["tail"]), fields["crc32"]
    except Exception as exc:  # msgpack raises several types on garbage
        raise ValueError(f"malformed block metadata: {exc}") from None
    if not isinstance(indices, list) or not all(type(i) is int for i in indices) or not indices:
        raise ValueError("block metadata: indices must be a non-empty list of ints")
    if len(data) != len(indices) * block_nbytes:
        raise ValueError(
            f"block data has {len(data)} bytes, expected {len(indices)} blocks of {block_nbytes}"
        )
    if zlib.crc32(data) != crc:
        raise ValueError("block data checksum mismatch (corrupted in transit)")
    return BlockBatch(indices, tail, data)


def batch_indices(indices: Sequence[int], block_nbytes: int) -> Iterator[list[int]]:
    """Split ``indices`` into runs of about ``TARGET_MESSAGE_BYTES`` each (at least one block)."""
    per_message = max(1, TARGET_MESSAGE_BYTES // max(block_nbytes, 1))
    for i in range(0, len(indices), per_message):
        yield list(indices[i : i + per_message])
