"""The nodes of one role as the router sees them: their load, which are down, and the pick rules.

Pure bookkeeping (no I/O): ``NodePool.pick`` chooses a node for a request; the registry
(``router.registry``) keeps the pools' membership and health current.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import grpc

from splitserve.kvstore.hashing import DEFAULT_BLOCK_SIZE
from splitserve.router.kv_budget import KVDemand, KVLedger
from splitserve.router.predictor import BusyRate, TPOTLine

logger = logging.getLogger(__name__)

DEFAULT_DOWN_S = 3.0  # how long a failed node is skipped before it is tried again
MAX_IMBALANCE = 2  # a node with the prefix is preferred while its in-flight count is at most
# this much above the least loaded node's (see docs/redis.md, "Cache-aware routing")


@dataclass(slots=True, eq=False)  # identity semantics: nodes go in sets
class Node:
    """A node as the router sees it: its health, the router's requests on it and the prompt
    tokens they make it compute. A prefill node is one; a decode node (``DecodeNode``) computes
    prompts too, on the direct route. ``in_flight`` counts router requests using it now."""

    address: str
    in_flight: int = 0
    down_until: float = 0.0  # clock time before which the node is skipped
    last_error: str = ""
    channel: grpc.aio.Channel | None = field(default=None, repr=False)
    discovered: bool = False  # from the Redis registry (dropped when its heartbeat expires)
    verified: bool = False  # its model identity was checked against the router's
    rejected: str = ""  # why it is never routed to (a model identity mismatch)
    leaving: bool = False  # left the registry (draining) while requests were still in flight
    # Set when the health checker finds the node silent: calls waiting on it give up then.
    stalled: asyncio.Event | None = field(default=None, repr=False)
    silent_probes: int = 0  # health checks failed in a row
    queued_tokens: int = 0  # prompt tokens its in-flight requests must compute there
    # prompt tokens of this router's requests it may have to compute at once (None: no limit):
    # beyond it requests wait in the router's queue, not in the node's
    max_queued_tokens: int | None = None
    # prompt tokens it computes per busy second (admission's TTFT prediction)
    rate: BusyRate = field(default_factory=BusyRate, repr=False)
    # seconds per block a load from each of its KV tiers takes, as it measured them (GetStats):
    # what a prefix held there is worth (router.prefix.CachedPrefix)
    tier_block_load_s: dict[str, float] = field(default_factory=dict, repr=False)

    def prefill_tokens_per_s(self) -> float | None:
        """Prompt tokens it computes per busy second, as measured here (None: not yet)."""
        return self.rate.rate()

    def stall_signal(self) -> asyncio.Event:
        if self.stalled is None:
            self.stalled = asyncio.Event()
        return self.stalled

    def has_room(
        self, demand: KVDemand | None = None, work: int = 0, tpot_s: float | None = None
    ) -> bool:
        """Room for ``work`` more prompt tokens (a node with nothing queued always has room).
        ``demand`` and ``tpot_s`` are a decode node's (``DecodeNode.has_room``)."""
        limit = self.max_queued_tokens
        if work and limit is not None and self.queued_tokens > 0:
            return self.queued_tokens + work <= limit
        return True

    def is_up(self, now: float) -> bool:
        return now >= self.down_until


@dataclass(slots=True, eq=False)
class DecodeNode(Node):
    """A decode node: its sequence slots and KV blocks this router may fill, and its time per
    output token against its batch."""

    capacity: int | None = None  # router requests it may hold at once (None: no limit)
    slots: int | None = None  # its max_num_seqs, once its GetStats answered
    full_slots: float = 0.0  # requests it may hold for all routers (slots x overcommit)
    share: float = 1.0  # the most of it this router fills (--capacity-share)
    # the share its lease grants (router.relay; None: the node grants none, ``share`` applies
    # alone); 0 until granted
    lease: float | None = None
    # the KV blocks this router's requests there will need (router.kv_budget)
    kv: KVLedger = field(default_factory=KVLedger, repr=False)
    # its requests' time per output token against how many it holds (router.predictor)
    tpot: TPOTLine = field(default_factory=TPOTLine, repr=False)

    def apply_share(self) -> None:
        """Set the capacity and the KV budget from the share this router may fill now (its
        lease's where the node grants one, never above ``share``)."""
        share = self.share if self.lease is None else min(self.share, self.lease)
        self.kv.share = share
        if self.full_slots:
            capacity = int(self.full_slots * share)
            self.capacity = capacity if self.lease is not None else max(1, capacity)

    def used_share(self) -> float:
        """The share of the node this router's requests hold (slots or KV blocks, whichever is
        more), out of the whole node's."""
        used = self.in_flight / self.full_slots if self.full_slots else 0.0
        whole = self.kv.whole()
        if whole:
            used = max(used, self.kv.used / whole)
        return min(used, 1.0)

    def has_room(
        self, demand: KVDemand | None = None, work: int = 0, tpot_s: float | None = None
    ) -> bool:
        """Room for one more request: a sequence slot and, with ``demand``, its KV blocks; with
        ``tpot_s``, a batch one larger still predicted within that time per output token (an
        idle node always has room); with ``work``, that many prompt tokens (``Node``'s)."""
        if self.capacity is not None and self.in_flight >= self.capacity:
            return False
        if demand is not None and not self.kv.fits(demand):
            return False
        if tpot_s is not None and self.in_flight:
            predicted = self.tpot.predict(self.in_flight + 1)
            if predicted is not None and predicted > tpot_s:
                return False
        return Node.has_room(self, work=work)


N = TypeVar("N", bound=Node)


def prompt_tokens_to_compute(prompt_tokens: int, cached_blocks: float, block_size: int) -> int:
    """Tokens a prefill node computes for a prompt of which it caches ``cached_blocks`` leading
    blocks (at least the last token, whose logits give the first output token). Blocks in a
    slower tier count for less than one (``router.prefix.CachedPrefix``): the tokens are then
    those whose computation the loads do not save."""
    return max(prompt_tokens - round(cached_blocks * block_size), 1)


class NodePool(Generic[N]):
    """The nodes of one role and the least-loaded choice among them (``PrefillPool``,
    ``DecodePool``). With no up node left ``pick`` falls back to the down ones (oldest failure
    first): a node that came back is then found at once and "no node reachable" is reported only
    after really trying."""

    role = ""

    def __init__(
        self,
        addresses: Sequence[str],
        clock: Callable[[], float] = time.monotonic,
        down_s: float = DEFAULT_DOWN_S,
    ) -> None:
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"{self.role} node addresses repeat: {', '.join(addresses)}")
        self.nodes: list[N] = [self._new_node(address) for address in addresses]
        self._clock = clock
        self._down_s = down_s
        self._rr = 0
        self.on_release: Callable[[], None] | None = None  # news for whoever waits for room

    def _new_node(self, address: str, discovered: bool = False) -> N:
        raise NotImplementedError

    def pick(
        self,
        exclude: Collection[Node] = (),
        cached: Mapping[str, float] | None = None,
        prompt_tokens: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        demand: KVDemand | None = None,
        tpot_s: float | None = None,
    ) -> N | None:
        """The up node not in ``exclude`` (nodes this request already tried) with the fewest
        in-flight requests; with ``cached`` (address → leading blocks of the prompt the node
        holds), the one holding the longest prefix among those within ``MAX_IMBALANCE`` of the
        least loaded. Round robin among ties.

        With ``prompt_tokens`` (prefill), the node where the prompt would be computed soonest:
        least ``queued_tokens`` plus the tokens it would compute for this prompt
        (``prompt_tokens_to_compute``); fewest in flight, then round robin among ties.

        With ``demand`` (decode), nodes whose KV ledger has room for it (and, with ``tpot_s``,
        whose batch stays within that TPOT) come first."""
        now = self._clock()
        candidates = [
            n for n in self.nodes if n not in exclude and not n.rejected and not n.leaving
        ]
        up = [n for n in candidates if n.is_up(now)]
        if not up:
            return min(candidates, key=lambda n: n.down_until, default=None)
        roomy = [n for n in up if n.has_room(demand, tpot_s=tpot_s)]
        up = roomy or up  # full nodes only when every node is full (the admission queue's job)
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

    def has_candidates(self) -> bool:
        """A node to try there is, up or down (not rejected, not leaving): with none, a
        request has nowhere to go until one registers."""
        return any(not n.rejected and not n.leaving for n in self.nodes)

    def usable(self) -> list[N]:
        """The nodes that may take work now (up, not rejected, not leaving)."""
        now = self._clock()
        return [n for n in self.nodes if n.is_up(now) and not n.rejected and not n.leaving]

    def has_room(
        self, demand: KVDemand | None = None, work: int = 0, tpot_s: float | None = None
    ) -> bool:
        """A node that may take work has room for one more request (``Node.has_room``)."""
        return any(n.has_room(demand, work, tpot_s) for n in self.usable())

    def prefill_capacity(self) -> float | None:
        """Prompt tokens per second the usable nodes compute when busy, summed over those whose
        rate is measured (None: none is)."""
        rates = [r for n in self.usable() if (r := n.rate.rate()) is not None]
        return sum(rates) if rates else None

    def notify_waiters(self) -> None:
        if self.on_release is not None:
            self.on_release()

    def sync(self, addresses: Collection[str]) -> None:
        """Make the discovered nodes exactly ``addresses`` (static ones always stay)."""
        known = {n.address for n in self.nodes}
        for address in sorted(set(addresses) - known):
            logger.info("%s node %s registered", self.role, address)
            self.nodes.append(self._new_node(address, discovered=True))
            self.notify_waiters()
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

    def acquire(self, node: N, tokens: int = 0) -> None:
        """Count one more in-flight request on ``node`` (and ``tokens`` to compute there); pair
        every call with ``release`` of the same arguments."""
        node.in_flight += 1
        node.queued_tokens += tokens
        if tokens:
            node.rate.start()

    def release(self, node: N, tokens: int = 0, computed: int = 0) -> None:
        """``computed``: prompt tokens the node computed for the request (its busy rate)."""
        node.in_flight -= 1
        node.queued_tokens -= tokens
        if tokens:
            node.rate.end(computed)
        assert node.in_flight >= 0, f"{node.address}: released more than acquired"
        self.notify_waiters()

    def mark_down(self, node: Node, reason: str, stalled: bool = False) -> None:
        """Skip ``node`` for a while; ``stalled`` (it stopped answering health checks): the
        calls in flight on it are given up and retried elsewhere."""
        if node.is_up(self._clock()):
            logger.warning("%s node %s marked down: %s", self.role, node.address, reason)
        node.down_until = self._clock() + self._down_s
        node.last_error = reason
        if stalled and node.stalled is not None:
            node.stalled.set()
            node.stalled = None  # the next calls wait on a fresh signal

    def mark_up(self, node: Node) -> None:
        was_down = not node.is_up(self._clock())
        node.down_until = 0.0
        if was_down:
            logger.info("%s node %s is back", self.role, node.address)
            self.notify_waiters()

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


class PrefillPool(NodePool[Node]):
    role = "prefill"

    def _new_node(self, address: str, discovered: bool = False) -> Node:
        return Node(address, discovered=discovered)


class DecodePool(NodePool[DecodeNode]):
    """The decode nodes, with the KV ledger settings of each and news of this router's load
    on them (``router.decode_stage``: the lease it asks for)."""

    role = "decode"

    def __init__(
        self,
        addresses: Sequence[str],
        clock: Callable[[], float] = time.monotonic,
        down_s: float = DEFAULT_DOWN_S,
        kv_headroom: float = 0.0,
        share: float = 1.0,
    ) -> None:
        self.kv_headroom = kv_headroom  # the KV ledger's headroom (router.kv_budget)
        self.share = share  # the share of each node's KV this router's ledger fills
        super().__init__(addresses, clock, down_s)
        self.on_load: Callable[[], None] | None = None
        self.waiting = 0  # requests waiting in admission for room

    def _new_node(self, address: str, discovered: bool = False) -> DecodeNode:
        kv = KVLedger(self.kv_headroom, self.share)
        return DecodeNode(address, discovered=discovered, kv=kv, share=self.share)

    def acquire(self, node: DecodeNode, tokens: int = 0, demand: KVDemand | None = None) -> None:
        """As ``NodePool.acquire``, and ``demand``'s KV blocks charged to the node's ledger."""
        super().acquire(node, tokens)
        if demand is not None:
            node.kv.take(demand)
        self.load_changed()

    def release(
        self,
        node: DecodeNode,
        tokens: int = 0,
        computed: int = 0,
        demand: KVDemand | None = None,
    ) -> None:
        if demand is not None:
            node.kv.give_back(demand)
        super().release(node, tokens, computed)
        self.load_changed()

    def load_changed(self) -> None:
        if self.on_load is not None:
            self.on_load()
