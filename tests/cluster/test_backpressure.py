"""Backpressure between the pools (real processes: Redis, a router, 2 prefill nodes and a decode
node whose KV holds about one request): a burst many times the decode node's KV waits in the
router's queue rather than on the prefill nodes, every request is served token-exact, and no
prompt is computed twice (the prefill nodes' own counters). Refusals come at once, before any
node did work, with a retry hint on both fronts and a reason in /metrics."""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.error
import urllib.request

import grpc
import pytest
from support.processes import (
    greedy_burst,
    node_stats,
    scrape_metrics,
    start_node,
    start_redis,
    start_router,
)
from support.reference import hf_greedy

from splitserve.client import SplitserveError
from splitserve.models.tiny import write_random_checkpoint

SEED = random.randrange(1 << 30)
OUT = 6


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    print(f"seed {SEED}")
    tmp = tmp_path_factory.mktemp("backpressure")
    # 4 layers x K and V x 16 tokens x 2 KV heads x 32 x fp32 = 32 KiB a block: 1 MiB holds 31
    # usable blocks, 496 tokens, one or two of the prompts below.
    model = write_random_checkpoint(tmp / "m", seed=23, with_tokenizer=True, num_hidden_layers=4)
    redis = start_redis(tmp)
    url = redis.address  # (already redis://host:port)
    prefill = [start_node("prefill", model, tmp, "--redis-url", url) for _ in range(2)]
    decode = start_node("decode", model, tmp, "--kv-cache-mb", "1", "--redis-url", url)
    procs = [redis, *prefill, decode]
    try:
        yield model, tmp, url, prefill, decode
    finally:
        for proc in procs:
            proc.stop()


def _prefill_work(prefill) -> tuple[float, float]:
    """(prompt tokens computed, transfers failed) summed over the prefill nodes."""
    computed = failed = 0.0
    for proc in prefill:
        c = node_stats(proc).counters
        computed += c["prompt_tokens"] - c["cached_tokens"]
        failed += c.get("transfers_failed", 0) + c.get("prefills_not_shipped", 0)
    return computed, failed


def _burst(address, prompts):
    return greedy_burst(address, prompts, OUT, timeout=120.0)


def test_a_burst_far_beyond_the_decode_kv_waits_at_the_router_and_nothing_is_recomputed(pools):
    model, tmp, url, prefill, decode = pools
    router = start_router(model, tmp, [p.address for p in prefill], [decode.address],
                          "--redis-url", url, "--metrics-port", "0")  # fmt: skip
    try:
        rng = random.Random(SEED)
        prompts = [[rng.randrange(256) for _ in range(rng.randrange(180, 420))] for _ in range(20)]
        # Four pairs share a 128-token prefix: the ledger counts their shared blocks once.
        for i in range(0, 8, 2):
            prompts[i + 1][:128] = prompts[i][:128]
        before, failed_before = _prefill_work(prefill)
        d_before = node_stats(decode).counters
        results = _burst(router.address, prompts)
        errors = [r for r in results if isinstance(r, Exception)]
        assert errors == [], f"seed {SEED}: {errors[:3]}"
        for prompt, tokens in zip(prompts[:4], results[:4], strict=True):
            assert tokens == hf_greedy(model, prompt, OUT)
        computed, failed = _prefill_work(prefill)
        served = sum(len(p) for p in prompts)
        assert failed == failed_before, "a prefill node's transfer failed: its work was lost"
        # At most the served prompts (less what the prefill caches already held), +2%.
        assert computed - before <= 1.02 * served, (computed - before, served)
        d = node_stats(decode)
        assert d.counters.get("transfers_waited_for_blocks", 0) == d_before.get(
            "transfers_waited_for_blocks", 0
        ), "a transfer reached the decode node before it had room for it"
        assert d.num_free_blocks == d.num_blocks  # nothing leaked
        figures = scrape_metrics(router.metrics_port)
        waited = figures["splitserve_router_queue_wait_seconds_count"]
        assert waited >= 10, "most of the burst should have waited in the router's queue"
        assert figures['splitserve_router_decode_kv_blocks{state="charged"}'] == 0
        assert figures['splitserve_router_decode_kv_blocks{state="total"}'] > 0
        assert figures['splitserve_router_nodes{role="prefill"}'] == 2
        assert figures["splitserve_router_prefill_computed_tokens_total"] > 0
        # The next request is served as usual.
        assert _burst(router.address, [prompts[0][:50]])[0] == hf_greedy(
            model, prompts[0][:50], OUT
        )
    finally:
        router.stop()


def test_refusals_come_at_once_with_a_retry_hint_and_a_reason(pools):
    model, tmp, _, prefill, decode = pools
    router = start_router(model, tmp, [p.address for p in prefill], [decode.address],
                          "--max-queue", "1", "--metrics-port", "0",
                          "--http-port", "0")  # fmt: skip
    http_port = router.http_port
    try:
        # A prompt larger than the decode node's whole KV (31 blocks): refused before any prefill.
        before, _ = _prefill_work(prefill)
        t0 = time.monotonic()
        big = _burst(router.address, [[3] * 600])[0]
        assert isinstance(big, SplitserveError), big
        assert big.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV blocks" in big.message
        assert time.monotonic() - t0 < 30  # at once, not after its 120 s timeout
        assert _prefill_work(prefill)[0] == before

        # A burst: one at a time fits, one waits, the rest are refused at once.
        rng = random.Random(SEED + 1)
        prompts = [[rng.randrange(256) for _ in range(400)] for _ in range(6)]
        t0 = time.monotonic()
        results = _burst(router.address, prompts)
        refused = [r for r in results if isinstance(r, Exception)]
        assert refused and all(r.code == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
        assert all("--max-queue" in r.message for r in refused)
        assert len([r for r in results if not isinstance(r, Exception)]) >= 2

        # HTTP: 429 with Retry-After while the queue is full.
        async def http_burst():
            def post(p):
                body = json.dumps({"prompt": p, "max_tokens": OUT, "ignore_eos": True}).encode()
                req = urllib.request.Request(
                    f"http://127.0.0.1:{http_port}/v1/completions",
                    body,
                    {"Content-Type": "application/json"},
                )
                t = time.monotonic()
                try:
                    with urllib.request.urlopen(req, timeout=60) as r:
                        return r.status, None, time.monotonic() - t
                except urllib.error.HTTPError as exc:
                    return exc.code, exc.headers.get("Retry-After"), time.monotonic() - t

            return await asyncio.gather(*(asyncio.to_thread(post, p) for p in prompts))

        answers = asyncio.run(http_burst())
        limited = [a for a in answers if a[0] == 429]
        assert limited, answers
        assert all(a[1] is not None and int(a[1]) >= 1 for a in limited)
        assert all(a[2] < 30 for a in limited), "a refusal must come at once, not at its timeout"
        figures = scrape_metrics(router.metrics_port)
        assert figures['splitserve_router_refused_total{reason="prompt_too_large"}'] == 1
        assert figures['splitserve_router_refused_total{reason="queue_full"}'] == len(
            refused
        ) + len(limited)
    finally:
        router.stop()
