"""The transfer layer's interface: one receiver per decode node, one sender per prefill node.

Decode node (receiver)::

    rx = KVReceiver(kv_pool, node_id)              # exports the pool (CUDA), hosts a store
    handshake bytes = rx.endpoint().to_bytes()     # what peers need to choose and connect
    res = rx.reserve(sender_id, block_ids, path)   # before the sender sends anything
    ticket bytes = res.ticket.to_bytes()           # to the sender
    dist: rx.receive(res, timeout)                 # returns once the blocks are in the pool
    ipc:  rx.complete(res)                         # after the sender said it finished
    tcp:  rx.receive(res, timeout)                 # as dist
    grpc: rx.write(res, ids, data); rx.complete(res)
    failure: rx.cancel(res), then free the blocks

Prefill node (sender)::

    tx = KVSender(kv_pool, node_id)
    path = tx.connect(Endpoint.from_bytes(handshake))  # cached per peer: ipc/dist/tcp/grpc
    tx.send(Ticket.from_bytes(ticket), src_block_ids, timeout=...)  # not grpc; then signal done

Every call here blocks; from asyncio run them in a thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import logging
import math
import threading
import time

import torch

from splitserve.transfer.dist import DistReceiver, DistSender
from splitserve.transfer.endpoint import (
    DIST,
    GRPC,
    IPC,
    PATHS,
    RECEIVED_PATHS,
    TCP,
    Endpoint,
    available_backends,
    choose_path,
    local_endpoint,
    why_not_ipc,
)
from splitserve.transfer.errors import NotConnected
from splitserve.transfer.ipc import IpcWriter, export_pool
from splitserve.transfer.reservation import Reservation, Ticket
from splitserve.transfer.tcp_receiver import TcpReceiver
from splitserve.transfer.tcp_sender import TcpSender

logger = logging.getLogger(__name__)


def _check_pool(kv_pool: torch.Tensor) -> None:
    if kv_pool.dim() != 6 or kv_pool.shape[2] != 2 or not kv_pool.is_contiguous():
        raise ValueError(
            "kv_pool must be a contiguous (num_blocks, layers, 2, block_size, kv_heads, "
            f"head_dim) tensor, got {tuple(kv_pool.shape)}"
        )


class KVReceiver:
    """Decode-node side. ``ipc`` (default: a CUDA pool) exports the pool for same-host senders;
    ``dist`` (default on) hosts a rendezvous store on ``dist_host:dist_port`` (default: this
    host's routable address, any free port) for senders on other hosts; ``tcp`` (default on) a
    listener on ``tcp_host`` (default: ``dist_host``, else as dist) and any free port."""

    def __init__(
        self,
        kv_pool: torch.Tensor,
        node_id: str,
        *,
        ipc: bool | None = None,
        dist: bool = True,
        dist_host: str | None = None,
        dist_port: int = 0,
        tcp: bool = True,
        tcp_host: str | None = None,
        connect_timeout: float = 30.0,
    ) -> None:
        _check_pool(kv_pool)
        self.kv_pool = kv_pool
        self.node_id = node_id
        self._ipc_handle: bytes | None = None
        if ipc or (ipc is None and kv_pool.device.type == "cuda"):
            try:
                self._ipc_handle = export_pool(kv_pool).to_bytes()
            except Exception as exc:
                if ipc:
                    raise
                logger.warning("transfer: not offering ipc, exporting the pool failed: %s", exc)
        self._dist: DistReceiver | None = None
        if dist and available_backends(kv_pool.device.type):
            self._dist = DistReceiver(
                kv_pool,
                node_id,
                host=dist_host,
                port=dist_port,
                connect_timeout=connect_timeout,
            )
        self._tcp: TcpReceiver | None = None
        if tcp:
            from splitserve.transfer.dist_group import default_host

            host = tcp_host or dist_host or default_host()
            self._tcp = TcpReceiver(kv_pool, node_id, host=host)
        self._endpoint = local_endpoint(
            node_id,
            kv_pool,
            ipc_handle=self._ipc_handle,
            dist=self._dist.address if self._dist else None,
            tcp=self._tcp.address if self._tcp else None,
        )

    def endpoint(self) -> Endpoint:
        """What this node offers; send ``endpoint().to_bytes()`` to senders in the handshake."""
        return self._endpoint

    def peers(self) -> list[str]:
        """Senders with an open dist channel."""
        return self._dist.peers() if self._dist else []

    def reserve(self, peer_id: str, block_ids, path: str) -> Reservation:
        """Reserve destination ``block_ids`` (allocated, not yet registered) for a transfer from
        ``peer_id`` over ``path``; its ``ticket`` goes to the sender. ``ValueError`` on an id out
        of range, the null block 0 or a repeat; ``NotConnected`` if ``path`` is not available
        from that peer."""
        if path == DIST:
            if self._dist is None:
                raise NotConnected("this node does not offer the dist path")
            return self._dist.reserve(peer_id, block_ids)
        if path == TCP:
            if self._tcp is None:
                raise NotConnected("this node does not offer the tcp path")
            return self._tcp.reserve(peer_id, block_ids)
        if path == IPC and self._ipc_handle is None:
            raise NotConnected("this node does not offer the ipc path")
        if path not in (IPC, GRPC):
            raise ValueError(f"unknown path {path!r}")
        res = Reservation(self.kv_pool, self.node_id, peer_id, path, block_ids)
        if not res.block_ids:
            res._complete()
        return res

    def receive(self, res: Reservation, timeout: float) -> None:
        """dist/tcp: block until the reserved blocks hold the sender's data (see
        ``DistReceiver.receive``); raises ``TransferError`` subclasses (the reservation failed:
        free its blocks)."""
        if res.path not in RECEIVED_PATHS:
            raise ValueError(f"receive() is for dist/tcp reservations, not {res.path}: complete()")
        if res.path == TCP:
            assert self._tcp is not None
            self._tcp.receive(res, timeout)
            return
        assert self._dist is not None
        self._dist.receive(res, timeout)

    def write(self, res: Reservation, block_ids, data: bytes | torch.Tensor) -> None:
        """grpc: write received blocks into reserved ids (``ValueError`` and no write for an id
        outside the reservation)."""
        res.write(block_ids, data)

    def complete(self, res: Reservation) -> None:
        """ipc/grpc: the sender finished writing (ipc: its copy is synchronized before it says
        so); the reservation ends as done. Raises if it had already failed or been cancelled."""
        if res.path in RECEIVED_PATHS:
            raise ValueError(f"{res.path} reservations complete in receive()")
        res._complete()

    def complete_prefix(self, res: Reservation, n: int) -> None:
        """ipc/tcp: the sender filled only the first ``n`` reserved blocks and said so (a peer's
        prefix fetch: it held fewer than asked); end the reservation as done. tcp checks that
        those blocks arrived (``TransferError`` otherwise). The other blocks were never written."""
        if res.path == TCP and self._tcp is not None:
            self._tcp.complete_prefix(res, n)
        elif res.path == IPC:
            res._complete()
        else:
            raise ValueError(f"complete_prefix() is for ipc/tcp reservations, not {res.path}")

    def cancel(self, res: Reservation) -> None:
        """Abandon a reservation; afterwards nothing of this layer writes into its blocks.
        (ipc: the writer is the sender's process: free the blocks only once the sender is
        known to have stopped, e.g. after its stream closed.)"""
        if res.path == DIST and self._dist is not None:
            self._dist.cancel(res)
        elif res.path == TCP and self._tcp is not None:
            self._tcp.cancel(res)
        else:
            res._cancel()

    def close(self, peer_id: str) -> None:
        """The sender ``peer_id`` left: tear down its dist pair."""
        if self._dist is not None:
            self._dist.close(peer_id)

    def shutdown(self) -> None:
        if self._dist is not None:
            self._dist.shutdown()
        if self._tcp is not None:
            self._tcp.shutdown()


class KVSender:
    """Prefill-node side. ``paths`` limits the paths it may choose (``grpc`` always remains);
    ``connect_timeout`` bounds building a pair group (``connect`` blocks that long at most)."""

    def __init__(
        self,
        kv_pool: torch.Tensor,
        node_id: str,
        *,
        paths=PATHS,
        connect_timeout: float = 30.0,
        retry_after: float = 60.0,
        tcp_options: dict | None = None,
    ) -> None:
        _check_pool(kv_pool)
        self.kv_pool = kv_pool
        self.node_id = node_id
        self.allowed = tuple(paths)
        self.retry_after = retry_after
        self._endpoint = local_endpoint(node_id, kv_pool)
        self._ipc = IpcWriter(kv_pool) if kv_pool.device.type == "cuda" else None
        self._dist = (
            DistSender(kv_pool, node_id, connect_timeout=connect_timeout)
            if self._endpoint.dist_backends
            else None
        )
        # tcp_options: TcpSender's streams / chunk_bytes / connect_timeout.
        self._tcp = None
        if TCP in self.allowed:
            self._tcp = TcpSender(kv_pool, node_id, **(tcp_options or {}))
        self._paths: dict[str, str] = {}
        self._peers: dict[str, Endpoint] = {}
        self._retry_at: dict[str, float] = {}  # peers whose preferred path failed to set up
        self._mu = threading.Lock()

    def endpoint(self) -> Endpoint:
        return self._endpoint

    def path(self, peer_id: str) -> str | None:
        """The path set up for ``peer_id`` (``None``: not connected)."""
        with self._mu:
            return self._paths.get(peer_id)

    def connect(self, peer: Endpoint | bytes) -> str:
        """Choose the path to the receiver ``peer`` and set it up (map its pool / build the pair
        group); cached per peer, so call it before every transfer. A peer whose endpoint changed
        (restarted) is set up afresh. A path that fails to set up is logged and the next one
        tried (``grpc`` needs no setup); the preferred one is tried again after
        ``retry_after`` seconds."""
        if isinstance(peer, bytes | bytearray):
            peer = Endpoint.from_bytes(bytes(peer))
        with self._mu:
            cached = self._paths.get(peer.node_id)
            known = self._peers.get(peer.node_id)
            retry = time.monotonic() >= self._retry_at.get(peer.node_id, math.inf)
        if cached is not None and known == peer and self._ready(peer.node_id, cached) and not retry:
            return cached
        if known is not None and known != peer:
            self.close(peer.node_id)  # the peer restarted or moved: its old pool/group is gone
        allowed = list(self.allowed)
        failed = False
        while True:
            path = choose_path(self._endpoint, peer, allowed)
            try:
                if path == IPC:
                    assert self._ipc is not None and peer.ipc_handle is not None
                    self._ipc.connect(peer.node_id, peer.ipc_handle)
                elif path == DIST:
                    assert self._dist is not None and peer.dist is not None
                    self._dist.connect(peer.node_id, peer.dist)
                elif path == TCP:
                    assert self._tcp is not None and peer.tcp is not None
                    self._tcp.connect(peer.node_id, peer.tcp)
                break
            except Exception as exc:
                logger.warning("transfer: %s path to %s unavailable: %s", path, peer.node_id, exc)
                allowed.remove(path)
                failed = True
        if known != peer:  # once per peer (and again if it restarted)
            why = why_not_ipc(self._endpoint, peer) if path != IPC else None
            logger.info(
                "transfer to %s (host %s): %s%s",
                peer.node_id,
                peer.hostname,
                path,
                f"; not ipc: {why}" if why else "",
            )
        with self._mu:
            self._paths[peer.node_id] = path
            self._peers[peer.node_id] = peer
            if failed:
                self._retry_at[peer.node_id] = time.monotonic() + self.retry_after
            else:
                self._retry_at.pop(peer.node_id, None)
        return path

    def _ready(self, peer_id: str, path: str) -> bool:
        if path == IPC:
            return self._ipc is not None and self._ipc.connected(peer_id)
        if path == DIST:
            return self._dist is not None and self._dist.connected(peer_id)
        if path == TCP:
            return self._tcp is not None and self._tcp.connected(peer_id)
        return True

    def send(self, ticket: Ticket | bytes, src_block_ids, *, timeout: float) -> int:
        """Fill the receiver's reservation described by ``ticket`` with our blocks
        ``src_block_ids`` (pairwise with ``ticket.block_ids``); returns the bytes moved.
        ipc: returns once the copy into the peer's pool has finished on the GPU; dist: once the
        data has been sent (the receiver's ``receive`` returns when it is in its pool). Only
        then tell the receiver the transfer is done."""
        if isinstance(ticket, bytes | bytearray):
            ticket = Ticket.from_bytes(bytes(ticket))
        if ticket.sender_id != self.node_id:
            raise ValueError(f"ticket is for sender {ticket.sender_id!r}, not {self.node_id!r}")
        if ticket.path == IPC:
            if self._ipc is None or not self._ipc.connected(ticket.receiver_id):
                raise NotConnected(f"no ipc mapping of {ticket.receiver_id!r}: connect first")
            return self._ipc.write(ticket.receiver_id, src_block_ids, ticket.block_ids)
        if ticket.path == DIST:
            if self._dist is None:
                raise NotConnected("this node cannot use the dist path")
            return self._dist.send(ticket.receiver_id, src_block_ids, ticket, timeout)
        if ticket.path == TCP:
            if self._tcp is None:
                raise NotConnected("this node may not use the tcp path")
            return self._tcp.send(ticket.receiver_id, src_block_ids, ticket, timeout)
        raise ValueError(f"path {ticket.path!r} is not sent through this layer")

    def close(self, peer_id: str) -> None:
        """The receiver ``peer_id`` left: drop its mapping / pair group."""
        with self._mu:
            self._paths.pop(peer_id, None)
            self._peers.pop(peer_id, None)
            self._retry_at.pop(peer_id, None)
        if self._ipc is not None:
            self._ipc.close(peer_id)
        if self._dist is not None:
            self._dist.close(peer_id)
        if self._tcp is not None:
            self._tcp.close(peer_id)

    def close_all(self) -> None:
        with self._mu:
            peers = list(self._paths)
        for peer in peers:
            self.close(peer)
