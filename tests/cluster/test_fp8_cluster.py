"""``--quantization fp8`` across processes: a prefill and a decode node quantizing a 16/32-bit
checkpoint at load serve, through a router given the same flag, the tokens of the FP8 model run in
this process; a decode node started without the flag computes other KV (another model identity),
so the router names it and never routes to it."""

import random
import time

import pytest
import torch
from support.processes import greedy_burst, node_stats, scrape_metrics, start_node, start_router

from splitserve.engine.core import LLMEngine
from splitserve.kvstore import ModelIdentity
from splitserve.models.loader import load_model
from splitserve.models.runner import ModelRunner, RunnerConfig
from splitserve.models.sampling_params import SamplingParams
from splitserve.models.tiny import write_random_checkpoint


def _fp8_greedy(path, prompts, n):
    config, model = load_model(path, quantization="fp8")
    kv = RunnerConfig(kv_cache_bytes=64 * 16 * config.kv_bytes_per_token(torch.float32))
    engine = LLMEngine(ModelRunner(config, model, kv), ModelIdentity(str(path)))
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [r.output_token_ids for r in engine.generate(prompts, params)]


def test_fp8_nodes_serve_the_fp8_models_tokens_and_an_unquantized_node_is_not_used(tmp_path):
    model = write_random_checkpoint(tmp_path / "m", seed=11, with_tokenizer=True)
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (20, 37, 50)]
    expected = _fp8_greedy(model, prompts, 6)
    fp8 = ("--quantization", "fp8")
    procs = []
    try:
        prefill = start_node("prefill", model, tmp_path, *fp8)
        good = start_node("decode", model, tmp_path, *fp8)
        plain = start_node("decode", model, tmp_path)
        procs += [prefill, good, plain]
        router = start_router(
            model, tmp_path, [prefill.address], [good.address, plain.address], *fp8
        )
        procs.append(router)
        assert greedy_burst(router.address, prompts, 6, timeout=60) == expected
        deadline = time.monotonic() + 10
        while f"decode node {plain.address} is not used" not in router.log.read_text():
            assert time.monotonic() < deadline, router.log.read_text()[-2000:]
            time.sleep(0.2)
        assert "quantization='fp8'" in router.log.read_text()
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.mark.parametrize(
    "path",
    [
        ("--kv-transfer", "dist"),
        # tcp, every prompt streamed layer by layer while the prefill runs
        ("--kv-transfer", "tcp", "--kv-stream-min-tokens", "1"),
    ],
    ids=["dist", "tcp-layer-stream"],
)
def test_an_fp8_kv_cache_ships_fp8_blocks_and_serves_its_engines_tokens(tmp_path, path):
    """--kv-cache-dtype fp8 on both nodes: KV blocks are e4m3 end to end (a quarter of a float32
    model's bytes per block shipped), and the tokens are the in-process FP8-KV engine's."""
    model = write_random_checkpoint(tmp_path / "m", seed=12, with_tokenizer=True)
    rng = random.Random(6)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (20, 37, 50)]
    config, weights = load_model(model)
    kv = RunnerConfig(kv_cache_bytes=64 << 20, kv_cache_dtype="fp8")
    runner = ModelRunner(config, weights, kv)
    engine = LLMEngine(runner, ModelIdentity(str(model)))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = [r.output_token_ids for r in engine.generate(prompts, params)]
    block_bytes = runner.block_bytes
    assert block_bytes * 4 == 16 * config.kv_bytes_per_token(torch.float32)
    flag = ("--kv-cache-dtype", "fp8")
    procs = []
    try:
        prefill = start_node("prefill", model, tmp_path, *flag, *path)
        decode = start_node("decode", model, tmp_path, *flag, *path)
        procs += [prefill, decode]
        router = start_router(
            model, tmp_path, [prefill.address], [decode.address], *flag, "--metrics-port", "0"
        )
        procs.append(router)
        assert greedy_burst(router.address, prompts, 6, timeout=60) == expected
        # Every block of each prompt, its partial last one too, in FP8, over the path given.
        counters = node_stats(prefill).counters
        shipped = block_bytes * sum(-(-len(p) // 16) for p in prompts)
        assert counters["bytes_shipped"] == shipped
        # The router's own books say the same, by path, per request.
        router_figures = scrape_metrics(router.metrics_port)
        label = f'{{path="{path[1]}"}}'
        assert router_figures[f"splitserve_router_kv_shipped_bytes_total{label}"] == shipped
        assert router_figures[f"splitserve_router_kv_transfers_total{label}"] == len(prompts)
        assert counters[f"transfers_{path[1]}"] == len(prompts), dict(counters)
        if "--kv-stream-min-tokens" in path:
            assert counters["transfers_streamed"] == len(prompts)
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_a_tensor_parallel_engine_on_an_fp8_kv_cache(tmp_path):
    """TP 2 (two rank processes, gloo) on an FP8 pool: the tokens of TP 1, and whole-head
    blocks read and written through rank 0 (what a transfer ships) byte-equal to TP 1's."""
    from splitserve.runtime.config import NodeConfig
    from splitserve.runtime.node import build_engine

    model = write_random_checkpoint(tmp_path / "m", seed=13, num_attention_heads=4)
    rng = random.Random(8)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (45, 60)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens, blocks = [], []
    for tp in (1, 2):
        config = NodeConfig(
            model_path=str(model),
            kv_cache_dtype="fp8",
            kv_transfer="none",
            tensor_parallel_size=tp,
            kv_cache_mb=16,
        )
        engine, _ = build_engine(config, prefill_only=False)
        try:
            tokens.append([r.output_token_ids for r in engine.generate(prompts, params)])
            data = engine.runner.read_blocks([1, 2, 3])
            engine.runner.write_blocks([5, 6, 7], data)
            assert engine.runner.read_blocks([5, 6, 7]) == data
            blocks.append(data)
        finally:
            engine.runner.close()
    assert tokens[0] == tokens[1]
    assert blocks[0] == blocks[1] and len(blocks[0]) == 3 * 16 * 2 * 2 * 2 * 32
