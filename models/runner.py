"""ModelRunner: turns a scheduled batch of sequences into one paged forward and its logits.

Over 300 lines: sizing the KV pool, the start-up warm-up and a step's inputs (ordering, tables,
checks, the device feed) all work on the runner's device, pool and limits; the CUDA graphs are
a module of their own.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from splitserve.kernels.checks import KV_FP8
from splitserve.kernels.layout import (
    allocate_kv_pool,
    check_block_ids,
    gather_blocks,
    read_blocks_bytes,
    scatter_blocks,
    write_blocks_bytes,
)
from splitserve.kvstore.hashing import DEFAULT_BLOCK_SIZE
from splitserve.kvstore.tp_shards import kv_heads_of
from splitserve.models.config import ModelConfig
from splitserve.models.layers import AttentionMetadata
from splitserve.models.llama import LlamaForCausalLM
from splitserve.models.rank_channel import READ, SHARDS, STEP, STOP, WRITE, RankChannel

logger = logging.getLogger(__name__)

# ``RunnerConfig.kv_cache_dtype`` → the pool's dtype (None: the model's).
KV_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": KV_FP8}
ABANDON_TIMEOUT_S = 1.0  # ``abandon``: how long a rank gets to see its stdin close before a kill
DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


@dataclass(slots=True)
class SequenceInput:
    """One sequence's share of a forward.

    ``token_ids``: the tokens whose K/V this step computes (a whole prompt, a chunk of it, or
    the one token of a decode step); ``start_pos``: how many tokens of the sequence are already
    in the KV cache; ``block_ids``: its block table, covering ``start_pos + len(token_ids)``.
    """

    token_ids: Sequence[int]
    start_pos: int
    block_ids: Sequence[int]
    # >= 0: the one new token is row ``feed_row`` of the previous step's sampled tokens, still
    # on the device (``token_ids`` then holds a stand-in); see ``ModelRunner.prepare``'s feed.
    feed_row: int = -1


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: int | None = None  # CPU, or to override the GPU's measured budget
    use_cuda_graph: bool = True
    graph_batch_sizes: tuple[int, ...] = DEFAULT_GRAPH_BATCH_SIZES
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) or fp8 (e4m3, per-layer scales)

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r}: use one of {', '.join(KV_DTYPES)}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.block_size < 16 or self.block_size % 16:
            raise ValueError(f"block_size must be a multiple of 16, got {self.block_size}")


class ModelRunner:
    """Runs the forwards of one model (of one rank's shards under tensor parallelism).

    Tensor parallelism (``model.tp``, models/parallel.py): every rank builds its runner alike —
    the pool holds the rank's KV heads, the number of blocks is the least any rank can hold, the
    warm-up and the CUDA graphs run in step — then rank 0 is the engine's runner and the others
    call ``follow``: rank 0's ``execute``, ``read_blocks`` and ``write_blocks`` send each
    operation to them first (models/rank_channel.py), and ``close`` lets them go. Blocks read
    or written through the runner are whole-heads blocks at any parallel size (what a node at
    another size holds for the same hash): rank 0 assembles and splits them.
    """

    def __init__(
        self, config: ModelConfig, model: LlamaForCausalLM, runner_config: RunnerConfig
    ) -> None:
        self.config = config
        self.model = model
        self.tp = model.tp
        self.rc = runner_config
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        # The KV pool's: the model's, or e4m3 (``kv_cache_dtype="fp8"``: each layer's values
        # divided by its K and V scales, models.layers.PagedAttention.kv_scales).
        self.kv_dtype = KV_DTYPES[runner_config.kv_cache_dtype] or self.dtype
        if self.kv_dtype == KV_FP8 and self.device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(self.device)
            if (major, minor) < (8, 9):
                raise ValueError(
                    f"--kv-cache-dtype fp8 needs a GPU with FP8 (compute capability 8.9 or more: "
                    f"Ada, Hopper); {torch.cuda.get_device_name(self.device)} is {major}.{minor}"
                )
        self.block_size = runner_config.block_size
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        self.num_kv_heads = len(model.shards.kv_heads)  # this rank's
        self.channel = RankChannel(self.tp, self.device) if self.tp.size > 1 else None
        # run by ``close`` (the ranks' processes); each takes ``timeout`` (``abandon``'s, short)
        self.closers: list[Callable[..., None]] = []
        self._abandoned = False
        # Rank 0: called with the error when an operation of the group fails (a rank went; the
        # group cannot compute any more), before the error propagates.
        self.on_group_error: Callable[[BaseException], None] | None = None
        self.num_blocks = self._count_kv_blocks()
        self.kv_pool = allocate_kv_pool(
            self.num_blocks,
            config.num_layers,
            self.block_size,
            self.num_kv_heads,
            config.head_dim,
            self.kv_dtype,
            self.device,
        )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GB, %d tokens)",
            self.num_blocks,
            self.block_size,
            self.kv_pool.numel() * self.kv_pool.element_size() / 1e9,
            (self.num_blocks - 1) * self.block_size,
        )
        self.graphs = None
        if self.device.type == "cuda":
            self._warmup()
        if self.device.type == "cuda" and runner_config.use_cuda_graph:
            from splitserve.models.cuda_graph import DecodeGraphs

            # NOTE: the ignore: pyright reads this file at two paths (pyproject.toml's NOTE).
            self.graphs = DecodeGraphs(self, runner_config.graph_batch_sizes)  # pyright: ignore[reportArgumentType]

    # ------------------------------------------------------------------ KV pool sizing

    @property
    def block_bytes(self) -> int:
        """One block of this rank's pool (its KV heads), over all layers."""
        return (
            self.block_size
            * self.config.kv_bytes_per_token(self.kv_dtype)
            // (self.config.num_kv_heads // self.num_kv_heads)
        )

    @property
    def transfer_block_bytes(self) -> int:
        """One whole-heads block, as ``read_blocks`` returns it (= ``block_bytes`` at TP 1)."""
        return self.block_size * self.config.kv_bytes_per_token(self.kv_dtype)

    def _count_kv_blocks(self) -> int:
        budget = self.rc.kv_cache_bytes
        if budget is None:
            if self.device.type != "cuda":
                raise ValueError("on CPU the KV cache size must be given (kv_cache_bytes)")
            budget = self._measure_gpu_kv_budget()
        elif self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0] - (1 << 30)  # as measured budgets
            if budget > free:
                mib = 1 << 20
                raise ValueError(
                    f"a KV pool of {budget // mib} MiB does not fit: {max(free, 0) // mib} MiB "
                    "of the GPU is free after the weights (less 1 GiB); lower --kv-cache-mb"
                )
        num_blocks = int(budget // self.block_bytes)
        if self.tp.size > 1:  # every rank holds the same block ids: the least any can hold
            agreed = torch.tensor([num_blocks], dtype=torch.int64, device=self.device)
            num_blocks = int(self.tp.all_reduce(agreed, op="min").item())
        if num_blocks < 2:
            raise ValueError(
                f"KV cache budget {budget / 1e9:.3f} GB holds fewer than 2 blocks of "
                f"{self.block_bytes} bytes; raise gpu_memory_utilization or kv_cache_bytes"
            )
        return num_blocks

    def _measure_gpu_kv_budget(self) -> int:
        """Free memory after the weights and one forward of ``max_num_batched_tokens`` tokens
        (the activation peak), under ``gpu_memory_utilization`` of the device."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = self.rc.max_num_batched_tokens
        scratch = allocate_kv_pool(
            2,
            self.config.num_layers,
            self.block_size,
            self.num_kv_heads,
            self.config.head_dim,
            self.kv_dtype,
            self.device,
        )
        # One long sequence whose writes all go to padding slots: only activations count.
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.full((tokens,), -1, dtype=torch.long, device=self.device),
            block_table=torch.zeros(
                (1, -(-tokens // self.block_size)), dtype=torch.int32, device=self.device
            ),
            seq_lens=torch.tensor([tokens], dtype=torch.int32, device=self.device),
            cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=self.device),
            max_query_len=tokens,
            is_decode=False,
        )
        with torch.inference_mode():
            hidden = self.model(ids, torch.arange(tokens, device=self.device), scratch, meta)
            self.model.compute_logits(hidden[-self.rc.max_num_seqs :])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # NOTE: gpu_memory_utilization is this process's share of the device (several nodes may
        # share one GPU); the pool also never takes more than is free right now, less a margin
        # for the allocator and the CUDA graphs.
        budget = min(total * self.rc.gpu_memory_utilization - peak, free - (1 << 30))
        logger.info(
            "GPU memory: %.1f GB total, %.1f GB free, peak %.1f GB with weights and "
            "activations: %.1f GB for the KV cache",
            total / 1e9,
            free / 1e9,
            peak / 1e9,
            budget / 1e9,
        )
        return max(int(budget), 0)

    @torch.inference_mode()
    def _warmup(self) -> None:
        """Compile every kernel variant a step can need (prefill tilings chosen by query length,
        single- and multi-split decode) now, so no request waits for a JIT compile later.
        Writes go to padding slots and reads to the null block: the pool is untouched."""
        t0 = time.perf_counter()
        dev, bs = self.device, self.block_size
        limit = min(self.rc.max_num_batched_tokens, self.config.max_model_len)
        # (query lengths, block table width): one per prefill tiling, then decode with many
        # splits (one sequence, a long table) and with one (a full batch, a short table).
        shapes = [([n], -(-n // bs)) for n in (16, 128, 1024) if n <= limit]
        shapes += [([1], self.max_blocks_per_seq), ([1] * self.rc.max_num_seqs, 1)]
        # A mixed step: one-token sequences (decode kernel) beside a prompt chunk (prefill).
        if limit >= 132 and self.rc.max_num_seqs >= 5:
            shapes.append(([1, 1, 1, 1, 128], -(-128 // bs)))
        for q_lens, width in shapes:
            n, t = len(q_lens), sum(q_lens)
            meta = self._padding_meta(q_lens, width)
            nd = sum(1 for q in q_lens if q == 1)
            if 0 < nd < n:
                meta.num_decodes = nd
                meta.prompt_part = self._padding_meta(q_lens[nd:], width)
            ids = torch.zeros(t, dtype=torch.long, device=dev)
            hidden = self.model(ids, torch.zeros_like(ids), self.kv_pool, meta)
            self.model.compute_logits(hidden[:n])
        torch.cuda.synchronize()
        logger.info("kernel warm-up took %.1f s", time.perf_counter() - t0)

    def _padding_meta(self, q_lens: list[int], width: int) -> AttentionMetadata:
        """Metadata whose writes go to padding slots and whose reads go to the null block."""
        dev, t = self.device, sum(q_lens)
        return AttentionMetadata(
            slot_mapping=torch.full((t,), -1, dtype=torch.long, device=dev),
            block_table=torch.zeros((len(q_lens), width), dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(q_lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(
                [0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=dev
            ),
            max_query_len=max(q_lens),
            is_decode=max(q_lens) == 1,
        )

    # ------------------------------------------------------------------ forward

    def prepare(
        self, seqs: Sequence[SequenceInput], feed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, bool]:
        """Flat input ids, positions and attention metadata for ``seqs``, on the device.

        Validates the block tables here, once per step, so the kernels need not. In a step that
        mixes one-token sequences with prompt chunks, the one-token ones go first (the decode
        kernel takes them: ``AttentionMetadata.num_decodes``); ``meta.last_rows`` says where each
        sequence's last token landed, in the order of ``seqs`` (set only when they were reordered).

        ``feed``: the previous step's sampled tokens on the device; a sequence with a
        ``feed_row`` takes its input token from there, copied on the device (the host never
        waits for that step to finish)."""
        num_seqs = len(seqs)
        if num_seqs == 0:
            raise ValueError("empty batch")
        q_lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=num_seqs)
        if (q_lens < 1).any():
            raise ValueError("every sequence needs >= 1 new token and a start_pos >= 0")
        is_decode = bool((q_lens == 1).all())
        order = None
        num_decodes = 0
        if not is_decode:
            ones = q_lens == 1
            num_decodes = int(ones.sum())
            if num_decodes:
                order = np.concatenate([np.flatnonzero(ones), np.flatnonzero(~ones)])
                seqs = [seqs[i] for i in order]
                q_lens = q_lens[order]
        input_ids, positions, meta = self._inputs(seqs, q_lens, is_decode, num_decodes)
        ends = np.cumsum(q_lens) - 1  # each sequence's last row (int64)
        fed = [i for i, seq in enumerate(seqs) if seq.feed_row >= 0]
        if fed:
            if feed is None or any(q_lens[i] != 1 for i in fed):
                raise ValueError("a fed sequence needs the feed and exactly one new token")
            rows = np.fromiter((seqs[i].feed_row for i in fed), dtype=np.int64, count=len(fed))
            input_ids[self._to_device(ends[fed])] = feed[self._to_device(rows)]
        if order is not None:  # where each sequence's last token went, in the caller's order
            meta.last_rows = self._to_device(ends[np.argsort(order)])
        return input_ids, positions, meta, is_decode

    def _inputs(
        self, seqs: Sequence[SequenceInput], q_lens: np.ndarray, is_decode: bool, num_decodes: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        num_seqs = len(seqs)
        starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=num_seqs)
        if (starts < 0).any():
            raise ValueError("every sequence needs >= 1 new token and a start_pos >= 0")
        seq_lens = starts + q_lens
        if seq_lens.max() > self.config.max_model_len:
            raise ValueError(
                f"a sequence of {int(seq_lens.max())} tokens exceeds max_model_len "
                f"{self.config.max_model_len}"
            )
        block_table = self._block_table(seqs, seq_lens)
        cu = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu[1:])
        seq_idx = np.repeat(np.arange(num_seqs), q_lens)
        positions = (
            np.arange(int(cu[-1]), dtype=np.int64)
            - np.repeat(cu[:-1], q_lens)
            + np.repeat(starts, q_lens)
        )
        slots = block_table[seq_idx, positions // bs].astype(np.int64) * bs + positions % bs
        input_ids = np.fromiter(
            (t for s in seqs for t in s.token_ids), dtype=np.int64, count=int(cu[-1])
        )
        if input_ids.min() < 0 or input_ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")
        put = self._to_device
        meta = AttentionMetadata(
            slot_mapping=put(slots),
            block_table=put(block_table),
            seq_lens=put(seq_lens.astype(np.int32)),
            cu_seqlens_q=put(cu),
            max_query_len=int(q_lens.max()),
            is_decode=is_decode,
            checked=True,  # block ids, lengths, slots and token ids: all checked above
        )
        if num_decodes:
            nd = num_decodes
            meta.num_decodes = nd
            meta.prompt_part = AttentionMetadata(
                slot_mapping=meta.slot_mapping,  # (unused: the cache is written for all rows)
                block_table=put(np.ascontiguousarray(block_table[nd:])),
                seq_lens=put(seq_lens[nd:].astype(np.int32)),
                cu_seqlens_q=put(cu[nd:] - cu[nd]),
                max_query_len=int(q_lens[nd:].max()),
                is_decode=False,
                checked=True,
            )
        return put(input_ids), put(positions), meta

    def _block_table(self, seqs: Sequence[SequenceInput], seq_lens: np.ndarray) -> np.ndarray:
        """``[num_seqs, widest table]`` block ids, zero-padded (block 0 is the null block);
        ``ValueError`` when a table is too short for its sequence or names a block not here."""
        bs = self.block_size
        block_table = np.zeros((len(seqs), int(-(-seq_lens.max() // bs))), dtype=np.int32)
        for i, s in enumerate(seqs):
            need = -(-int(seq_lens[i]) // bs)
            if len(s.block_ids) < need:
                raise ValueError(
                    f"sequence {i} has {len(s.block_ids)} blocks for "
                    f"{int(seq_lens[i])} tokens ({need} needed)"
                )
            block_table[i, :need] = s.block_ids[:need]
        if block_table.max() >= self.num_blocks or block_table.min() < 0:
            raise ValueError(f"block ids must be in [0, {self.num_blocks})")
        # Block 0 is the null block (the padding above): a sequence's own blocks are never it.
        used = np.arange(block_table.shape[1]) * bs < seq_lens[:, None]
        if (block_table[used] == 0).any():
            raise ValueError("a sequence's block table names the reserved null block 0")
        return block_table

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        # NOTE: through pinned memory so the copy is asynchronous; on CPU the array is used as is.
        return (
            t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t
        )

    @torch.inference_mode()
    def execute(
        self,
        seqs: Sequence[SequenceInput],
        feed: torch.Tensor | None = None,
        layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run one forward; returns float32 logits ``[len(seqs), vocab]`` of each sequence's last
        new token (for a prompt chunk that is not the last, the caller ignores them). ``feed``:
        see ``prepare``. ``layer_done(i)``: called once each layer's forward is queued, in an
        eager forward on one rank (a layer-wise KV stream's cue; a CUDA graph replay or a
        tensor-parallel step calls it for none)."""
        self._check_open()
        input_ids, positions, meta, _ = self.prepare(seqs, feed)
        if self.channel is None:
            self.model.layer_done = layer_done
            try:
                return self.forward(input_ids, positions, meta, len(seqs))
            finally:
                self.model.layer_done = None
        channel = self.channel

        def step() -> torch.Tensor:
            channel.send_step(input_ids, positions, meta)  # the other ranks run it too
            return self.forward(input_ids, positions, meta, len(seqs))

        return self._in_group(step)

    def _check_open(self) -> None:
        if self.tp.size > 1 and self.channel is None and self.tp.rank == 0:
            raise RuntimeError("this runner's tensor-parallel group was closed")

    def _in_group(self, op: Callable[[], Any]) -> Any:
        """Run an operation of the whole group (its inputs already checked, so it fails only
        when the group does); ``on_group_error`` hears of a failure."""
        try:
            return op()
        except Exception as exc:
            if self.on_group_error is not None:
                self.on_group_error(exc)
            raise

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        num_seqs: int,
    ) -> torch.Tensor:
        """The forward of prepared inputs (``prepare``): logits of each sequence's last row."""
        if meta.is_decode and self.graphs is not None and self.graphs.can_run(num_seqs):
            return self.graphs.run(input_ids, positions, meta)
        hidden = self.model(input_ids, positions, self.kv_pool, meta)
        last = meta.last_rows
        if last is None:  # the sequences kept their order
            last = meta.cu_seqlens_q[1:].long() - 1
        return self.model.compute_logits(hidden[last])

    # ------------------------------------------------------------------ blocks, whole heads

    def read_blocks(self, block_ids: Sequence[int]) -> bytes:
        """The blocks' bytes over all layers and every KV head, in order (what a node of any
        tensor parallel size reads and writes for these hashes)."""
        self._check_open()
        if self.channel is None:
            return read_blocks_bytes(self.kv_pool, list(block_ids))
        ids = check_block_ids(self.kv_pool, torch.tensor(list(block_ids), dtype=torch.int64))
        channel, out = self.channel, []
        for chunk in ids.split(self._group_chunk()):

            def read(chunk: torch.Tensor = chunk) -> torch.Tensor | None:
                channel.send_read(chunk)
                return self._gather_heads(chunk)

            whole = self._in_group(read)
            assert whole is not None  # rank 0 assembles
            out.append(whole.view(torch.uint8).cpu().numpy().tobytes())
        return b"".join(out)

    def write_blocks(self, block_ids: Sequence[int], data: bytes) -> None:
        """Write whole-heads blocks (as ``read_blocks`` returns them) into ``block_ids``."""
        self._check_open()
        if self.channel is None:
            write_blocks_bytes(self.kv_pool, list(block_ids), data)
            return
        ids = check_block_ids(self.kv_pool, torch.tensor(list(block_ids), dtype=torch.int64))
        n, size = ids.numel(), self.transfer_block_bytes
        if len(data) != n * size:
            raise ValueError(f"got {len(data)} bytes for {n} blocks of {size} bytes")
        if not n:
            return
        if bool((ids == 0).any()) or torch.unique(ids).numel() != n:
            raise ValueError("block ids must be distinct and never the null block 0")
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.kv_dtype)
        whole = flat.view(n, *self._whole_block_shape())
        channel, step = self.channel, self._group_chunk()
        for first in range(0, n, step):
            chunk, part = ids[first : first + step], whole[first : first + step]

            def write(chunk: torch.Tensor = chunk, part: torch.Tensor = part) -> None:
                channel.send_write(chunk)
                self._scatter_heads(chunk, part.to(self.device))

            self._in_group(write)

    def _whole_block_shape(self) -> tuple[int, ...]:
        c = self.config
        return (c.num_layers, 2, self.block_size, c.num_kv_heads, c.head_dim)

    def _group_chunk(self) -> int:
        """Blocks per group read or write: whole heads of at most ~64 MiB on rank 0 at once."""
        return max(1, (64 << 20) // self.transfer_block_bytes)

    def _gather_heads(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Every rank's heads of blocks ``ids``, assembled on rank 0 (None elsewhere)."""
        parts = self.tp.gather(gather_blocks(self.kv_pool, ids.to(self.device)))
        if parts is None:
            return None
        whole = torch.empty(
            (ids.numel(), *self._whole_block_shape()), dtype=self.kv_dtype, device=self.device
        )
        for rank, part in enumerate(parts):
            heads = kv_heads_of(self.config.num_kv_heads, self.tp.size, rank)
            whole[..., heads.start : heads.stop, :] = part
        return whole

    def _scatter_heads(self, ids: torch.Tensor, whole: torch.Tensor | None) -> None:
        """Rank 0 hands every rank its heads of ``whole`` (rank 0's: None elsewhere), and each
        writes them into blocks ``ids``."""
        parts = None
        if whole is not None:
            parts = [
                whole[..., h.start : h.stop, :]
                for h in (
                    kv_heads_of(self.config.num_kv_heads, self.tp.size, r)
                    for r in range(self.tp.size)
                )
            ]
        mine = torch.empty(
            (ids.numel(), *self.kv_pool.shape[1:]), dtype=self.kv_dtype, device=self.device
        )
        self.tp.scatter(parts, mine)
        scatter_blocks(self.kv_pool, ids.to(self.device), mine)

    # ------------------------------------------------------------------ the other ranks

    def send_shards(self, payload: bytes) -> None:
        """On rank 0 of a parallel group: hand the other ranks' KV transfer agents ``payload``
        (on the thread that steps: the channel's messages are the group's, in order)."""
        self._check_open()
        channel = self.channel
        if channel is None:
            raise RuntimeError("send_shards is for rank 0 of a parallel group")
        self._in_group(lambda: channel.send_shards(payload))

    def follow(self, on_shards: Callable[[bytes], None] | None = None) -> None:
        """On a rank other than 0: run what rank 0 sends until it says stop. ``on_shards``:
        takes the KV transfer agent's messages (it must not block)."""
        if self.channel is None or self.tp.rank == 0:
            raise RuntimeError("follow() is for the ranks other than 0 of a parallel group")
        with torch.inference_mode():
            while True:
                msg = self.channel.receive()
                if msg.op == STOP:
                    self.channel.leave()
                    return
                if msg.op == STEP and msg.step is not None:
                    self.forward(*msg.step)
                elif msg.op == READ and msg.block_ids is not None:
                    self._gather_heads(msg.block_ids)
                elif msg.op == WRITE and msg.block_ids is not None:
                    self._scatter_heads(msg.block_ids, None)
                elif msg.op == SHARDS and on_shards is not None:
                    on_shards(msg.payload)

    def abandon(self) -> None:
        """On rank 0 of a parallel group that cannot stop in order (a step stuck in a collective,
        a rank stopped): end the other ranks now, sending nothing over the group (idempotent).
        The thread stuck in the step is left to fail or to the process's exit."""
        if self.tp.rank != 0 or self._abandoned:
            return
        self._abandoned = True
        self.channel = None  # (``close`` may be stuck sending the stop: it took it already)
        for close in self.closers:
            try:
                close(timeout=ABANDON_TIMEOUT_S)
            except Exception as exc:
                logger.warning("ending the tensor-parallel ranks: %s", exc)

    def close(self) -> None:
        """On rank 0 of a parallel group: let the other ranks go (idempotent)."""
        if self.channel is not None and self.tp.rank == 0:
            channel, self.channel = self.channel, None
            try:
                channel.send_stop()
            except Exception as exc:  # a rank went already: stop what is left all the same
                logger.warning("tensor-parallel ranks did not all take the stop: %s", exc)
            finally:
                for close in self.closers:
                    close()
