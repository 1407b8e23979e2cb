"""Which KV heads a tensor-parallel rank holds, and how a block's heads move between pools of
different tensor parallelism (plain Python: the model, the transfer layer and the router all use
it).

A block's identity (its hash) does not change with tensor parallelism; its bytes do: at TP ``n``
rank ``r`` holds the KV heads ``kv_heads_of(num_kv_heads, n, r)`` of every block, Megatron-style
(vLLM's and SGLang's layout): contiguous equal shards when ``n`` divides the KV heads, and each
head replicated on ``n / num_kv_heads`` consecutive ranks when ``n`` is a multiple of them (a
model with 8 KV heads at TP 16: ranks 0-1 hold head 0, ranks 2-3 head 1, ...).

``transfer_plan`` maps a prefill pool at TP ``p`` onto a decode pool at TP ``d``: for every
decode rank, the pieces of its shard and which prefill rank sends each (p > d: several senders
fill one receiver's shard; p < d: one sender's shard is split between receivers). Every head a
receiver holds is written exactly once; a head replicated on the sending side is sent by one of
its holders, chosen so the senders share the work.
"""

from __future__ import annotations

from typing import NamedTuple


class Piece(NamedTuple):
    """Heads ``[head, head + count)`` (model numbering) of every shipped block, from the sender
    rank's shard at ``src_offset`` heads into the receiver rank's shard at ``dst_offset``."""

    sender: int
    receiver: int
    head: int
    count: int
    src_offset: int
    dst_offset: int


def check_tp(num_kv_heads: int, tp: int, num_heads: int | None = None) -> None:
    """``ValueError`` saying what to change when ``tp`` cannot shard the model's heads: it must
    divide the attention heads, and divide the KV heads or be a multiple of them."""
    if tp < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
    if num_kv_heads < 1:
        raise ValueError(f"the model must have >= 1 KV head, got {num_kv_heads}")
    if num_heads is not None and num_heads % tp:
        raise ValueError(
            f"tensor parallel size {tp} does not divide the {num_heads} attention heads"
        )
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(
            f"tensor parallel size {tp} neither divides the {num_kv_heads} KV heads nor is a "
            "multiple of them"
        )


def replicas(num_kv_heads: int, tp: int) -> int:
    """How many ranks hold each KV head (1 unless ``tp`` exceeds the KV heads)."""
    check_tp(num_kv_heads, tp)
    return max(tp // num_kv_heads, 1)


def kv_heads_of(num_kv_heads: int, tp: int, rank: int) -> range:
    """The KV heads (model numbering) rank ``rank`` of ``tp`` holds."""
    check_tp(num_kv_heads, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} of tensor parallel size {tp}")
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp // num_kv_heads)
    return range(head, head + 1)


def holders(num_kv_heads: int, tp: int, head: int) -> range:
    """The ranks of ``tp`` that hold KV head ``head``."""
    check_tp(num_kv_heads, tp)
    if not 0 <= head < num_kv_heads:
        raise ValueError(f"KV head {head} of {num_kv_heads}")
    if tp <= num_kv_heads:
        rank = head // (num_kv_heads // tp)
        return range(rank, rank + 1)
    per = tp // num_kv_heads
    return range(head * per, (head + 1) * per)


def transfer_plan(num_kv_heads: int, sender_tp: int, receiver_tp: int) -> list[Piece]:
    """The pieces that fill every receiver rank's shard from the senders' shards, each run of
    heads that one sender sends to one receiver as one piece (ordered by receiver, then head)."""
    pieces: list[Piece] = []
    for receiver in range(receiver_tp):
        mine = kv_heads_of(num_kv_heads, receiver_tp, receiver)
        for head in mine:
            options = holders(num_kv_heads, sender_tp, head)
            sender = options[receiver % len(options)]  # spread replicated heads over holders
            src = head - kv_heads_of(num_kv_heads, sender_tp, sender).start
            dst = head - mine.start
            last = pieces[-1] if pieces else None
            if (
                last is not None
                and last.sender == sender
                and last.receiver == receiver
                and last.head + last.count == head
                and last.src_offset + last.count == src
            ):
                pieces[-1] = last._replace(count=last.count + 1)
            else:
                pieces.append(Piece(sender, receiver, head, 1, src, dst))
    return pieces
