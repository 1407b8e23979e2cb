"""Helpers for tests and benchmarks: deterministic pools and a sender process driven by a pipe.
Not part of the installed package: tests import it as ``support.kv_pools``, benchmarks/transfer.py
and transfer_grpc.py the same way (transfer.py puts tests/ on ``sys.path``).

``sender_main`` runs in a child process (``multiprocessing`` spawn) and answers commands sent
over a ``Connection``; each answer is ``("ok", result)`` or ``("error", "Type: message")``.
Commands: ``("connect", endpoint_bytes)``, ``("close", peer_id)``,
``("send", ticket_bytes, src_ids, timeout)`` (answers ``(bytes, seconds)``),
``("send_header_then", ticket_bytes, src_ids, "kill" | "stop")`` (sends a dist transfer's
header, answers, then SIGKILLs or SIGSTOPs itself: a sender that dies mid-transfer),
``("send_tcp_half_then_kill", ticket_bytes, src_ids)`` (the first tcp chunk's header and half
its data, then SIGKILL),
``("checksums", ids)``, ``("exit",)``. ``security``: what guards the sender's paths, as plain
values (``security_of``).
"""

from __future__ import annotations

import os
import signal
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from splitserve.transfer import KVSecurity, TcpAddress, Ticket


def make_pool(
    num_blocks: int,
    num_layers: int = 2,
    block_size: int = 16,
    num_kv_heads: int = 2,
    head_dim: int = 8,
    dtype: str = "bfloat16",
    device: str = "cpu",
) -> torch.Tensor:
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    return torch.empty(shape, dtype=getattr(torch, dtype), device=device)


def fill_pool(kv_pool: torch.Tensor, seed: int) -> torch.Tensor:
    """Fill the pool with random bytes determined by ``seed`` (and the device kind)."""
    gen = torch.Generator(device=kv_pool.device).manual_seed(seed)
    raw = kv_pool.view(torch.uint8).view(kv_pool.shape[0], -1)
    for start in range(0, raw.shape[0], 256):  # bounded temporaries on big pools
        chunk = raw[start : start + 256]
        chunk.copy_(
            torch.randint(
                0, 256, chunk.shape, generator=gen, dtype=torch.uint8, device=kv_pool.device
            )
        )
    return kv_pool


def block_checksums(kv_pool: torch.Tensor, block_ids: list[int]) -> list[int]:
    """A position-sensitive checksum of each listed block (for comparing across processes)."""
    out: list[int] = []
    flat = kv_pool.view(torch.uint8).view(kv_pool.shape[0], -1)
    for start in range(0, len(block_ids), 64):
        ids = torch.tensor(block_ids[start : start + 64], device=kv_pool.device)
        rows = flat.index_select(0, ids).view(torch.int32).to(torch.int64)
        weights = torch.arange(1, rows.shape[1] + 1, device=rows.device, dtype=torch.int64)
        out.extend(((rows * weights).sum(1) % (1 << 61)).tolist())
    return out


def security_of(spec: dict | None) -> KVSecurity:
    """A ``KVSecurity`` from plain values (they cross to a spawned process): ``tls`` a (cert,
    key, ca) of PEM paths, ``token`` the cluster token, ``trust`` the trust-kv-network switch."""
    from splitserve.transfer import KVSecurity, KVTls, rendezvous_key

    spec = spec or {}
    tls, token = spec.get("tls"), spec.get("token")
    return KVSecurity(
        tls=KVTls(*tls) if tls else None,
        trust_network=bool(spec.get("trust")),
        rendezvous_key=rendezvous_key(token) if token else None,
    )


def sender_main(
    conn: Connection,
    node_id: str,
    pool_spec: dict,
    seed: int,
    connect_timeout: float = 10.0,
    tcp_options: dict | None = None,
    security: dict | None = None,
) -> None:
    from splitserve.transfer import DIST, Endpoint, PathOptions, Ticket
    from splitserve.transfer.api import NodeSender
    from splitserve.transfer.chooser import PATHS, open_senders
    from splitserve.transfer.dist.channel import TAG_HEADER, header
    from splitserve.transfer.dist.sender import DistSender

    if pool_spec.get("device", "cpu").startswith("cuda"):
        torch.cuda.set_device(torch.device(pool_spec["device"]))
    pool = fill_pool(make_pool(**pool_spec), seed)
    options = PathOptions(
        connect_timeout=connect_timeout, tcp_options=tcp_options, security=security_of(security)
    )
    # A node's sender, built from its parts here: the faults below use the dist part's channel.
    parts = open_senders(pool, node_id, PATHS, options)
    tx = NodeSender(pool, node_id, parts)
    endpoints: dict[str, Endpoint] = {}  # the receivers connected to, by node id
    conn.send(("ready", tx.endpoint().to_bytes()))
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            return
        result = None
        try:
            if cmd == "exit":
                tx.close_all()
                conn.send(("ok", None))
                return
            if cmd == "connect":
                peer = Endpoint.from_bytes(args[0])
                result = tx.connect(peer)
                endpoints[peer.node_id] = peer
            elif cmd == "close":
                tx.close(args[0])
            elif cmd == "send":
                t0 = time.perf_counter()
                nbytes = tx.send(args[0], args[1], timeout=args[2])
                result = (nbytes, time.perf_counter() - t0)
            elif cmd == "send_part":  # (ticket, first, src, (lo, hi), timeout)
                result = tx.send_part(args[0], args[1], args[2], tuple(args[3]), timeout=args[4])
            elif cmd == "send_header_then":
                ticket = Ticket.from_bytes(args[0])
                dist_sender = parts[DIST]
                assert isinstance(dist_sender, DistSender)
                channel = dist_sender.channel(ticket.receiver_id)
                assert channel is not None
                head = header(ticket.gen, ticket.seq, len(args[1]), pool, channel.device)
                conn.send(("ok", "sending the header"))  # the receiver posts its recv now
                channel.post("send", head, TAG_HEADER).wait()
                os.kill(os.getpid(), signal.SIGKILL if args[2] == "kill" else signal.SIGSTOP)
                continue
            elif cmd == "send_tcp_half_then_kill":
                ticket = Ticket.from_bytes(args[0])
                address = endpoints[ticket.receiver_id].tcp
                assert address is not None
                _send_tcp_half(pool, address, ticket, args[1], tcp_options or {})
                conn.send(("ok", "half a chunk sent"))
                time.sleep(0.2)
                os.kill(os.getpid(), signal.SIGKILL)
            elif cmd == "checksums":
                result = block_checksums(pool, args[0])
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", result))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _send_tcp_half(
    pool: torch.Tensor, address: TcpAddress, ticket: Ticket, src: list[int], tcp_options: dict
) -> None:
    """The first chunk's header (as the tcp sender cuts it, for the whole chunk) and half of its
    data, on a connection of its own."""
    import socket

    from splitserve.kernels.layout import host_bytes
    from splitserve.transfer.reservation import block_nbytes
    from splitserve.transfer.tcp.receiver import MAX_CHUNK_BYTES
    from splitserve.transfer.tcp.sender import DEFAULT_CHUNK_BYTES
    from splitserve.transfer.tcp.wire import checksum, pack_chunk

    chunk_bytes = min(tcp_options.get("chunk_bytes", DEFAULT_CHUNK_BYTES), MAX_CHUNK_BYTES)
    first = src[: max(1, chunk_bytes // block_nbytes(pool))]
    blocks = pool[torch.tensor(first, device=pool.device)].cpu().contiguous()
    view = host_bytes(blocks)
    sock = socket.create_connection((address.host, address.port), timeout=5)
    sock.sendall(pack_chunk(ticket.token, 0, len(first), checksum(view)))
    sock.sendall(view[: len(view) // 2])


class SenderProcess:
    """A ``sender_main`` child (spawned) and the pipe to it."""

    def __init__(
        self,
        node_id: str,
        pool_spec: dict,
        seed: int,
        connect_timeout: float = 10.0,
        tcp_options: dict | None = None,
        security: dict | None = None,
    ) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.node_id = node_id
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=sender_main,
            args=(child, node_id, pool_spec, seed, connect_timeout, tcp_options, security),
            name=f"sender-{node_id}",
            daemon=True,
        )
        self.proc.start()
        child.close()
        self.endpoint: bytes | None = None

    def wait_ready(self, timeout: float = 120.0) -> bytes:
        endpoint = self.endpoint
        if endpoint is None:
            status, endpoint = self.reply_raw(timeout)
            if status != "ready":
                raise RuntimeError(f"sender {self.node_id} failed to start: {endpoint}")
            self.endpoint = endpoint
        return endpoint

    def request(self, *cmd: Any) -> None:
        self.conn.send(cmd)

    def reply_raw(self, timeout: float = 60.0) -> tuple[str, Any]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no answer from sender {self.node_id} in {timeout}s")
        return self.conn.recv()

    def reply(self, timeout: float = 60.0) -> Any:
        status, value = self.reply_raw(timeout)
        if status != "ok":
            raise RuntimeError(f"sender {self.node_id}: {value}")
        return value

    def call(self, *cmd: Any, timeout: float = 60.0) -> Any:
        self.request(*cmd)
        return self.reply(timeout)

    def kill(self) -> None:
        pid = self.proc.pid
        if pid is not None and self.proc.is_alive():
            os.kill(pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("exit", timeout=10)
        except Exception:
            pass
        self.proc.join(5)
        self.kill()
