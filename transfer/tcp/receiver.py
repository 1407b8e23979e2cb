"""The tcp path's receiver (decode node) side: a listener; every connection is served by its own
thread, which takes chunks (``transfer.tcp.wire``) straight into a (pinned) buffer, checks them
and writes them into their reservation's blocks in one scatter each (whole blocks, or a layer range
of them: a layer-wise stream's chunk).

Bounded by construction: at most ``max_connections`` connections (more are closed at once), a
chunk is at most its reservation's size, a socket that stays silent ``io_timeout`` seconds
mid-chunk (or ``idle_timeout`` between chunks) is closed, and a chunk whose token names no open
reservation, whose blocks are outside it or already written, or whose CRC does not match is
refused (and the reservation failed on a CRC mismatch or a repeat).

With ``tls`` (the node's ``--tls-*`` files, ``security.KVTls``) every connection is mutual TLS 1.3:
the handshake (at most ``HANDSHAKE_TIMEOUT_S``) in the connection's own thread, a client
certificate signed by the CA required, then one ``OK`` ack saying it was accepted (so a sender
knows at ``connect``); a connection that fails the handshake is closed and logged.

Over 300 lines: the connections and the reservations they fill share one table and its lock,
and read best side by side.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import ssl
import threading
import time

import torch

from splitserve.kernels.layout import host_bytes
from splitserve.transfer.base import BlockIds, KVReceiver, PathOptions, check_count, check_path
from splitserve.transfer.dist.group import default_host
from splitserve.transfer.endpoint import TCP, TcpAddress
from splitserve.transfer.errors import Incomplete, TransferError, TransferTimeout
from splitserve.transfer.reservation import RESERVED, Reservation, block_nbytes
from splitserve.transfer.security import KVTls, RefusalLog, listen
from splitserve.transfer.tcp.wire import (
    ALL_LAYERS,
    CHUNK,
    OK,
    REFUSED,
    TOKEN_LEN,
    WireError,
    checksum,
    recv_exact,
    send_ack,
    unpack_chunk,
)

logger = logging.getLogger(__name__)

MAX_CHUNK_BYTES = 64 << 20  # a chunk is at most this (or one block, if a block is larger)
HANDSHAKE_TIMEOUT_S = 10.0  # a TLS handshake that takes longer is dropped (the slot freed)


class _Inbound:
    """A tcp reservation's progress: which (block, layer) pieces a chunk has claimed, which are
    in (whole-block chunks claim every layer of their blocks; a layer-wise stream's, some)."""

    def __init__(self, res: Reservation, num_layers: int) -> None:
        self.res = res
        self.layers = num_layers
        n = len(res.block_ids) * num_layers
        self.claimed = bytearray(n)
        self.landed = bytearray(n)
        self.left = n
        self.mu = threading.Lock()

    def _pieces(self, first: int, count: int, lo: int, hi: int) -> list[slice]:
        return [
            slice(b * self.layers + lo, b * self.layers + hi) for b in range(first, first + count)
        ]

    def claim(self, first: int, count: int, lo: int, hi: int) -> str | None:
        """Take layers ``[lo, hi)`` of blocks ``[first, first + count)`` for one chunk; why not
        (None: taken)."""
        n = len(self.res.block_ids)
        if count == 0 or first >= n or count > n - first:
            return f"blocks {first}..{first + count} are outside the reservation of {n}"
        if not 0 <= lo < hi <= self.layers:
            return f"layers {lo}..{hi} are outside the pool's {self.layers}"
        pieces = self._pieces(first, count, lo, hi)
        with self.mu:
            if any(any(self.claimed[p]) for p in pieces):
                return "blocks sent twice"
            for p in pieces:
                self.claimed[p] = b"\1" * (hi - lo)
            return None

    def landed_run(self, first: int, count: int, lo: int, hi: int) -> bool:
        """A claimed piece is in the pool; True once every (block, layer) is."""
        with self.mu:
            for p in self._pieces(first, count, lo, hi):
                self.landed[p] = b"\1" * (hi - lo)
            self.left -= count * (hi - lo)
            return self.left == 0

    def has_prefix(self, n: int) -> bool:
        with self.mu:
            return all(self.landed[: n * self.layers])


class TcpReceiver(KVReceiver):
    def __init__(
        self,
        kv_pool: torch.Tensor,
        node_id: str,
        *,
        host: str,
        port: int = 0,
        max_connections: int = 256,
        io_timeout: float = 30.0,
        idle_timeout: float = 600.0,
        tls: KVTls | None = None,
    ) -> None:
        self.kv_pool = kv_pool
        self.node_id = node_id
        self.block_nbytes = block_nbytes(kv_pool)
        self.max_connections = max_connections
        self.io_timeout, self.idle_timeout = io_timeout, idle_timeout
        self._listener = listen(host, port)
        self.address = TcpAddress(host, int(self._listener.getsockname()[1]), tls=tls is not None)
        self._tls = tls
        self._refusals = RefusalLog(logger, "tcp KV listener")
        self._inbound: dict[bytes, _Inbound] = {}
        self._conns: set[socket.socket] = set()
        self._mu = threading.Lock()
        self._stop = threading.Event()
        self._scratch = threading.local()
        self._stream = torch.cuda.Stream(kv_pool.device) if kv_pool.device.type == "cuda" else None
        threading.Thread(target=self._accept_loop, name=f"kv-tcp-{node_id}", daemon=True).start()

    @classmethod
    def open(cls, kv_pool: torch.Tensor, node_id: str, options: PathOptions) -> TcpReceiver:
        host = options.host or default_host()
        return cls(kv_pool, node_id, host=host, tls=options.security.tls)

    @property
    def paths(self) -> tuple[str, ...]:
        return (TCP,)

    def offer(self) -> dict[str, object]:
        return {TCP: self.address}

    # ---------------------------------------------------------------- reservations

    def reserve(self, peer_id: str, block_ids: BlockIds, path: str = TCP) -> Reservation:
        check_path(path, TCP)
        res = Reservation(
            self.kv_pool, self.node_id, peer_id, TCP, block_ids, token=secrets.token_bytes(16)
        )
        if not res.block_ids:
            res.end_done()
            return res
        with self._mu:
            self._inbound[res.ticket.token] = _Inbound(res, self.kv_pool.shape[1])
        return res

    def receive(self, res: Reservation, timeout: float) -> None:
        """Block until every reserved block has been written (then the reservation is done), or
        fail it with ``TransferTimeout`` after ``timeout`` seconds. (The decode node does not call
        it: ``finish`` checks on the sender's end, and no thread waits meanwhile.)"""
        try:
            if not res.wait(timeout):
                res.end_failed(TransferTimeout(f"no complete tcp transfer within {timeout:.1f} s"))
            res.result()
        finally:
            self._forget(res)

    def finish(self, res: Reservation, count: int | None = None) -> None:
        """The sender filled the reservation (or only its first ``count`` blocks: a peer that
        held fewer): end it as done if they are all in, else fail it (``Incomplete``)."""
        n = check_count(res, count)
        try:
            with self._mu:
                entry = self._inbound.get(res.ticket.token)
            if res.state == RESERVED and (entry is None or not entry.has_prefix(n)):
                if count is None:
                    why = "the sender finished before every tcp chunk had arrived"
                else:
                    why = f"the first {n} blocks did not all arrive"
                res.end_failed(Incomplete(why))
            res.end_done()  # raises if it failed
        finally:
            self._forget(res)

    def cancel(self, res: Reservation) -> float:
        res.end_cancelled()
        self._forget(res)
        return 0.0

    def _forget(self, res: Reservation) -> None:
        with self._mu:
            self._inbound.pop(res.ticket.token, None)

    def shutdown(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._mu:
            conns, self._conns = list(self._conns), set()
            inbound, self._inbound = list(self._inbound.values()), {}
        for conn in conns:
            _close(conn)
        for entry in inbound:
            entry.res.end_failed(TransferError("the receiver shut down"))

    # ---------------------------------------------------------------- connections

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError as exc:
                if self._stop.is_set():
                    return  # closed by shutdown
                logger.warning("tcp KV: accept failed (%s); retrying", exc)  # e.g. out of fds
                time.sleep(0.1)
                continue
            with self._mu:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                logger.warning("tcp KV: refusing %s: %d connections open", peer, len(self._conns))
                _close(conn)
                continue
            try:
                threading.Thread(target=self._serve, args=(conn, peer), daemon=True).start()
            except RuntimeError as exc:  # no thread to be had: drop this connection only
                logger.warning("tcp KV: cannot serve %s: %s", peer, exc)
                with self._mu:
                    self._conns.discard(conn)
                _close(conn)

    def _serve(self, conn: socket.socket, peer: object) -> None:
        header = bytearray(CHUNK.size)
        self._scratch.buf = None  # this thread's receive buffer, reused chunk after chunk
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                wrapped = self._handshake(conn, peer, self._tls)
                if wrapped is None:
                    return
                conn = wrapped
            while not self._stop.is_set():
                conn.settimeout(self.idle_timeout)
                if not recv_exact(conn, memoryview(header)[:1]):
                    return  # the sender closed between chunks
                conn.settimeout(self.io_timeout)
                recv_exact(conn, memoryview(header)[1:])
                why = self._chunk(conn, bytes(header))
                if why is not None:
                    send_ack(conn, REFUSED, why)
                    return
                send_ack(conn, OK)
        except (OSError, WireError) as exc:
            logger.debug("tcp KV connection ended: %s", exc)
        finally:
            with self._mu:
                self._conns.discard(conn)
            _close(conn)

    def _handshake(self, raw: socket.socket, peer: object, tls: KVTls) -> ssl.SSLSocket | None:
        """Mutual TLS on ``raw`` (which it replaces in the open connections); None, logged and
        closed, if the sender is not one of the cluster's (no certificate, another CA's)."""
        raw.settimeout(min(HANDSHAKE_TIMEOUT_S, self.io_timeout))
        try:
            conn = tls.server.wrap_socket(raw, server_side=True)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            self._refusals.refused(peer, f"TLS handshake failed: {exc}")
            return None  # (wrap_socket closed the connection)
        try:
            send_ack(conn, OK)  # the certificate was accepted
        except OSError:  # the sender left at once
            _close(conn)
            return None
        with self._mu:
            self._conns.discard(raw)
            self._conns.add(conn)
        return conn

    def _chunk(self, conn: socket.socket, header: bytes) -> str | None:
        """Take one chunk into its reservation; why it was refused (None: written)."""
        token, first, count, lo, hi, crc = unpack_chunk(header)
        num_layers = self.kv_pool.shape[1]
        hi = num_layers if hi == ALL_LAYERS else hi
        with self._mu:
            entry = self._inbound.get(token) if len(token) == TOKEN_LEN else None
        if entry is None:
            return "no open reservation with this token (ended, cancelled or never made)"
        layer_nbytes = self.block_nbytes // num_layers
        nbytes = count * max(hi - lo, 0) * layer_nbytes
        if nbytes > max(MAX_CHUNK_BYTES, self.block_nbytes):
            return f"a chunk of {count} blocks is over the {MAX_CHUNK_BYTES >> 20} MiB limit"
        why = entry.claim(first, count, lo, hi)
        if why is not None:
            entry.res.end_failed(TransferError(f"tcp transfer: {why}"))
            return why
        block_shape = (hi - lo, *self.kv_pool.shape[2:])
        buf = self._buffer(nbytes)
        view = host_bytes(buf)
        if not recv_exact(conn, view):
            raise WireError("connection closed before the chunk's data")
        if self._tls is None and checksum(view) != crc:  # inside TLS: the records' AEAD tags
            entry.res.end_failed(TransferError("tcp transfer: CRC mismatch"))
            return "CRC mismatch"
        blocks = buf.view(self.kv_pool.dtype).view(count, *block_shape)
        ids = entry.res.block_ids[first : first + count]
        try:
            with self._on_side_stream():
                entry.res.write(ids, blocks, layers=(lo, hi))
        except TransferError:
            return "the reservation ended (cancelled or failed)"
        if entry.landed_run(first, count, lo, hi):
            with contextlib.suppress(TransferError):
                entry.res.end_done()
        return None

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """This connection's (pinned, on CUDA) receive buffer, grown to ``nbytes`` if needed."""
        buf = self._scratch.buf
        if buf is None or buf.numel() < nbytes:
            pinned = self._stream is not None
            buf = self._scratch.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        return buf[:nbytes]

    def _on_side_stream(self) -> contextlib.AbstractContextManager:
        """Scatters run on this receiver's CUDA stream, not behind the engine's kernels."""
        if self._stream is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.kv_pool.device))
        stack.enter_context(torch.cuda.stream(self._stream))
        return stack


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
