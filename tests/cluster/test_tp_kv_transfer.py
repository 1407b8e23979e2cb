"""KV rank to rank between tensor-parallel nodes (transfer.shards over the dist path), on the CPU:
gloo groups of real rank processes, random checkpoints saved with save_pretrained.

- prefill at TP 2 → decode at TP 1, TP 1 → TP 2, TP 4 → TP 2 and TP 2 → TP 2, token-exact end
  to end, every transfer over dist (each decode rank receives its heads from the prefill rank(s)
  holding them);
- with a cluster token: every prefill rank crosses the decode node's rendezvous gate itself;
- streams cancelled at random moments: both pools settle back to idle.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from support.processes import (
    assert_settled,
    idle_free_blocks,
    node_stats,
    start_node,
    start_router,
)
from support.reference import hf_greedy
from support.streams import cancel_at_random_moments
from support.tensor_parallel import SHAPES, greedy, tp_flags

from splitserve.models.tiny import write_random_checkpoint


@pytest.mark.slow
def test_pools_of_different_tp_answer_token_exact(tmp_path):
    arch, overrides = SHAPES["llama-bias-tied"]
    model = write_random_checkpoint(tmp_path / "m", arch, seed=41, with_tokenizer=True, **overrides)
    nodes = {
        "p1": start_node("prefill", model, tmp_path),
        # (the engine process, a GPU node's default, starts the ranks)
        "p2": start_node("prefill", model, tmp_path, *tp_flags(2), "--engine-process", "on"),
        "p4": start_node("prefill", model, tmp_path, *tp_flags(4)),
        "d1": start_node("decode", model, tmp_path),
        "d2": start_node("decode", model, tmp_path, *tp_flags(2)),
    }
    pairs = [("p2", "d1"), ("p1", "d2"), ("p4", "d2"), ("p2", "d2")]
    routers = [
        start_router(model, tmp_path, [nodes[p].address], [nodes[d].address]) for p, d in pairs
    ]
    rng = random.Random(9)
    prompts = [[rng.randrange(250) for _ in range(rng.randrange(5, 50))] for _ in range(4)]
    max_tokens = 12
    try:

        async def run() -> list[list[list[int]]]:
            return [
                list(await asyncio.gather(*(greedy(r.address, p, max_tokens) for p in prompts)))
                for r in routers
            ]

        answers = asyncio.run(run())
        expected = [hf_greedy(model, p, max_tokens) for p in prompts]
        for (p, d), got in zip(pairs, answers, strict=True):
            assert got == expected, f"prefill {p} -> decode {d}"
        for name in ("d1", "d2"):
            stats = node_stats(nodes[name])
            assert stats.num_free_blocks == stats.num_blocks, name
        # Rank to rank (dist), not through rank 0 and gRPC bytes.
        assert node_stats(nodes["d1"]).counters["transfers_dist"] == len(prompts)
        d2 = node_stats(nodes["d2"]).counters
        assert d2["transfers"] == d2["transfers_dist"] == 3 * len(prompts), d2
    finally:
        for proc in [*routers, *nodes.values()]:
            proc.stop()


@pytest.mark.slow
def test_tp_pools_with_a_cluster_token_ship_rank_to_rank_through_the_gate(tmp_path):
    """With a cluster token the decode node's rendezvous store sits behind its gate: every
    prefill rank opens a tunnel of its own with the token's key (transfer.shards), and the
    transfers still go rank to rank, token-exact, every block given back."""
    import grpc

    from splitserve.runtime.auth import metadata_for, write_token_file
    from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

    arch, overrides = SHAPES["llama-bias-tied"]
    model = write_random_checkpoint(tmp_path / "m", arch, seed=43, with_tokenizer=True, **overrides)
    token = write_token_file(tmp_path / "token")
    auth = ("--auth-token-file", str(tmp_path / "token"))
    prefill = start_node("prefill", model, tmp_path, *tp_flags(2), *auth)
    decode = start_node("decode", model, tmp_path, *tp_flags(2), *auth)
    router = start_router(model, tmp_path, [prefill.address], [decode.address], *auth)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 3, list(range(40, 77))]
    try:

        async def run() -> list[list[int]]:
            return list(await asyncio.gather(*(greedy(router.address, p, 10) for p in prompts)))

        assert asyncio.run(run()) == [hf_greedy(model, p, 10) for p in prompts]
        with grpc.insecure_channel(decode.address) as channel:
            stub = nodes_pb2_grpc.NodeStatsServiceStub(channel)
            stats = stub.GetStats(
                nodes_pb2.GetStatsRequest(), timeout=10, metadata=metadata_for(token)
            )
        assert stats.counters["transfers_dist"] == len(prompts), dict(stats.counters)
        assert stats.num_free_blocks == stats.num_blocks
    finally:
        for proc in (router, prefill, decode):
            proc.stop()


@pytest.mark.slow
def test_tp_streams_cancelled_at_random_moments_leave_every_rank_settled(tmp_path):
    """Prefill TP 2 -> decode TP 2 over dist rank to rank; 60 streams cancelled at random
    moments (in prefill, mid-transfer, decoding): both pools settle back to idle, and the next
    request answers token-exact. (A cancel waits for the transfer's ranks to finish writing: no
    rank writes into blocks a cancel freed.)"""
    arch, overrides = SHAPES["llama-bias-tied"]
    model = write_random_checkpoint(tmp_path / "m", arch, seed=47, with_tokenizer=True, **overrides)
    flags = ("--transfer-deadline-s", "3", "--kv-transfer", "dist", *tp_flags(2))
    nodes = [start_node(role, model, tmp_path, *flags) for role in ("prefill", "decode")]
    router = start_router(model, tmp_path, [nodes[0].address], [nodes[1].address])
    try:
        warm = asyncio.run(greedy(router.address, [1, 2, 3], 2))
        assert len(warm) == 2
        idle = idle_free_blocks(nodes)
        results = asyncio.run(cancel_at_random_moments(router.address, random.Random(13), 60))
        assert sum(isinstance(r, asyncio.CancelledError) for r in results) >= 30, results
        errors = [r for r in results if isinstance(r, Exception)]
        assert not errors, errors[:3]
        assert_settled(nodes, idle)
        prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1] * 4
        assert asyncio.run(greedy(router.address, prompt, 6)) == hf_greedy(model, prompt, 6)
        assert node_stats(nodes[1]).counters["transfers_dist"] > 0
    finally:
        for proc in (router, *nodes):
            proc.stop()
