"""The prefill stage of a request: Prefill on some P shipping to some D, or (the direct route,
``router.route``) D's Generate prefilling the prompt itself; retried elsewhere.

- ``RESOURCE_EXHAUSTED`` (P or D full): try another pair, up to ``max_attempts``, with a short
  back-off when a node that refused must be asked again.
- ``UNAVAILABLE`` / ``DEADLINE_EXCEEDED`` (before the request's own deadline): P is probed with
  grpc.health.v1; a healthy P means D was unreachable. The failed node is marked down and the
  stage retried elsewhere. No node left → ``UNAVAILABLE`` naming every node's state.
- The direct route fails the same way before D's first token (full: busy; unreachable or
  draining: marked down), and the next attempt chooses its route again.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable

import grpc

from splitserve.kvstore.hashing import DEFAULT_BLOCK_SIZE
from splitserve.router.admission import Admission
from splitserve.router.decode_stage import DecodeStage
from splitserve.router.direct import open_direct
from splitserve.router.errors import UNREACHABLE, GenerateError
from splitserve.router.kv_budget import KVDemand
from splitserve.router.pool import Node, NodePool, prompt_tokens_to_compute
from splitserve.router.prefilled import Prefilled, Tried
from splitserve.router.prefix import PrefixLookup
from splitserve.router.registry import NodeRegistry
from splitserve.router.request import GenerateParams
from splitserve.router.route import DISAGGREGATED, NO_DIRECT, RoutePolicy, choose_route
from splitserve.runtime.auth import call_metadata
from splitserve.runtime.metrics import RouterMetrics
from splitserve.runtime.protocol import sampling_to_proto
from splitserve.v1 import nodes_pb2

logger = logging.getLogger(__name__)


class PrefillStage:
    def __init__(
        self,
        registry: NodeRegistry,
        metrics: RouterMetrics,
        max_attempts: int,
        block_size: int,
        lookup: PrefixLookup | None,
        admission: Admission | None = None,
        decode: DecodeStage | None = None,
        policy: RoutePolicy = NO_DIRECT,
        kv_reserve_tokens: int = 256,
        on_computed: Callable[[int], None] | None = None,
    ) -> None:
        self._admission = admission  # requests wait there while the pools are full
        self._registry = registry
        self._metrics = metrics
        self._max_attempts = max_attempts
        self._block_size = block_size
        self._lookup = lookup
        self._decode = decode or DecodeStage(registry)  # opens the direct route's streams
        self._policy = policy
        self._kv_reserve_tokens = kv_reserve_tokens  # router.kv_budget's up-front output
        self._on_computed = on_computed  # prompt tokens a prefill node computed (pressure)

    async def run(self, params: GenerateParams, deadline: float) -> Prefilled:
        """Run Prefill on some P shipping to some D (or D's Generate: the direct route), retrying
        elsewhere on refusals/failures; the route is chosen again on each attempt."""
        tried = Tried(set(), set())
        error = GenerateError(grpc.StatusCode.UNAVAILABLE, "no attempt made")
        # The prompt is hashed once, for the index look-up and the decode KV ledger alike.
        hashes = None
        if self._lookup is not None:
            hashes = self._lookup.block_hashes(params.prompt_token_ids, params.cache_salt)
        cached = await self._cached_blocks(hashes)
        demand = KVDemand.of(
            params.prompt_token_ids,
            params.cache_salt,
            params.sampling.max_tokens,
            self._block_size,
            self._kv_reserve_tokens,
            hashes,
        )
        n_prompt = len(params.prompt_token_ids)
        for attempt in range(self._max_attempts):
            if attempt:
                self._metrics.retries.inc()
                if tried.busy:  # a node refused: give it a moment (before queueing again)
                    await asyncio.sleep(min(0.05 * 2**attempt, max(deadline - time.monotonic(), 0)))
            admitted = time.monotonic()
            if self._admission is not None:
                admitted = await self._admission.enter(deadline, demand, n_prompt)
            # NOTE: from here to the acquire in _attempt or _direct nothing awaits: the room
            # just found is this request's.
            d = self._choose_decode(tried, cached, demand)
            route = choose_route(
                self._policy,
                self._registry.prefill,
                d,
                cached,
                n_prompt,
                self._block_size,
                tried.unreachable,
            )
            p = self._choose_prefill(params, tried, cached) if route == DISAGGREGATED else None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GenerateError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed in prefill"
                )
            if p is None:
                result = await open_direct(
                    self._decode, self._registry.decode, params, (d, demand), tried, deadline
                )
            else:
                result = await self._attempt(
                    params, (p, d), demand, cached, tried, (deadline, remaining)
                )
            if isinstance(result, Prefilled):
                self._metrics.routes.labels(route=route).inc()
                return result._replace(admitted_at=admitted)
            error = result
            logger.info(
                "request %s: prefill attempt %d/%d failed: %s",
                params.request_id,
                attempt + 1,
                self._max_attempts,
                error.message,
            )
        raise error

    async def _cached_blocks(self, hashes: list[bytes] | None) -> dict[str, int]:
        """Leading blocks of the prompt (its ``hashes``) each node holds; empty without an
        index."""
        if self._lookup is None or hashes is None:
            return {}
        reg = self._registry
        addresses = [n.address for pool in (reg.prefill, reg.decode) for n in pool.nodes]
        return await self._lookup.cached_blocks(hashes, addresses)

    def _choose_decode(self, tried: Tried, cached: dict[str, int], demand: KVDemand) -> Node:
        d = _choose(self._registry.decode, tried, cached, demand=demand)
        if d is None:
            raise _none_reachable(self._registry.decode)
        return d

    def _choose_prefill(self, params: GenerateParams, tried: Tried, cached: dict[str, int]):
        n_prompt = len(params.prompt_token_ids)
        p = _choose(self._registry.prefill, tried, cached, n_prompt, self._block_size)
        if p is None:  # not reached: choose_route goes direct when no prefill node is usable
            raise _none_reachable(self._registry.prefill)
        return p

    async def _attempt(
        self,
        params: GenerateParams,
        pair: tuple[Node, Node],
        demand: KVDemand,
        cached: dict[str, int],
        tried: Tried,
        times: tuple[float, float],
    ) -> Prefilled | GenerateError:
        """One Prefill call; the error when another pair may succeed (raised when none can).
        ``times``: the request's deadline and the seconds left until it."""
        reg = self._registry
        p, d = pair
        deadline, remaining = times
        node_request_id = f"{params.request_id}-{secrets.token_hex(4)}"
        request = nodes_pb2.PrefillRequest(
            request_id=node_request_id,
            prompt_token_ids=params.prompt_token_ids,
            sampling=sampling_to_proto(params.sampling),
            cache_salt=params.cache_salt,
            decode_address=d.address,
            **_peer_hint(reg.prefill, p, cached, tried.unreachable),
        )
        n_prompt = len(params.prompt_token_ids)
        work = prompt_tokens_to_compute(n_prompt, cached.get(p.address, 0), self._block_size)
        reg.prefill.acquire(p, work)
        reg.decode.acquire(d, demand=demand)
        ok = False
        try:
            call = reg.prefill_stub(p).Prefill(request, timeout=remaining, metadata=call_metadata())
            try:
                response = await _unless_stalled(call, p, d)
            finally:
                call.cancel()
            if self._on_computed is not None:
                self._on_computed(max(n_prompt - response.cached_tokens, 0))
            ok = True
            return Prefilled(response, d, node_request_id, demand=demand)
        except grpc.aio.AioRpcError as exc:
            # NOTE: classified while p and d still count this request: a probe may take a while.
            return await self._classify(p, d, exc, deadline, tried)
        finally:
            reg.prefill.release(p, work)
            if not ok:
                reg.decode.release(d, demand=demand)

    async def _classify(
        self, p: Node, d: Node, exc: grpc.aio.AioRpcError, deadline: float, tried: Tried
    ) -> GenerateError:
        """Classify a failed Prefill; raise when retrying cannot help, else return the error."""
        code, details = exc.code(), exc.details()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            tried.busy.update((p, d))
            return GenerateError(
                code, f"every node tried is full (last: {details}); retry later or add nodes"
            )
        if code not in UNREACHABLE:
            raise GenerateError(code, details or f"prefill node {p.address} failed: {code.name}")
        if time.monotonic() >= deadline:
            raise GenerateError(
                grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed in prefill"
            )
        reason = f"{code.name}: {details}"
        probe_timeout = min(1.0, max(deadline - time.monotonic(), 0.01))
        if await self._registry.probe(p, timeout=probe_timeout):
            culprit, pool = d, self._registry.decode  # P answers: its target D was the problem
        else:
            culprit, pool = p, self._registry.prefill
        pool.mark_down(culprit, reason)
        tried.unreachable.add(culprit)
        return GenerateError(
            grpc.StatusCode.UNAVAILABLE,
            f"no {pool.role} node reachable: {culprit.address} failed ({details}); "
            f"nodes: {pool.describe()}",
        )


def _none_reachable(pool: NodePool) -> GenerateError:
    return GenerateError(
        grpc.StatusCode.UNAVAILABLE,
        f"no {pool.role} node is reachable ({pool.describe()}); "
        "start one or check the router's --prefill/--decode addresses",
    )


async def _unless_stalled(call, p: Node, d: Node):
    """The call's answer, unless P or D stops answering health checks first (frozen, or its
    host gone): then UNAVAILABLE at once, and the stage retries elsewhere rather than wait for
    the request's deadline."""
    answer = asyncio.ensure_future(call)
    answer.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved, even if late
    stalls = {asyncio.ensure_future(n.stall_signal().wait()): n for n in (p, d)}
    try:
        await asyncio.wait([answer, *stalls], return_when=asyncio.FIRST_COMPLETED)
        silent = next((n for f, n in stalls.items() if f.done()), p)
    finally:
        for stall in stalls:
            stall.cancel()
    if answer.done():
        return answer.result()
    call.cancel()
    raise grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        None,
        None,
        f"{silent.role} node {silent.address} stopped answering health checks",
    )


def _peer_hint(
    pool: NodePool, chosen: Node, cached: dict[str, int], unreachable: set[Node]
) -> dict:
    """When another prefill node holds a longer prefix than the chosen one (the imbalance guard
    sent the request elsewhere), name it: the chosen node fetches those blocks from it rather
    than computing them."""
    here = cached.get(chosen.address, 0)
    peers = [n for n in pool.nodes if n is not chosen and n not in unreachable]
    best = max(peers, key=lambda n: cached.get(n.address, 0), default=None)
    if best is None or cached.get(best.address, 0) <= here:
        return {}
    return {"peer_address": best.address, "peer_blocks": cached[best.address]}


def _choose(
    pool: NodePool,
    tried: Tried,
    cached: dict[str, int],
    prompt_tokens: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    demand: KVDemand | None = None,
) -> Node | None:
    """A node not yet tried by this request if any, else one that only refused (full)."""
    args = (cached, prompt_tokens, block_size, demand)
    return pool.pick(tried.unreachable | tried.busy, *args) or pool.pick(tried.unreachable, *args)
