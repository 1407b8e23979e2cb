"""The nodes the router knows, their load as the router sees it, and which ones are down.

Nodes come from the command line (static) and, with a prefix index, from the node registry in
Redis (``NodeRegistry.sync``): a node that registers is used within a discovery interval, one
whose heartbeat expired is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.exceptions import RedisError

from splitserve.kvstore import ModelIdentity
from splitserve.kvstore.redis_index import NodeInfo, PrefixIndex
from splitserve.runtime.metrics import LoadFigures
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

logger = logging.getLogger(__name__)

DEFAULT_DOWN_S = 3.0  # how long a failed node is skipped before it is tried again
MAX_IMBALANCE = 2  # a node with the prefix is preferred while its in-flight count is at most
# this much above the least loaded node's (see docs/redis.md, "Cache-aware routing")


@dataclass(slots=True, eq=False)  # identity semantics: nodes go in sets
class Node:
    """One prefill or decode node. ``in_flight`` counts router requests using it right now."""

    address: str
    role: str  # "prefill" or "decode"
    in_flight: int = 0
    queued_tokens: int = 0  # prefill: prompt tokens its in-flight requests must compute there
    down_until: float = 0.0  # clock time before which the node is skipped
    last_error: str = ""
    channel: grpc.aio.Channel | None = field(default=None, repr=False)
    discovered: bool = False  # from the Redis registry (dropped when its heartbeat expires)
    verified: bool = False  # its model identity was checked against the router's
    rejected: str = ""  # why it is never routed to (a model identity mismatch)
    leaving: bool = False  # left the registry (draining) while requests were still in flight

    def is_up(self, now: float) -> bool:
        return now >= self.down_until


def prompt_tokens_to_compute(prompt_tokens: int, cached_blocks: int, block_size: int) -> int:
    """Tokens a prefill node computes for a prompt of which it caches ``cached_blocks`` leading
    blocks (at least the last token, whose logits give the first output token)."""
    return max(prompt_tokens - cached_blocks * block_size, 1)


class NodePool:
    """The nodes of one role and the least-loaded choice among them.

    ``pick`` returns the up node with the fewest in-flight requests, round-robin among ties,
    skipping ``exclude`` (nodes this request already tried). When no up node is left it falls
    back to the down ones (oldest failure first): a node that came back is then found at once
    and "no node reachable" is reported only after really trying.
    """

    def __init__(
        self,
        role: str,
        addresses: Sequence[str],
        clock: Callable[[], float] = time.monotonic,
        down_s: float = DEFAULT_DOWN_S,
    ) -> None:
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"{role} node addresses repeat: {', '.join(addresses)}")
        self.role = role
        self.nodes = [Node(address, role) for address in addresses]
        self._clock = clock
        self._down_s = down_s
        self._rr = 0

    def pick(
        self,
        exclude: Collection[Node] = (),
        cached: Mapping[str, int] | None = None,
        prompt_tokens: int | None = None,
        block_size: int = 16,
    ) -> Node | None:
        """The up node with the fewest in-flight requests; with ``cached`` (address → leading
        blocks of the prompt the node holds), the one holding the longest prefix among those
        within ``MAX_IMBALANCE`` of the least loaded. Round robin among ties.

        With ``prompt_tokens`` (prefill), the node where the prompt would be computed soonest:
        least ``queued_tokens`` plus the tokens it would compute for this prompt
        (``prompt_tokens_to_compute``); fewest in flight, then round robin among ties."""
        now = self._clock()
        candidates = [
            n for n in self.nodes if n not in exclude and not n.rejected and not n.leaving
        ]
        up = [n for n in candidates if n.is_up(now)]
        if not up:
            if not candidates:
                return None
            return min(candidates, key=lambda n: n.down_until)
        if prompt_tokens is not None:
            cached = cached or {}
            score = {
                n: n.queued_tokens
                + prompt_tokens_to_compute(prompt_tokens, cached.get(n.address, 0), block_size)
                for n in up
            }
            best = min(score.values())
            up = [n for n in up if score[n] == best]
        least = min(n.in_flight for n in up)
        if cached and prompt_tokens is None:
            eligible = [n for n in up if n.in_flight <= least + MAX_IMBALANCE]
            best = max(cached.get(n.address, 0) for n in eligible)
            if best > 0:
                up = [n for n in eligible if cached.get(n.address, 0) == best]
                least = min(n.in_flight for n in up)
        ties = [n for n in up if n.in_flight == least]
        node = ties[self._rr % len(ties)]
        self._rr += 1
        return node

    def sync(self, addresses: Collection[str]) -> None:
        """Make the discovered nodes exactly ``addresses`` (static ones always stay)."""
        known = {n.address for n in self.nodes}
        for address in sorted(set(addresses) - known):
            logger.info("%s node %s registered", self.role, address)
            self.nodes.append(Node(address, self.role, discovered=True))
        for node in self.nodes:
            if node.leaving and node.address in addresses:
                logger.info("%s node %s registered again", self.role, node.address)
                node.leaving = False
        for node in [n for n in self.nodes if n.discovered and n.address not in addresses]:
            if node.in_flight == 0:
                logger.info("%s node %s left the registry", self.role, node.address)
                self.nodes.remove(node)
            elif not node.leaving:
                # Draining: no new work, its in-flight requests finish; removed once idle.
                logger.info("%s node %s is leaving the registry", self.role, node.address)
                node.leaving = True

    def acquire(self, node: Node, tokens: int = 0) -> None:
        """Count one more in-flight request on ``node`` (and ``tokens`` to compute there); pair
        every call with ``release`` of the same tokens."""
        node.in_flight += 1
        node.queued_tokens += tokens

    def release(self, node: Node, tokens: int = 0) -> None:
        node.in_flight -= 1
        node.queued_tokens -= tokens
        assert node.in_flight >= 0, f"{node.address}: released more than acquired"

    def mark_down(self, node: Node, reason: str) -> None:
        if node.is_up(self._clock()):
            logger.warning("%s node %s marked down: %s", self.role, node.address, reason)
        node.down_until = self._clock() + self._down_s
        node.last_error = reason

    def mark_up(self, node: Node) -> None:
        if not node.is_up(self._clock()):
            logger.info("%s node %s is back", self.role, node.address)
        node.down_until = 0.0

    def reject(self, node: Node, reason: str) -> None:
        """Never route to ``node`` again (its KV would not be this model's)."""
        logger.error("%s node %s is not used: %s", self.role, node.address, reason)
        node.rejected = reason

    def describe(self) -> str:
        """For error messages: every node with its state."""
        now = self._clock()
        parts = []
        for n in self.nodes:
            if n.rejected:
                parts.append(f"{n.address} (rejected: {n.rejected})")
            elif not n.is_up(now):
                parts.append(f"{n.address} (down: {n.last_error})")
            else:
                parts.append(n.address)
        return ", ".join(parts)


class NodeRegistry:
    """Both pools, one gRPC channel per node, and a background health checker."""

    def __init__(
        self,
        prefill_addresses: Sequence[str],
        decode_addresses: Sequence[str],
        down_s: float = DEFAULT_DOWN_S,
        expected_identity: ModelIdentity | None = None,
    ) -> None:
        self.prefill = NodePool("prefill", prefill_addresses, down_s=down_s)
        self.decode = NodePool("decode", decode_addresses, down_s=down_s)
        self.expected_identity = expected_identity
        self._foreign_reported: set[str] = set()

    def _all(self) -> list[tuple[NodePool, Node]]:
        return [(pool, n) for pool in (self.prefill, self.decode) for n in pool.nodes]

    def channel(self, node: Node) -> grpc.aio.Channel:
        if node.channel is None:
            node.channel = grpc.aio.insecure_channel(node.address)
        return node.channel

    def prefill_stub(self, node: Node) -> nodes_pb2_grpc.PrefillNodeServiceStub:
        return nodes_pb2_grpc.PrefillNodeServiceStub(self.channel(node))

    def decode_stub(self, node: Node) -> nodes_pb2_grpc.DecodeNodeServiceStub:
        return nodes_pb2_grpc.DecodeNodeServiceStub(self.channel(node))

    async def stats(self, node: Node, timeout: float = 2.0) -> nodes_pb2.GetStatsResponse:
        """The node's GetStats (raises grpc.aio.AioRpcError)."""
        stub = nodes_pb2_grpc.NodeStatsServiceStub(self.channel(node))
        return await stub.GetStats(nodes_pb2.GetStatsRequest(), timeout=timeout)

    async def probe(self, node: Node, timeout: float = 1.0) -> bool:
        """True when the node answers grpc.health.v1 Check with SERVING within ``timeout``."""
        stub = health_pb2_grpc.HealthStub(self.channel(node))
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
                pool.mark_up(node)
                if not node.verified:
                    unverified.append((pool, node))
            else:
                pool.mark_down(node, node.last_error)
        await asyncio.gather(*(self.verify(pool, node) for pool, node in unverified))

    async def verify(self, pool: NodePool, node: Node) -> None:
        """Compare the node's model root hash with the router's: a node started with another
        checkpoint, dtype or block size would hash every prompt differently (prefix hits would
        silently never match) and its KV could not be used by the other nodes."""
        if self.expected_identity is None:
            node.verified = True
            return
        try:
            stats = await self.stats(node)
        except grpc.aio.AioRpcError:
            return  # checked again on the next round
        node.verified = True
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
        """Adopt the registry's view of the live nodes (static nodes always stay)."""
        for pool in (self.prefill, self.decode):
            before = set(pool.nodes)
            pool.sync({n.address for n in live if n.role == pool.role})
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
        """Every reachable node's load figures, (role, address) → LoadFigures (GetStats)."""
        pairs = [(pool, n) for pool, n in self._all() if not n.rejected]

        async def one(pool: NodePool, node: Node):
            try:
                s = await self.stats(node)
            except grpc.aio.AioRpcError:
                return None
            return LoadFigures(
                s.running,
                s.waiting,
                s.num_blocks,
                s.num_free_blocks,
                s.prefill_tokens_waiting,
                s.pending_transfers,
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
        for _, node in self._all():
            if node.channel is not None:
                await node.channel.close()
                node.channel = None
