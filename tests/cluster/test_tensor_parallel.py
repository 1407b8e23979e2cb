"""Tensor parallelism (models/parallel.py, engine/ranks.py) on the CPU: gloo groups of real rank
processes, random checkpoints saved with save_pretrained.

- engines at TP 2 and 4 answer token-exact with transformers (fp32) and with TP 1 — fresh and
  from the prefix cache — on models whose shapes exercise every split: GQA heads split,
  KV heads replicated past their number (TP 4 over 2 KV heads), a vocabulary TP does not divide,
  q/k/v, o_proj and MLP biases, tied embeddings; and their whole-heads block reads equal TP 1's;
  the embedded model (SmolLM2-135M) at TP 3;
- nodes of different TP sizes, shipping KV rank to rank: test_tp_kv_transfer.py;
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
    children,
    node_stats,
    start_node,
    start_router,
    still_alive,
)
from support.reference import hf_greedy
from support.streams import stream_through
from support.tensor_parallel import SHAPES, tp_flags

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


@pytest.mark.slow
def test_a_rank_killed_mid_answer_takes_its_node_down_and_streams_resume(tmp_path):
    arch, overrides = SHAPES["llama-bias-tied"]
    model = write_random_checkpoint(tmp_path / "m", arch, seed=42, with_tokenizer=True, **overrides)
    decode = [
        start_node("decode", model, tmp_path, *tp_flags(2)),
        start_node("decode", model, tmp_path),
    ]
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
