"""The dist path's receiver (decode node) side: hosts the rendezvous store, accepts senders
(their hello, the layout check, the ack, the pair group) and receives transfers into
reservations. Protocol: ``transfer.dist``. With a ``rendezvous_key`` (the cluster has a token)
the store listens on loopback only, behind a ``gate.Gate`` on the advertised address.

Over 300 lines: the accepting and the receiving share the channel table and its locking, and
read best side by side."""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta

import msgpack
import torch

from splitserve.transfer.base import BlockIds, KVReceiver, PathOptions, check_count, check_path
from splitserve.transfer.dist.channel import (
    HEADER_LEN,
    MAGIC,
    TAG_DATA,
    TAG_HEADER,
    Channel,
    ChannelTable,
    DistReservation,
    device_guard,
    first_line,
)
from splitserve.transfer.dist.gate import Gate
from splitserve.transfer.dist.group import (
    KEY,
    POLL_S,
    default_host,
    logger,
    loopback_store,
    make_group,
    store_client,
)
from splitserve.transfer.endpoint import MAX_TP, DIST, DistAddress, available_backends, dtype_name
from splitserve.transfer.errors import (
    ChannelClosed,
    Incomplete,
    NotConnected,
    TransferError,
    TransferTimeout,
)
from splitserve.transfer.reservation import Reservation
from splitserve.transfer.shards import RankLink, ShardGroup, encode, receive_acks, receive_shards


class DistReceiver(ChannelTable, KVReceiver):
    """Receiver (decode node) side: hosts the rendezvous store, accepts senders, receives."""

    def __init__(
        self,
        kv_pool: torch.Tensor,
        node_id: str,
        *,
        host: str | None = None,
        port: int = 0,
        backend: str | None = None,
        connect_timeout: float = 30.0,
        rendezvous_key: bytes | None = None,
        ranks: RankLink | None = None,
    ) -> None:
        from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage] (not re-exported in the stubs)

        super().__init__(kv_pool, node_id, backend, connect_timeout, ranks)
        self.host = host or default_host()
        self._gate: Gate | None = None
        if rendezvous_key is None:
            self._store = TCPStore(
                self.host,
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=connect_timeout),
            )
            self.port = int(self._store.port)
            self.store_address = (self.host, self.port)  # where the store listens
        else:
            self._store, store_port = loopback_store(connect_timeout)
            self._gate = Gate(self.host, port, rendezvous_key, store_port)
            self.port = self._gate.port
            self.store_address = ("127.0.0.1", store_port)  # loopback only
        self._stop = threading.Event()
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"kv-accept-{node_id}", daemon=True
        )
        self._acceptor.start()

    @classmethod
    def open(cls, kv_pool: torch.Tensor, node_id: str, options: PathOptions) -> DistReceiver | None:
        if not available_backends(kv_pool.device.type):
            return None
        return cls(
            kv_pool,
            node_id,
            host=options.host,
            port=options.dist_port,
            connect_timeout=options.connect_timeout,
            rendezvous_key=options.security.rendezvous_key,
            ranks=options.ranks,
        )

    @property
    def address(self) -> DistAddress:
        return DistAddress(self.host, self.port, self.backend, gated=self._gate is not None)

    @property
    def paths(self) -> tuple[str, ...]:
        return (DIST,)

    def offer(self) -> dict[str, object]:
        return {DIST: self.address}

    def peers(self) -> list[str]:
        with self._mu:
            return [p for p, ch in self._channels.items() if ch.closed is None]

    # -------------------------------------------------------------- accepting senders

    def _accept_loop(self) -> None:
        try:
            client = store_client(*self.store_address, self.connect_timeout)
        except Exception:
            logger.exception("transfer: cannot reach our own rendezvous store")
            return
        n = 1
        stuck_since = None
        while not self._stop.is_set():
            key = f"{KEY}/join/{n}"
            try:
                if not client.check([key]):
                    # A sender that took number n and died before announcing itself must not
                    # block the ones after it.
                    if client.add(f"{KEY}/joins", 0) > n:
                        stuck_since = stuck_since or time.monotonic()
                        if time.monotonic() - stuck_since > self.connect_timeout:
                            n, stuck_since = n + 1, None
                    self._stop.wait(POLL_S)
                    continue
                hello = client.get(key)
                client.delete_key(key)
            except Exception:
                if self._stop.is_set():
                    break
                logger.exception("transfer: reading join %d", n)
                self._stop.wait(1.0)
                continue
            stuck_since = None
            threading.Thread(
                target=self._accept, args=(n, hello), name=f"kv-join-{n}", daemon=True
            ).start()
            n += 1

    def _refusal(self, hello: dict) -> str | None:
        """Why a sender announcing ``hello`` cannot pair with this node (None: it can). Blocks
        are compared whole (every KV head), whatever either side's tensor parallel size."""
        if hello["backend"] != self.backend:
            return f"backend {hello['backend']!r}, this node runs {self.backend!r}"
        if list(hello["block_shape"]) != self.whole_shape or hello["dtype"] != dtype_name(
            self.kv_pool.dtype
        ):
            return (
                f"block layout {hello['block_shape']} {hello['dtype']} differs from "
                f"{self.whole_shape} {dtype_name(self.kv_pool.dtype)}"
            )
        tp = hello.get("tp", 1)
        if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= MAX_TP:
            return f"tensor parallel size {tp!r} (1 to {MAX_TP})"
        try:
            ShardGroup(self.num_kv_heads, tp, self.tp).plan()
        except ValueError as exc:
            return str(exc)
        return None

    def _accept(self, n: int, hello_bytes: bytes) -> None:
        peer_id = "?"
        try:
            hello = msgpack.unpackb(hello_bytes, raw=False)
            peer_id = str(hello["node_id"])
            reason = self._refusal(hello)
            store = store_client(*self.store_address, self.connect_timeout)
            ack = {"ok": reason is None, "reason": reason}
            if self.tp > 1:
                ack["tp"] = self.tp
            store.set(f"{KEY}/ack/{n}", msgpack.packb(ack))
            if reason is not None:
                logger.warning("transfer: refused %s: %s", peer_id, reason)
                return
            from torch.distributed import PrefixStore  # pyright: ignore[reportPrivateImportUsage] (not re-exported in the stubs)

            layout = ShardGroup(self.num_kv_heads, int(hello.get("tp", 1)), self.tp)
            prefix = f"{KEY}/pair/{n}/"
            prefixed = PrefixStore(prefix, store)
            gid = f"rx/{self.node_id}/{n}"
            if self.ranks is not None and self.tp > 1:  # this engine's other ranks join too
                host, port = self.store_address
                self.ranks.command(
                    encode(
                        "join", gid=gid, role="rx", host=host, port=port, key=b"",
                        prefix=prefix, bind=self.host, backend=self.backend,
                        timeout=self.connect_timeout, num_kv_heads=self.num_kv_heads,
                        sender_tp=layout.sender_tp, receiver_tp=layout.receiver_tp,
                    ),
                    True,
                )  # fmt: skip
            with self._device_guard():
                group = make_group(
                    prefixed, 0, layout.size, self.backend, self.connect_timeout, host=self.host
                )
            channel = Channel(peer_id, n, 0, group, prefixed, self._wire_device(), self.backend)
            channel.layout, channel.ranks, channel.gid = layout, self.ranks, gid
            channel.peer = layout.sender(0)
            old = self._install(channel)
            if old is not None:
                old.close(ChannelClosed(f"{peer_id!r} connected again"))
            if self._stop.is_set():
                channel.close(ChannelClosed("receiver shut down"))
                return
            store.set(f"{KEY}/ready/{n}", b"1")
            logger.info("transfer: %s connected (%s, generation %d)", peer_id, self.backend, n)
        except Exception:
            logger.exception("transfer: accepting %s (join %d) failed", peer_id, n)

    def _wire_device(self) -> torch.device:
        return self.kv_pool.device

    def _device_guard(self) -> contextlib.AbstractContextManager:
        return device_guard(self.kv_pool)

    # -------------------------------------------------------------- transfers

    def reserve(self, peer_id: str, block_ids: BlockIds, path: str = DIST) -> Reservation:
        """Reserve destination ``block_ids`` for the next transfer from ``peer_id``.
        ``ValueError`` on bad ids; ``NotConnected`` if the peer has no open channel."""
        check_path(path, DIST)
        channel = self.channel(peer_id)
        if channel is None or channel.closed is not None:
            raise NotConnected(f"no open dist channel from {peer_id!r}")
        with channel.mu:
            seq = channel.next_seq
            channel.next_seq += 1
        res = DistReservation(self.kv_pool, self.node_id, channel, block_ids, seq)
        if not res.block_ids:
            res.end_done()
            return res
        with channel.mu:
            if channel.closed is not None:
                raise NotConnected(f"dist channel from {peer_id!r} closed: {channel.closed}")
            channel.outstanding[seq] = res
        return res

    def receive(self, res: Reservation, timeout: float) -> None:
        """Block until the sender's blocks are in the reserved ids (on CUDA: the copy has
        finished), or raise: ``TransferTimeout`` past ``timeout`` seconds, ``PeerLost`` /
        ``ChannelClosed`` if the pair broke, ``TransferError`` otherwise. On any error nothing
        was written and the reservation has ended (its blocks may be freed)."""
        if not isinstance(res, DistReservation):
            raise ValueError(f"{res!r} is not a dist reservation")
        channel = res.channel
        deadline = time.monotonic() + timeout
        while not res.ended:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._expire(channel, res)
                break
            if not channel.lock.acquire(timeout=min(remaining, POLL_S)):
                continue
            try:
                if res.ended:
                    break
                if channel.closed is not None:
                    res.end_failed(ChannelClosed(f"channel to {res.peer_id!r}: {channel.closed}"))
                    break
                self._receive_turn(channel, res, deadline)
            finally:
                channel.release()
        res.result()

    def _receive_turn(self, channel: Channel, res: Reservation, deadline: float) -> None:
        """One turn holding ``channel.lock``: receive the next transfer; a failure ends ``res``
        and the channel (a pair that broke mid-transfer cannot be resynchronized)."""
        try:
            with self._device_guard():
                self._receive_one(channel, deadline)
        except Exception as exc:
            error = (
                exc
                if isinstance(exc, TransferError)
                else TransferError(f"receiving from {res.peer_id!r}: {first_line(exc)}")
            )
            res.end_failed(error)
            channel.close(error)
            self._forget(channel)

    def _receive_one(self, channel: Channel, deadline: float) -> None:
        """Receive the next transfer on ``channel`` and fill the reservation it names."""
        if not channel.pair:
            self._receive_shards(channel, deadline)
            return
        pool = self.kv_pool
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=channel.device)
        channel.run("recv", header, TAG_HEADER, deadline, "receiving a header")
        magic, gen, seq, n, numel, esize = (int(x) for x in header.tolist())
        if (magic, gen, numel, esize) != (MAGIC, channel.gen, pool[0].numel(), pool.element_size()):
            raise TransferError(
                f"bad transfer header from {channel.peer_id!r}: {[magic, gen, seq, n, numel]}"
            )
        if not 0 < n < pool.shape[0]:
            raise TransferError(f"bad block count {n} in a header from {channel.peer_id!r}")
        staging = torch.empty((n, *pool.shape[1:]), dtype=pool.dtype, device=channel.device)
        channel.run("recv", staging, TAG_DATA, deadline, "receiving blocks")
        with channel.mu:
            res = channel.outstanding.pop(seq, None)
        if res is None:
            logger.info("transfer: dropped %d blocks of ended seq %d from %s", n, seq, channel)
            return
        if n != len(res.block_ids):
            res.end_failed(
                TransferError(f"{channel.peer_id!r} sent {n} blocks for {len(res.block_ids)}")
            )
            return
        try:
            res.fill(staging)
        except Exception as exc:
            res.end_failed(TransferError(f"writing received blocks failed: {exc}"))

    def _receive_shards(self, channel: Channel, deadline: float) -> None:
        """The next transfer of a group of tensor-parallel ranks (``transfer.shards``): the
        header from the sender's rank 0, then every receiver rank its pieces; the reservation is
        held (``fill_in_place``) from before this engine's other ranks write until they all
        said they did, so nothing writes into blocks a cancel has freed."""
        layout, pool = channel.layout, self.kv_pool
        assert layout is not None
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=channel.device)
        channel.run("recv", header, TAG_HEADER, deadline, "receiving a header")
        magic, gen, seq, n, numel, esize = (int(x) for x in header.tolist())
        if (magic, gen, numel, esize) != (MAGIC, channel.gen, self.whole_numel, pool.element_size()):
            raise TransferError(
                f"bad transfer header from {channel.peer_id!r}: {[magic, gen, seq, n, numel]}"
            )
        if not 0 < n < pool.shape[0]:
            raise TransferError(f"bad block count {n} in a header from {channel.peer_id!r}")
        with channel.mu:
            res = channel.outstanding.pop(seq, None)
        if res is not None and n != len(res.block_ids):
            res.end_failed(
                TransferError(f"{channel.peer_id!r} sent {n} blocks for {len(res.block_ids)}")
            )
            res = None
        others = [layout.receiver(r) for r in range(1, layout.receiver_tp)]

        def run(ids: list[int], keep: bool) -> None:
            left = max(deadline - time.monotonic(), 0.001)
            if others and channel.ranks is not None:
                message = encode("recv", gid=channel.gid, ids=ids, keep=keep, timeout=left)
                channel.ranks.command(message, True)
            try:
                receive_shards(
                    channel.group, layout, 0, pool, ids, tag=TAG_DATA, timeout_s=left, write=keep
                )
            finally:  # their word, whatever became of this rank's pieces
                receive_acks(
                    channel.group, others, max(deadline - time.monotonic(), 0.001), channel.device
                )

        if res is None or not res.fill_in_place(lambda: run(list(res.block_ids), True)):
            logger.info("transfer: dropping %d blocks of ended seq %d from %s", n, seq, channel)
            run(list(range(1, n + 1)), False)  # received to keep the group in step

    def _expire(self, channel: Channel, res: Reservation) -> None:
        with channel.mu:
            channel.outstanding.pop(res.ticket.seq, None)
        res.end_failed(TransferTimeout(f"no blocks from {res.peer_id!r} within the deadline"))

    def finish(self, res: Reservation, count: int | None = None) -> None:
        """The data ended the reservation in ``receive`` (else the sender finished before it was
        received: ``Incomplete``); a dist sender fills whole reservations only."""
        if check_count(res, count) != len(res.block_ids):
            raise ValueError("the dist path fills whole reservations, not a prefix")
        if not res.ended and isinstance(res, DistReservation):
            self._forget_reservation(res)  # its data, if it comes, is dropped
            res.end_failed(Incomplete("the sender finished before its blocks were received"))
        res.result()

    def cancel(self, res: Reservation) -> float:
        """Abandon a reservation; after this returns nothing writes into it."""
        if isinstance(res, DistReservation):
            self._forget_reservation(res)
        res.end_cancelled()
        return 0.0

    def _forget_reservation(self, res: DistReservation) -> None:
        with res.channel.mu:
            res.channel.outstanding.pop(res.ticket.seq, None)

    def shutdown(self) -> None:
        self._stop.set()
        if self._gate is not None:
            self._gate.shutdown()
        self._acceptor.join(timeout=2.0)
        with self._mu:
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:
            channel.close(ChannelClosed("receiver shut down"))
        self._store = None
