"""The nodes the router knows: one gRPC channel each, health checks, identity checks, discovery.

The pools themselves (load, down state, pick rules) are ``router.pool``. Nodes come from the
command line (static) and, with a prefix index, from the node registry in Redis
(``NodeRegistry.sync``): a node that registers is used within a discovery interval, one whose
heartbeat expired is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.exceptions import RedisError

from splitserve.kvstore import ModelIdentity
from splitserve.kvstore.host_cache import DISK, HOST, STORE
from splitserve.kvstore.redis_index import NodeInfo, PrefixIndex
from splitserve.router.pool import DEFAULT_DOWN_S, DecodeNode, DecodePool, Node, PrefillPool
from splitserve.runtime import tls
from splitserve.runtime.auth import call_metadata
from splitserve.runtime.metrics import LoadFigures
from splitserve.runtime.server import CHANNEL_OPTIONS
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

EMPTY_GRACE_S = 5.0  # a role that vanished whole from the registry is kept this long

# A prefill node may have this many steps' worth of prompt tokens (its max_num_batched_tokens) of
# the router's requests to compute: enough to keep its batches full, the rest waits at the router.
PREFILL_QUEUE_STEPS = 4

STALL_PROBES = 2  # failed health checks in a row before a node counts as stalled

logger = logging.getLogger(__name__)


class NodeRegistry:
    """Both pools, one gRPC channel per node, and a background health checker."""

    def __init__(
        self,
        prefill_addresses: Sequence[str],
        decode_addresses: Sequence[str],
        down_s: float = DEFAULT_DOWN_S,
        expected_identity: ModelIdentity | None = None,
        decode_overcommit: float = 1.5,
        decode_kv_headroom: float = 0.0,
        prefill_queue_tokens: int = 0,
        share: float = 1.0,
    ) -> None:
        # A decode node may hold this many of the router's requests per max_num_seqs slot: those
        # in prefill or transfer do not decode yet, and the node queues the rest it receives.
        self.decode_overcommit = decode_overcommit
        # A prefill node's queue bound (0: PREFILL_QUEUE_STEPS of its own step budget).
        self.prefill_queue_tokens = prefill_queue_tokens
        # The most of each node this router fills (--capacity-share: a cap on its decode leases,
        # and prefill nodes' queue bound).
        self.share = share
        self.prefill = PrefillPool(prefill_addresses, down_s=down_s)
        self.decode = DecodePool(
            decode_addresses, down_s=down_s, kv_headroom=decode_kv_headroom, share=share
        )
        self.expected_identity = expected_identity
        self._empty_since: dict[str, float] = {}  # role → when the registry first had none
        # After each health round (router.decode_stage: the lease streams of the nodes up)
        self.on_checked: Callable[[], None] | None = None
        self.closed = False
        self._foreign_reported: set[str] = set()

    def _all(self) -> list[tuple[PrefillPool | DecodePool, Node]]:
        return [(pool, n) for pool in (self.prefill, self.decode) for n in pool.nodes]

    def channel(self, node: Node) -> grpc.aio.Channel:
        if node.channel is None:
            node.channel = tls.channel(node.address, options=CHANNEL_OPTIONS)
        return node.channel

    def prefill_stub(self, node: Node) -> nodes_pb2_grpc.PrefillNodeServiceStub:
        return nodes_pb2_grpc.PrefillNodeServiceStub(self.channel(node))

    def decode_stub(self, node: Node) -> nodes_pb2_grpc.DecodeNodeServiceStub:
        return nodes_pb2_grpc.DecodeNodeServiceStub(self.channel(node))

    async def stats(self, node: Node, timeout: float = 2.0) -> nodes_pb2.GetStatsResponse:
        """The node's GetStats (raises grpc.aio.AioRpcError)."""
        stub = nodes_pb2_grpc.NodeStatsServiceStub(self.channel(node))
        return await stub.GetStats(
            nodes_pb2.GetStatsRequest(), timeout=timeout, metadata=call_metadata()
        )

    async def probe(self, node: Node, timeout: float = 1.0) -> bool:
        """True when the node answers grpc.health.v1 Check with SERVING within ``timeout``."""
        # typeshed's HealthStub declares no methods (the generated one sets them in __init__)
        stub: Any = health_pb2_grpc.HealthStub(self.channel(node))
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            node.last_error = f"health check: {exc.code().name} {exc.details()}"
            return False
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            node.last_error = "health check: not serving"
            return False
        return True

    async def check_all(self) -> None:
        """Probe every node once: mark the silent ones down and the answering ones up; check
        the model identity of each answering node not yet checked."""
        pairs = self._all()
        results = await asyncio.gather(*(self.probe(n) for _, n in pairs))
        unverified = []
        for (pool, node), ok in zip(pairs, results, strict=True):
            if ok:
                node.silent_probes = 0
                pool.mark_up(node)
                if not node.verified:
                    unverified.append((pool, node))
            else:
                # Calls waiting on it are given up only once it stays silent (one slow answer
                # from a busy node must not cancel all its work).
                node.silent_probes += 1
                stalled = node.silent_probes >= STALL_PROBES
                pool.mark_down(node, node.last_error, stalled=stalled)
        await asyncio.gather(*(self.verify(pool, node) for pool, node in unverified))
        if self.on_checked is not None:
            self.on_checked()

    async def verify(self, pool: PrefillPool | DecodePool, node: Node) -> None:
        """Compare the node's model root hash with the router's: a node started with another
        checkpoint, dtype or block size would hash every prompt differently (prefix hits would
        silently never match) and its KV could not be used by the other nodes."""
        try:
            stats = await self.stats(node)
        except grpc.aio.AioRpcError:
            if self.expected_identity is None:
                node.verified = True  # nothing to check; its capacity stays unknown
            return  # checked again on the next round
        node.verified = True
        node.tier_block_load_s = tier_times(stats)
        if isinstance(node, DecodeNode) and stats.max_num_seqs:
            node.slots = stats.max_num_seqs
            node.full_slots = stats.max_num_seqs * self.decode_overcommit
            node.kv.num_blocks = stats.num_blocks or None
            if stats.relay_leases and node.lease is None:
                node.lease = 0.0  # nothing until the node grants this router a share
            node.apply_share()
            pool.notify_waiters()
        if pool.role == "prefill" and (self.prefill_queue_tokens or stats.max_num_batched_tokens):
            queued = self.prefill_queue_tokens or PREFILL_QUEUE_STEPS * stats.max_num_batched_tokens
            node.max_queued_tokens = max(1, int(queued * self.share))
            pool.notify_waiters()
        if self.expected_identity is None:
            return
        expected = self.expected_identity
        if stats.role != pool.role:
            pool.reject(node, f"it is a {stats.role or 'unknown'} node, listed as {pool.role}")
        elif stats.model_root_hash != expected.root_hash:
            pool.reject(
                node,
                f"it serves {stats.model_identity or 'an unknown model identity'}, the router "
                f"expects {expected} (same checkpoint, --dtype and --block-size everywhere)",
            )

    async def run_health_checks(self, interval_s: float = 1.0) -> None:
        """Run until cancelled (a background task of the server)."""
        while True:
            try:
                await self.check_all()
            except Exception:  # never let the checker die silently
                logger.exception("health check round failed")
            await asyncio.sleep(interval_s)

    async def sync(self, live: Sequence[NodeInfo]) -> None:
        """Adopt the registry's view of the live nodes (static nodes always stay).

        A role whose every node vanished at once (Redis restarted empty, or flushed) keeps its
        known nodes for EMPTY_GRACE_S: they register again within a heartbeat, and meanwhile
        requests still have somewhere to go."""
        now = time.monotonic()
        for pool in (self.prefill, self.decode):
            addresses = {n.address for n in live if n.role == pool.role}
            if not addresses and any(n.discovered for n in pool.nodes):
                since = self._empty_since.setdefault(pool.role, now)
                if now - since < EMPTY_GRACE_S:
                    continue
            else:
                self._empty_since.pop(pool.role, None)
            before = set(pool.nodes)
            pool.sync(addresses)
            for node in before - set(pool.nodes):
                if node.channel is not None:
                    await node.channel.close()

    async def run_discovery(self, index: PrefixIndex, interval_s: float = 1.0) -> None:
        """Follow the node registry in Redis until cancelled; while Redis is unreachable the
        last known nodes stay in use."""
        reachable = True
        while True:
            try:
                await self.sync(await index.live_nodes())
                await self._report_foreign(index)
                if not reachable:
                    logger.info("node registry reachable again")
                reachable = True
            except (RedisError, OSError) as exc:
                if reachable:
                    logger.warning("node registry unreachable (%s): keeping known nodes", exc)
                reachable = False
            except Exception:  # never let one bad read end discovery for good
                logger.exception("node registry: reading it failed; trying again")
            await asyncio.sleep(interval_s)

    async def _report_foreign(self, index: PrefixIndex) -> None:
        """Log (once per node) nodes registered in Redis under another model identity."""
        for node_id, identity in (await index.foreign_nodes()).items():
            if node_id not in self._foreign_reported:
                self._foreign_reported.add(node_id)
                logger.error(
                    "node %s registered for %s, not this router's %s: it is not used "
                    "(same checkpoint, --dtype and --block-size everywhere)",
                    node_id,
                    identity,
                    index.identity or index.root_hash.hex(),
                )

    async def poll_load(self) -> dict[tuple[str, str], LoadFigures]:
        """Every reachable node's load figures, (role, address) → LoadFigures (GetStats); each
        node's measured tier load times are taken on the way (``Node.tier_block_load_s``)."""
        pairs = [(pool, n) for pool, n in self._all() if not n.rejected]

        async def one(pool: PrefillPool | DecodePool, node: Node) -> LoadFigures | None:
            try:
                s = await self.stats(node)
            except grpc.aio.AioRpcError:
                return None
            node.tier_block_load_s = tier_times(s)  # (what its tiers cost now)
            return LoadFigures(
                s.running,
                s.waiting,
                s.num_blocks,
                s.num_free_blocks,
                s.prefill_tokens_waiting,
                s.pending_transfers,
                s.kv_tokens_held if s.HasField("kv_tokens_held") else None,
                s.kv_token_slots if s.HasField("kv_token_slots") else None,
            )

        loads = await asyncio.gather(*(one(pool, n) for pool, n in pairs))
        return {
            (pool.role, n.address): load
            for (pool, n), load in zip(pairs, loads, strict=True)
            if load is not None
        }

    async def run_load_polls(self, into: dict, interval_s: float = 2.0) -> None:
        """Keep ``into`` (the metrics' node figures) current until cancelled."""
        while True:
            try:
                loads = await self.poll_load()
                into.clear()
                into.update(loads)
            except Exception:
                logger.exception("load poll failed")
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        self.closed = True  # nothing opens a channel again (router.decode_stage's lease streams)
        for _, node in self._all():
            if node.channel is not None:
                await node.channel.close()
                node.channel = None


def tier_times(stats: nodes_pb2.GetStatsResponse) -> dict[str, float]:
    """A node's reported load time per block of each tier, as far as it makes sense: known tier
    names, finite and not negative, at most an hour (anything else is dropped: the tier then
    counts as unmeasured, i.e. as good as the pool)."""
    out = {}
    for tier in (HOST, DISK, STORE):
        value = stats.tier_block_load_s.get(tier)
        if value is not None and math.isfinite(value) and 0.0 <= value <= 3600.0:
            out[tier] = value
    return out
