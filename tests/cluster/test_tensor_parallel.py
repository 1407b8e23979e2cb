"""Tensor parallelism (models/parallel.py, engine/ranks.py) on the CPU: gloo groups of real rank
processes, random checkpoints saved with save_pretrained.

- engines at TP 2 and 4 answer token-exact with transformers (fp32) and with TP 1 — fresh and
  from the prefix cache — on models whose shapes exercise every split: GQA heads split,
  KV heads replicated past their number (TP 4 over 2 KV heads), a vocabulary TP does not divide,
  q/k/v, o_proj and MLP biases, tied embeddings; and their whole-heads block reads equal TP 1's;
  the embedded model (SmolLM2-135M) at TP 3;
- nodes: prefill at TP 2 → decode at TP 1, TP 1 → TP 2, TP 4 → TP 2 and TP 2 → TP 2, token-exact
  end to end, every transfer over dist rank to rank (transfer.shards: each decode rank receives
  its heads from the prefill rank(s) holding them);
- a rank killed mid-answer takes its node down (exit status 70, a clear log line), the router
  resumes the streams on another decode node, and the node's other rank processes go with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import random
import signal
from pathlib import Path

import pytest
import torch
from support.processes import (
    assert_settled,
    children,
    idle_free_blocks,
    node_stats,
    start_node,
    start_router,
    still_alive,
)
from support.reference import hf_greedy
from support.streams import cancel_at_random_moments, stream_through

from splitserve.client import AsyncClient
from splitserve.engine.core import LLMEngine
from splitserve.engine.ranks import LOST_EXIT_CODE, RankSpec, start_ranks
from splitserve.kvstore import ModelIdentity
from splitserve.kvstore.hashing import hash_request_tokens
from splitserve.models.embedded import default_model_file, resolve_model_path
from splitserve.models.loader import load_model
from splitserve.models.parallel import SINGLE
from splitserve.models.runner import ModelRunner, RunnerConfig
from splitserve.models.sampling_params import SamplingParams
from splitserve.models.tiny import write_random_checkpoint

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
SHAPES = {
    # 8 heads over 4 KV heads; every bias Llama can have; tied embeddings; 321 rows: TP 2 pads.
    "llama-bias-tied": (
        "LlamaForCausalLM",
        dict(
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=16,
            vocab_size=321,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
        ),
    ),
    # Qwen2 (q/k/v biases): 2 KV heads, so at TP 4 each is held by two ranks.
    "qwen2-gqa": (
        "Qwen2ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=322),
    ),
}


def _engine(path: Path, tp_size: int, lost: list, **kw) -> LLMEngine:
    rc = RunnerConfig(kv_cache_bytes=8 << 20, **kw)
    tp, ranks = SINGLE, None
    if tp_size > 1:
        spec = RankSpec(str(path), "float32", "auto", ["cpu"] * tp_size, dataclasses.asdict(rc))
        tp, ranks = start_ranks(spec, on_lost=lambda rank, code: lost.append((rank, code)))
    config, model = load_model(path, dtype="float32", tp=tp)
    runner = ModelRunner(config, model, rc)
    if ranks is not None:
        runner.closers.append(ranks.stop)
        runner.on_group_error = ranks.group_failed
        runner.ranks = ranks  # (for the test: their processes)
    return LLMEngine(runner, ModelIdentity(str(path), block_size=16))


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "tp_size"), [("llama-bias-tied", 2), ("qwen2-gqa", 4)])
def test_tp_engines_match_transformers_and_tp1(tmp_path, shape, tp_size):
    arch, overrides = SHAPES[shape]
    path = write_random_checkpoint(tmp_path / shape, arch, seed=11, **overrides)
    rng = random.Random(5)
    vocab = overrides["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (1, 16, 17, 40)]
    expected = [hf_greedy(path, p, MAX_NEW) for p in prompts]

    single = _engine(path, 1, [])
    assert [r.output_token_ids for r in single.generate(prompts, GREEDY)] == expected
    lost: list = []
    engine = _engine(path, tp_size, lost)
    ranks = engine.runner.ranks  # pyright: ignore[reportAttributeAccessIssue]
    try:
        assert engine.runner.num_kv_heads < single.runner.num_kv_heads
        assert [r.output_token_ids for r in engine.generate(prompts, GREEDY)] == expected
        again = engine.generate(prompts, GREEDY)  # full blocks from the prefix cache
        assert [r.output_token_ids for r in again] == expected
        assert [r.num_cached_tokens for r in again] == [0, 0, 16, 32]

        # Whole-heads reads: the same hashes hold the same KV (to rounding) at TP 1 and TP N.
        prompt = prompts[-1]
        for e in (single, engine):
            e.generate([prompt], GREEDY)
        ids_1 = [single.pool.get_cached_block(h).block_id for h in _hashes(single, prompt)]
        ids_n = [engine.pool.get_cached_block(h).block_id for h in _hashes(engine, prompt)]
        whole_1 = single.runner.read_blocks(ids_1)
        whole_n = engine.runner.read_blocks(ids_n)
        # In group operations of one block each, the same bytes.
        engine.runner._group_chunk = lambda: 1  # pyright: ignore[reportAttributeAccessIssue]
        assert engine.runner.read_blocks(ids_n) == whole_n
        assert len(whole_n) == len(ids_n) * single.runner.block_bytes
        a = torch.frombuffer(bytearray(whole_1), dtype=torch.float32)
        b = torch.frombuffer(bytearray(whole_n), dtype=torch.float32)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        # ... and a write of them lands every head on its rank (read back byte for byte).
        free = [b.block_id for b in engine.pool.get_new_blocks(len(ids_n))]
        engine.runner.write_blocks(free, whole_1)
        assert engine.runner.read_blocks(free) == whole_1
        with pytest.raises(ValueError, match="bytes"):
            engine.runner.write_blocks(free, whole_1[:-4])  # refused on rank 0, before any rank
        assert engine.runner.read_blocks(free) == whole_1  # the group still answers
    finally:
        engine.runner.close()
    assert not lost
    assert all(p.returncode == 0 for p in ranks.procs)
    engine.runner.close()  # idempotent


@pytest.mark.slow
def test_the_embedded_model_at_tp3_matches_transformers(tmp_path):
    """SmolLM2-135M (9 heads over 3 KV heads, a 49,152-token vocabulary): TP 3 is its one split."""
    try:
        default_model_file()
    except ValueError as exc:
        pytest.skip(f"the embedded model is not installed here: {exc}")
    path = Path(resolve_model_path(None))
    rng = random.Random(2)
    prompts = [[rng.randrange(49152) for _ in range(n)] for n in (7, 18)]
    lost: list = []
    engine = _engine(path, 3, lost, max_num_seqs=8)
    try:
        got = [r.output_token_ids for r in engine.generate(prompts, GREEDY)]
    finally:
        engine.runner.close()
    assert got == [hf_greedy(path, p, MAX_NEW) for p in prompts]
    assert not lost


def _hashes(engine: LLMEngine, prompt: list[int]) -> list:
    return hash_request_tokens(prompt, engine.block_size, engine.root_hash)


async def _greedy(address: str, prompt: list[int], max_tokens: int) -> list[int]:
    async with AsyncClient(address) as client:
        out = await client.generate(
            prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
        return list(out.token_ids)


def _tp(n: int) -> tuple[str, ...]:
    return ("--tensor-parallel-size", str(n))


@pytest.mark.slow
def test_pools_of_different_tp_answer_token_exact(tmp_path):
    arch, overrides = SHAPES["llama-bias-tied"]
    model = write_random_checkpoint(tmp_path / "m", arch, seed=41, with_tokenizer=True, **overrides)
    nodes = {
        "p1": start_node("prefill", model, tmp_path),
        # (the engine process, a GPU node's default, starts the ranks)
        "p2": start_node("prefill", model, tmp_path, *_tp(2), "--engine-process", "on"),
        "p4": start_node("prefill", model, tmp_path, *_tp(4)),
        "d1": start_node("decode", model, tmp_path),
        "d2": start_node("decode", model, tmp_path, *_tp(2)),
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
                list(await asyncio.gather(*(_greedy(r.address, p, max_tokens) for p in prompts)))
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
    prefill = start_node("prefill", model, tmp_path, *_tp(2), *auth)
    decode = start_node("decode", model, tmp_path, *_tp(2), *auth)
    router = start_router(model, tmp_path, [prefill.address], [decode.address], *auth)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 3, list(range(40, 77))]
    try:

        async def run() -> list[list[int]]:
            return list(await asyncio.gather(*(_greedy(router.address, p, 10) for p in prompts)))

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
    flags = ("--transfer-deadline-s", "3", "--kv-transfer", "dist", *_tp(2))
    nodes = [start_node(role, model, tmp_path, *flags) for role in ("prefill", "decode")]
    router = start_router(model, tmp_path, [nodes[0].address], [nodes[1].address])
    try:
        warm = asyncio.run(_greedy(router.address, [1, 2, 3], 2))
        assert len(warm) == 2
        idle = idle_free_blocks(nodes)
        results = asyncio.run(cancel_at_random_moments(router.address, random.Random(13), 60))
        assert sum(isinstance(r, asyncio.CancelledError) for r in results) >= 30, results
        errors = [r for r in results if isinstance(r, Exception)]
        assert not errors, errors[:3]
        assert_settled(nodes, idle)
        prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1] * 4
        assert asyncio.run(_greedy(router.address, prompt, 6)) == hf_greedy(model, prompt, 6)
        assert node_stats(nodes[1]).counters["transfers_dist"] > 0
    finally:
        for proc in (router, *nodes):
            proc.stop()


@pytest.mark.slow
def test_a_rank_killed_mid_answer_takes_its_node_down_and_streams_resume(tmp_path):
    arch, overrides = SHAPES["llama-bias-tied"]
    model = write_random_checkpoint(tmp_path / "m", arch, seed=42, with_tokenizer=True, **overrides)
    decode = [start_node("decode", model, tmp_path, *_tp(2)), start_node("decode", model, tmp_path)]
    router = start_router(model, tmp_path, [], [d.address for d in decode])
    (rank1,) = children(decode[0].popen.pid)  # engine in the node's process on a CPU
    rng = random.Random(3)
    prompts = [[rng.randrange(250) for _ in range(rng.randrange(8, 40))] for _ in range(6)]
    max_tokens = 120
    try:
        kill = functools.partial(os.kill, rank1, signal.SIGKILL)
        outputs = asyncio.run(stream_through(router.address, prompts, max_tokens, kill))
        for prompt, tokens in zip(prompts, outputs, strict=True):
            assert tokens == hf_greedy(model, prompt, max_tokens)
        assert decode[0].popen.wait(30) == LOST_EXIT_CODE
        assert "tensor-parallel rank 1 went" in decode[0].log.read_text()
        survivor = node_stats(decode[1])
        assert survivor.num_free_blocks == survivor.num_blocks
    finally:
        router.stop()
        for d in decode:
            d.stop()
    assert not still_alive([rank1], 10)
