"""KV rank to rank: ``kvstore.tp_shards.transfer_plan`` carried out over one group that holds every
rank of a sending pool (tensor parallel size ``p``) and of a receiving pool (size ``d``).

Under tensor parallelism a block's KV is spread over the ranks, each holding its heads
(``kv_heads_of``). Sending it through rank 0 (gather, bytes, scatter) moves every byte twice and
through one process. Here every rank sends or receives only its own pieces, straight from and
into its own pool: sender rank ``s`` cuts heads ``[src_offset, src_offset + count)`` of the
shipped blocks out of its shard (one ``index_select`` of a head slice: a contiguous buffer) and
sends it to receiver rank ``r``, which receives it and copies it into heads ``[dst_offset, ...)``
of its reserved blocks. Pools of equal size send each rank's whole shard to the same rank; a
pool of 1 sends each receiver the heads it holds; replicated heads (size above the KV heads) are
sent once, by one of their holders.

The group (``ShardGroup``): receiver ranks first, ``0 .. d-1``, then sender ranks ``d .. d+p-1``;
built on a store like the dist path's pair groups (gloo on CPU, NCCL on CUDA). A transfer is one
``send_shards`` on every sender rank and one ``receive_shards`` on every receiver rank, with the
same plan, block counts and ``tag``; each returns once its own pieces are through. What a rank
receives is checked against its pool (shape, dtype) before anything is written, and nothing is
written until all of that rank's pieces arrived: a transfer that fails or times out leaves the
pool as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from splitserve.kvstore.tp_shards import Piece, kv_heads_of, transfer_plan
from splitserve.transfer.errors import TransferTimeout
from splitserve.transfer.reservation import check_block_ids, check_source_ids

HEAD_DIM = 4  # pools are (blocks, layers, 2, block_size, kv_heads, head_dim)


@dataclass(frozen=True)
class ShardGroup:
    """The numbering of a group of a receiving pool's ``receiver_tp`` ranks and a sending pool's
    ``sender_tp`` ranks, and the plan between them."""

    num_kv_heads: int
    sender_tp: int
    receiver_tp: int

    @property
    def size(self) -> int:
        return self.receiver_tp + self.sender_tp

    def receiver(self, rank: int) -> int:
        """Group rank of receiver rank ``rank``."""
        if not 0 <= rank < self.receiver_tp:
            raise ValueError(f"receiver rank {rank} of {self.receiver_tp}")
        return rank

    def sender(self, rank: int) -> int:
        """Group rank of sender rank ``rank``."""
        if not 0 <= rank < self.sender_tp:
            raise ValueError(f"sender rank {rank} of {self.sender_tp}")
        return self.receiver_tp + rank

    def plan(self) -> list[Piece]:
        return transfer_plan(self.num_kv_heads, self.sender_tp, self.receiver_tp)

    def sent_by(self, rank: int) -> list[Piece]:
        self.sender(rank)
        return [p for p in self.plan() if p.sender == rank]

    def received_by(self, rank: int) -> list[Piece]:
        self.receiver(rank)
        return [p for p in self.plan() if p.receiver == rank]

    def check_pool(self, pool: torch.Tensor, tp: int, rank: int) -> None:
        """``ValueError`` unless ``pool`` holds exactly the heads rank ``rank`` of ``tp`` holds."""
        if pool.dim() != 6:
            raise ValueError(f"a KV pool has 6 dimensions, got shape {tuple(pool.shape)}")
        heads = len(kv_heads_of(self.num_kv_heads, tp, rank))
        if pool.shape[HEAD_DIM] != heads:
            raise ValueError(
                f"rank {rank} of tensor parallel size {tp} holds {heads} KV heads of "
                f"{self.num_kv_heads}; its pool has {pool.shape[HEAD_DIM]}"
            )


def _head_slice(pool: torch.Tensor, offset: int, count: int) -> torch.Tensor:
    return pool.narrow(HEAD_DIM, offset, count)


def _piece_shape(pool: torch.Tensor, num_blocks: int, count: int) -> tuple[int, ...]:
    shape = list(pool.shape)
    shape[0], shape[HEAD_DIM] = num_blocks, count
    return tuple(shape)


def _wait(works: Sequence[Any], timeout_s: float, what: str) -> None:
    for work in works:
        try:
            ok = work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # gloo: a timeout or a lost peer
            raise TransferTimeout(f"{what}: {exc}") from exc
        if ok is False:
            raise TransferTimeout(f"{what}: not through within {timeout_s:g} s")


def send_shards(
    pg: Any,
    group: ShardGroup,
    rank: int,
    pool: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    tag: int = 0,
    timeout_s: float = 30.0,
) -> int:
    """On sender rank ``rank``: send its pieces of blocks ``block_ids`` (its pool, its heads) to
    the receiver ranks the plan names. Returns the bytes sent."""
    group.sender(rank)
    group.check_pool(pool, group.sender_tp, rank)
    ids = torch.tensor(check_source_ids(block_ids, pool.shape[0]), dtype=torch.int64)
    ids = ids.to(pool.device)
    works, buffers, sent = [], [], 0
    for piece in group.sent_by(rank):
        # As bytes: every backend moves uint8, whatever the pool's dtype (bf16, fp8).
        buf = _head_slice(pool, piece.src_offset, piece.count).index_select(0, ids)
        raw = buf.view(torch.uint8)
        buffers.append(raw)  # alive until sent
        works.append(pg.send([raw], group.receiver(piece.receiver), tag))
        sent += raw.numel()
    _wait(works, timeout_s, f"sender rank {rank}: sending {ids.numel()} blocks")
    return sent


def receive_shards(
    pg: Any,
    group: ShardGroup,
    rank: int,
    pool: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    tag: int = 0,
    timeout_s: float = 30.0,
) -> int:
    """On receiver rank ``rank``: receive its pieces of the shipped blocks and write them into
    ``block_ids`` of its pool (the reserved destinations, in the senders' order). Nothing is
    written unless every piece arrived. Returns the bytes received."""
    group.receiver(rank)
    group.check_pool(pool, group.receiver_tp, rank)
    ids = torch.tensor(check_block_ids(block_ids, pool.shape[0]), dtype=torch.int64)
    ids = ids.to(pool.device)
    pieces = group.received_by(rank)
    buffers = [
        torch.empty(_piece_shape(pool, ids.numel(), p.count), dtype=pool.dtype, device=pool.device)
        for p in pieces
    ]
    works = [
        pg.recv([buf.view(torch.uint8)], group.sender(p.sender), tag)
        for p, buf in zip(pieces, buffers, strict=True)
    ]
    _wait(works, timeout_s, f"receiver rank {rank}: receiving {ids.numel()} blocks")
    for piece, buf in zip(pieces, buffers, strict=True):
        _head_slice(pool, piece.dst_offset, piece.count).index_copy_(0, ids, buf)
    if pool.device.type == "cuda":
        torch.cuda.current_stream(pool.device).synchronize()
    return sum(b.numel() * b.element_size() for b in buffers)
