"""KV block transfer between a prefill node (sender) and a decode node (receiver).

One interface (``KVSender`` / ``KVReceiver``), four paths chosen per pair at handshake
(``choose_path``): ``ipc`` (same host, CUDA: the sender writes into the receiver's pool mapped
through a CUDA IPC handle), ``dist`` (torch.distributed point-to-point in a two-rank group per
pair: NCCL on CUDA, gloo on CPU), ``tcp`` (raw sockets from pinned memory, several connections,
CRC-checked chunks) and ``grpc`` (the services' gRPC byte stream, ``kvstore.codec``).
See docs/transfer.md.
"""

from splitserve.transfer.api import KVReceiver, KVSender
from splitserve.transfer.dist import DistReceiver, DistSender, make_pair_group, prepare_backend
from splitserve.transfer.endpoint import (
    DIST,
    GRPC,
    IPC,
    PATHS,
    RECEIVED_PATHS,
    TCP,
    DistAddress,
    Endpoint,
    TcpAddress,
    available_backends,
    boot_id,
    choose_path,
    local_endpoint,
)
from splitserve.transfer.errors import (
    ChannelClosed,
    NotConnected,
    PeerLost,
    TransferError,
    TransferTimeout,
)
from splitserve.transfer.ipc import IpcHandle, IpcWriter, export_pool, open_pool
from splitserve.transfer.reservation import Reservation, Ticket, check_block_ids

__all__ = [
    "DIST",
    "GRPC",
    "IPC",
    "PATHS",
    "RECEIVED_PATHS",
    "TCP",
    "ChannelClosed",
    "DistAddress",
    "DistReceiver",
    "DistSender",
    "Endpoint",
    "IpcHandle",
    "IpcWriter",
    "KVReceiver",
    "KVSender",
    "NotConnected",
    "PeerLost",
    "Reservation",
    "TcpAddress",
    "Ticket",
    "TransferError",
    "TransferTimeout",
    "available_backends",
    "boot_id",
    "check_block_ids",
    "choose_path",
    "export_pool",
    "local_endpoint",
    "make_pair_group",
    "open_pool",
    "prepare_backend",
]
