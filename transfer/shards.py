"""KV rank to rank: ``kvstore.tp_shards.transfer_plan`` carried out over one group that holds every
rank of a sending pool (tensor parallel size ``p``) and of a receiving pool (size ``d``).

Under tensor parallelism a block's KV is spread over the ranks, each holding its heads
(``kv_heads_of``). Sending it through rank 0 (gather, bytes, scatter) moves every byte twice and
through one process. Here every rank sends or receives only its own pieces, straight from and
into its own pool: sender rank ``s`` cuts heads ``[src_offset, src_offset + count)`` of the
shipped blocks out of its shard (one ``index_select`` of a head slice: a contiguous buffer) and
sends it to receiver rank ``r``, which receives it and copies it into heads ``[dst_offset, ...)``
of its reserved blocks. Pools of equal size send each rank's whole shard to the same rank; a
pool of 1 sends each receiver the heads it holds; replicated heads (size above the KV heads) are
sent once, by one of their holders.

The group (``ShardGroup``): receiver ranks first, ``0 .. d-1``, then sender ranks ``d .. d+p-1``;
built on a store like the dist path's pair groups (gloo on CPU, NCCL on CUDA). A transfer is one
``send_shards`` on every sender rank and one ``receive_shards`` on every receiver rank, with the
same plan, block counts and ``tag``; each returns once its own pieces are through. What a rank
receives is checked against its pool (shape, dtype) before anything is written, and nothing is
written until all of that rank's pieces arrived: a transfer that fails or times out leaves the
pool as it was.

Between nodes this is the dist path's group when either side's tensor parallel size is above 1
(``transfer.dist``: the pair group is then this group, its rank 0 the receiver's rank 0 and its
rank ``d`` the sender's). The dist sides run on rank 0 of each engine; they reach the engine's
other ranks through a ``RankLink`` (the engine's rank channel: ``models.rank_channel.SHARDS``),
whose messages a ``ShardAgent`` on every other rank serves on a thread of its own: ``join`` a
group, ``recv`` or ``send`` its pieces of one transfer and then acknowledge it to its leader
(group rank 0 or ``d``, on ``TAG_ACK``), ``leave``. Its leader counts the acknowledgements before
it calls the transfer done, so the receiver's rank 0 ends a reservation only once every rank's
heads are in.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgpack
import torch

from splitserve.kvstore.tp_shards import Piece, kv_heads_of, transfer_plan
from splitserve.transfer.errors import TransferTimeout
from splitserve.transfer.reservation import check_block_ids, check_source_ids

logger = logging.getLogger(__name__)

HEAD_DIM = 4  # pools are (blocks, layers, 2, block_size, kv_heads, head_dim)
TAG_PIECES = 1  # a transfer's pieces (the dist path's data tag)
TAG_ACK = 3  # a rank's word to its leader that its part of a transfer is through (1) or not (0)


@dataclass(frozen=True)
class RankLink:
    """What rank 0's transfer sides need of a tensor-parallel engine's other ranks: its size, the
    model's KV heads, and ``command(payload, wait)``, which hands every other rank's
    ``ShardAgent`` a message (encoded by ``encode``) in order; ``wait``: until it is sent."""

    tp: int
    num_kv_heads: int
    command: Callable[[bytes, bool], None]


def encode(op: str, **fields: Any) -> bytes:
    packed = msgpack.packb({"op": op, **fields}, use_bin_type=True)
    assert packed is not None
    return packed


@dataclass(frozen=True)
class ShardGroup:
    """The numbering of a group of a receiving pool's ``receiver_tp`` ranks and a sending pool's
    ``sender_tp`` ranks, and the plan between them."""

    num_kv_heads: int
    sender_tp: int
    receiver_tp: int

    @property
    def size(self) -> int:
        return self.receiver_tp + self.sender_tp

    def receiver(self, rank: int) -> int:
        """Group rank of receiver rank ``rank``."""
        if not 0 <= rank < self.receiver_tp:
            raise ValueError(f"receiver rank {rank} of {self.receiver_tp}")
        return rank

    def sender(self, rank: int) -> int:
        """Group rank of sender rank ``rank``."""
        if not 0 <= rank < self.sender_tp:
            raise ValueError(f"sender rank {rank} of {self.sender_tp}")
        return self.receiver_tp + rank

    def plan(self) -> list[Piece]:
        return transfer_plan(self.num_kv_heads, self.sender_tp, self.receiver_tp)

    def sent_by(self, rank: int) -> list[Piece]:
        self.sender(rank)
        return [p for p in self.plan() if p.sender == rank]

    def received_by(self, rank: int) -> list[Piece]:
        self.receiver(rank)
        return [p for p in self.plan() if p.receiver == rank]

    def check_pool(self, pool: torch.Tensor, tp: int, rank: int) -> None:
        """``ValueError`` unless ``pool`` holds exactly the heads rank ``rank`` of ``tp`` holds."""
        if pool.dim() != 6:
            raise ValueError(f"a KV pool has 6 dimensions, got shape {tuple(pool.shape)}")
        heads = len(kv_heads_of(self.num_kv_heads, tp, rank))
        if pool.shape[HEAD_DIM] != heads:
            raise ValueError(
                f"rank {rank} of tensor parallel size {tp} holds {heads} KV heads of "
                f"{self.num_kv_heads}; its pool has {pool.shape[HEAD_DIM]}"
            )


def _head_slice(pool: torch.Tensor, offset: int, count: int) -> torch.Tensor:
    return pool.narrow(HEAD_DIM, offset, count)


def _piece_shape(pool: torch.Tensor, num_blocks: int, count: int) -> tuple[int, ...]:
    shape = list(pool.shape)
    shape[0], shape[HEAD_DIM] = num_blocks, count
    return tuple(shape)


def _wait(works: Sequence[Any], timeout_s: float, what: str) -> None:
    for work in works:
        try:
            ok = work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # gloo: a timeout or a lost peer
            raise TransferTimeout(f"{what}: {exc}") from exc
        if ok is False:
            raise TransferTimeout(f"{what}: not through within {timeout_s:g} s")


def send_shards(
    pg: Any,
    group: ShardGroup,
    rank: int,
    pool: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    tag: int = 0,
    timeout_s: float = 30.0,
) -> int:
    """On sender rank ``rank``: send its pieces of blocks ``block_ids`` (its pool, its heads) to
    the receiver ranks the plan names. Returns the bytes sent."""
    group.sender(rank)
    group.check_pool(pool, group.sender_tp, rank)
    ids = torch.tensor(check_source_ids(block_ids, pool.shape[0]), dtype=torch.int64)
    ids = ids.to(pool.device)
    works, buffers, sent = [], [], 0
    for piece in group.sent_by(rank):
        # As bytes: every backend moves uint8, whatever the pool's dtype (bf16, fp8).
        buf = _head_slice(pool, piece.src_offset, piece.count).index_select(0, ids)
        raw = buf.view(torch.uint8)
        buffers.append(raw)  # alive until sent
        works.append(pg.send([raw], group.receiver(piece.receiver), tag))
        sent += raw.numel()
    _wait(works, timeout_s, f"sender rank {rank}: sending {ids.numel()} blocks")
    return sent


def receive_shards(
    pg: Any,
    group: ShardGroup,
    rank: int,
    pool: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    tag: int = 0,
    timeout_s: float = 30.0,
    write: bool = True,
) -> int:
    """On receiver rank ``rank``: receive its pieces of the shipped blocks and write them into
    ``block_ids`` of its pool (the reserved destinations, in the senders' order). Nothing is
    written unless every piece arrived (nor ever with ``write`` False: a transfer whose
    reservation ended, received to keep the group in step and dropped). Returns the bytes
    received."""
    group.receiver(rank)
    group.check_pool(pool, group.receiver_tp, rank)
    ids = torch.tensor(check_block_ids(block_ids, pool.shape[0]), dtype=torch.int64)
    ids = ids.to(pool.device)
    pieces = group.received_by(rank)
    buffers = [
        torch.empty(_piece_shape(pool, ids.numel(), p.count), dtype=pool.dtype, device=pool.device)
        for p in pieces
    ]
    works = [
        pg.recv([buf.view(torch.uint8)], group.sender(p.sender), tag)
        for p, buf in zip(pieces, buffers, strict=True)
    ]
    _wait(works, timeout_s, f"receiver rank {rank}: receiving {ids.numel()} blocks")
    if not write:
        return sum(b.numel() * b.element_size() for b in buffers)
    for piece, buf in zip(pieces, buffers, strict=True):
        _head_slice(pool, piece.dst_offset, piece.count).index_copy_(0, ids, buf)
    if pool.device.type == "cuda":
        torch.cuda.current_stream(pool.device).synchronize()
    return sum(b.numel() * b.element_size() for b in buffers)


def send_ack(pg: Any, leader: int, ok: bool, timeout_s: float, device: Any = "cpu") -> None:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device)
    _wait([pg.send([flag], leader, TAG_ACK)], timeout_s, "acknowledging a transfer")


def receive_acks(pg: Any, ranks: Sequence[int], timeout_s: float, device: Any = "cpu") -> None:
    """A leader: every one of ``ranks`` says its part went through, or ``TransferError``."""
    from splitserve.transfer.errors import TransferError

    flags = [torch.zeros(1, dtype=torch.int64, device=device) for _ in ranks]
    works = [pg.recv([flag], rank, TAG_ACK) for rank, flag in zip(ranks, flags, strict=True)]
    _wait(works, timeout_s, "waiting for the other ranks' part")
    failed = [rank for rank, flag in zip(ranks, flags, strict=True) if int(flag.item()) != 1]
    if failed:
        raise TransferError(f"group ranks {failed} could not do their part of the transfer")


class ShardAgent:
    """On a rank other than 0 of a tensor-parallel engine: its part of the transfers rank 0's
    dist sides run with peer nodes. ``handle`` (the rank's loop, for each ``SHARDS`` message)
    never blocks: each group is served by a thread of its own, in the order of its messages."""

    def __init__(self, kv_pool: torch.Tensor, tp_rank: int, tp_size: int, num_kv_heads: int):
        self.kv_pool = kv_pool
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_kv_heads = num_kv_heads
        self._members: dict[str, _Member] = {}

    def handle(self, payload: bytes) -> None:
        try:
            self._handle(payload)
        except Exception as exc:  # never into the rank's loop: its steps go on
            logger.error("a transfer message from rank 0 could not be taken: %r", exc)

    def _handle(self, payload: bytes) -> None:
        message = msgpack.unpackb(payload, raw=False)
        op, gid = message["op"], str(message["gid"])
        if op == "join":
            old = self._members.pop(gid, None)
            if old is not None:
                old.leave()
            member = _Member(self, gid, message)
            self._members[gid] = member
            member.start()
        elif op == "leave":
            member = self._members.pop(gid, None)
            if member is not None:
                member.leave()
        elif op in ("send", "recv"):
            member = self._members.get(gid)
            if member is None:  # its leader times out waiting for this rank's word
                logger.warning("a %s for group %s this rank is not in", op, gid)
            else:
                member.work.put(message)
        else:
            logger.error("an unknown transfer message %r from rank 0", op)

    def close(self) -> None:
        for member in self._members.values():
            member.leave()
        self._members.clear()


class _Member:
    """This rank in one group: builds it, then runs its part of each transfer in order."""

    def __init__(self, agent: ShardAgent, gid: str, join: dict) -> None:
        self.agent, self.gid, self.join = agent, gid, join
        self.work: queue.Queue[dict | None] = queue.Queue()
        self.layout = ShardGroup(
            int(join["num_kv_heads"]), int(join["sender_tp"]), int(join["receiver_tp"])
        )
        self.role = str(join["role"])
        if self.role == "rx":
            self.rank = self.layout.receiver(agent.tp_rank)
            self.leader = self.layout.receiver(0)
        else:
            self.rank = self.layout.sender(agent.tp_rank)
            self.leader = self.layout.sender(0)
        self._pg: Any = None
        self._thread = threading.Thread(target=self._main, name=f"kv-shards-{gid}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def leave(self) -> None:
        self.work.put(None)

    def _connect(self) -> Any:
        from torch.distributed import PrefixStore  # pyright: ignore[reportPrivateImportUsage]

        from splitserve.transfer.dist.gate import open_tunnel
        from splitserve.transfer.dist.group import make_group, store_client

        j, timeout = self.join, float(self.join["timeout"])
        host, port = str(j["host"]), int(j["port"])
        if j.get("key"):  # the receiver's store behind its gate: a tunnel of this process's own
            port = open_tunnel(host, port, bytes(j["key"]), timeout)
            host = "127.0.0.1"
        store = PrefixStore(str(j["prefix"]), store_client(host, port, timeout))
        size = self.layout.size
        return make_group(store, self.rank, size, str(j["backend"]), timeout, str(j["bind"]))

    def _main(self) -> None:
        pool = self.agent.kv_pool
        if pool.device.type == "cuda":
            torch.cuda.set_device(pool.device)
        try:
            self._pg = self._connect()
        except Exception as exc:
            logger.error("joining KV transfer group %s failed: %s", self.gid, exc)
            return  # its leader's group construction fails or times out
        tp_rank = self.agent.tp_rank
        while True:
            message = self.work.get()
            if message is None:
                break
            deadline = time.monotonic() + float(message["timeout"])
            ok = False
            try:
                ids = [int(i) for i in message["ids"]]
                if message["op"] == "recv":
                    receive_shards(
                        self._pg, self.layout, tp_rank, pool, ids, tag=TAG_PIECES,
                        timeout_s=float(message["timeout"]), write=bool(message["keep"]),
                    )  # fmt: skip
                else:
                    send_shards(
                        self._pg, self.layout, tp_rank, pool, ids, tag=TAG_PIECES,
                        timeout_s=float(message["timeout"]),
                    )  # fmt: skip
                ok = True
            except Exception as exc:
                logger.warning("rank %d's part of a KV transfer failed: %s", tp_rank, exc)
            try:
                left = max(deadline - time.monotonic(), 1.0)
                send_ack(self._pg, self.leader, ok, left, pool.device)
            except Exception as exc:  # the leader gave up on the group: it sends "leave"
                logger.warning("rank %d could not acknowledge a KV transfer: %s", tp_rank, exc)
        pg, self._pg = self._pg, None
        if pg is not None and pool.device.type == "cuda":
            with contextlib.suppress(Exception):
                pg.abort()
