"""How rank 0 of a tensor-parallel node tells the other ranks what to do, over the group itself.

Rank 0 runs the scheduler and everything else of the engine; the other ranks only follow. Before
each operation that takes part in the group's collectives, rank 0 broadcasts a fixed-size header
(the operation and its sizes), then the operation's inputs; every other rank receives them in
the same order and runs the same operation, so every rank issues the same collectives in the
same order. The operations:

- ``STEP``: one forward — the flat input ids (already fed from the previous step's samples on
  rank 0's device), positions, slot mapping, block table, lengths, offsets, and the reordering
  and prompt-part tables a mixed step has (``AttentionMetadata``);
- ``READ``: block ids whose KV the ranks gather to rank 0 (each holds its heads);
- ``WRITE``: block ids; rank 0 then scatters each rank its heads of them;
- ``STOP``: the ranks leave their loop (after one last all-reduce, so none exits before all
  have it);
- ``SHARDS``: bytes for the ranks' KV transfer agent (``transfer.shards``: join a group with a
  peer node's ranks, send or receive this rank's pieces of a transfer), which runs them on a
  thread of its own: the loop goes on at once, and no collective of the group is involved.

Everything a step could fail on (ids, lengths, block tables) is checked on rank 0 before the
header goes, so a follower never fails where rank 0 did not: a step either runs on every rank or
on none.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from splitserve.models.layers import AttentionMetadata
from splitserve.models.parallel import TPGroup

STEP, READ, WRITE, STOP, SHARDS = 1, 2, 3, 4, 5
MAX_SHARDS_BYTES = 1 << 20  # a transfer command: a few ids per block, far below
HEADER = 10


class Step(NamedTuple):
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    num_seqs: int


class Message(NamedTuple):
    op: int
    step: Step | None = None
    block_ids: torch.Tensor | None = None
    payload: bytes = b""


class RankChannel:
    """Rank 0's sending side and the followers' receiving side of one group, on ``device`` (the
    group's: CPU for gloo, the rank's GPU for NCCL)."""

    def __init__(self, tp: TPGroup, device: torch.device) -> None:
        self.tp, self.device = tp, device

    def _header(self, *values: int) -> None:
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[: len(values)] = torch.tensor(values, dtype=torch.int64)
        if self.device.type == "cuda":  # from pinned memory: no wait for the stream's work
            header = header.pin_memory().to(self.device, non_blocking=True)
        self.tp.broadcast(header)

    def _send(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self.tp.broadcast(t.contiguous())

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.tp.broadcast(torch.empty(shape, dtype=dtype, device=self.device))

    # ------------------------------------------------------------------ rank 0

    def send_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        part = meta.prompt_part if meta.num_decodes else None
        self._header(
            STEP,
            input_ids.shape[0],
            meta.block_table.shape[0],
            meta.block_table.shape[1],
            meta.max_query_len,
            int(meta.is_decode),
            meta.num_decodes if part is not None else 0,
            int(meta.last_rows is not None),
            part.max_query_len if part is not None else 0,
        )
        self._send(input_ids, positions, meta.slot_mapping, meta.block_table, meta.seq_lens)
        self._send(meta.cu_seqlens_q)
        if meta.last_rows is not None:
            self._send(meta.last_rows)
        if part is not None:
            self._send(part.block_table, part.seq_lens, part.cu_seqlens_q)

    def send_read(self, block_ids: torch.Tensor) -> None:
        self._header(READ, block_ids.numel())
        self._send(block_ids.to(self.device, torch.int64))

    def send_write(self, block_ids: torch.Tensor) -> None:
        """(each rank's heads follow, scattered by the runner)"""
        self._header(WRITE, block_ids.numel())
        self._send(block_ids.to(self.device, torch.int64))

    def send_shards(self, payload: bytes) -> None:
        """Bytes for every other rank's KV transfer agent (``SHARDS``)."""
        if not 0 < len(payload) <= MAX_SHARDS_BYTES:
            raise ValueError(f"a SHARDS message of {len(payload)} bytes")
        self._header(SHARDS, len(payload))
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self._send(data.to(self.device))

    def send_stop(self) -> None:
        self._header(STOP)
        self.leave()

    def leave(self) -> None:
        """Every rank's last collective (after STOP): none exits before all have the STOP."""
        done = self.tp.all_reduce(torch.zeros(1, device=self.device))
        done.item()  # NOTE: an NCCL wait only orders the stream; this waits for the collective

    # ------------------------------------------------------------------ the other ranks

    def receive(self) -> Message:
        """The next message from rank 0."""
        header = self._recv((HEADER,), torch.int64).tolist()
        op = header[0]
        if op == STEP:
            return Message(STEP, step=self._receive_step(header))
        if op in (READ, WRITE):
            return Message(op, block_ids=self._recv((header[1],), torch.int64))
        if op == STOP:
            return Message(STOP)
        if op == SHARDS and 0 < header[1] <= MAX_SHARDS_BYTES:
            data = self._recv((header[1],), torch.uint8)
            return Message(SHARDS, payload=data.cpu().numpy().tobytes())
        raise RuntimeError(f"unknown tensor-parallel operation {op} from rank 0")

    def _receive_step(self, header: list[int]) -> Step:
        _, t, b, width, max_q, is_decode, nd, has_last, part_max_q = header[:9]
        i64, i32 = torch.int64, torch.int32
        input_ids, positions, slots = (self._recv((t,), i64) for _ in range(3))
        block_table = self._recv((b, width), i32)
        seq_lens = self._recv((b,), i32)
        cu = self._recv((b + 1,), i32)
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_table=block_table,
            seq_lens=seq_lens,
            cu_seqlens_q=cu,
            max_query_len=max_q,
            is_decode=bool(is_decode),
            checked=True,
        )
        if has_last:
            meta.last_rows = self._recv((b,), i64)
        if nd:
            meta.num_decodes = nd
            meta.prompt_part = AttentionMetadata(
                slot_mapping=slots,
                block_table=self._recv((b - nd, width), i32),
                seq_lens=self._recv((b - nd,), i32),
                cu_seqlens_q=self._recv((b - nd + 1,), i32),
                max_query_len=part_max_q,
                is_decode=False,
                checked=True,
            )
        return Step(input_ids, positions, meta, b)
