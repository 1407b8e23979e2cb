"""KV block transfer between a prefill node (sender) and a decode node (receiver).

One interface (``KVSender`` / ``KVReceiver``, ``base.py``) that every path implements, five paths,
each a sub-package, chosen per pair at handshake (``chooser.py``, the only place a path is
picked): ``ipc`` (same host, CUDA: the sender writes into the receiver's pool mapped through a
CUDA IPC handle), ``nixl`` (NIXL/UCX one-sided writes, when named), ``dist`` (torch.distributed
point-to-point in a two-rank group per pair: NCCL on CUDA, gloo on CPU), ``tcp`` (raw sockets
from pinned memory, several connections, CRC-checked chunks, layer ranges for a layer-wise
stream) and ``grpc_bytes`` (the byte path: the services' own gRPC stream, whose message codec
this package hands out: ``encode_blocks``, ``decode_blocks``, ``batch_indices``). A node holds
one receiver and one sender over all of them (``open_receiver`` / ``open_sender``), guarded by
its ``KVSecurity`` (``security.py``: TLS on tcp, dist between nodes, the rendezvous key). Code
outside this package names no path module. See docs/transfer.md and docs/security.md.
"""

from splitserve.transfer.api import NodeReceiver, NodeSender, open_receiver, open_sender
from splitserve.transfer.base import KVReceiver, KVSender, PathOptions, TransferPath
from splitserve.transfer.chooser import (
    BYTES_ONLY,
    FETCH_PATHS,
    PATHS,
    PREFERENCE,
    TP_PATHS,
    choose_path,
    fetch_paths,
    parse_paths,
    rate_prior,
    secured_paths,
)
from splitserve.transfer.dist import make_pair_group, prepare_backend
from splitserve.transfer.dist.group import loopback_store, make_group
from splitserve.transfer.endpoint import (
    DIST,
    GRPC,
    IPC,
    NIXL,
    TCP,
    DistAddress,
    Endpoint,
    TcpAddress,
    available_backends,
    boot_id,
    local_endpoint,
)
from splitserve.transfer.errors import (
    ChannelClosed,
    Incomplete,
    NotConnected,
    PeerLost,
    StreamFailed,
    TransferError,
    TransferTimeout,
)
from splitserve.transfer.grpc_bytes.codec import batch_indices, decode_blocks, encode_blocks
from splitserve.transfer.ipc.handle import IpcHandle, export_pool, open_pool
from splitserve.transfer.reservation import Reservation, Ticket, check_block_ids
from splitserve.transfer.security import KVSecurity, KVTls, rendezvous_key
from splitserve.transfer.shards import RankLink, ShardAgent

__all__ = [
    "BYTES_ONLY",
    "DIST",
    "FETCH_PATHS",
    "GRPC",
    "IPC",
    "NIXL",
    "PATHS",
    "PREFERENCE",
    "TCP",
    "TP_PATHS",
    "ChannelClosed",
    "DistAddress",
    "Endpoint",
    "Incomplete",
    "IpcHandle",
    "KVReceiver",
    "KVSecurity",
    "KVSender",
    "KVTls",
    "NodeReceiver",
    "NodeSender",
    "NotConnected",
    "PathOptions",
    "PeerLost",
    "RankLink",
    "Reservation",
    "ShardAgent",
    "StreamFailed",
    "TcpAddress",
    "Ticket",
    "TransferError",
    "TransferPath",
    "TransferTimeout",
    "available_backends",
    "batch_indices",
    "boot_id",
    "check_block_ids",
    "choose_path",
    "decode_blocks",
    "encode_blocks",
    "export_pool",
    "fetch_paths",
    "local_endpoint",
    "loopback_store",
    "make_group",
    "make_pair_group",
    "open_pool",
    "open_receiver",
    "open_sender",
    "parse_paths",
    "prepare_backend",
    "rate_prior",
    "rendezvous_key",
    "secured_paths",
]
