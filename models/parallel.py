"""Tensor parallelism inside a node, Megatron-style (the layout vLLM and SGLang use).

A node at tensor parallel size N runs N ranks, one process each; rank ``r`` holds:

- attention: the query heads ``[r * H/N, (r+1) * H/N)`` and the KV heads
  ``kvstore.tp_shards.kv_heads_of(Hkv, N, r)`` (each KV head replicated on N/Hkv ranks when N
  exceeds them): ``qkv_proj`` is column-parallel (its rows of q, k and v), ``o_proj``
  row-parallel (its input columns; the partial outputs are summed by one all-reduce);
- the MLP: rows ``[r * I/N, (r+1) * I/N)`` of gate and up (column-parallel), the same columns of
  ``down_proj`` (row-parallel, one all-reduce);
- the vocabulary: rows ``[r * V', (r+1) * V')`` of the embedding and of ``lm_head``, V' = ceil(V/N)
  (the last shard zero-padded): a token outside a rank's rows embeds to zero there and the
  all-reduce adds the one rank's row; logits are all-gathered and cut back to V;
- norms and the rotary tables whole.

A row-parallel bias is added once, after the all-reduce. At N = 1 every layer computes exactly
what it computed before (no collective, the bias inside the matmul).

``TPGroup`` is the rank's view of its group: a torch.distributed backend (gloo on CPU, NCCL on
GPUs) made on a store (``engine.ranks``), used through its own methods so the process's default
group stays free for other users (the dist transfer path). ``RankChannel``
(``models.rank_channel``) is how rank 0 tells the other ranks what to run: each forward's inputs,
block reads and writes, the stop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from splitserve.kernels import quant
from splitserve.kvstore.tp_shards import check_tp, kv_heads_of


@dataclass(frozen=True, slots=True)
class TPGroup:
    """Rank ``rank`` of ``size``; ``backend``: the ProcessGroup (None at size 1)."""

    rank: int = 0
    size: int = 1
    backend: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of tensor parallel size {self.size}")
        if self.size > 1 and self.backend is None:
            raise ValueError("a tensor parallel group of more than one rank needs a backend")

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (or min) ``x`` over the ranks, in place; returns it."""
        if self.size == 1:
            return x
        from torch.distributed import AllreduceOptions, ReduceOp

        opts = AllreduceOptions()
        # NOTE: the stubs type the option as ReduceOp, the constants as its inner RedOpType.
        opts.reduceOp = ReduceOp.MIN if op == "min" else ReduceOp.SUM  # pyright: ignore[reportAttributeAccessIssue]
        self.backend.allreduce([x], opts).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape and dtype on each), in rank order."""
        if self.size == 1:
            return [x]
        out = [torch.empty_like(x) for _ in range(self.size)]
        self.backend.allgather([out], [x.contiguous()]).wait()
        return out

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (same shape and dtype) on rank 0, in rank order; None elsewhere."""
        if self.size == 1:
            return [x]
        from torch.distributed import GatherOptions

        opts = GatherOptions()
        opts.rootRank = 0
        out = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else []
        sent = _wire(x.contiguous())
        self.backend.gather([[_wire(o) for o in out]] if out else [], [sent], opts).wait()
        return out or None

    def scatter(self, parts: list[torch.Tensor] | None, out: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``parts[r]`` into rank r's ``out`` (``parts``: rank 0's, one per rank)."""
        if self.size == 1:
            assert parts is not None
            return out.copy_(parts[0])
        from torch.distributed import ScatterOptions

        opts = ScatterOptions()
        opts.rootRank = 0
        given = (
            [[_wire(p.contiguous()) for p in parts]] if self.rank == 0 and parts is not None else []
        )
        self.backend.scatter([_wire(out)], given, opts).wait()
        return out

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (contiguous, same shape), in place."""
        if self.size > 1:
            self.backend.broadcast(x, 0).wait()
        return x


def _wire(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the collectives move it: a one-byte float (an FP8 KV block) as its bytes, which
    gloo takes (it has no float8 type); anything else as it is."""
    return x.view(torch.uint8) if x.dtype.is_floating_point and x.element_size() == 1 else x


SINGLE = TPGroup()


@dataclass(frozen=True, slots=True)
class Shards:
    """What rank ``tp.rank`` holds of a model of this shape (see the module docstring)."""

    heads: range  # query heads
    kv_heads: range
    intermediate: range
    vocab: range  # the rows of the padded vocabulary (may run past the real vocabulary)
    vocab_size: int

    @classmethod
    def of(cls, config: Any, tp: TPGroup) -> Shards:
        """``ValueError`` saying what to change when ``tp.size`` cannot split this model."""
        n, r = tp.size, tp.rank
        check_tp(config.num_kv_heads, n, config.num_heads)
        if config.intermediate_size % n:
            raise ValueError(
                f"tensor parallel size {n} does not divide the MLP's intermediate size "
                f"{config.intermediate_size}"
            )
        heads, inter = config.num_heads // n, config.intermediate_size // n
        per_vocab = -(-config.vocab_size // n)
        return cls(
            heads=range(r * heads, (r + 1) * heads),
            kv_heads=kv_heads_of(config.num_kv_heads, n, r),
            intermediate=range(r * inter, (r + 1) * inter),
            vocab=range(r * per_vocab, (r + 1) * per_vocab),
            vocab_size=config.vocab_size,
        )

    @property
    def vocab_rows(self) -> range:
        """The rows of the real vocabulary this rank holds (the padding excluded)."""
        return range(min(self.vocab.start, self.vocab_size), min(self.vocab.stop, self.vocab_size))


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` where this rank holds the columns of W of its share of x's features:
    the partial products are summed over the ranks, then the (whole) bias is added.

    ``fp8``: W in float8_e4m3fn with ``weight_scale`` (one float32 per output channel, of this
    rank's columns: models/quantization.py)."""

    weight_scale: torch.Tensor | None

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TPGroup, fp8: bool = False
    ) -> None:
        super().__init__()
        self.tp = tp
        if fp8:
            self.weight = nn.Parameter(
                torch.empty(out_features, in_features, dtype=quant.FP8), requires_grad=False
            )
            self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32))
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features))
            self.weight_scale = None
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def _matmul(
        self, x: torch.Tensor | quant.QuantizedRows, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if self.weight_scale is not None:
            return quant.fp8_linear(x, self.weight, self.weight_scale, bias)
        assert isinstance(x, torch.Tensor), "quantized rows need an FP8 weight"
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor | quant.QuantizedRows) -> torch.Tensor:
        if self.tp.size == 1:
            return self._matmul(x, self.bias)
        y = self.tp.all_reduce(self._matmul(x, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """The embedding rows ``shards.vocab`` of the (padded) vocabulary; every rank's lookup is
    summed, so a token gets the one row that holds it."""

    def __init__(self, shards: Shards, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp, self.start, self.rows = tp, shards.vocab.start, len(shards.vocab)
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


def gather_logits(local: torch.Tensor, tp: TPGroup, vocab_size: int) -> torch.Tensor:
    """``[n, V']`` logits of this rank's vocabulary rows → ``[n, V]`` of the whole vocabulary."""
    if tp.size == 1:
        return local
    return torch.cat(tp.all_gather(local), dim=-1)[:, :vocab_size]
