"""The tcp path's sender (prefill node) side.

A transfer is cut into chunks spread over up to ``streams`` connections sent in parallel; each
connection's thread gathers its chunks one at a time into its own reused host buffer (CUDA: an
``index_select`` and a copy into pinned memory on a side stream; CPU: one ``index_select``), so
host memory stays at one chunk per connection however large the transfer. Each chunk is one header
and one ``sendall`` of its buffer (no per-block Python copies), its CRC computed by zlib over the
whole chunk outside the GIL. Connections are kept per receiver and reused; one that broke is
dropped and the failure raised (``PeerLost``/``TransferTimeout``/``TransferError``): the caller
ships the request another way or fails it, and the next ``send`` opens fresh connections.

With ``tls`` (``security.KVTls``) every connection is mutual TLS 1.3, the listener's certificate
checked against the CA and the dialled host; ``connect`` waits for the listener's ack that it
accepted ours. A listener whose TLS differs from this node's (plaintext here, TLS there, or the
reverse) is not connected to: the pair takes the next path.

Over 300 lines: the lanes and the kept connections (opened, checked, handed back) share the
peer table and its lock.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, NamedTuple, TypeVar

import torch

from splitserve.kernels.layout import host_bytes, indexable
from splitserve.transfer.base import BlockIds, KVSender, PathOptions, as_endpoint, own_ticket
from splitserve.transfer.endpoint import TCP, Endpoint, TcpAddress
from splitserve.transfer.errors import NotConnected, PeerLost, TransferError, TransferTimeout
from splitserve.transfer.reservation import Ticket, block_nbytes, check_source_ids
from splitserve.transfer.security import KVTls
from splitserve.transfer.tcp.receiver import MAX_CHUNK_BYTES
from splitserve.transfer.tcp.wire import PeerClosed, WireError, checksum, pack_chunk, read_ack

DEFAULT_CHUNK_BYTES = 16 << 20
_T = TypeVar("_T")


class _Chunk(NamedTuple):
    first: int  # position in the reservation
    ids: list[int]  # its source blocks
    lo: int  # its layers: [lo, hi)
    hi: int

    @property
    def num_blocks(self) -> int:
        return len(self.ids)


class TcpSender(KVSender):
    def __init__(
        self,
        kv_pool: torch.Tensor,
        node_id: str,
        *,
        streams: int = 4,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        connect_timeout: float = 10.0,
        tls: KVTls | None = None,
    ) -> None:
        self.kv_pool = kv_pool
        self.node_id = node_id
        self.block_nbytes = block_nbytes(kv_pool)
        self.streams = max(1, streams)
        self.blocks_per_chunk = max(1, min(chunk_bytes, MAX_CHUNK_BYTES) // self.block_nbytes)
        self.connect_timeout = connect_timeout
        self._tls = tls
        self._peers: dict[str, TcpAddress] = {}
        self._idle: dict[str, list[socket.socket]] = {}
        self._mu = threading.Lock()
        self._workers = ThreadPoolExecutor(self.streams * 8, thread_name_prefix="kv-tcp-send")
        cuda = kv_pool.device.type == "cuda"
        self._stream = torch.cuda.Stream(kv_pool.device) if cuda else None

    @classmethod
    def open(cls, kv_pool: torch.Tensor, node_id: str, options: PathOptions) -> TcpSender:
        return cls(kv_pool, node_id, tls=options.security.tls, **(options.tcp_options or {}))

    @property
    def paths(self) -> tuple[str, ...]:
        return (TCP,)

    @property
    def layered_paths(self) -> tuple[str, ...]:
        return (TCP,)

    # ---------------------------------------------------------------- peers

    def connect(self, peer: Endpoint | bytes) -> str:
        """Check that the peer's listener answers (one connection, kept for reuse)."""
        peer = as_endpoint(peer)
        if peer.tcp is None:
            raise NotConnected(f"{peer.node_id!r} offers no tcp listener")
        if peer.tcp.tls != (self._tls is not None):
            theirs, ours = ("TLS", "plaintext") if peer.tcp.tls else ("plaintext", "TLS")
            raise NotConnected(
                f"{peer.node_id!r}'s tcp listener takes {theirs} connections, this node sends "
                f"{ours} (give every node the same --tls-* options)"
            )
        sock = self._open(peer.tcp, time.monotonic() + self.connect_timeout)
        with self._mu:
            self._peers[peer.node_id] = peer.tcp
            self._idle.setdefault(peer.node_id, []).append(sock)
        return TCP

    def path(self, peer_id: str) -> str | None:
        with self._mu:
            return TCP if peer_id in self._peers else None

    def close(self, peer_id: str) -> None:
        with self._mu:
            self._peers.pop(peer_id, None)
            idle = self._idle.pop(peer_id, [])
        for sock in idle:
            _close(sock)

    def close_all(self) -> None:
        with self._mu:
            peers = list(self._peers)
        for peer in peers:
            self.close(peer)

    # ---------------------------------------------------------------- sending

    def send(self, ticket: Ticket | bytes, src_block_ids: BlockIds, *, timeout: float) -> int:
        """Fill the receiver's reservation ``ticket`` with our blocks ``src_block_ids`` (one per
        reserved id, in its order); returns the bytes sent once the receiver acknowledged every
        chunk (then they are in its pool)."""
        ticket = own_ticket(ticket, self.node_id, TCP)
        src = check_source_ids(src_block_ids, self.kv_pool.shape[0])
        if len(src) != len(ticket.block_ids):
            raise ValueError(f"{len(src)} source blocks for {len(ticket.block_ids)} reserved")
        return self._send(ticket, 0, src, (0, self.kv_pool.shape[1]), timeout, None)

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
        ``first, first + 1, ...``: one piece of a layer-wise stream (every (block, layer) of the
        reservation is sent exactly once, in any order; the receiver completes it when all are
        in). ``after``: a CUDA event the pieces' data is ready at (default: everything queued on
        the engine's stream so far). Returns the bytes sent once acknowledged."""
        ticket = own_ticket(ticket, self.node_id, TCP)
        src = check_source_ids(src_block_ids, self.kv_pool.shape[0])
        if first < 0 or first + len(src) > len(ticket.block_ids):
            raise ValueError(
                f"positions {first}..{first + len(src)} are outside the reservation of "
                f"{len(ticket.block_ids)}"
            )
        lo, hi = layers
        if not 0 <= lo < hi <= self.kv_pool.shape[1]:
            raise ValueError(f"layers {lo}..{hi} are not a range of the pool's layers")
        return self._send(ticket, first, src, (lo, hi), timeout, after)

    def _send(
        self,
        ticket: Ticket,
        first: int,
        src: list[int],
        layers: tuple[int, int],
        timeout: float,
        after: Any,
    ) -> int:
        peer_id = ticket.receiver_id
        with self._mu:
            address = self._peers.get(peer_id)
        if address is None:
            raise NotConnected(f"no tcp connection to {peer_id!r}: connect first")
        if not src:
            return 0
        deadline = time.monotonic() + timeout
        if self._stream is not None:  # the blocks' KV is written (the engine's stream)
            with torch.cuda.device(self.kv_pool.device):
                if after is not None:
                    self._stream.wait_event(after)
                else:
                    self._stream.wait_stream(torch.cuda.current_stream(self.kv_pool.device))
        chunks = self._chunks(first, src, *layers)
        lanes = [chunks[i :: self.streams] for i in range(min(self.streams, len(chunks)))]
        futures = [
            self._workers.submit(self._send_lane, peer_id, address, ticket.token, lane, deadline)
            for lane in lanes
        ]
        wait(futures)
        for future in futures:
            future.result()  # raises the first lane's failure
        lo, hi = layers
        return len(src) * (hi - lo) * self.layer_nbytes

    @property
    def layer_nbytes(self) -> int:
        return self.block_nbytes // self.kv_pool.shape[1]

    def _chunks(self, first: int, src: list[int], lo: int, hi: int) -> list[_Chunk]:
        """At most a chunk's bytes each, and at least one chunk per connection where there
        are blocks enough (a layer range of many blocks fits one chunk: one connection would
        carry it alone)."""
        per = max(1, self.blocks_per_chunk * self.kv_pool.shape[1] // (hi - lo))
        per = max(1, min(per, -(-len(src) // self.streams)))
        return [_Chunk(first + at, src[at : at + per], lo, hi) for at in range(0, len(src), per)]

    def _scratch(self) -> torch.Tensor:
        """A lane's host buffer for one chunk (pinned on CUDA; torch caches and reuses it)."""
        pinned = self._stream is not None
        nbytes = self.blocks_per_chunk * self.block_nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def _fill(self, chunk: _Chunk, scratch: torch.Tensor) -> torch.Tensor:
        """Gather ``chunk``'s blocks (its layers) into ``scratch``; returns its bytes."""
        pool = self.kv_pool
        if (chunk.lo, chunk.hi) != (0, pool.shape[1]):
            pool = pool.narrow(1, chunk.lo, chunk.hi - chunk.lo)
        data = scratch[: chunk.num_blocks * (chunk.hi - chunk.lo) * self.layer_nbytes]
        index = torch.tensor(chunk.ids, dtype=torch.int64)
        if self._stream is None:
            torch.index_select(indexable(pool), 0, index, out=indexable(_blocks_of(data, pool)))
            return data
        with torch.cuda.device(pool.device), torch.cuda.stream(self._stream):
            blocks = indexable(pool).index_select(0, index.to(pool.device, non_blocking=True))
            blocks = blocks.view(pool.dtype)
            _blocks_of(data, pool).copy_(blocks, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        ready.synchronize()
        return data

    def _send_lane(
        self, peer_id: str, address: TcpAddress, token: bytes, lane: list[_Chunk], deadline: float
    ) -> None:
        sock = self._take(peer_id, address, deadline)
        ok = False
        try:
            scratch = self._scratch()  # one chunk's buffer per lane, reused for its chunks
            for chunk in lane:
                data = self._fill(chunk, scratch)
                view = host_bytes(data)
                # NOTE: inside TLS every record's AEAD tag checks the data: no CRC (0).
                crc = 0 if self._tls is not None else checksum(view)
                header = pack_chunk(token, chunk.first, chunk.num_blocks, crc, chunk.lo, chunk.hi)
                _io(sock, deadline, sock.sendall, header)
                _io(sock, deadline, sock.sendall, view)
            for _ in lane:
                _io(sock, deadline, read_ack, sock)
            ok = True
        except (OSError, WireError) as exc:
            raise self._failure(sock, peer_id, exc) from None
        finally:
            if ok:
                self._give_back(peer_id, sock)
            else:
                _close(sock)

    def _failure(self, sock: socket.socket, peer_id: str, exc: BaseException) -> TransferError:
        if isinstance(exc, TimeoutError):
            return TransferTimeout(f"tcp transfer to {peer_id!r}: no progress before the deadline")
        if isinstance(exc, PeerClosed):
            self.close_idle(peer_id)
            return PeerLost(f"tcp connection to {peer_id!r} closed: {exc}")
        if isinstance(exc, OSError):
            # The receiver may have refused a chunk and closed: its reason beats "broken pipe".
            with contextlib.suppress(OSError, WireError):
                sock.settimeout(0.5)
                read_ack(sock)
            self.close_idle(peer_id)
            return PeerLost(f"tcp connection to {peer_id!r} broke: {exc}")
        return TransferError(f"tcp transfer to {peer_id!r}: {exc}")

    # ---------------------------------------------------------------- connections

    def _open(self, address: TcpAddress, deadline: float) -> socket.socket:
        try:
            sock = socket.create_connection(
                (address.host, address.port), timeout=max(deadline - time.monotonic(), 0.01)
            )
        except OSError as exc:
            raise PeerLost(f"cannot connect to {address.host}:{address.port}: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is None:
            return sock
        return self._handshake(sock, address, self._tls)

    def _handshake(self, sock: socket.socket, address: TcpAddress, tls: KVTls) -> ssl.SSLSocket:
        """Mutual TLS on ``sock`` (within its connect timeout), then the listener's ack that it
        accepted this node's certificate."""
        where = f"{address.host}:{address.port}"
        try:
            conn = tls.client.wrap_socket(sock, server_hostname=address.host)
        except ssl.SSLCertVerificationError as exc:
            _close(sock)
            why = f"its certificate is not trusted ({exc})"
            raise PeerLost(f"tcp listener {where}: {why}") from None
        except (OSError, ValueError) as exc:
            _close(sock)
            raise PeerLost(f"tcp listener {where}: TLS handshake failed ({exc})") from None
        try:
            read_ack(conn)
        except (OSError, WireError) as exc:
            _close(conn)
            why = f"refused this node's certificate ({exc})"
            raise PeerLost(f"tcp listener {where} {why}") from None
        return conn

    def _take(self, peer_id: str, address: TcpAddress, deadline: float) -> socket.socket:
        while True:
            with self._mu:
                idle = self._idle.get(peer_id)
                sock = idle.pop() if idle else None
            if sock is None:
                return self._open(address, deadline)
            # An idle connection has nothing to read; if it has, the receiver closed it (or
            # sent bytes nobody asked for). NOTE: select, not a peek: a TLS socket takes no flags.
            try:
                readable = bool(select.select([sock], [], [], 0)[0])
            except (OSError, ValueError):
                readable = True
            if not readable:
                return sock  # alive and idle (_io sets each operation's timeout)
            _close(sock)

    def _give_back(self, peer_id: str, sock: socket.socket) -> None:
        with self._mu:
            idle = self._idle.get(peer_id) if peer_id in self._peers else None
            # Twice the lanes of one send: a layer-wise stream keeps two sends in flight
            # (engine/layer_stream.py), and connections closed after each would be reopened.
            if idle is not None and len(idle) < 2 * self.streams:
                idle.append(sock)
                return
        _close(sock)

    def close_idle(self, peer_id: str) -> None:
        with self._mu:
            idle = self._idle.get(peer_id, [])
            socks, idle[:] = list(idle), []
        for sock in socks:
            _close(sock)

    def shutdown(self) -> None:
        self.close_all()
        self._workers.shutdown(wait=False)


def _blocks_of(host: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    return host.view(pool.dtype).view(-1, *pool.shape[1:])


def _io(sock: socket.socket, deadline: float, op: Callable[..., _T], *args: Any) -> _T:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(left)
    return op(*args)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
