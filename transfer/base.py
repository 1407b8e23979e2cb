"""The transfer layer's interface: one ``KVReceiver`` and one ``KVSender``, which every path
implements and every caller uses.

A *path* moves KV blocks from a sender's pool into blocks a receiver reserved. Each path is one
module that declares a ``TransferPath`` (its name, when it reaches a peer, how to open its two
sides): ``ipc``, ``dist``, ``tcp`` and ``grpc_bytes`` (the byte path). ``chooser.py`` lists them
in order of preference and is the one place that picks a path; ``api.py`` puts a node's paths
behind one receiver and one sender (``NodeReceiver``, ``NodeSender``) that implement these same
interfaces, so a caller never knows which path a transfer takes. docs/transfer.md shows what a
new path implements.

One transfer, whatever the path (receiver R, sender S)::

    R  res = rx.reserve(sender_id, block_ids, path)  # before S sends anything ("" : bytes)
    R  res.ticket.to_bytes()  → S                    # unless res.caller_writes
    S  tx.send(ticket, src_block_ids, timeout=...)   # unless the caller carries the bytes, and
    R  rx.write(res, ids, data)                      #   R writes each message that arrives
    R  rx.receive(res, timeout)                      # if res.receive_first: before S's end
    S  its end message  → R                          # (the services': TransferEnd, an answer)
    R  rx.finish(res)   or  rx.finish(res, count)    # done, or it raises and the res failed
    R  on any failure: grace = rx.cancel(res); free the blocks after ``grace`` seconds

The reservation's ``state`` is the transfer's one status: ``reserved``, then exactly once
``done``, ``failed`` or ``cancelled`` (``ended``, ``result()``, ``wait(timeout)``); nothing of the
layer writes into its blocks after it ended (but see ``cancel``'s grace). Failures are
``TransferError``s (``errors.py``). Every call may block; from asyncio, run in a thread those
that wait (``send``, ``connect``, ``receive`` where ``receive_first``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from splitserve.transfer.endpoint import Endpoint, local_endpoint
from splitserve.transfer.errors import NotConnected
from splitserve.transfer.reservation import DONE, Reservation, Ticket
from splitserve.transfer.security import KVSecurity

BlockIds = Sequence[int] | torch.Tensor
# Writes raw whole-heads block bytes into block ids (``Reservation.write``'s ``writer``).
BlockWriter = Callable[[list[int], bytes], None]


class KVReceiver(ABC):
    """The receiving side of a node (a decode node; a prefill node for peers' prefix fetches):
    reserves blocks of its pool for a sender and sees the transfer into them to its end."""

    kv_pool: torch.Tensor  # (num_blocks, layers, 2, block_size, kv_heads, head_dim)
    node_id: str

    @property
    @abstractmethod
    def paths(self) -> tuple[str, ...]:
        """The paths whose blocks the layer moves into this receiver (what it offers senders).
        The byte path is never among them: every receiver serves it, its blocks come through
        the caller (``write``)."""

    @abstractmethod
    def offer(self) -> dict[str, object]:
        """What senders need to reach this side, by path name: an exported pool, an address...
        (``Endpoint.offered``); empty for a receiver of the byte path only."""

    def endpoint(self) -> Endpoint:
        """What this node offers; send ``endpoint().to_bytes()`` to senders in the handshake."""
        return local_endpoint(self.node_id, self.kv_pool, offers=self.offer())

    @abstractmethod
    def reserve(self, peer_id: str, block_ids: BlockIds, path: str) -> Reservation:
        """Reserve destination ``block_ids`` (allocated, not registered) for a transfer from
        ``peer_id`` over ``path`` (the sender's choice; "" for the byte path). ``ValueError`` on
        an id out of range, the null block 0 or a repeat, or an unknown path; ``NotConnected``
        if this side cannot take ``path`` from that peer (the caller may reserve for the byte
        path instead). A reservation of no blocks is done at once."""

    def write(
        self,
        res: Reservation,
        block_ids: BlockIds,
        data: bytes | torch.Tensor,
        writer: BlockWriter | None = None,
    ) -> None:
        """``res.caller_writes``: write blocks that came in the caller's stream into reserved
        ids (``ValueError`` and no write for an id outside the reservation). ``writer``: see
        ``Reservation.write``."""
        raise ValueError(f"a {res.path} reservation takes no written blocks: its sender moves them")

    def receive(self, res: Reservation, timeout: float) -> None:
        """Wait until the blocks are in the pool, as far as this side can tell, or raise
        (``TransferTimeout`` after ``timeout`` seconds; the reservation then failed). Where
        ``res.receive_first`` this side takes the data in itself and the sender cannot finish
        unless it runs: call it before waiting for the sender's end. Paths whose data lands
        without it wait for that (tcp); where only the sender or the caller can tell (ipc, the
        byte path) it returns at once. ``finish`` is what ends a reservation as done."""
        if res.ended:
            res.result()

    @abstractmethod
    def finish(self, res: Reservation, count: int | None = None) -> None:
        """The sender said it finished: it filled every reserved block, or with ``count`` only
        the first ``count`` (a peer's prefix fetch: it held fewer; the rest stay unwritten).
        Ends the reservation as done, or raises: ``Incomplete`` where this side can tell the
        blocks are not all in (the reservation then failed), the reservation's own failure,
        ``ValueError`` for a ``count`` the path cannot fill."""

    def cancel(self, res: Reservation) -> float:
        """Abandon ``res`` (idempotent: an ended one only drops what the path keeps for it);
        afterwards nothing of this side writes into its blocks. Returns the seconds to wait
        before freeing them anyway: 0, or, where the sender writes into this pool itself and had
        not finished, a grace for the write it may still have queued (ipc)."""
        res.end_cancelled()
        return 0.0

    def peers(self) -> list[str]:
        """Senders this side keeps a channel for (paths with a pair per sender)."""
        return []

    def close(self, peer_id: str) -> None:
        """The sender ``peer_id`` left: drop what this side keeps for it."""
        return None  # a path that keeps nothing per sender

    def shutdown(self) -> None:
        """Stop serving (listeners, stores); outstanding reservations fail."""
        return None  # a path that serves nothing of its own


class SenderWritesReceiver(KVReceiver):
    """A receiver whose sender writes the reserved blocks into this pool itself (ipc, nixl): it
    takes the sender's word that they are in (``finish``), and a reservation cancelled before
    that waits ``free_grace_s`` before its blocks are freed (a write may still be queued)."""

    path_name: str
    free_grace_s: float

    def reserve(self, peer_id: str, block_ids: BlockIds, path: str = "") -> Reservation:
        check_path(path or self.path_name, self.path_name)
        res = Reservation(self.kv_pool, self.node_id, peer_id, self.path_name, block_ids)
        if not res.block_ids:
            res.end_done()
        return res

    def finish(self, res: Reservation, count: int | None = None) -> None:
        check_count(res, count)
        res.end_done()  # the sender's write was complete before it said it finished

    def cancel(self, res: Reservation) -> float:
        finished = res.state == DONE
        res.end_cancelled()
        return 0.0 if finished else self.free_grace_s


class KVSender(ABC):
    """The sending side of a node (a prefill node shipping to decode nodes; serving peers'
    prefix fetches): sets a path up per receiver and fills the receiver's reservations."""

    kv_pool: torch.Tensor
    node_id: str

    @property
    @abstractmethod
    def paths(self) -> tuple[str, ...]:
        """The paths whose blocks ``send`` moves. The byte path is never among them: its blocks
        travel in the caller's own stream."""

    def endpoint(self) -> Endpoint:
        """What this node tells receivers about itself (a sender offers nothing)."""
        return local_endpoint(self.node_id, self.kv_pool)

    @abstractmethod
    def connect(self, peer: Endpoint | bytes) -> str:
        """Set up the path to the receiver ``peer`` (map its pool, build the pair group, open a
        connection) unless it is set up; returns the path's name. Raises where it cannot (the
        ``NodeSender`` then tries the next path, the byte path last)."""

    @abstractmethod
    def path(self, peer_id: str) -> str | None:
        """The path set up to ``peer_id`` (None: not connected)."""

    @abstractmethod
    def send(self, ticket: Ticket | bytes, src_block_ids: BlockIds, *, timeout: float) -> int:
        """Fill the receiver's reservation described by ``ticket`` with our blocks
        ``src_block_ids`` (pairwise with ``ticket.block_ids``); returns the bytes moved, once
        they are moved as far as this side is concerned (ipc: the copy into the peer's pool
        finished; dist: the data left; tcp: every chunk was acknowledged). Only then tell the
        receiver the transfer is done. ``ValueError`` (nothing moved) on bad ids or a ticket
        that is not this sender's; ``TransferError``s on failure (``NotConnected``: connect)."""

    @property
    def layered_paths(self) -> tuple[str, ...]:
        """The paths whose ``send_part`` moves a layer range of blocks (a layer-wise stream)."""
        return ()

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
        """Layers ``[lo, hi)`` of our blocks ``src_block_ids`` into the reservation's positions
        ``first, first + 1, ...`` (one piece of a layer-wise stream: every (block, layer) of the
        reservation is sent exactly once; the receiver completes it when all are in). ``after``:
        a CUDA event the data is ready at (None: everything queued on the current stream).
        Returns the bytes moved, as ``send`` does. Only on ``layered_paths``."""
        raise NotImplementedError(f"{type(self).__name__} sends whole blocks only")

    @abstractmethod
    def close(self, peer_id: str) -> None:
        """The receiver ``peer_id`` left: drop what this side keeps for it."""

    @abstractmethod
    def close_all(self) -> None:
        """Drop every peer."""


@dataclass(frozen=True, slots=True)
class PathOptions:
    """How a node's paths are opened (one per node, built from its config)."""

    host: str | None = None  # where receivers listen: default this host's routable address
    dist_port: int = 0  # the dist rendezvous store's port (0: any free one)
    connect_timeout: float = 30.0  # building a dist pair group
    tcp_options: Mapping[str, Any] | None = None  # TcpSender's streams/chunk_bytes/connect_timeout
    # TLS on tcp, dist between nodes, the rendezvous key (default: none of them)
    security: KVSecurity = field(default_factory=KVSecurity)
    # rank 0 of a tensor-parallel engine: its other ranks (transfer.shards.RankLink)
    ranks: Any = None


@dataclass(frozen=True, slots=True)
class TransferPath:
    """One path, as the chooser sees it: its name (in tickets and headers), when it can carry
    blocks from a sender into a receiver (a pure function of their two ``Endpoint``s), how a
    process opens its two sides (None: the path cannot run here, e.g. no CUDA), and the rate a
    transfer over it is assumed to reach until one is measured (bytes/s; None: not measured
    anywhere — whoever needs one assumes the byte path's)."""

    name: str
    reaches: Callable[[Endpoint, Endpoint], bool]  # (sender, receiver)
    open_receiver: Callable[[torch.Tensor, str, PathOptions], KVReceiver | None]
    open_sender: Callable[[torch.Tensor, str, PathOptions], KVSender | None]
    rate_prior: float | None = None


def as_endpoint(peer: Endpoint | bytes) -> Endpoint:
    return Endpoint.from_bytes(bytes(peer)) if isinstance(peer, bytes | bytearray) else peer


def own_ticket(ticket: Ticket | bytes, sender_id: str, path: str | None = None) -> Ticket:
    """``ticket`` parsed, checked to be for ``sender_id`` (and over ``path``): ``ValueError``."""
    if isinstance(ticket, bytes | bytearray):
        ticket = Ticket.from_bytes(bytes(ticket))
    if ticket.sender_id != sender_id:
        raise ValueError(f"ticket is for sender {ticket.sender_id!r}, not {sender_id!r}")
    if path is not None and ticket.path != path:
        raise ValueError(f"not a {path} ticket: {ticket.path!r}")
    return ticket


def check_path(path: str, mine: str) -> None:
    """A single path's side asked to take ``path``: ``NotConnected`` unless it is ``mine``."""
    if path != mine:
        raise NotConnected(f"the {mine} path's receiver cannot take a {path or 'byte'} transfer")


def check_count(res: Reservation, count: int | None) -> int:
    """``finish``'s ``count``, or every block: ``ValueError`` outside ``[0, len]``."""
    n = len(res.block_ids) if count is None else count
    if not 0 <= n <= len(res.block_ids):
        raise ValueError(f"{count} blocks of a reservation of {len(res.block_ids)}")
    return n


def check_pool(kv_pool: torch.Tensor) -> None:
    if kv_pool.dim() != 6 or kv_pool.shape[2] != 2 or not kv_pool.is_contiguous():
        raise ValueError(
            "kv_pool must be a contiguous (num_blocks, layers, 2, block_size, kv_heads, "
            f"head_dim) tensor, got {tuple(kv_pool.shape)}"
        )
