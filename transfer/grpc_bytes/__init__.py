"""The byte path (``grpc``): the blocks travel in the caller's own stream — the services' gRPC
messages (``codec.py`` here: ~4 MB ``BlockData``, CRC-checked) — and the layer only writes
them into the receiver's reservation and checks on ``finish`` that every block was written.

Every node serves it and it reaches every peer: it is each pair's fallback (``chooser``). Its
sender moves nothing (``send`` refuses): the caller streams the blocks itself, and the receiver
hands out no ticket for them (``BytesReservation.caller_writes``).
"""

from __future__ import annotations

import torch

from splitserve.transfer.base import (
    BlockIds,
    BlockWriter,
    KVReceiver,
    KVSender,
    PathOptions,
    TransferPath,
    as_endpoint,
    check_count,
    check_path,
)
from splitserve.transfer.endpoint import GRPC, Endpoint
from splitserve.transfer.errors import Incomplete
from splitserve.transfer.reservation import Reservation, Ticket


class BytesReservation(Reservation):
    """A byte-path reservation: its blocks come in the caller's stream; ``written``: the ids
    written so far."""

    caller_writes = True

    def __init__(
        self, kv_pool: torch.Tensor, receiver_id: str, peer_id: str, block_ids: BlockIds
    ) -> None:
        super().__init__(kv_pool, receiver_id, peer_id, GRPC, block_ids)
        self.written: set[int] = set()


class GrpcReceiver(KVReceiver):
    def __init__(self, kv_pool: torch.Tensor, node_id: str) -> None:
        self.kv_pool, self.node_id = kv_pool, node_id

    @classmethod
    def open(cls, kv_pool: torch.Tensor, node_id: str, options: PathOptions) -> GrpcReceiver:
        return cls(kv_pool, node_id)

    @property
    def paths(self) -> tuple[str, ...]:
        return ()

    def offer(self) -> dict[str, object]:
        return {}

    def reserve(self, peer_id: str, block_ids: BlockIds, path: str = GRPC) -> Reservation:
        check_path(path or GRPC, GRPC)
        res = BytesReservation(self.kv_pool, self.node_id, peer_id, block_ids)
        if not res.block_ids:
            res.end_done()
        return res

    def write(
        self,
        res: Reservation,
        block_ids: BlockIds,
        data: bytes | torch.Tensor,
        writer: BlockWriter | None = None,
    ) -> None:
        if not isinstance(res, BytesReservation):
            super().write(res, block_ids, data)  # raises
            return
        res.written.update(res.write(block_ids, data, writer))

    def finish(self, res: Reservation, count: int | None = None) -> None:
        n = check_count(res, count)
        written = res.written if isinstance(res, BytesReservation) else set()
        missing = sum(1 for b in res.block_ids[:n] if b not in written)
        if missing:
            res.end_failed(Incomplete(f"transfer incomplete: {missing} blocks missing"))
        res.end_done()  # raises if it failed (or was cancelled)


class GrpcSender(KVSender):
    def __init__(self, kv_pool: torch.Tensor, node_id: str) -> None:
        self.kv_pool, self.node_id = kv_pool, node_id

    @classmethod
    def open(cls, kv_pool: torch.Tensor, node_id: str, options: PathOptions) -> GrpcSender:
        return cls(kv_pool, node_id)

    @property
    def paths(self) -> tuple[str, ...]:
        return ()

    def connect(self, peer: Endpoint | bytes) -> str:
        as_endpoint(peer)  # checks the bytes; nothing to set up
        return GRPC

    def path(self, peer_id: str) -> str | None:
        return GRPC

    def send(self, ticket: Ticket | bytes, src_block_ids: BlockIds, *, timeout: float) -> int:
        raise ValueError(
            f"path {GRPC!r} is not sent through this layer: the caller streams the blocks"
        )

    def close(self, peer_id: str) -> None:
        pass

    def close_all(self) -> None:
        pass


PATH = TransferPath(
    GRPC,
    reaches=lambda sender, receiver: True,
    open_receiver=GrpcReceiver.open,
    open_sender=GrpcSender.open,
    rate_prior=0.25e9,  # 0.22 GB/s measured (docs/benchmarks.md, "KV transfer paths:
    # transfer.py")
)
