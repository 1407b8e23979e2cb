"""Cache-aware routing with a real Redis: nodes register and publish their cached blocks, the
router discovers them and sends a shared-prefix request to the node that holds the prefix;
tenants' salts keep caches apart; losing Redis or a node never fails a request."""

import asyncio
import random
import time

import pytest
from support.processes import start_node, start_redis, start_router_discovering
from support.reference import hf_greedy

from splitserve.client import Client
from splitserve.kvstore import ModelIdentity
from splitserve.kvstore.redis_index import PrefixIndex
from splitserve.models.tiny import write_random_checkpoint

GREEDY = dict(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_checkpoint(
        tmp_path_factory.mktemp("prefix") / "m",
        seed=11,
        with_tokenizer=True,
        num_hidden_layers=2,
        num_key_value_heads=1,
        head_dim=64,
        num_attention_heads=2,
    )


def live_nodes(redis_url, model_dir):
    async def run():
        index = PrefixIndex(redis_url, ModelIdentity.for_checkpoint(model_dir, "float32").root_hash)
        try:
            return await index.live_nodes()
        finally:
            await index.close()

    return asyncio.run(run())


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_prefix_routing_salts_and_outages(model_dir, tmp_path):
    redis = start_redis(tmp_path)
    procs = [redis]
    try:
        flags = ("--redis-url", redis.address)
        prefill = [start_node("prefill", model_dir, tmp_path, *flags) for _ in range(2)]
        decode = start_node("decode", model_dir, tmp_path, *flags)
        procs += [*prefill, decode]
        wait_for(lambda: len(live_nodes(redis.address, model_dir)) == 3)
        router = start_router_discovering(model_dir, tmp_path, redis.address)
        procs.append(router)
        system = [random.randrange(256) for _ in range(96)]  # six full blocks
        prompts = [[*system, *[random.randrange(256) for _ in range(5)]] for _ in range(5)]
        with Client(router.address) as client:
            wait_for(lambda: _ok(client))  # the router has discovered the nodes
            first = client.generate(prompt_token_ids=prompts[0], **GREEDY)
            assert list(first.token_ids) == hf_greedy(model_dir, prompts[0], 6)
            # Published (within ~50 ms, whatever this machine's speed: waited for, not slept on).
            wait_for(lambda: _published(prefill, redis.address, model_dir, system))
            for prompt in prompts[1:]:
                r = client.generate(prompt_token_ids=prompt, **GREEDY)
                assert r.usage.cached_tokens >= 96, r.usage  # routed to the caching node
                assert list(r.token_ids) == hf_greedy(model_dir, prompt, 6)
            salted = client.generate(prompt_token_ids=prompts[1], cache_salt="tenant-b", **GREEDY)
            assert salted.usage.cached_tokens == 0
            assert list(salted.token_ids) == hf_greedy(model_dir, prompts[1], 6)

            # Redis goes away: every request still succeeds (routing by load only).
            redis_port = int(redis.address.rsplit(":", 1)[1])
            redis.stop()
            for prompt in prompts:
                assert len(client.generate(prompt_token_ids=prompt, **GREEDY).token_ids) == 6
            # Redis comes back empty: nodes re-register and republish, hits come back.
            redis = start_redis(tmp_path, redis_port)
            procs[0] = redis
            wait_for(lambda: len(live_nodes(redis.address, model_dir)) == 3)
            wait_for(lambda: _published(prefill, redis.address, model_dir, system))
            # Once the router reads the index again (its client reconnects), every request that
            # shares the prefix is sent to its holder: three in a row after the first.
            wait_for(lambda: _cached(client, prompts[2]))
            assert all(_cached(client, p) for p in prompts[2:5])

            # The caching prefill node dies: its entries stop attracting requests.
            holder = max(prefill, key=lambda p: _cached_blocks(p, redis.address, model_dir, system))
            holder.popen.kill()
            wait_for(lambda: len(live_nodes(redis.address, model_dir)) == 2, timeout=15)
            r = client.generate(prompt_token_ids=prompts[3], **GREEDY, timeout=60)
            assert list(r.token_ids) == hf_greedy(model_dir, prompts[3], 6)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _ok(client):
    try:
        client.generate(prompt_token_ids=[1, 2, 3], max_tokens=1, temperature=0.0)
        return True
    except Exception:
        return False


def _cached(client, prompt) -> bool:
    return client.generate(prompt_token_ids=prompt, **GREEDY).usage.cached_tokens >= 96


def _published(prefill, redis_url, model_dir, tokens) -> bool:
    """A prefill node's whole prefix (six blocks) is in the index."""
    return max(_cached_blocks(p, redis_url, model_dir, tokens) for p in prefill) >= 6


def _cached_blocks(node, redis_url, model_dir, tokens):
    from splitserve.kvstore import hash_request_tokens

    root = ModelIdentity.for_checkpoint(model_dir, "float32").root_hash

    async def run():
        index = PrefixIndex(redis_url, root)
        try:
            hashes = hash_request_tokens(tokens, 16, root)
            return (await index.longest_prefixes([node.address], hashes))[node.address]
        finally:
            await index.close()

    return asyncio.run(run())
