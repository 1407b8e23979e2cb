"""The dist path's channel (one pair's group on one side) and its framing: a transfer is a
header tensor then the data tensor, on two tags. Protocol: ``transfer.dist``."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from splitserve.transfer.dist.group import check_backend, default_backend, prepare_backend
from splitserve.transfer.endpoint import DIST
from splitserve.transfer.errors import ChannelClosed, PeerLost, TransferError, TransferTimeout
from splitserve.transfer.reservation import Reservation
from splitserve.transfer.shards import RankLink, ShardGroup, encode

MAGIC = 0x53504B56  # "SPKV"
HEADER_LEN = 6  # magic, gen, seq, n blocks, elements per block, element size
TAG_HEADER = 0
TAG_DATA = 1


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def header(
    gen: int, seq: int, n: int, kv_pool: torch.Tensor, device: torch.device | str
) -> torch.Tensor:
    """The header announcing ``n`` blocks of ``kv_pool`` for reservation ``seq`` of ``gen``."""
    values = [MAGIC, gen, seq, n, kv_pool[0].numel(), kv_pool.element_size()]
    return torch.tensor(values, dtype=torch.int64, device=device)


def device_guard(kv_pool: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make the pool's GPU current for group construction and ops (no-op on CPU)."""
    if kv_pool.device.type == "cuda":
        return torch.cuda.device(kv_pool.device)
    return contextlib.nullcontext()


class Channel:
    """One pair's group on one side. ``lock`` serializes a transfer's ops (header, data);
    ``mu`` guards the bookkeeping. Closed once, by the first failure or ``close``; the group is
    destroyed by whoever holds ``lock`` then (never under a thread blocked in an op)."""

    def __init__(
        self,
        peer_id: str,
        gen: int,
        rank: int,
        group: Any,  # ProcessGroupGloo | ProcessGroupNCCL
        store: Any,  # the pair's PrefixStore
        device: torch.device,
        backend: str,
    ) -> None:
        self.peer_id = peer_id
        self.gen = gen
        self.rank = rank
        self.group = group
        self.store = store
        self.device = device
        self.backend = backend
        self.lock = threading.Lock()
        self.mu = threading.Lock()
        self.outstanding: dict[int, DistReservation] = {}
        self.next_seq = 0
        self.closed: TransferError | None = None
        # A group of both nodes' tensor-parallel ranks (transfer.shards) rather than a pair:
        # its layout, this side's engine's other ranks, and the group's name among them.
        self.layout: ShardGroup | None = None
        self.ranks: RankLink | None = None
        self.gid = ""
        self.peer = 1 - rank  # the other side's leader: the pair's other rank, or 0 / d

    @property
    def pair(self) -> bool:
        """A pair of single-rank engines: header, then whole blocks."""
        return self.layout is None or self.layout.size == 2

    def __repr__(self) -> str:
        return f"<channel to {self.peer_id!r} gen {self.gen}>"

    def post(self, op: str, tensor: torch.Tensor, tag: int) -> Any:
        """Post one send/recv to the peer; its ``Work``."""
        group, peer = self.group, self.peer
        if group is None:
            raise ChannelClosed(f"channel to {self.peer_id!r} is closed: {self.closed}")
        if op == "send":
            return group.send([tensor], peer, tag)
        return group.recv([tensor], peer, tag)

    def run(self, op: str, tensor: torch.Tensor, tag: int, deadline: float, what: str) -> None:
        """Post one send/recv and wait for it until ``deadline``; failures become
        ``TransferTimeout`` (deadline passed) or ``PeerLost`` (anything else)."""
        try:
            work = self.post(op, tensor, tag)
            work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except Exception as exc:
            if time.monotonic() >= deadline - 0.01 or "timed out" in str(exc).lower():
                raise TransferTimeout(
                    f"{what} with {self.peer_id!r}: no completion within the deadline"
                ) from exc
            raise PeerLost(f"{what} with {self.peer_id!r} failed: {first_line(exc)}") from exc

    def close(self, error: TransferError) -> None:
        """Fail every outstanding reservation and tear the group down (now if no op is in
        flight on this side, else when the op ends)."""
        with self.mu:
            if self.closed is not None:
                return
            self.closed = error
            pending = list(self.outstanding.values())
            self.outstanding.clear()
        for res in pending:
            res.end_failed(ChannelClosed(f"channel to {self.peer_id!r} closed: {error}"))
        if self.ranks is not None and self.ranks.tp > 1:  # this engine's other ranks leave too
            try:
                self.ranks.command(encode("leave", gid=self.gid), False)
            except Exception as exc:
                from splitserve.transfer.dist.group import logger

                logger.warning("telling the other ranks to leave %s: %s", self.gid, exc)
        if self.lock.acquire(blocking=False):
            self.release()

    def release(self) -> None:
        try:
            if self.closed is not None and self.group is not None:
                group, self.group = self.group, None
                if self.backend == "nccl":
                    with contextlib.suppress(Exception):
                        group.abort()
                del group
                self.store = None
        finally:
            self.lock.release()

    def check_open(self) -> None:
        if self.closed is not None:
            raise ChannelClosed(f"channel to {self.peer_id!r} is closed: {self.closed}")


class DistReservation(Reservation):
    """A dist reservation: the pair channel it was reserved on. The receiver takes its data in
    itself (``DistReceiver.receive``), and the sender's send completes only while it does."""

    receive_first = True

    def __init__(
        self,
        kv_pool: torch.Tensor,
        receiver_id: str,
        channel: Channel,
        block_ids: Sequence[int] | torch.Tensor,
        seq: int,
    ) -> None:
        super().__init__(
            kv_pool, receiver_id, channel.peer_id, DIST, block_ids, gen=channel.gen, seq=seq
        )
        self.channel = channel


class ChannelTable:
    """One side of the dist path: its pool, id and backend, and its open channels by peer id
    (``_channels``, guarded by ``_mu``). ``ranks``: this is rank 0 of a tensor-parallel engine
    (its pool holds its share of the KV heads; the other ranks take part through it)."""

    def __init__(
        self,
        kv_pool: torch.Tensor,
        node_id: str,
        backend: str | None,
        connect_timeout: float,
        ranks: RankLink | None = None,
    ) -> None:
        self.kv_pool = kv_pool
        self.ranks = ranks
        self.tp = ranks.tp if ranks is not None else 1
        self.num_kv_heads = ranks.num_kv_heads if ranks is not None else int(kv_pool.shape[4])
        # a whole block (every KV head), as the peers see it
        self.whole_shape = [*kv_pool.shape[1:4], self.num_kv_heads, kv_pool.shape[5]]
        self.whole_numel = int(torch.Size(self.whole_shape).numel())
        self.node_id = node_id
        self.backend = backend or default_backend(kv_pool.device)
        check_backend(self.backend, kv_pool)
        prepare_backend(self.backend)
        self.connect_timeout = connect_timeout
        self._channels: dict[str, Channel] = {}
        self._mu = threading.Lock()

    def channel(self, peer_id: str) -> Channel | None:
        """The open or closed channel of ``peer_id``, if any."""
        with self._mu:
            return self._channels.get(peer_id)

    def close(self, peer_id: str) -> None:
        """Tear down the pair with ``peer_id`` (it left); its reservations and sends fail."""
        with self._mu:
            channel = self._channels.pop(peer_id, None)
        if channel is not None:
            channel.close(ChannelClosed(f"{peer_id!r} closed by {self.node_id!r}"))

    def _forget(self, channel: Channel) -> None:
        with self._mu:
            if self._channels.get(channel.peer_id) is channel:
                del self._channels[channel.peer_id]

    def _install(self, channel: Channel) -> Channel | None:
        """Make ``channel`` the one of its peer; returns the one it replaced, if any."""
        with self._mu:
            old = self._channels.get(channel.peer_id)
            self._channels[channel.peer_id] = channel
        return old
