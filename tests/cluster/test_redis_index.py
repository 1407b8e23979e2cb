"""The prefix index and node registry against a real redis-server."""

import asyncio
import random

import pytest
from support.processes import start_redis

from splitserve.kvstore import BlockPool, ModelIdentity, hash_request_tokens
from splitserve.kvstore.block_pool import BlockRemoved, BlockStored
from splitserve.kvstore.host_cache import DISK, HOST
from splitserve.kvstore.redis_index import (
    IDENTITIES_KEY,
    Held,
    IndexPublisher,
    NodeInfo,
    PrefixIndex,
)

ROOT = ModelIdentity("m").root_hash


@pytest.fixture
def redis_url(tmp_path):
    proc = start_redis(tmp_path)
    yield proc.address
    proc.stop()


def _chain(n, salt=None):
    return hash_request_tokens([random.randrange(1000) for _ in range(16 * n)], 16, ROOT, salt)


def _info(node_id, role="prefill"):
    return NodeInfo(node_id, role, f"{node_id}:9000", 100, 90, 1, 0)


def test_longest_prefix_per_node_follows_stores_and_evictions(redis_url):
    async def run():
        index = PrefixIndex(redis_url, ROOT)
        chain = _chain(6)
        await index.publish("a", [BlockStored(chain[:4])])
        await index.publish("b", [BlockStored(chain[:2]), BlockStored(chain[3:6])])
        got = await index.longest_prefixes(["a", "b", "c"], chain)
        assert got == {"a": 4, "b": 2, "c": 0}
        await index.publish("a", [BlockRemoved(chain[1:2])])
        assert (await index.longest_prefixes(["a"], chain)) == {"a": 1}
        # Another model sharing the Redis sees none of it.
        other = PrefixIndex(redis_url, ModelIdentity("other").root_hash)
        await other.publish("a", [BlockStored(chain)])
        assert (await index.longest_prefixes(["a"], chain)) == {"a": 1}
        # A restarted node forgets its earlier life.
        await index.reset_node("a", [BlockStored(chain[:3])])
        assert (await index.longest_prefixes(["a"], chain)) == {"a": 3}
        await index.close()
        await other.close()

    asyncio.run(run())


def test_a_block_moves_between_tiers_in_the_index_and_leaves_it_at_the_last(redis_url):
    """The host tier publishes its own stored/removed events: a block the device pool evicts but
    the host tier holds still counts for its node; one that leaves both is gone."""

    async def run():
        index = PrefixIndex(redis_url, ROOT)
        chain = _chain(4)
        await index.publish("a", [BlockStored(chain)])
        await index.publish("a", [BlockStored(chain, HOST)])  # copied out as cached
        await index.publish("a", [BlockRemoved(chain[:2])])  # evicted from the device pool
        assert (await index.longest_prefixes(["a"], chain)) == {"a": 4}
        assert await index.redis.smembers(index._blocks_key("a")) == set(chain[2:])
        # By tier, each block counted in the fastest holding it (what the router prices).
        held = (await index.held_prefixes_many([(["a", "b"], chain)]))[0]
        assert held == {"a": Held(device=2, host=2), "b": Held()}
        await index.publish("a", [BlockRemoved(chain[1:2], HOST)])  # and from the host tier
        assert (await index.longest_prefixes(["a"], chain)) == {"a": 1}
        # A snapshot per tier replaces both sets; deregistering removes both.
        await index.reset_node("a", [BlockStored(chain[:1]), BlockStored(chain[1:3], HOST)])
        assert (await index.longest_prefixes(["a"], chain)) == {"a": 3}
        await index.publish("a", [BlockStored(chain[3:], DISK)])
        held = (await index.held_prefixes_many([(["a"], chain)]))[0]
        assert held == {"a": Held(device=1, host=2, disk=1)} and held["a"].blocks == 4
        await index.deregister("a")
        assert (await index.longest_prefixes(["a"], chain)) == {"a": 0}
        assert not await index.redis.exists(*index._tier_keys("a"))
        await index.close()

    asyncio.run(run())


def test_expired_heartbeats_drop_nodes_and_their_blocks(redis_url):
    async def run():
        index = PrefixIndex(redis_url, ROOT, ttl_s=0.5)
        chain = _chain(3)
        for node in ("a", "b"):
            await index.heartbeat(_info(node))
            await index.publish(node, [BlockStored(chain)])
        assert {n.node_id for n in await index.live_nodes()} == {"a", "b"}
        await asyncio.sleep(0.3)
        await index.heartbeat(_info("a"))
        await asyncio.sleep(0.4)
        assert [n.node_id for n in await index.live_nodes()] == ["a"]
        assert (await index.longest_prefixes(["b"], chain)) == {"b": 0}  # cleaned up
        await index.deregister("a")
        assert await index.live_nodes() == []
        await index.close()

    asyncio.run(run())


def test_malformed_registry_entries_are_skipped_and_the_rest_discovered(redis_url):
    """A bad value in one node's entry (written by anyone who reaches Redis) must not stop
    discovery: that entry is ignored, the others are found, a node added later too."""

    async def run():
        index = PrefixIndex(redis_url, ROOT)
        await index.heartbeat(_info("good"))
        for node, field, value in (("bad-int", "num_blocks", "lots"),
                                   ("bad-role", "role", "admin"),
                                   ("bad-addr", "address", "nowhere")):  # fmt: skip
            await index.heartbeat(_info(node))
            await index.redis.hset(index._node_key(node), field, value)
        await index.redis.hset(IDENTITIES_KEY, "junk", "not a stamp")
        assert {n.node_id for n in await index.live_nodes()} == {"good"}
        await index.foreign_nodes()  # the junk identity entry is dropped, no error
        assert await index.redis.hget(IDENTITIES_KEY, "junk") is None
        await index.heartbeat(_info("later", role="decode"))
        assert {n.node_id for n in await index.live_nodes()} == {"good", "later"}
        await index.close()

    asyncio.run(run())


def test_with_a_cluster_key_only_signed_entries_count(redis_url):
    """Whoever can write to Redis cannot register a node with a cluster that has a key: entries
    not signed with it, or changed after signing (a redirected address), are ignored."""
    key = b"k" * 32

    async def run():
        router = PrefixIndex(redis_url, ROOT, key=key)
        node = PrefixIndex(redis_url, ROOT, key=key)
        stranger = PrefixIndex(redis_url, ROOT)  # no key
        other = PrefixIndex(redis_url, ROOT, key=b"x" * 32)
        await node.heartbeat(_info("good"))
        await stranger.heartbeat(_info("fake"))
        await other.heartbeat(_info("other-cluster"))
        await node.heartbeat(_info("hijacked"))
        await router.redis.hset(router._node_key("hijacked"), "address", "evil:9000")
        # A signed entry replayed long after its node stopped refreshing it.
        await node.heartbeat(_info("replayed"))
        fields = {k.decode(): v.decode() for k, v in
                  (await router.redis.hgetall(router._node_key("replayed"))).items()}  # fmt: skip
        fields["time"] = f"{float(fields['time']) - 3600:.3f}"
        order = ("role", "address", "num_blocks", "num_free_blocks", "running", "waiting", "time")
        fields["sig"] = node._sign("replayed", *(fields[k] for k in order))
        await router.redis.hset(router._node_key("replayed"), mapping=fields)
        assert {n.node_id for n in await router.live_nodes()} == {"good"}
        # Without a key (no token), every well-formed entry counts, as before.
        assert {n.node_id for n in await stranger.live_nodes()} == {
            "good",
            "fake",
            "other-cluster",
            "hijacked",
            "replayed",
        }
        other_model = PrefixIndex(redis_url, ModelIdentity("other").root_hash, key=key)
        forged_model = PrefixIndex(redis_url, ModelIdentity("other").root_hash, key=b"y" * 32)
        await other_model.heartbeat(_info("mismatch"))
        await forged_model.heartbeat(_info("forged-mismatch"))
        assert set(await router.foreign_nodes()) == {"mismatch"}
        for index in (router, node, stranger, other, other_model, forged_model):
            await index.close()

    asyncio.run(run())


def test_publisher_survives_redis_restart_and_republishes(tmp_path):
    redis_proc = start_redis(tmp_path)
    port = int(redis_proc.address.rsplit(":", 1)[1])
    pool = BlockPool(64, enable_events=True)
    chain = _chain(4)

    async def take_events():
        return pool.take_events()

    async def snapshot():
        return [BlockStored(list(pool.cached_block_hash_to_block))]

    async def info():
        return _info("node")

    async def run():
        nonlocal redis_proc
        index = PrefixIndex(redis_proc.address, ROOT)
        publisher = IndexPublisher(index, "node", take_events, snapshot, info, interval_s=0.02)
        task = asyncio.create_task(publisher.run())
        blocks = pool.get_new_blocks(4)
        pool.cache_full_blocks(blocks, chain, 0, 2)
        reader = PrefixIndex(redis_proc.address, ROOT)
        for _ in range(100):
            if (await reader.longest_prefixes(["node"], chain))["node"] == 2:
                break
            await asyncio.sleep(0.02)
        assert (await reader.longest_prefixes(["node"], chain))["node"] == 2
        await reader.close()
        redis_proc.stop()
        pool.cache_full_blocks(blocks, chain, 2, 4)  # stored while Redis is down
        await asyncio.sleep(0.3)
        assert not publisher.connected
        redis_proc = start_redis(tmp_path, port)  # an empty Redis comes back
        reader = PrefixIndex(redis_proc.address, ROOT)
        for _ in range(200):
            if (await reader.longest_prefixes(["node"], chain))["node"] == 4:
                break
            await asyncio.sleep(0.02)
        assert (await reader.longest_prefixes(["node"], chain))["node"] == 4
        assert publisher.connected
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await publisher.stop()
        await reader.close()

    try:
        asyncio.run(run())
    finally:
        redis_proc.stop()


def test_concurrent_router_lookups_share_round_trips(redis_url):
    from splitserve.router.prefix import LookupBatcher

    async def run():
        index = PrefixIndex(redis_url, ROOT)
        chains = [_chain(4) for _ in range(20)]
        for i, chain in enumerate(chains):
            await index.publish("a", [BlockStored(chain[: i % 5])])
        await index.publish("b", [BlockStored(chains[3])])
        pipelines = []
        many = index.held_prefixes_many

        async def counted(queries):
            pipelines.append(len(queries))
            return await many(queries)

        index.held_prefixes_many = counted
        batcher = LookupBatcher(index)
        got = await asyncio.gather(*(batcher.lookup(["a", "b"], c) for c in chains))
        assert got == [{"a": Held(i % 5), "b": Held(4 if i == 3 else 0)} for i in range(20)]
        assert sum(pipelines) == 20 and len(pipelines) <= 3, pipelines  # not one per request
        assert await batcher.lookup(["a"], []) == {"a": Held()}
        await index.close()

    asyncio.run(run())
