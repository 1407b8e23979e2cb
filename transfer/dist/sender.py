"""The dist path's sender (prefill node) side: joins a receiver's rendezvous store on demand,
builds the pair group and sends header + blocks. Protocol: ``transfer.dist``. A receiver whose
store is gated (the cluster has a token) is joined through ``gate.open_tunnel``."""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta

import msgpack
import torch

from splitserve.kernels.layout import indexable
from splitserve.transfer.base import BlockIds, KVSender, PathOptions, as_endpoint, own_ticket
from splitserve.transfer.dist.channel import (
    MAGIC,
    TAG_DATA,
    TAG_HEADER,
    Channel,
    ChannelTable,
    device_guard,
    first_line,
    header,
)
from splitserve.transfer.dist.gate import open_tunnel
from splitserve.transfer.dist.group import (
    KEY,
    local_address_towards,
    make_group,
    store_client,
)
from splitserve.transfer.endpoint import (
    DIST,
    MAX_TP,
    DistAddress,
    Endpoint,
    available_backends,
    dtype_name,
)
from splitserve.transfer.errors import (
    ChannelClosed,
    NotConnected,
    PeerLost,
    TransferError,
    TransferTimeout,
)
from splitserve.transfer.reservation import Ticket, check_source_ids
from splitserve.transfer.shards import RankLink, ShardGroup, encode, receive_acks, send_shards


class DistSender(ChannelTable, KVSender):
    """Sender (prefill node) side: connects to receivers on demand and sends blocks."""

    def __init__(
        self,
        kv_pool: torch.Tensor,
        node_id: str,
        *,
        backend: str | None = None,
        connect_timeout: float = 30.0,
        rendezvous_key: bytes | None = None,
        ranks: RankLink | None = None,
    ) -> None:
        super().__init__(kv_pool, node_id, backend, connect_timeout, ranks)
        self._key = rendezvous_key
        self._connecting: dict[str, threading.Lock] = {}

    @classmethod
    def open(cls, kv_pool: torch.Tensor, node_id: str, options: PathOptions) -> DistSender | None:
        if not available_backends(kv_pool.device.type):
            return None
        key = options.security.rendezvous_key
        return cls(
            kv_pool,
            node_id,
            connect_timeout=options.connect_timeout,
            rendezvous_key=key,
            ranks=options.ranks,
        )

    @property
    def paths(self) -> tuple[str, ...]:
        return (DIST,)

    def path(self, peer_id: str) -> str | None:
        channel = self.channel(peer_id)
        return DIST if channel is not None and channel.closed is None else None

    def connect(self, peer: Endpoint | bytes) -> str:
        """Build the pair group with the receiver ``peer`` unless one is open."""
        peer = as_endpoint(peer)
        if peer.dist is None:
            raise NotConnected(f"{peer.node_id!r} offers no dist address")
        self._connect(peer.node_id, peer.dist)
        return DIST

    def _connect(self, peer_id: str, address: DistAddress) -> None:
        if address.backend != self.backend:
            raise ValueError(f"receiver runs {address.backend!r}, this sender {self.backend!r}")
        if address.gated != (self._key is not None):
            why = "requires" if address.gated else "does not take"
            raise NotConnected(
                f"{peer_id!r}'s rendezvous {why} the cluster token, which this node "
                f"{'lacks' if address.gated else 'has'} (give every node the same "
                "--auth-token-file)"
            )
        with self._mu:
            lock = self._connecting.setdefault(peer_id, threading.Lock())
        with lock:
            if self.path(peer_id) is not None:
                return
            try:
                channel = self._open(peer_id, address)
            except TransferError:
                raise
            except Exception as exc:
                raise PeerLost(
                    f"connecting to {peer_id!r} at {address.host}:{address.port}: {first_line(exc)}"
                ) from exc
            old = self._install(channel)
            if old is not None:
                old.close(ChannelClosed("reconnected"))

    def _open(self, peer_id: str, address: DistAddress) -> Channel:
        from torch.distributed import PrefixStore  # pyright: ignore[reportPrivateImportUsage] (not re-exported in the stubs)

        timeout = timedelta(seconds=self.connect_timeout)
        if self._key is None:
            store = store_client(address.host, address.port, self.connect_timeout)
        else:
            tunnel = open_tunnel(address.host, address.port, self._key, self.connect_timeout)
            store = store_client("127.0.0.1", tunnel, self.connect_timeout)
        n = int(store.add(f"{KEY}/joins", 1))
        hello = {
            "node_id": self.node_id,
            "backend": self.backend,
            "block_shape": self.whole_shape,  # every KV head, whatever this engine's TP
            "dtype": dtype_name(self.kv_pool.dtype),
        }
        if self.tp > 1:
            hello["tp"] = self.tp
        store.set(f"{KEY}/join/{n}", msgpack.packb(hello))
        store.wait([f"{KEY}/ack/{n}"], timeout)
        ack = msgpack.unpackb(store.get(f"{KEY}/ack/{n}"), raw=False)
        store.delete_key(f"{KEY}/ack/{n}")
        if not ack["ok"]:
            raise TransferError(f"{peer_id!r} refused the connection: {ack['reason']}")
        receiver_tp = ack.get("tp", 1)
        bad = not isinstance(receiver_tp, int) or isinstance(receiver_tp, bool)
        if bad or not 1 <= receiver_tp <= MAX_TP:
            raise TransferError(f"{peer_id!r} acknowledged with a bad tensor parallel size")
        layout = ShardGroup(self.num_kv_heads, self.tp, receiver_tp)
        layout.plan()  # (the receiver checked it too)
        prefix = f"{KEY}/pair/{n}/"
        prefixed = PrefixStore(prefix, store)
        host = local_address_towards(address.host, address.port)
        gid = f"tx/{self.node_id}/{peer_id}/{n}"
        if self.ranks is not None and self.tp > 1:  # this engine's other ranks join too
            self.ranks.command(
                encode(
                    "join", gid=gid, role="tx", host=address.host, port=address.port,
                    key=self._key or b"", prefix=prefix, bind=host, backend=self.backend,
                    timeout=self.connect_timeout, num_kv_heads=self.num_kv_heads,
                    sender_tp=self.tp, receiver_tp=receiver_tp,
                ),
                True,
            )  # fmt: skip
        me = layout.sender(0)
        with self._device_guard():
            group = make_group(prefixed, me, layout.size, self.backend, self.connect_timeout, host)
        store.wait([f"{KEY}/ready/{n}"], timeout)
        store.delete_key(f"{KEY}/ready/{n}")
        channel = Channel(peer_id, n, me, group, prefixed, self.kv_pool.device, self.backend)
        channel.layout, channel.ranks, channel.gid = layout, self.ranks, gid
        channel.peer = layout.receiver(0)
        return channel

    def _device_guard(self) -> contextlib.AbstractContextManager:
        return device_guard(self.kv_pool)

    def send(self, ticket: Ticket | bytes, src_block_ids: BlockIds, *, timeout: float) -> int:
        """Send our blocks ``src_block_ids`` (one per id of the ticket, in its order) to fill the
        receiver's reservation; returns the bytes sent. Returns once the data has left (the
        receiver signals its own completion). On failure the pair is torn down and the error
        raised (``TransferTimeout``, ``PeerLost``, ``ChannelClosed``); reconnect to retry."""
        ticket = own_ticket(ticket, self.node_id, DIST)
        channel = self.channel(ticket.receiver_id)
        if channel is None:
            raise NotConnected(f"no dist channel to {ticket.receiver_id!r}")
        channel.check_open()
        if ticket.gen != channel.gen:
            raise ChannelClosed(
                f"ticket for generation {ticket.gen} of the pair, which is now {channel.gen}"
            )
        src = check_source_ids(src_block_ids, self.kv_pool.shape[0])
        if len(src) != len(ticket.block_ids):
            raise ValueError(f"{len(src)} source blocks for {len(ticket.block_ids)} reserved")
        if not src:
            return 0
        deadline = time.monotonic() + timeout
        if channel.pair:
            self._send_blocks(channel, src, ticket.seq, deadline)
        else:
            self._send_shards(channel, src, ticket.seq, deadline)
        return len(src) * self.whole_numel * self.kv_pool.element_size()

    def _send_shards(self, channel: Channel, src: list[int], seq: int, deadline: float) -> None:
        """One transfer of a group of tensor-parallel ranks (``transfer.shards``): the header to
        the receiver's rank 0, then every sender rank its pieces; done once every rank of this
        engine said it sent its own. A failure tears the group down."""
        layout = channel.layout
        assert layout is not None
        values = [MAGIC, channel.gen, seq, len(src), self.whole_numel, self.kv_pool.element_size()]
        head = torch.tensor(values, dtype=torch.int64, device=channel.device)
        others = [layout.sender(s) for s in range(1, layout.sender_tp)]
        if not channel.lock.acquire(timeout=max(deadline - time.monotonic(), 0)):
            raise TransferTimeout(f"the channel to {channel.peer_id!r} stayed busy")
        try:
            channel.check_open()
            try:
                with self._device_guard():
                    channel.run("send", head, TAG_HEADER, deadline, "sending a header")
                    left = max(deadline - time.monotonic(), 0.001)
                    if others and channel.ranks is not None:
                        message = encode("send", gid=channel.gid, ids=src, timeout=left)
                        channel.ranks.command(message, True)
                    try:
                        send_shards(channel.group, layout, 0, self.kv_pool, src, TAG_DATA, left)
                    finally:
                        receive_acks(
                            channel.group, others, max(deadline - time.monotonic(), 0.001), channel.device
                        )
            except Exception as exc:
                error = exc if isinstance(exc, TransferError) else PeerLost(first_line(exc))
                channel.close(error)
                self._forget(channel)
                raise error from exc
        finally:
            channel.release()

    def _send_blocks(self, channel: Channel, src: list[int], seq: int, deadline: float) -> None:
        """Gather ``src`` and send header + blocks as one turn on ``channel``; a failure tears
        the pair down (the receiver cannot resynchronize a half-sent transfer)."""
        with self._device_guard():
            index = torch.tensor(src, dtype=torch.int64, device=self.kv_pool.device)
            buffer = indexable(self.kv_pool).index_select(0, index).view(self.kv_pool.dtype)
            head = header(channel.gen, seq, len(src), self.kv_pool, channel.device)
            if not channel.lock.acquire(timeout=max(deadline - time.monotonic(), 0)):
                raise TransferTimeout(f"the channel to {channel.peer_id!r} stayed busy")
            try:
                channel.check_open()
                try:
                    channel.run("send", head, TAG_HEADER, deadline, "sending a header")
                    channel.run("send", buffer, TAG_DATA, deadline, "sending blocks")
                except TransferError as exc:
                    channel.close(exc)
                    self._forget(channel)
                    raise
            finally:
                channel.release()

    def close_all(self) -> None:
        with self._mu:
            peers = list(self._channels)
        for peer in peers:
            self.close(peer)
