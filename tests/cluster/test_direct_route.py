"""Conditional disaggregation on CPU, real processes: a decode node prefilling requests itself
(the router's direct route, DecodeNodeService.Generate) is token-exact with transformers, alone
(``splitserve up --num-prefill 0``: a decode node, no prefill node) and beside a prefill pool
(``--direct-prefill-tokens 32``: short prompts direct, long ones through a prefill node); a direct
stream cancelled at any moment leaves no block held."""

import asyncio
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.processes import node_stats, start_node, start_router
from support.reference import hf_greedy

from splitserve.client import AsyncClient
from splitserve.launcher import ClusterSpec, LocalCluster
from splitserve.models.tiny import write_random_checkpoint

MAX_NEW = 6
GREEDY = dict(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
DIRECT_TOKENS = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_checkpoint(
        tmp_path_factory.mktemp("direct") / "tiny",
        "LlamaForCausalLM",
        seed=11,
        with_tokenizer=True,
        num_hidden_layers=2,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=300,
    )


def _decode_only(model_dir) -> LocalCluster:
    # A small token budget: long prompts are prefilled in chunks beside the running decodes.
    spec = ClusterSpec(
        model_path=str(model_dir),
        num_prefill=0,
        num_decode=1,
        port=0,  # the router binds a free one (a port picked here could be taken first)
        node_args=("--kv-cache-mb", "32", "--max-num-batched-tokens", "48"),
    )
    return LocalCluster(spec).__enter__()


def _mixed(model_dir, tmp):
    procs = []
    try:
        with ThreadPoolExecutor(2) as pool:
            started = [
                pool.submit(start_node, role, model_dir, tmp) for role in ("prefill", "decode")
            ]
            procs += [f.result() for f in started]
        router = start_router(
            model_dir, tmp, [procs[0].address], [procs[1].address],
            "--direct-prefill-tokens", str(DIRECT_TOKENS), "--metrics-port", "0",
        )  # fmt: skip
        procs.append(router)
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    return SimpleNamespace(procs=procs, metrics=f"http://127.0.0.1:{router.metrics_port}/metrics")


@pytest.fixture(scope="module")
def clusters(model_dir, tmp_path_factory):
    """Both clusters, started side by side (LocalCluster from this thread: its processes get
    SIGTERM when the thread that started them ends)."""
    tmp = tmp_path_factory.mktemp("mixed")
    with ThreadPoolExecutor(1) as pool:
        mixed = pool.submit(_mixed, model_dir, tmp)
        try:
            alone = _decode_only(model_dir)
        except BaseException:
            if mixed.exception() is None:
                for proc in mixed.result().procs:
                    proc.stop()
            raise
        try:
            procs = mixed.result().procs
        except BaseException:
            alone.stop()
            raise
    try:
        yield SimpleNamespace(alone=alone, mixed=mixed.result())
    finally:
        alone.stop()
        for proc in reversed(procs):
            proc.stop()


def generate_all(target: str, prompts: list[list[int]], **kw) -> list:
    async def run():
        async with AsyncClient(target) as client:
            return await asyncio.gather(
                *(client.generate(prompt_token_ids=p, **{**GREEDY, **kw}) for p in prompts)
            )

    return asyncio.run(run())


def routes(metrics_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "splitserve_router_routes":
            return {s.labels["route"]: s.value for s in family.samples if s.name.endswith("_total")}
    raise AssertionError("no splitserve_router_routes in the router's /metrics")


def test_decode_only_cluster_matches_transformers(clusters, model_dir):
    cluster = clusters.alone
    assert cluster.addresses.prefill == ()
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 5, 17, 33, 48, 90, 130)]
    results = generate_all(cluster.addresses.router, prompts)
    want = [hf_greedy(model_dir, p, MAX_NEW) for p in prompts]
    assert [list(r.token_ids) for r in results] == want
    for prompt, r in zip(prompts, results, strict=True):
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == MAX_NEW
        assert r.usage.time_to_first_token_s > 0
    again = generate_all(cluster.addresses.router, prompts[-1:])[0]  # its prefix is cached on D
    assert list(again.token_ids) == list(results[-1].token_ids)
    assert again.usage.cached_tokens == (len(prompts[-1]) - 1) // 16 * 16


def test_a_cancelled_direct_stream_frees_every_block(clusters):
    cluster = clusters.alone
    decode = SimpleNamespace(address=cluster.addresses.decode[0])
    rng = random.Random(5)

    async def one(client, i):
        prompt = [rng.randrange(256) for _ in range(rng.randrange(1, 200))]
        # Long answers: a request left running would hold its blocks well past the check below.
        async for _ in client.stream(
            prompt_token_ids=prompt, max_tokens=800, temperature=0.0, ignore_eos=True
        ):
            pass

    async def run():
        loop = asyncio.get_running_loop()
        async with AsyncClient(cluster.addresses.router) as client:
            tasks = []
            for i in range(24):  # cancelled in prefill (the first ~100 ms) or while decoding
                task = asyncio.create_task(one(client, i))
                loop.call_later(
                    rng.uniform(0, 0.1) if i % 2 else rng.uniform(0.1, 1.0), task.cancel
                )
                tasks.append(task)
            return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(run())
    assert sum(isinstance(r, asyncio.CancelledError) for r in results) >= 12, results
    assert not [r for r in results if isinstance(r, Exception)]
    deadline = time.monotonic() + 3
    while True:
        s = node_stats(decode)
        now = (s.num_free_blocks, s.running, s.waiting)
        if now == (s.num_blocks, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert now == (s.num_blocks, 0, 0)
    assert s.counters["requests_aborted"] > 0


def test_short_prompts_go_direct_and_long_ones_through_prefill(clusters, model_dir):
    prefill, decode, router = clusters.mixed.procs
    rng = random.Random(7)
    lengths = [1, 9, 16, DIRECT_TOKENS, DIRECT_TOKENS + 1, 50, 77]
    prompts = [[rng.randrange(256) for _ in range(n)] for n in lengths]
    short = sum(n <= DIRECT_TOKENS for n in lengths)
    before_p, before_d = node_stats(prefill).counters, node_stats(decode).counters
    before = routes(clusters.mixed.metrics)
    results = generate_all(router.address, prompts)
    want = [hf_greedy(model_dir, p, MAX_NEW) for p in prompts]
    assert [list(r.token_ids) for r in results] == want
    after_p, after_d = node_stats(prefill).counters, node_stats(decode).counters
    after = routes(clusters.mixed.metrics)
    assert after_p["prefills"] - before_p.get("prefills", 0) == len(lengths) - short
    assert after_d["direct_requests"] - before_d.get("direct_requests", 0) == short
    assert after_d["transfers"] - before_d.get("transfers", 0) == len(lengths) - short
    assert after["direct"] - before["direct"] == short
    assert after["disaggregated"] - before["disaggregated"] == len(lengths) - short
