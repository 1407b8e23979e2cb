"""The ipc path (same host, CUDA): the receiver's KV pool, mapped into the sender's process.

The receiver exports its pool once (``handle.export_pool``; the handle travels in its
endpoint). The sender maps it once per peer (``handle.open_pool``) and then writes shipped
blocks straight into the receiver's reserved blocks: one ``index_select`` of the source blocks
and one ``index_copy_`` into the mapped pool, on a side stream that first waits for the current
stream, then a CUDA event synchronized before ``send`` returns. Only then may the sender tell the
receiver that the transfer is complete; the receiver takes its word (``finish``). The writer is
the sender's process, so the receiver cannot stop a copy in flight: a reservation cancelled
before the sender finished is freed only after ``IPC_FREE_GRACE_S`` (``cancel``'s grace).
"""

from __future__ import annotations

import logging
import threading

import torch

from splitserve.kernels.layout import indexable
from splitserve.transfer.base import (
    BlockIds,
    KVSender,
    PathOptions,
    SenderWritesReceiver,
    TransferPath,
    as_endpoint,
    own_ticket,
)
from splitserve.transfer.endpoint import IPC, Endpoint
from splitserve.transfer.errors import NotConnected
from splitserve.transfer.ipc.handle import IpcHandle, export_pool, open_pool
from splitserve.transfer.reservation import (
    Ticket,
    block_nbytes,
    check_block_ids,
    check_source_ids,
)

logger = logging.getLogger(__name__)

# A reservation the sender never finished may still be the target of a copy its GPU has queued.
IPC_FREE_GRACE_S = 10.0


def why_not_ipc(local: Endpoint, peer: Endpoint) -> str | None:
    """Why the sender ``local`` cannot write into the receiver ``peer``'s pool (None: it can):
    both pools on CUDA, on one kernel (boot id) but in two processes, the peer's pool exported
    and its GPU visible to the sender."""
    checks = (
        (local.device == peer.device == "cuda", "a pool is not on CUDA"),
        (local.same_host(peer), "another kernel (boot id): another host"),
        (local.pid != peer.pid, "the same process"),
        (bool(peer.ipc_handle), "the receiver offers no ipc (disabled, or its export failed)"),
        (
            peer.device_uuid is not None and peer.device_uuid in local.visible_devices,
            "the receiver's GPU is not visible to the sender (CUDA_VISIBLE_DEVICES, container "
            "devices)",
        ),
    )
    return next((why for ok, why in checks if not ok), None)


class IpcReceiver(SenderWritesReceiver):
    """Exports the pool; the sender writes the reserved blocks itself."""

    path_name = IPC
    free_grace_s = IPC_FREE_GRACE_S

    def __init__(self, kv_pool: torch.Tensor, node_id: str) -> None:
        self.kv_pool, self.node_id = kv_pool, node_id
        self._handle = export_pool(kv_pool).to_bytes()

    @classmethod
    def open(cls, kv_pool: torch.Tensor, node_id: str, options: PathOptions) -> IpcReceiver | None:
        if kv_pool.device.type != "cuda":
            return None
        try:
            return cls(kv_pool, node_id)
        except Exception as exc:
            logger.warning("transfer: not offering ipc, exporting the pool failed: %s", exc)
            return None

    @property
    def paths(self) -> tuple[str, ...]:
        return (IPC,)

    def offer(self) -> dict[str, object]:
        return {IPC: self._handle}


class IpcSender(KVSender):
    """Peers' mapped pools (one per peer, cached) and block copies into them."""

    def __init__(self, kv_pool: torch.Tensor, node_id: str) -> None:
        if kv_pool.device.type != "cuda":
            raise ValueError(f"the ipc path needs a CUDA pool, got {kv_pool.device}")
        self.kv_pool, self.node_id = kv_pool, node_id
        self._peers: dict[str, torch.Tensor] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._mu = threading.Lock()

    @classmethod
    def open(cls, kv_pool: torch.Tensor, node_id: str, options: PathOptions) -> IpcSender | None:
        return cls(kv_pool, node_id) if kv_pool.device.type == "cuda" else None

    @property
    def paths(self) -> tuple[str, ...]:
        return (IPC,)

    def connect(self, peer: Endpoint | bytes) -> str:
        """Map the peer's pool (cached: later calls reuse the mapping)."""
        peer = as_endpoint(peer)
        if not peer.ipc_handle:
            raise NotConnected(f"{peer.node_id!r} offers no ipc")
        self._map(peer.node_id, peer.ipc_handle)
        return IPC

    def _map(self, peer_id: str, handle: IpcHandle | bytes) -> torch.Tensor:
        with self._mu:
            mapped = self._peers.get(peer_id)
            if mapped is not None:
                return mapped
        mapped = open_pool(handle)
        if mapped.dim() != 6 or tuple(mapped.shape[1:]) != tuple(self.kv_pool.shape[1:]):
            raise ValueError(
                f"peer pool blocks {tuple(mapped.shape[1:])} differ from ours "
                f"{tuple(self.kv_pool.shape[1:])}"
            )
        if mapped.dtype != self.kv_pool.dtype:
            raise ValueError(f"peer pool dtype {mapped.dtype} differs from ours")
        with self._mu:
            return self._peers.setdefault(peer_id, mapped)

    def path(self, peer_id: str) -> str | None:
        return IPC if peer_id in self._peers else None

    def close(self, peer_id: str) -> None:
        """Drop the mapping of ``peer_id``'s pool (when it leaves)."""
        with self._mu:
            self._peers.pop(peer_id, None)

    def close_all(self) -> None:
        with self._mu:
            self._peers.clear()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index or 0
        with self._mu:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(device=index)
            return stream

    def send(self, ticket: Ticket | bytes, src_block_ids: BlockIds, *, timeout: float) -> int:
        """Copy our blocks into the peer's reserved ones; returns the bytes written once the copy
        has finished on the GPU (``timeout`` is not needed: a GPU copy cannot stall)."""
        ticket = own_ticket(ticket, self.node_id, IPC)
        dst_pool = self._peers.get(ticket.receiver_id)
        if dst_pool is None:
            raise NotConnected(f"no ipc mapping of {ticket.receiver_id!r}: connect first")
        src = check_source_ids(src_block_ids, self.kv_pool.shape[0])
        dst = check_block_ids(ticket.block_ids, dst_pool.shape[0])
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source blocks for {len(dst)} destination blocks")
        if not src:
            return 0
        self._copy(src, dst_pool, dst).synchronize()
        return len(src) * block_nbytes(self.kv_pool)

    def _copy(self, src: list[int], dst_pool: torch.Tensor, dst: list[int]) -> torch.cuda.Event:
        """Gather ``src`` and scatter it into ``dst_pool[dst]`` on side streams; the event that
        marks the end of the copy."""
        src_dev, dst_dev = self.kv_pool.device, dst_pool.device
        src_stream = self._stream(src_dev)
        with torch.cuda.device(src_dev):
            src_index = torch.tensor(src, dtype=torch.int64, device=src_dev)
            src_stream.wait_stream(torch.cuda.current_stream(src_dev))
            with torch.cuda.stream(src_stream):
                buffer = indexable(self.kv_pool).index_select(0, src_index)
                if dst_dev == src_dev:
                    dst_index = torch.tensor(dst, dtype=torch.int64, device=dst_dev)
                    indexable(dst_pool).index_copy_(0, dst_index, buffer)
                    done = torch.cuda.Event()
                    done.record(src_stream)
                    return done
        # Pool on another GPU of this host: one peer copy, then the scatter over there.
        dst_stream = self._stream(dst_dev)
        with torch.cuda.device(dst_dev):
            dst_stream.wait_stream(src_stream)
            with torch.cuda.stream(dst_stream):
                moved = buffer.to(dst_dev)
                dst_index = torch.tensor(dst, dtype=torch.int64, device=dst_dev)
                indexable(dst_pool).index_copy_(0, dst_index, moved)
                done = torch.cuda.Event()
                done.record(dst_stream)
        return done


def reaches(sender: Endpoint, receiver: Endpoint) -> bool:
    return why_not_ipc(sender, receiver) is None


PATH = TransferPath(
    IPC,
    reaches=reaches,
    open_receiver=IpcReceiver.open,
    open_sender=IpcSender.open,
    rate_prior=100e9,  # 384 GB/s measured (docs/benchmarks-history.md, "The tcp byte path,
    # H200 (2026-12-01)"), taken lower: see chooser
)
