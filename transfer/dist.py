"""Cross-host path: torch.distributed point-to-point in a two-rank group per (receiver, sender).

No global world: every pair gets its own group, built directly from a ``(store, rank, size=2)``
triple (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on CUDA), on demand, and torn down by
``close(peer)`` or the first failure. Nothing calls ``init_process_group``.

Rendezvous. The receiver (decode node) hosts a ``TCPStore`` and advertises its address. A sender
(prefill node) connects as a store client, takes a join number ``n`` (``add``), announces itself
under ``join/n`` (node id, backend, block layout) and waits for ``ack/n``; the receiver's accept
thread checks the layout, acks, and both sides construct the group on ``PrefixStore("pair/n/")``,
receiver rank 0, sender rank 1. The receiver registers the pair's channel, then sets ``ready/n``;
``connect`` returns after it. ``n`` is the channel's generation: a sender that reconnects gets a
new one, which replaces (and fails) the old channel on both sides.

One transfer. The receiver reserves destination ids (``reserve``: a ``Reservation`` whose ticket
carries ``(gen, seq, block ids)``); the sender gathers its source blocks into one buffer and
sends a header ``[magic, gen, seq, n, block elements, element size]`` then the buffer. The
receiver's ``receive`` receives a header then the data into a staging buffer, and only once the
whole buffer has arrived scatters it into the reservation named by the header's ``seq``
(``index_copy_``; CUDA: synchronized) and ends it. Concurrent transfers on one pair are fine: the
sender sends header+data of one transfer at a time, and receivers waiting on the same channel take
turns receiving whatever comes next and completing the reservation it names; data for a
reservation that ended meanwhile (cancelled, timed out) is received and dropped.

Failures. Every wait has a deadline (``Work.wait(timeout)``; gloo's recv honours it). A sender
killed mid-transfer breaks the connection (``PeerLost``) or stops sending (``TransferTimeout``);
either way the staging buffer is dropped, the pool is untouched, the channel is torn down on this
side and every outstanding reservation on it fails. The next ``connect`` builds a new group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from datetime import timedelta

import msgpack
import torch

from splitserve.transfer.endpoint import BACKEND_FOR_DEVICE, DIST, DistAddress, dtype_name
from splitserve.transfer.errors import (
    ChannelClosed,
    NotConnected,
    PeerLost,
    TransferError,
    TransferTimeout,
)
from splitserve.transfer.reservation import (
    Reservation,
    Ticket,
    block_nbytes,
    check_source_ids,
)

logger = logging.getLogger(__name__)

MAGIC = 0x53504B56  # "SPKV"
HEADER_LEN = 6  # magic, gen, seq, n blocks, elements per block, element size
TAG_HEADER = 0
TAG_DATA = 1
KEY = "splitserve/kv"
_POLL_S = 0.05


def default_backend(device: torch.device | str) -> str:
    kind = torch.device(device).type
    if kind not in BACKEND_FOR_DEVICE:
        raise ValueError(f"no dist backend for a pool on {device}")
    return BACKEND_FOR_DEVICE[kind]


def _check_backend(backend: str, kv_pool: torch.Tensor) -> None:
    if backend != default_backend(kv_pool.device):
        raise ValueError(
            f"backend {backend!r} cannot move a pool on {kv_pool.device} "
            f"(use {default_backend(kv_pool.device)!r})"
        )


def prepare_backend(backend: str) -> None:
    """Process-wide settings a backend needs before its first group; call at startup.

    NCCL: ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` defaults to 3, which tears the whole process down
    when a communicator fails (e.g. a peer dies mid-transfer); a serving node must survive that,
    so unless it is set this makes it 2 (abort the communicator, surface the error to the wait).
    ProcessGroupNCCL reads it when a group is constructed.
    """
    if backend == "nccl":
        value = os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        if value not in ("0", "2"):
            logger.warning(
                "TORCH_NCCL_ASYNC_ERROR_HANDLING=%s: a peer failing mid-transfer will take this "
                "process down (2 keeps it alive)",
                value,
            )


def make_pair_group(store, rank: int, backend: str, timeout_s: float, host: str | None = None):
    """A two-rank torch.distributed backend on ``store`` (give each pair its own
    ``PrefixStore``); rank 0 is the receiver. Gloo connects both ranks here (blocks until the
    other side constructs its group or ``timeout_s`` passes); NCCL connects at the first op.
    ``host``: the local address gloo binds and advertises (default: the hostname's)."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        opts = ProcessGroupGloo._Options()
        opts._timeout = timeout
        device = (
            ProcessGroupGloo.create_device(hostname=host)
            if host
            else ProcessGroupGloo.create_default_device()
        )
        opts._devices = [device]
        return ProcessGroupGloo(store, rank, 2, opts)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        prepare_backend("nccl")
        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(store, rank, 2, opts)
    raise ValueError(f"unsupported backend {backend!r}")


def _local_address_towards(host: str, port: int) -> str:
    """The local IP address this host uses to reach ``host`` (no packet is sent)."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def default_host() -> str:
    """An address of this host that other hosts can reach (the one of the default route)."""
    for probe in ("10.255.255.255", "192.0.2.1"):
        address = _local_address_towards(probe, 1)
        if not address.startswith("127."):
            return address
    return "127.0.0.1"


def _client(host: str, port: int, timeout_s: float):
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


class _Channel:
    """One pair's group on one side. ``lock`` serializes a transfer's ops (header, data);
    ``mu`` guards the bookkeeping. Closed once, by the first failure or ``close``; the group is
    destroyed by whoever holds ``lock`` then (never under a thread blocked in an op)."""

    def __init__(self, peer_id, gen, rank, group, store, device, backend) -> None:
        self.peer_id = peer_id
        self.gen = gen
        self.rank = rank
        self.group = group
        self.store = store
        self.device = device
        self.backend = backend
        self.lock = threading.Lock()
        self.mu = threading.Lock()
        self.outstanding: dict[int, Reservation] = {}
        self.next_seq = 0
        self.closed: TransferError | None = None

    def __repr__(self) -> str:
        return f"<channel to {self.peer_id!r} gen {self.gen}>"

    def post(self, op: str, tensor: torch.Tensor, tag: int):
        peer = 1 - self.rank
        if op == "send":
            return self.group.send([tensor], peer, tag)
        return self.group.recv([tensor], peer, tag)

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
            raise PeerLost(f"{what} with {self.peer_id!r} failed: {_first_line(exc)}") from exc

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
            res._fail(ChannelClosed(f"channel to {self.peer_id!r} closed: {error}"))
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


def _header(gen: int, seq: int, n: int, kv_pool: torch.Tensor, device) -> torch.Tensor:
    values = [MAGIC, gen, seq, n, kv_pool[0].numel(), kv_pool.element_size()]
    return torch.tensor(values, dtype=torch.int64, device=device)


class DistReceiver:
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
    ) -> None:
        from torch.distributed import TCPStore

        self.kv_pool = kv_pool
        self.node_id = node_id
        self.backend = backend or default_backend(kv_pool.device)
        _check_backend(self.backend, kv_pool)
        prepare_backend(self.backend)
        self.host = host or default_host()
        self.connect_timeout = connect_timeout
        self._store = TCPStore(
            self.host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=connect_timeout),
        )
        self.port = int(self._store.port)
        self._channels: dict[str, _Channel] = {}
        self._mu = threading.Lock()
        self._stop = threading.Event()
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"kv-accept-{node_id}", daemon=True
        )
        self._acceptor.start()

    @property
    def address(self) -> DistAddress:
        return DistAddress(self.host, self.port, self.backend)

    def peers(self) -> list[str]:
        with self._mu:
            return [p for p, ch in self._channels.items() if ch.closed is None]

    # -------------------------------------------------------------- accepting senders

    def _accept_loop(self) -> None:
        try:
            client = _client(self.host, self.port, self.connect_timeout)
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
                    self._stop.wait(_POLL_S)
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

    def _accept(self, n: int, hello_bytes: bytes) -> None:
        peer_id = "?"
        try:
            hello = msgpack.unpackb(hello_bytes, raw=False)
            peer_id = str(hello["node_id"])
            reason = None
            if hello["backend"] != self.backend:
                reason = f"backend {hello['backend']!r}, this node runs {self.backend!r}"
            elif tuple(hello["block_shape"]) != tuple(self.kv_pool.shape[1:]) or hello[
                "dtype"
            ] != dtype_name(self.kv_pool.dtype):
                reason = (
                    f"block layout {hello['block_shape']} {hello['dtype']} differs from "
                    f"{list(self.kv_pool.shape[1:])} {dtype_name(self.kv_pool.dtype)}"
                )
            store = _client(self.host, self.port, self.connect_timeout)
            store.set(f"{KEY}/ack/{n}", msgpack.packb({"ok": reason is None, "reason": reason}))
            if reason is not None:
                logger.warning("transfer: refused %s: %s", peer_id, reason)
                return
            from torch.distributed import PrefixStore

            prefixed = PrefixStore(f"{KEY}/pair/{n}/", store)
            with self._device_guard():
                group = make_pair_group(
                    prefixed, 0, self.backend, self.connect_timeout, host=self.host
                )
            channel = _Channel(peer_id, n, 0, group, prefixed, self._wire_device(), self.backend)
            with self._mu:
                old = self._channels.get(peer_id)
                self._channels[peer_id] = channel
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

    def _device_guard(self):
        if self.kv_pool.device.type == "cuda":
            return torch.cuda.device(self.kv_pool.device)
        return contextlib.nullcontext()

    # -------------------------------------------------------------- transfers

    def reserve(self, peer_id: str, block_ids) -> Reservation:
        """Reserve destination ``block_ids`` for the next transfer from ``peer_id``.
        ``ValueError`` on bad ids; ``NotConnected`` if the peer has no open channel."""
        with self._mu:
            channel = self._channels.get(peer_id)
        if channel is None or channel.closed is not None:
            raise NotConnected(f"no open dist channel from {peer_id!r}")
        with channel.mu:
            seq = channel.next_seq
            channel.next_seq += 1
        res = Reservation(
            self.kv_pool, self.node_id, peer_id, DIST, block_ids, gen=channel.gen, seq=seq
        )
        res._channel = channel
        if not res.block_ids:
            res._complete()
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
        if res.path != DIST or res._channel is None:
            raise ValueError(f"{res!r} is not a dist reservation")
        channel: _Channel = res._channel
        deadline = time.monotonic() + timeout
        while not res.ended:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._expire(channel, res)
                break
            if not channel.lock.acquire(timeout=min(remaining, _POLL_S)):
                continue
            try:
                if res.ended:
                    break
                if channel.closed is not None:
                    res._fail(ChannelClosed(f"channel to {res.peer_id!r}: {channel.closed}"))
                    break
                try:
                    with self._device_guard():
                        self._receive_one(channel, deadline)
                except Exception as exc:
                    error = (
                        exc
                        if isinstance(exc, TransferError)
                        else TransferError(f"receiving from {res.peer_id!r}: {_first_line(exc)}")
                    )
                    res._fail(error)
                    channel.close(error)
                    self._forget(channel)
            finally:
                channel.release()
        res.result()

    def _receive_one(self, channel: _Channel, deadline: float) -> None:
        """Receive the next transfer on ``channel`` and fill the reservation it names."""
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
            res._fail(
                TransferError(f"{channel.peer_id!r} sent {n} blocks for {len(res.block_ids)}")
            )
            return
        try:
            res._fill(staging)
        except Exception as exc:
            res._fail(TransferError(f"writing received blocks failed: {exc}"))

    def _expire(self, channel: _Channel, res: Reservation) -> None:
        with channel.mu:
            channel.outstanding.pop(res.ticket.seq, None)
        res._fail(TransferTimeout(f"no blocks from {res.peer_id!r} within the deadline"))

    def cancel(self, res: Reservation) -> None:
        """Abandon a reservation; after this returns nothing writes into it."""
        channel = res._channel
        if channel is not None:
            with channel.mu:
                channel.outstanding.pop(res.ticket.seq, None)
        res._cancel()

    def _forget(self, channel: _Channel) -> None:
        with self._mu:
            if self._channels.get(channel.peer_id) is channel:
                del self._channels[channel.peer_id]

    def close(self, peer_id: str) -> None:
        """Tear down the pair with ``peer_id`` (it left); its reservations fail."""
        with self._mu:
            channel = self._channels.pop(peer_id, None)
        if channel is not None:
            channel.close(ChannelClosed(f"{peer_id!r} closed by {self.node_id!r}"))

    def shutdown(self) -> None:
        self._stop.set()
        self._acceptor.join(timeout=2.0)
        with self._mu:
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:
            channel.close(ChannelClosed("receiver shut down"))
        self._store = None


class DistSender:
    """Sender (prefill node) side: connects to receivers on demand and sends blocks."""

    def __init__(
        self,
        kv_pool: torch.Tensor,
        node_id: str,
        *,
        backend: str | None = None,
        connect_timeout: float = 30.0,
    ) -> None:
        self.kv_pool = kv_pool
        self.node_id = node_id
        self.backend = backend or default_backend(kv_pool.device)
        _check_backend(self.backend, kv_pool)
        prepare_backend(self.backend)
        self.connect_timeout = connect_timeout
        self._channels: dict[str, _Channel] = {}
        self._connecting: dict[str, threading.Lock] = {}
        self._mu = threading.Lock()

    def connected(self, peer_id: str) -> bool:
        with self._mu:
            channel = self._channels.get(peer_id)
        return channel is not None and channel.closed is None

    def connect(self, peer_id: str, address: DistAddress) -> None:
        """Build the pair group with receiver ``peer_id`` at ``address`` unless one is open."""
        if address.backend != self.backend:
            raise ValueError(f"receiver runs {address.backend!r}, this sender {self.backend!r}")
        with self._mu:
            lock = self._connecting.setdefault(peer_id, threading.Lock())
        with lock:
            if self.connected(peer_id):
                return
            try:
                channel = self._open(peer_id, address)
            except TransferError:
                raise
            except Exception as exc:
                raise PeerLost(
                    f"connecting to {peer_id!r} at {address.host}:{address.port}: "
                    f"{_first_line(exc)}"
                ) from exc
            with self._mu:
                old = self._channels.get(peer_id)
                self._channels[peer_id] = channel
            if old is not None:
                old.close(ChannelClosed("reconnected"))

    def _open(self, peer_id: str, address: DistAddress) -> _Channel:
        from torch.distributed import PrefixStore

        timeout = timedelta(seconds=self.connect_timeout)
        store = _client(address.host, address.port, self.connect_timeout)
        n = int(store.add(f"{KEY}/joins", 1))
        hello = {
            "node_id": self.node_id,
            "backend": self.backend,
            "block_shape": list(self.kv_pool.shape[1:]),
            "dtype": dtype_name(self.kv_pool.dtype),
        }
        store.set(f"{KEY}/join/{n}", msgpack.packb(hello))
        store.wait([f"{KEY}/ack/{n}"], timeout)
        ack = msgpack.unpackb(store.get(f"{KEY}/ack/{n}"), raw=False)
        store.delete_key(f"{KEY}/ack/{n}")
        if not ack["ok"]:
            raise TransferError(f"{peer_id!r} refused the connection: {ack['reason']}")
        prefixed = PrefixStore(f"{KEY}/pair/{n}/", store)
        host = _local_address_towards(address.host, address.port)
        with self._device_guard():
            group = make_pair_group(prefixed, 1, self.backend, self.connect_timeout, host=host)
        store.wait([f"{KEY}/ready/{n}"], timeout)
        store.delete_key(f"{KEY}/ready/{n}")
        return _Channel(peer_id, n, 1, group, prefixed, self.kv_pool.device, self.backend)

    def _device_guard(self):
        if self.kv_pool.device.type == "cuda":
            return torch.cuda.device(self.kv_pool.device)
        return contextlib.nullcontext()

    def send(self, peer_id: str, src_block_ids, ticket: Ticket | bytes, timeout: float) -> int:
        """Send our blocks ``src_block_ids`` (one per id of the ticket, in its order) to fill the
        receiver's reservation; returns the bytes sent. Returns once the data has left (the
        receiver signals its own completion). On failure the pair is torn down and the error
        raised (``TransferTimeout``, ``PeerLost``, ``ChannelClosed``); reconnect to retry."""
        if isinstance(ticket, bytes | bytearray):
            ticket = Ticket.from_bytes(bytes(ticket))
        if ticket.path != DIST:
            raise ValueError(f"not a dist ticket: {ticket.path!r}")
        with self._mu:
            channel = self._channels.get(peer_id)
        if channel is None:
            raise NotConnected(f"no dist channel to {peer_id!r}")
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
        with self._device_guard():
            index = torch.tensor(src, dtype=torch.int64, device=self.kv_pool.device)
            buffer = self.kv_pool.index_select(0, index)
            header = _header(channel.gen, ticket.seq, len(src), self.kv_pool, channel.device)
            if not channel.lock.acquire(timeout=max(deadline - time.monotonic(), 0)):
                raise TransferTimeout(f"the channel to {peer_id!r} stayed busy")
            try:
                channel.check_open()
                try:
                    channel.run("send", header, TAG_HEADER, deadline, "sending a header")
                    channel.run("send", buffer, TAG_DATA, deadline, "sending blocks")
                except TransferError as exc:
                    channel.close(exc)
                    self._forget(channel)
                    raise
            finally:
                channel.release()
        return len(src) * block_nbytes(self.kv_pool)

    def _forget(self, channel: _Channel) -> None:
        with self._mu:
            if self._channels.get(channel.peer_id) is channel:
                del self._channels[channel.peer_id]

    def close(self, peer_id: str) -> None:
        """Tear down the pair with receiver ``peer_id`` (it left)."""
        with self._mu:
            channel = self._channels.pop(peer_id, None)
        if channel is not None:
            channel.close(ChannelClosed(f"closed by {self.node_id!r}"))

    def close_all(self) -> None:
        with self._mu:
            peers = list(self._channels)
        for peer in peers:
            self.close(peer)
