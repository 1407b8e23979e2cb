"""The KV tiers in a running cluster, as a new user meets them: `splitserve up --num-prefill 0
--kv-cache-mb 1` (the host tier on by default, a disk tier asked for), 32 prompts of 256 tokens,
eight times what the pool holds, sent twice. The second round's prefixes come from the tiers
(usage.cached_tokens, the node's counters and /metrics), its answers are transformers' own, and
the Redis index lists the node's blocks in each tier, the disk's in the node's own folder."""

import asyncio
import random
import time
import urllib.request

import grpc
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from support.reference import hf_greedy

from splitserve.client import AsyncClient
from splitserve.kvstore import ModelIdentity
from splitserve.launcher import ClusterSpec, LocalCluster
from splitserve.models.tiny import write_random_checkpoint
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

MAX_NEW = 4
GREEDY = dict(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_checkpoint(
        tmp_path_factory.mktemp("tiers") / "tiny",
        "LlamaForCausalLM",
        seed=13,
        with_tokenizer=True,
        num_hidden_layers=2,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=300,
    )


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def cluster(model_dir, disk_dir):
    spec = ClusterSpec(
        model_path=str(model_dir),
        num_prefill=0,
        num_decode=1,
        port=0,
        metrics_port=0,
        # 1 KiB a token: 63 blocks of 16; a disk tier below the folder given, one per node.
        node_args=("--kv-cache-mb", "1", "--kv-disk-cache-dir", str(disk_dir)),
    )
    with LocalCluster(spec) as running:
        yield running


def _generate(target, prompts):
    async def run():
        async with AsyncClient(target) as client:
            sem = asyncio.Semaphore(4)  # four at a time: the pool holds about four prompts

            async def one(p):
                async with sem:
                    return await client.generate(prompt_token_ids=p, **GREEDY)

            return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(run())


def _counter(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"no {name} at {url}")


def test_prompts_evicted_from_the_pool_come_back_from_the_host_tier(cluster, model_dir, disk_dir):
    rng = random.Random()
    prompts = [[rng.randrange(256) for _ in range(256)] for _ in range(32)]
    first = _generate(cluster.addresses.router, prompts)
    second = _generate(cluster.addresses.router, prompts)
    assert [list(r.token_ids) for r in second] == [list(r.token_ids) for r in first]
    for i in rng.sample(range(len(prompts)), 2):
        assert list(second[i].token_ids) == hf_greedy(model_dir, prompts[i], MAX_NEW)
    cached = sum(r.usage.cached_tokens for r in second)
    # Without the tier this is 0: each prompt evicts the ones before it from the pool.
    assert cached >= 0.9 * 32 * 240, cached
    node = cluster.addresses.decode[0]
    metrics = cluster.addresses.metrics[node]
    deadline = time.monotonic() + 30  # (a node's figures may be a moment old)
    while _counter(metrics, "splitserve_decode_prefix_host_hit_tokens_total") < cached * 0.9:
        assert time.monotonic() < deadline, "the node's counters never showed the tier's hits"
        time.sleep(0.2)
    assert _counter(metrics, "splitserve_decode_host_tier_loaded_blocks_total") > 0
    # The index: the node's host set holds the blocks its pool no longer does.
    client = redis.Redis.from_url(cluster.addresses.redis_url)
    root = ModelIdentity.for_checkpoint(str(model_dir)).root_hash.hex()[:16]
    host = client.smembers(f"ss:{root}:host:{node}")
    device = client.smembers(f"ss:{root}:blocks:{node}")
    assert len(host) >= 32 * 15 and len(device) <= 63 and len(host - device) > len(device)
    # The disk tier: the node's own folder under the one given to up, its blocks indexed too
    # (written by a thread of the node's, published every 50 ms: waited for).
    folder = disk_dir / "decode-0" / root
    deadline = time.monotonic() + 30
    while True:
        files = {bytes.fromhex(p.name[:64]) for p in folder.glob("*.kv")}
        disk = client.smembers(f"ss:{root}:disk:{node}")
        if (len(disk) >= 32 * 15 and disk <= files) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(files) >= 32 * 15 and disk <= files and len(disk) >= 32 * 15
    # The node says what a load from its host tier costs (the router prices the tier by it):
    # the second round loaded runs of 15 blocks, each sampled.
    with grpc.insecure_channel(node) as channel:
        stats = nodes_pb2_grpc.NodeStatsServiceStub(channel).GetStats(
            nodes_pb2.GetStatsRequest(), timeout=10
        )
    assert 0 < stats.tier_block_load_s["host"] < 1, dict(stats.tier_block_load_s)
