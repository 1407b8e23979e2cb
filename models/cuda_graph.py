"""Decode steps replayed from CUDA graphs, one graph per batch size, so small batches are not bound
by Python and kernel-launch overhead."""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from typing import TYPE_CHECKING

import torch

from splitserve.models.layers import AttentionMetadata

if TYPE_CHECKING:
    from splitserve.models.runner import ModelRunner

logger = logging.getLogger(__name__)


class DecodeGraphs:
    """Static input buffers sized for the largest batch, and a captured graph per batch size.

    A batch of ``b`` sequences runs the graph of the smallest captured size ``>= b``; padding rows
    write nowhere (slot -1) and read only the null block. The block table is always
    ``max_blocks_per_seq`` wide, so the decode kernel's split count is fixed at capture time.
    """

    def __init__(self, runner: ModelRunner, batch_sizes: tuple[int, ...]) -> None:
        self.runner = runner
        sizes = sorted({b for b in batch_sizes if 0 < b <= runner.rc.max_num_seqs})
        self.batch_sizes = sizes
        if not sizes:
            return
        dev, n = runner.device, sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.block_table = torch.zeros(
            (n, runner.max_blocks_per_seq), dtype=torch.int32, device=dev
        )
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for b in reversed(sizes):  # largest first, so smaller ones reuse its memory
                meta = self._meta(b)
                args = (self.input_ids[:b], self.positions[:b], runner.kv_pool, meta)
                for _ in range(2):  # warm-up: Triton compiles, allocator settles
                    runner.model.compute_logits(runner.model(*args))
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[b] = runner.model.compute_logits(runner.model(*args))
                self.graphs[b] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode CUDA graphs (batch %d..%d) in %.1f s",
            len(sizes),
            sizes[0],
            sizes[-1],
            time.perf_counter() - t0,
        )

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            block_table=self.block_table[:b],
            seq_lens=self.seq_lens[:b],
            cu_seqlens_q=self.cu_seqlens_q[: b + 1],
            max_query_len=1,
            is_decode=True,
        )

    def can_run(self, batch: int) -> bool:
        return bool(self.batch_sizes) and batch <= self.batch_sizes[-1]

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        b = input_ids.shape[0]
        size = self.batch_sizes[bisect_left(self.batch_sizes, b)]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.seq_lens[:b].copy_(meta.seq_lens)
        width = meta.block_table.shape[1]
        self.block_table[:b, :width].copy_(meta.block_table)
        self.block_table[:b, width:].zero_()
        if size > b:  # padding rows: write nowhere, read one token of the null block
            self.slot_mapping[b:size].fill_(-1)
            self.seq_lens[b:size].fill_(1)
            self.block_table[b:size].zero_()
        self.graphs[size].replay()
        return self.logits[size][:b]
