"""The cluster's prefix index and node registry in Redis (key schema: docs/redis.md).

Every node publishes which block hashes it holds and a heartbeat; the router reads both to send a
request where its prefix is cached. Redis is a hint, never the truth: a node verifies blocks
before it relies on them, and when Redis is unreachable everything works without it (routing by
load only) and nodes republish what they hold once it is back.

Over 300 lines on purpose: both sides of the key schema (a node's publisher, the router's
reads) live in one file so that they cannot drift apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from splitserve.kvstore.block_pool import DEVICE, BlockRemoved, BlockStored, KVCacheEvent
from splitserve.kvstore.host_cache import DISK, HOST

logger = logging.getLogger(__name__)

HEARTBEAT_TTL_S = 5.0  # a node whose heartbeat is older than this is dead to the router
HEARTBEAT_EVERY_S = 1.0
IDENTITIES_KEY = "ss:identities"  # node id -> "root_hex time identity", every model identity


def _prefix(root_hash: bytes) -> str:
    # Keys are per model identity: two models sharing a Redis never see each other's blocks.
    return f"ss:{root_hash.hex()[:16]}"


TIERS = (DEVICE, HOST, DISK)  # the tiers a node publishes, each a set of its own, fastest first


class Held(NamedTuple):
    """The leading blocks of a prompt one node holds, by the fastest of its tiers holding each
    (``TIERS``' order)."""

    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def blocks(self) -> int:
        return self.device + self.host + self.disk


REPLAY_TTLS = 3  # a signed entry older than this many TTLs is ignored (clock skew slack)

# The fields of a registry entry its signature covers (with the node id), in this order.
_SIGNED_FIELDS = ("role", "address", "num_blocks", "num_free_blocks", "running", "waiting", "time")


@dataclass(frozen=True, slots=True)
class NodeInfo:
    node_id: str  # the node's address, host:port
    role: str  # "prefill" or "decode"
    address: str
    num_blocks: int
    num_free_blocks: int
    running: int
    waiting: int

    @property
    def load(self) -> float:
        """Share of the KV pool in use plus queued work, for load balancing."""
        used = 1.0 - self.num_free_blocks / max(self.num_blocks, 1)
        return used + self.running / 64 + self.waiting / 16


class PrefixIndex:
    """A node's or the router's handle on the index. All methods raise ``RedisError`` when Redis
    is unreachable; callers decide whether that degrades or fails."""

    def __init__(
        self,
        url: str,
        root_hash: bytes,
        ttl_s: float = HEARTBEAT_TTL_S,
        identity: str = "",
        key: bytes | None = None,
    ) -> None:
        """``key`` (the cluster's, ``runtime.auth.registry_key``): registry and identity entries
        are signed with it (HMAC-SHA256) when written, and ignored unless signed with it when
        read: a node registered by whoever can write to Redis is never routed to."""
        self.redis = aioredis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._key = key
        self.root_hash = root_hash
        self.identity = identity  # readable form of the model identity, for other processes' logs
        self.prefix = _prefix(root_hash)
        self.ttl_s = ttl_s
        self._malformed_reported: set[str] = set()

    def _blocks_key(self, node_id: str, tier: str = DEVICE) -> str:
        # NOTE: the device tier keeps the key it had before there were tiers.
        return f"{self.prefix}:{'blocks' if tier == DEVICE else tier}:{node_id}"

    def _tier_keys(self, node_id: str) -> list[str]:
        return [self._blocks_key(node_id, tier) for tier in TIERS]

    def _node_key(self, node_id: str) -> str:
        return f"{self.prefix}:node:{node_id}"

    @property
    def _nodes_key(self) -> str:
        return f"{self.prefix}:nodes"

    async def close(self) -> None:
        await self.redis.aclose()

    # ------------------------------------------------------------------ node side

    async def reset_node(self, node_id: str, held: Sequence[BlockStored] = ()) -> None:
        """Forget what an earlier life of this node published, then publish ``held`` (what it
        holds now, one ``BlockStored`` per tier)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(*self._tier_keys(node_id))
            for event in held:
                if event.block_hashes:
                    pipe.sadd(self._blocks_key(node_id, event.tier), *event.block_hashes)
            await pipe.execute()

    async def publish(self, node_id: str, events: Sequence[KVCacheEvent]) -> None:
        """Apply a batch of stored/removed events in one pipelined round trip, in order (each
        to its tier's set: a block that leaves the device for the host tier moves between
        them)."""
        if not events:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for event in events:
                if not event.block_hashes or event.tier not in TIERS:
                    continue
                key = self._blocks_key(node_id, event.tier)
                if isinstance(event, BlockStored):
                    pipe.sadd(key, *event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    pipe.srem(key, *event.block_hashes)
            await pipe.execute()

    async def heartbeat(self, info: NodeInfo) -> None:
        """Register (or refresh) the node; its entry expires unless refreshed in time."""
        mapping = {
            "role": info.role,
            "address": info.address,
            "num_blocks": str(info.num_blocks),
            "num_free_blocks": str(info.num_free_blocks),
            "running": str(info.running),
            "waiting": str(info.waiting),
            "time": f"{time.time():.3f}",
        }
        mapping["sig"] = self._sign(info.node_id, *(mapping[f] for f in _SIGNED_FIELDS))
        async with self.redis.pipeline(transaction=True) as pipe:
            # NOTE: redis' mapping type has invariant keys (FieldT), which str keys do not meet.
            pipe.hset(self._node_key(info.node_id), mapping=mapping)  # pyright: ignore[reportArgumentType]
            pipe.pexpire(self._node_key(info.node_id), int(self.ttl_s * 1000))
            pipe.sadd(self._nodes_key, info.node_id)
            # Across all model identities: lets a router see nodes it would never match.
            pipe.hset(IDENTITIES_KEY, info.node_id, self._identity_entry(info.node_id))
            await pipe.execute()

    def _identity_entry(self, node_id: str) -> str:
        root, stamp = self.root_hash.hex(), f"{time.time():.3f}"
        return f"{root} {stamp} {self._sign(node_id, root, stamp, self.identity)} {self.identity}"

    def _sign(self, *fields: str) -> str:
        """HMAC-SHA256 of the fields with the cluster key ("-" without a key)."""
        if self._key is None:
            return "-"
        return hmac.new(self._key, "\x1f".join(fields).encode(), "sha256").hexdigest()

    def _signed(self, sig: str, *fields: str) -> bool:
        return self._key is None or hmac.compare_digest(sig, self._sign(*fields))

    async def deregister(self, node_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._node_key(node_id), *self._tier_keys(node_id))
            pipe.srem(self._nodes_key, node_id)
            pipe.hdel(IDENTITIES_KEY, node_id)
            await pipe.execute()

    # ------------------------------------------------------------------ router side

    async def live_nodes(self) -> list[NodeInfo]:
        """Nodes with a fresh heartbeat; entries of expired nodes are cleaned up on the way."""
        # NOTE: this client returns bytes (no decode_responses); redis' types say bytes | str.
        members = cast("set[bytes]", await self.redis.smembers(self._nodes_key))
        ids = [i.decode() for i in members]
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for node_id in ids:
                pipe.hgetall(self._node_key(node_id))
            rows = await pipe.execute()
        live, dead = [], []
        for node_id, row in zip(ids, rows, strict=True):
            if not row:
                dead.append(node_id)
                continue
            info = self._node_info(node_id, row)
            if info is not None:
                live.append(info)
        if dead:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.srem(self._nodes_key, *dead)
                for node_id in dead:
                    pipe.delete(*self._tier_keys(node_id))
                await pipe.execute()
            logger.info("prefix index: dropped %d expired nodes: %s", len(dead), dead)
        return live

    def _node_info(self, node_id: str, row: dict) -> NodeInfo | None:
        """A registry entry as NodeInfo; None (logged once per node) if it is malformed: one bad
        entry must not stop discovery of the others."""
        try:
            f = {k.decode(): v.decode() for k, v in row.items()}
            info = NodeInfo(
                node_id,
                f["role"],
                f["address"],
                int(f["num_blocks"]),
                int(f["num_free_blocks"]),
                int(f["running"]),
                int(f["waiting"]),
            )
            host, _, port = info.address.rpartition(":")
            if info.role not in ("prefill", "decode") or not host or not port.isdigit():
                raise ValueError(f"role {info.role!r}, address {info.address!r}")
            if self._key is not None:
                if not self._signed(f.get("sig", ""), node_id, *(f[k] for k in _SIGNED_FIELDS)):
                    raise ValueError("not signed with this cluster's key")
                # A signed entry replayed into Redis after its node stopped refreshing it.
                if time.time() - float(f["time"]) > REPLAY_TTLS * self.ttl_s:
                    raise ValueError("a stale signed entry (replayed?)")
            return info
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            if node_id not in self._malformed_reported:
                if len(self._malformed_reported) > 10_000:
                    self._malformed_reported.clear()  # bounded: at worst logged again
                self._malformed_reported.add(node_id)
                logger.warning("ignoring malformed registry entry %r: %r", node_id, exc)
            return None

    async def foreign_nodes(self) -> dict[str, str]:
        """Live nodes (any role) registered under another model identity than this index's:
        node id → their identity. Such nodes hash prompts differently, so they are never
        routed to; the router reports them (a dtype, block size or checkpoint mismatch)."""
        rows = cast("dict[bytes, bytes]", await self.redis.hgetall(IDENTITIES_KEY))
        now, stale, out = time.time(), [], {}
        for node_id, entry in rows.items():
            try:
                root, stamp, sig, identity = [*entry.decode().split(" ", 3), ""][:4]
                age = now - float(stamp)
                if not self._signed(sig, node_id.decode(), root, stamp, identity):
                    continue  # another cluster's, or forged: not ours to report or drop
            except (ValueError, UnicodeDecodeError):
                stale.append(node_id)  # malformed: dropped like an expired one
                continue
            if age > self.ttl_s:
                stale.append(node_id)
            elif root != self.root_hash.hex():
                out[node_id.decode()] = identity or root
        if stale:
            await self.redis.hdel(IDENTITIES_KEY, *stale)
        return out

    async def longest_prefixes(
        self, node_ids: Sequence[str], block_hashes: Sequence[bytes]
    ) -> dict[str, int]:
        """For each node, how many leading blocks of the chain it holds in any of its tiers (a
        block may be in its device pool or its host memory: either is copied, not computed), in
        one round trip."""
        held = (await self.held_prefixes_many([(node_ids, block_hashes)]))[0]
        return {node_id: h.blocks for node_id, h in held.items()}

    async def held_prefixes_many(
        self, queries: Sequence[tuple[Sequence[str], Sequence[bytes]]]
    ) -> list[dict[str, Held]]:
        """For several (node ids, block hashes) queries in one round trip: for each node, the
        leading blocks of the chain it holds in any tier, counted by the fastest tier holding
        each (``Held``)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for node_ids, block_hashes in queries:
                if block_hashes:
                    for node_id in node_ids:
                        for key in self._tier_keys(node_id):
                            pipe.smismember(key, list(block_hashes))
            rows = iter(await pipe.execute() if len(pipe) else [])
        out = []
        for node_ids, block_hashes in queries:
            found = {}
            for node_id in node_ids:
                counts = [0] * len(TIERS)
                if block_hashes:
                    tiers = [next(rows) for _ in TIERS]
                    for flags in zip(*tiers, strict=True):
                        fastest = next((t for t, flag in enumerate(flags) if flag), None)
                        if fastest is None:
                            break
                        counts[fastest] += 1
                found[node_id] = Held(*counts)
            out.append(found)
        return out


class IndexPublisher:
    """Runs on a node: drains the pool's events every ``interval_s`` into Redis and heartbeats.

    ``take_events``/``snapshot``/``info`` are coroutine functions supplied by the node (they run
    on its engine thread). When Redis fails the publisher keeps the node serving, drops the
    events and, once Redis answers again, republishes the node's whole cache.
    """

    def __init__(
        self,
        index: PrefixIndex,
        node_id: str,
        take_events,
        snapshot,
        info,
        interval_s: float = 0.05,
    ) -> None:
        self.index, self.node_id = index, node_id
        self._take_events, self._snapshot, self._info = take_events, snapshot, info
        self.interval_s = interval_s
        self.connected = False
        self.published = 0

    async def run(self) -> None:
        last_beat = 0.0
        while True:
            try:
                if not self.connected:
                    await self._take_events()  # superseded by the snapshot below
                    await self.index.reset_node(self.node_id, await self._snapshot())
                    self.connected = True
                    logger.info("prefix index: published %s's cache", self.node_id)
                events = await self._take_events()
                await self.index.publish(self.node_id, events)
                self.published += sum(len(e.block_hashes) for e in events)
                if time.monotonic() - last_beat >= HEARTBEAT_EVERY_S:
                    await self.index.heartbeat(await self._info())
                    last_beat = time.monotonic()
            except (RedisError, OSError) as exc:
                if self.connected:
                    logger.warning("prefix index unreachable (%s): serving without it", exc)
                self.connected = False
                await asyncio.sleep(1.0)
                continue
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self.index.deregister(self.node_id)
        await self.index.close()
