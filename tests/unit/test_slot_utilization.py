"""KV slot utilisation (issue 17): tokens held ÷ token slots of the blocks in use, each block once
however many requests share it (kvstore.kv_cache_manager.SlotUsage), kept incrementally by the
KV cache manager and exported by every node (``splitserve_<role>_kv_slot_utilization``,
``..._kv_tokens_held``, ``..._kv_token_slots``), in GetStats, and re-exported by the router."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.decode_node.service import DecodeService
from splitserve.engine.core import LLMEngine
from splitserve.engine.local import LocalEngine, engine_figures
from splitserve.kvstore import BlockPool, KVCacheManager, ModelIdentity, hash_request_tokens
from splitserve.kvstore.kv_cache_manager import SlotUsage
from splitserve.models.loader import load_model
from splitserve.models.runner import ModelRunner, RunnerConfig
from splitserve.models.sampling_params import SamplingParams
from splitserve.models.tiny import write_random_checkpoint
from splitserve.router.metrics import RouterMetrics
from splitserve.runtime.metrics import LoadFigures, NodeCollector

BS = 16
ROOT = ModelIdentity("m", block_size=BS).root_hash
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def _tokens(n: int) -> list[int]:
    return [random.randrange(300) for _ in range(n)]


def brute_force(mgr: KVCacheManager) -> SlotUsage:
    """The definition, computed from scratch: every distinct block held by a request once, its
    tokens the most any holder has written into it (a shared block is full for all)."""
    filled: dict[int, int] = {}
    for rid, blocks in mgr.req_to_blocks.items():
        held = mgr.num_tokens[rid]
        for i, block in enumerate(blocks):
            n = min(max(held - i * BS, 0), BS)
            filled[block.block_id] = max(filled.get(block.block_id, 0), n)
    return SlotUsage(sum(filled.values()), len(filled) * BS)


def _prefill(mgr: KVCacheManager, rid: str, tokens: list[int]) -> None:
    hashes = hash_request_tokens(tokens, BS, ROOT)
    computed = mgr.get_computed_blocks(hashes, len(tokens))
    assert mgr.allocate_slots(rid, len(tokens), computed) is not None
    mgr.cache_blocks(rid, hashes, len(tokens))


# ------------------------------------------------------------------ the manager's figure


def test_one_request_of_20_tokens_holds_20_of_32_slots():
    mgr = KVCacheManager(BlockPool(16), BS)
    assert mgr.slot_usage() == (0, 0) and math.isnan(mgr.slot_usage().utilization)
    _prefill(mgr, "a", _tokens(20))
    assert mgr.slot_usage() == (20, 32)
    assert mgr.slot_usage().utilization == pytest.approx(20 / 32)
    assert mgr.allocate_slots("a", 21) == []  # a decoded token fills the tail block
    assert mgr.slot_usage() == (21, 32)
    mgr.free("a")
    assert mgr.slot_usage() == (0, 0)  # its blocks stay cached, but no longer in use


def test_a_shared_prefix_block_counts_once():
    mgr = KVCacheManager(BlockPool(16), BS)
    prefix = _tokens(16)
    _prefill(mgr, "a", prefix + _tokens(4))
    _prefill(mgr, "b", prefix + _tokens(7))
    assert mgr.get_blocks("a")[0] is mgr.get_blocks("b")[0]  # really shared
    # 3 distinct blocks: the shared prefix (16 tokens), a's tail (4), b's tail (7) — not the
    # per-request sum 20 + 23 over 32 + 32.
    assert mgr.slot_usage() == (16 + 4 + 7, 3 * BS) == brute_force(mgr)
    mgr.free("a")
    assert mgr.slot_usage() == (16 + 7, 2 * BS)
    mgr.free("b")
    assert mgr.slot_usage() == (0, 0)


def test_adopted_blocks_and_their_tail_count_as_held():
    mgr = KVCacheManager(BlockPool(16), BS)
    tokens = _tokens(37)
    hashes = hash_request_tokens(tokens, BS, ROOT)
    assert len(mgr.adopt_blocks("t", hashes)) == 2
    assert mgr.allocate_slots("t", len(tokens)) is not None
    assert mgr.slot_usage() == (37, 48)
    assert mgr.allocate_slots("nope", 16 * 16) is None  # refused: changes nothing
    assert mgr.slot_usage() == (37, 48)


def test_random_lives_match_the_definition():
    """Prefills sharing prefixes, decode steps, frees, refusals: the incremental figure always
    equals the one computed from scratch."""
    rng = random.Random(17)
    mgr = KVCacheManager(BlockPool(40), BS)
    prefixes = [_tokens(BS * k) for k in (1, 2, 3)]
    live: dict[str, int] = {}
    for step in range(400):
        op = rng.random()
        if op < 0.3 or not live:
            rid = f"r{step}"
            tokens = rng.choice(prefixes) + _tokens(rng.randrange(1, 40))
            hashes = hash_request_tokens(tokens, BS, ROOT)
            computed = mgr.get_computed_blocks(hashes, len(tokens))
            if mgr.allocate_slots(rid, len(tokens), computed) is not None:
                mgr.cache_blocks(rid, hashes, len(tokens))
                live[rid] = len(tokens)
        elif op < 0.8:
            rid = rng.choice(sorted(live))
            if mgr.allocate_slots(rid, live[rid] + 1) is not None:
                live[rid] += 1
        else:
            rid = rng.choice(sorted(live))
            mgr.free(rid)
            del live[rid]
        usage = mgr.slot_usage()
        assert usage == brute_force(mgr), step
        assert usage.token_slots == (39 - mgr.block_pool.num_free_blocks) * BS
    assert any(len(b) > 1 for b in mgr.req_to_blocks.values())


def test_the_check_fails_on_a_double_counted_shared_block():
    """The definition check can fail: a figure summing per request differs on a shared prefix."""
    mgr = KVCacheManager(BlockPool(16), BS)
    prefix = _tokens(16)
    _prefill(mgr, "a", prefix + _tokens(4))
    _prefill(mgr, "b", prefix + _tokens(7))
    per_request = SlotUsage(
        sum(mgr.num_tokens.values()), sum(len(b) for b in mgr.req_to_blocks.values()) * BS
    )
    assert per_request == (43, 64)
    with pytest.raises(AssertionError):
        assert per_request == brute_force(mgr)


# ------------------------------------------------------------------ a real engine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_random_checkpoint(tmp_path_factory.mktemp("slots") / "m", seed=5)
    return load_model(path)


def _engine(model, num_blocks=32, **kw) -> LLMEngine:
    config, m = model
    rc = RunnerConfig(kv_cache_bytes=num_blocks * BS * config.kv_bytes_per_token(torch.float32))
    return LLMEngine(ModelRunner(config, m, rc), ModelIdentity("m"), **kw)


def _run_until_output(engine: LLMEngine) -> None:
    while not engine.step():
        pass


def test_prefill_node_counts_held_requests_and_shared_prefix_once(model):
    engine = _engine(model, prefill_only=True)
    prefix = _tokens(16)
    engine.add_request("a", prefix + _tokens(4), GREEDY)
    _run_until_output(engine)
    assert "a" in engine.held  # held until shipped: still counted
    load = LoadFigures.of_figures(engine_figures(engine))
    assert (load.kv_tokens_held, load.kv_token_slots) == (20, 32)
    assert load.kv_slot_utilization == pytest.approx(20 / 32)

    engine.add_request("b", prefix + _tokens(9), GREEDY)
    _run_until_output(engine)
    assert engine.requests == {} and engine.kv.get_blocks("b")[0] is engine.kv.get_blocks("a")[0]
    assert engine.kv_port.slot_usage() == (16 + 4 + 9, 3 * BS)

    engine.release("a")
    engine.release("b")
    load = LoadFigures.of_figures(engine_figures(engine))
    assert (load.kv_tokens_held, load.kv_token_slots) == (0, 0)
    assert math.isnan(load.kv_slot_utilization)


def test_decode_engine_holds_exactly_the_computed_tokens_between_steps(model):
    engine = _engine(model)
    req = engine.add_request("d", _tokens(30), GREEDY)
    seen = []
    while engine.has_unfinished():
        engine.step()
        if "d" in engine.requests:
            n = req.num_computed_tokens  # whose KV is stored
            assert engine.kv_port.slot_usage() == (n, -(-n // BS) * BS)
            seen.append(n)
    assert seen == [30, 31, 32, 33]  # the 5th token finishes it
    assert engine.kv_port.slot_usage() == (0, 0)


def test_a_transferred_request_counts_its_reserved_tokens(model):
    engine = _engine(model)
    tokens = _tokens(37)
    hashes = hash_request_tokens(tokens, BS, engine.root_hash)
    assert engine.kv_port.reserve("t", hashes, len(tokens)) is not None
    assert engine.kv_port.slot_usage() == (37, 48)
    engine.kv_port.free("t")
    assert engine.kv_port.slot_usage() == (0, 0)


# ------------------------------------------------------------------ exported


def _samples(registry: CollectorRegistry) -> dict[str, list]:
    text = generate_latest(registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_node_metrics_export_the_three_gauges(model, role):
    engine = _engine(model, prefill_only=True)
    registry = CollectorRegistry()
    registry.register(
        NodeCollector(role, lambda: LoadFigures.of_figures(engine_figures(engine)), dict)
    )
    idle = _samples(registry)
    assert math.isnan(idle[f"splitserve_{role}_kv_slot_utilization"][0].value)
    assert idle[f"splitserve_{role}_kv_token_slots"][0].value == 0

    engine.add_request("a", _tokens(20), GREEDY)
    _run_until_output(engine)
    got = _samples(registry)
    expected = {"kv_slot_utilization": 20 / 32, "kv_tokens_held": 20, "kv_token_slots": 32}
    for name, value in expected.items():
        (sample,) = got[f"splitserve_{role}_{name}"]
        assert sample.labels == {"role": role}
        assert sample.value == pytest.approx(value), name


def test_getstats_carries_the_figures_and_the_router_re_exports_them(model):
    engine = _engine(model)
    tokens = _tokens(20)
    engine.kv_port.reserve("t", hash_request_tokens(tokens, BS, engine.root_hash), len(tokens))
    # The real service over the engine's commands (figures read without a step: not started).
    service = DecodeService(LocalEngine(engine), engine.identity, 30.0)
    stats = asyncio.run(service.GetStats(None, None))
    assert stats.HasField("kv_tokens_held") and stats.HasField("kv_token_slots")
    assert (stats.kv_tokens_held, stats.kv_token_slots) == (20, 32)

    router = RouterMetrics()
    known = LoadFigures(1, 0, 31, 29, 0, 0, stats.kv_tokens_held, stats.kv_token_slots)
    router.nodes[("decode", "d:1")] = known
    router.nodes[("prefill", "p:1")] = LoadFigures(0, 0, 31, 31, 0)  # does not report them
    (sample,) = _samples(router.registry)["splitserve_node_kv_slot_utilization"]
    assert sample.labels == {"role": "decode", "node": "d:1"}
    assert sample.value == pytest.approx(20 / 32)
