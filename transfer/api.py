"""A node's one receiver and one sender, over every path it opens: what callers hold.

Decode node (and a prefill node, for peers' prefix fetches)::

    rx = open_receiver(kv_pool, node_id, paths=..., host=...)  # CUDA: exports the pool, ...
    handshake bytes = rx.endpoint().to_bytes()                  # what senders choose a path from

Prefill node::

    tx = open_sender(kv_pool, node_id, paths=...)
    path = tx.connect(Endpoint.from_bytes(handshake))  # chosen and set up, cached per peer

Both implement ``base.KVReceiver`` / ``base.KVSender`` (one transfer: ``transfer.base``) by
handing each call to the part of the path it concerns, by name: the path itself is chosen in
``chooser.choose_path`` only.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Collection, Mapping
from typing import Any

import torch

from splitserve.transfer.base import (
    BlockIds,
    BlockWriter,
    KVReceiver,
    KVSender,
    PathOptions,
    as_endpoint,
    check_pool,
    own_ticket,
)
from splitserve.transfer.chooser import (
    DEFAULT_PATHS,
    PATHS,
    TP_PATHS,
    choose_path,
    open_receivers,
    open_senders,
    why_not_preferred,
)
from splitserve.transfer.endpoint import GRPC, Endpoint, local_endpoint
from splitserve.transfer.errors import NotConnected
from splitserve.transfer.reservation import Reservation, Ticket
from splitserve.transfer.security import KVSecurity
from splitserve.transfer.shards import RankLink

logger = logging.getLogger(__name__)


def open_receiver(
    kv_pool: torch.Tensor,
    node_id: str,
    *,
    paths: Collection[str] = DEFAULT_PATHS,
    host: str | None = None,
    dist_port: int = 0,
    connect_timeout: float = 30.0,
    security: KVSecurity | None = None,
    ranks: RankLink | None = None,
) -> NodeReceiver:
    """A receiver offering each of ``paths`` that can run here (ipc: a CUDA pool whose export
    works; dist: a backend for the pool's device) and always the byte path. ``host``: where the
    dist store and the tcp listener listen (default: this host's routable address; any free
    port, the dist store ``dist_port`` if given). ``security``: TLS on tcp, dist between nodes,
    the rendezvous key (``transfer.security``; default none). ``ranks``: ``kv_pool`` is rank 0's
    of a tensor-parallel engine (only dist and the byte path are opened then: ``TP_PATHS``)."""
    check_pool(kv_pool)
    options = PathOptions(
        host=host,
        dist_port=dist_port,
        connect_timeout=connect_timeout,
        security=security or KVSecurity(),
        ranks=ranks,
    )
    paths = _tp_paths(paths, ranks)
    parts = open_receivers(kv_pool, node_id, paths, options)
    return NodeReceiver(kv_pool, node_id, parts, ranks=ranks)


def _tp_paths(paths: Collection[str], ranks: RankLink | None) -> Collection[str]:
    if ranks is None or ranks.tp == 1:
        return paths
    return [p for p in paths if p in TP_PATHS]


def open_sender(
    kv_pool: torch.Tensor,
    node_id: str,
    *,
    paths: Collection[str] = DEFAULT_PATHS,
    connect_timeout: float = 30.0,
    retry_after: float = 60.0,
    tcp_options: Mapping | None = None,
    security: KVSecurity | None = None,
    ranks: RankLink | None = None,
) -> NodeSender:
    """A sender that may choose each of ``paths`` that can run here (the byte path always
    remains). ``connect_timeout`` bounds building a dist pair (``connect`` blocks that long at
    most); ``tcp_options``: the tcp sender's streams / chunk_bytes / connect_timeout;
    ``security``, ``ranks``: as ``open_receiver``'s."""
    check_pool(kv_pool)
    options = PathOptions(
        connect_timeout=connect_timeout,
        tcp_options=tcp_options,
        security=security or KVSecurity(),
        ranks=ranks,
    )
    parts = open_senders(kv_pool, node_id, _tp_paths(paths, ranks), options)
    return NodeSender(kv_pool, node_id, parts, retry_after=retry_after, ranks=ranks)


def _tp_of(ranks: RankLink | None) -> dict:
    """``local_endpoint``'s tensor-parallel arguments for rank 0 of an engine (none at TP 1)."""
    if ranks is None:
        return {}
    return {"tp": ranks.tp, "num_kv_heads": ranks.num_kv_heads}


class NodeReceiver(KVReceiver):
    """A node's receiving side: ``parts``, one receiver per path it offers by name (the byte
    path's among them)."""

    def __init__(
        self,
        kv_pool: torch.Tensor,
        node_id: str,
        parts: Mapping[str, KVReceiver],
        *,
        ranks: RankLink | None = None,
    ):
        if GRPC not in parts:
            raise ValueError("a node's receiver always serves the byte path")
        self.kv_pool, self.node_id = kv_pool, node_id
        self._parts = dict(parts)
        self._endpoint = local_endpoint(node_id, kv_pool, offers=self.offer(), **_tp_of(ranks))

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(p for part in self._parts.values() for p in part.paths)

    def offer(self) -> dict[str, object]:
        return {path: what for part in self._parts.values() for path, what in part.offer().items()}

    def endpoint(self) -> Endpoint:
        return self._endpoint

    def peers(self) -> list[str]:
        return [peer for part in self._parts.values() for peer in part.peers()]

    def reserve(self, peer_id: str, block_ids: BlockIds, path: str) -> Reservation:
        part = self._parts.get(path or GRPC)
        if part is None:
            if path in PATHS:
                raise NotConnected(f"this node does not offer the {path} path")
            raise ValueError(f"unknown path {path!r}")
        return part.reserve(peer_id, block_ids, path or GRPC)

    def _part(self, res: Reservation) -> KVReceiver:
        part = self._parts.get(res.path)
        if part is None:
            raise ValueError(f"{res!r} is not a reservation of this receiver")
        return part

    def write(
        self,
        res: Reservation,
        block_ids: BlockIds,
        data: bytes | torch.Tensor,
        writer: BlockWriter | None = None,
    ) -> None:
        self._part(res).write(res, block_ids, data, writer)

    def receive(self, res: Reservation, timeout: float) -> None:
        self._part(res).receive(res, timeout)

    def finish(self, res: Reservation, count: int | None = None) -> None:
        self._part(res).finish(res, count)

    def cancel(self, res: Reservation) -> float:
        return self._part(res).cancel(res)

    def close(self, peer_id: str) -> None:
        for part in self._parts.values():
            part.close(peer_id)

    def shutdown(self) -> None:
        for part in self._parts.values():
            part.shutdown()


class NodeSender(KVSender):
    """A node's sending side: ``parts``, one sender per path it may use by name (the byte
    path's among them). ``connect`` chooses a path per peer and sets it up; a path that fails
    to set up is logged and the next one tried (the byte path needs no setup), the preferred one
    again after ``retry_after`` seconds."""

    def __init__(
        self,
        kv_pool: torch.Tensor,
        node_id: str,
        parts: Mapping[str, KVSender],
        *,
        retry_after: float = 60.0,
        ranks: RankLink | None = None,
    ) -> None:
        if GRPC not in parts:
            raise ValueError("a node's sender always has the byte path")
        self.kv_pool, self.node_id = kv_pool, node_id
        self.retry_after = retry_after
        self._parts = dict(parts)
        self._endpoint = local_endpoint(node_id, kv_pool, **_tp_of(ranks))
        self._paths: dict[str, str] = {}
        self._peers: dict[str, Endpoint] = {}
        self._retry_at: dict[str, float] = {}  # peers whose preferred path failed to set up
        self._mu = threading.Lock()

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(p for part in self._parts.values() for p in part.paths)

    def endpoint(self) -> Endpoint:
        return self._endpoint

    def path(self, peer_id: str) -> str | None:
        with self._mu:
            return self._paths.get(peer_id)

    def connect(self, peer: Endpoint | bytes) -> str:
        """Choose the path to the receiver ``peer`` and set it up; cached per peer, so call it
        before every transfer. A peer whose endpoint changed (restarted) is set up afresh."""
        peer = as_endpoint(peer)
        with self._mu:
            cached = self._paths.get(peer.node_id)
            known = self._peers.get(peer.node_id)
            retry = time.monotonic() >= self._retry_at.get(peer.node_id, math.inf)
        if (
            cached is not None
            and known == peer
            and not retry
            and self._parts[cached].path(peer.node_id) is not None
        ):
            return cached
        if known is not None and known != peer:
            self.close(peer.node_id)  # the peer restarted or moved: its old pool/group is gone
        allowed = list(self._parts)
        failed = False
        while True:
            path = choose_path(self._endpoint, peer, allowed)
            try:
                self._parts[path].connect(peer)
                break
            except Exception as exc:
                logger.warning("transfer: %s path to %s unavailable: %s", path, peer.node_id, exc)
                allowed.remove(path)
                failed = True
        if known != peer:  # once per peer (and again if it restarted)
            why = why_not_preferred(self._endpoint, peer, path)
            logger.info(
                "transfer to %s (host %s): %s%s",
                peer.node_id,
                peer.hostname,
                path,
                f"; {why}" if why else "",
            )
        with self._mu:
            self._paths[peer.node_id] = path
            self._peers[peer.node_id] = peer
            if failed:
                self._retry_at[peer.node_id] = time.monotonic() + self.retry_after
            else:
                self._retry_at.pop(peer.node_id, None)
        return path

    def send(self, ticket: Ticket | bytes, src_block_ids: BlockIds, *, timeout: float) -> int:
        ticket = own_ticket(ticket, self.node_id)
        part = self._parts.get(ticket.path)
        if part is None:
            if ticket.path in PATHS:
                raise NotConnected(f"this node may not use the {ticket.path} path")
            raise ValueError(f"path {ticket.path!r} is not sent through this layer")
        return part.send(ticket, src_block_ids, timeout=timeout)

    @property
    def layered_paths(self) -> tuple[str, ...]:
        return tuple(p for part in self._parts.values() for p in part.layered_paths)

    def send_part(
        self,
        ticket: Ticket | bytes,
        first: int,
        src_block_ids: BlockIds,
        layers: tuple[int, int],
        *,
        timeout: float,
        after: Any = None,
    ) -> int:
        ticket = own_ticket(ticket, self.node_id)
        part = self._parts.get(ticket.path)
        if part is None or ticket.path not in part.layered_paths:
            raise ValueError(f"the {ticket.path} path does not stream layer by layer here")
        return part.send_part(ticket, first, src_block_ids, layers, timeout=timeout, after=after)

    def close(self, peer_id: str) -> None:
        """The receiver ``peer_id`` left: drop its mapping / pair group / connections."""
        with self._mu:
            self._paths.pop(peer_id, None)
            self._peers.pop(peer_id, None)
            self._retry_at.pop(peer_id, None)
        for part in self._parts.values():
            part.close(peer_id)

    def close_all(self) -> None:
        with self._mu:
            peers = list(self._paths)
        for peer in peers:
            self.close(peer)
