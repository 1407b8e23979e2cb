"""Helpers for tests and benchmarks: deterministic pools and a sender process driven by a pipe.

``sender_main`` runs in a child process (``multiprocessing`` spawn) and answers commands sent
over a ``Connection``; each answer is ``("ok", result)`` or ``("error", "Type: message")``.
Commands: ``("connect", endpoint_bytes)``, ``("close", peer_id)``,
``("send", ticket_bytes, src_ids, timeout)`` (answers ``(bytes, seconds)``),
``("send_header_then", ticket_bytes, src_ids, "kill" | "stop")`` (sends a dist transfer's
header, answers, then SIGKILLs or SIGSTOPs itself: a sender that dies mid-transfer),
``("send_tcp_half_then_kill", ticket_bytes, src_ids)`` (the first tcp chunk's header and half
its data, then SIGKILL),
``("checksums", ids)``, ``("exit",)``.
"""

from __future__ import annotations

import os
import signal
import time

import torch


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


def sender_main(
    conn,
    node_id: str,
    pool_spec: dict,
    seed: int,
    connect_timeout: float = 10.0,
    tcp_options: dict | None = None,
):
    from splitserve.transfer import KVSender, Ticket, dist

    if pool_spec.get("device", "cpu").startswith("cuda"):
        torch.cuda.set_device(torch.device(pool_spec["device"]))
    pool = fill_pool(make_pool(**pool_spec), seed)
    tx = KVSender(pool, node_id, connect_timeout=connect_timeout, tcp_options=tcp_options)
    conn.send(("ready", tx.endpoint().to_bytes()))
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "exit":
                tx.close_all()
                conn.send(("ok", None))
                return
            if cmd == "connect":
                result = tx.connect(args[0])
            elif cmd == "close":
                tx.close(args[0])
                result = None
            elif cmd == "send":
                t0 = time.perf_counter()
                nbytes = tx.send(args[0], args[1], timeout=args[2])
                result = (nbytes, time.perf_counter() - t0)
            elif cmd == "send_header_then":
                ticket = Ticket.from_bytes(args[0])
                channel = tx._dist._channels[ticket.receiver_id]
                header = dist._header(ticket.gen, ticket.seq, len(args[1]), pool, channel.device)
                conn.send(("ok", "sending the header"))  # the receiver posts its recv now
                channel.post("send", header, dist.TAG_HEADER).wait()
                os.kill(os.getpid(), signal.SIGKILL if args[2] == "kill" else signal.SIGSTOP)
                continue
            elif cmd == "send_tcp_half_then_kill":
                _send_tcp_half(tx, Ticket.from_bytes(args[0]), args[1])
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


def _send_tcp_half(tx, ticket, src: list[int]) -> None:
    """The first chunk's header (as for the whole chunk) and half of its data."""
    import time as _time

    from splitserve.transfer.tcp_wire import checksum, pack_chunk

    tcp = tx._tcp
    chunk = tcp._chunks(src)[0]
    view = memoryview(tcp._fill(chunk, tcp._scratch()).numpy())
    sock = tcp._take(ticket.receiver_id, tcp._peers[ticket.receiver_id], _time.monotonic() + 5)
    sock.sendall(pack_chunk(ticket.token, chunk.first, chunk.count, checksum(view)))
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
    ) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.node_id = node_id
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=sender_main,
            args=(child, node_id, pool_spec, seed, connect_timeout, tcp_options),
            name=f"sender-{node_id}",
            daemon=True,
        )
        self.proc.start()
        child.close()
        self.endpoint: bytes | None = None

    def wait_ready(self, timeout: float = 120.0) -> bytes:
        if self.endpoint is None:
            status, self.endpoint = self.reply_raw(timeout)
            if status != "ready":
                raise RuntimeError(f"sender {self.node_id} failed to start: {self.endpoint}")
        return self.endpoint

    def request(self, *cmd) -> None:
        self.conn.send(cmd)

    def reply_raw(self, timeout: float = 60.0):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no answer from sender {self.node_id} in {timeout}s")
        return self.conn.recv()

    def reply(self, timeout: float = 60.0):
        status, value = self.reply_raw(timeout)
        if status != "ok":
            raise RuntimeError(f"sender {self.node_id}: {value}")
        return value

    def call(self, *cmd, timeout: float = 60.0):
        self.request(*cmd)
        return self.reply(timeout)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("exit", timeout=10)
        except Exception:
            pass
        self.proc.join(5)
        self.kill()
