"""A request's way to its first token: wait in admission, choose D and the route, run the route's
stage (``PrefillStage``: P prefills and ships to D; ``DirectStage``: D prefills itself), retry a
refusing or failed attempt elsewhere.

- ``RESOURCE_EXHAUSTED`` (a node full): another attempt, up to ``max_attempts``, after a short
  back-off when a node that refused must be asked again.
- ``UNAVAILABLE`` before the request's deadline: the failed node is marked down (by the stage)
  and the next attempt avoids it. No node left → ``UNAVAILABLE`` naming every node's state.
- The route is chosen again on each attempt (``choose_route``): a direct attempt that failed may
  be followed by a disaggregated one and the other way round.

Each attempt claims the request's slot on its D (``DecodeStage.claim``) and either hands it on
in ``Started`` or closes it before the next attempt.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Collection, Mapping
from typing import Any, NamedTuple

from splitserve.kvstore.hashing import DEFAULT_BLOCK_SIZE
from splitserve.router.admission import Admission
from splitserve.router.decode_stage import (
    DecodeSession,
    DecodeStage,
    DirectStage,
    FirstToken,
    Tried,
)
from splitserve.router.kv_budget import KVDemand
from splitserve.router.metrics import RouterMetrics
from splitserve.router.pool import DecodeNode, N, Node, NodePool, prompt_tokens_to_compute
from splitserve.router.prefill_stage import PrefillStage
from splitserve.router.prefix import CachedPrefix, PrefixLookup
from splitserve.router.registry import NodeRegistry
from splitserve.router.request import GenerateError, GenerateParams
from splitserve.runtime import tracing
from splitserve.runtime.failure import Failure
from splitserve.runtime.slo import Slo

logger = logging.getLogger(__name__)


TRANSFER_PATHS = frozenset({"ipc", "nixl", "dist", "tcp", "grpc"})


class Started(NamedTuple):
    """A request past its first token, held on its decode node."""

    first: FirstToken
    session: DecodeSession  # D's slot and stream: whoever receives this closes it
    admitted_at: float  # when admission let it go to the pools (time.monotonic())
    first_at: float = 0.0  # when its first token came (time.monotonic())


# ------------------------------------------------------------------ the route

DIRECT = "direct"
DISAGGREGATED = "disaggregated"


class DispatchPolicy(NamedTuple):
    """The dispatcher's settings (``RouterConfig``'s). The defaults go direct only when no
    prefill node is usable."""

    direct_prefill_tokens: int = 0  # uncached prompt tokens at most this: direct (0: never)
    direct_prefill_backlog_tokens: int = 0  # every P at least this backlogged: direct (0: never)
    max_attempts: int = 3  # attempts per request, each on other nodes where it can
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_reserve_tokens: int = 256  # output tokens a request's KV demand reserves up front


DEFAULT_POLICY = DispatchPolicy()


class Stages(NamedTuple):
    """What an attempt runs: P's prefill and transfer, or D's direct prefill; then D's decode."""

    prefill: PrefillStage
    direct: DirectStage
    decode: DecodeStage


def choose_route(
    policy: DispatchPolicy,
    prefill: NodePool,
    decode_node: DecodeNode,
    cached: Mapping[str, float],
    prompt_tokens: int,
    block_size: int,
    exclude: Collection[Node] = (),
) -> str:
    """``DIRECT`` or ``DISAGGREGATED`` for a prompt of ``prompt_tokens`` whose decode node is
    ``decode_node``; ``exclude``: prefill nodes this request found unreachable.

    Pure rules over the router's own bookkeeping (no I/O). Direct when

    - no prefill node may take work (none configured: ``splitserve up --num-prefill 0`` or a router
      with decode nodes only; or every one down, leaving or already failed for this request);
    - the prompt's uncached part on the chosen decode node (its prompt length less the prefix the
      index says that node holds; without an index, the prompt length) is at most
      ``direct_prefill_tokens`` (0: never): shipping the KV of a short prompt costs more than
      computing it beside the decodes. The break-even depends on the model, the GPU and the
      transfer path: measure it with benchmarks (docs/deploy.md), it is not guessed here;
    - every usable prefill node has at least ``direct_prefill_backlog_tokens`` prompt tokens of this
      router's requests in flight (0: never) while the decode node has a free batch slot (fewer of
      this router's requests than its ``max_num_seqs``; unknown until its GetStats answered)."""
    usable = [n for n in prefill.usable() if n not in exclude]
    if not usable:
        return DIRECT
    uncached = prompt_tokens_to_compute(
        prompt_tokens, cached.get(decode_node.address, 0), block_size
    )
    if uncached <= policy.direct_prefill_tokens:
        return DIRECT
    backlog = policy.direct_prefill_backlog_tokens
    if backlog > 0 and all(n.queued_tokens >= backlog for n in usable):
        slots = decode_node.slots
        if slots is not None and decode_node.in_flight < slots:
            return DIRECT
    return DISAGGREGATED


class Dispatcher:
    def __init__(
        self,
        registry: NodeRegistry,
        metrics: RouterMetrics,
        stages: Stages,
        policy: DispatchPolicy = DEFAULT_POLICY,
        lookup: PrefixLookup | None = None,
        admission: Admission | None = None,
    ) -> None:
        if policy.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {policy.max_attempts}")
        self._registry = registry
        self._metrics = metrics
        self._prefill, self._direct, self._decode = stages
        self._policy = policy
        self._block_size = policy.block_size
        self._lookup = lookup
        self._admission = admission  # requests wait there while the pools are full

    async def run(
        self,
        params: GenerateParams,
        deadline: float,
        slo: Slo | None = None,
        arrival: float | None = None,
        client: str = "",
    ) -> Started:
        """The request's first token, on a D that holds it (close ``Started.session``);
        ``GenerateError`` when no attempt succeeded. For admission: ``slo``, its targets;
        ``arrival``, when it reached the router (default: now); ``client``, who sent it."""
        arrival = time.monotonic() if arrival is None else arrival
        tried = Tried(set(), set())
        error = GenerateError(Failure.UNAVAILABLE, "no attempt made")
        # The prompt is hashed once, for the index look-up and the decode KV ledger alike.
        hashes = None
        cached = CachedPrefix()  # leading blocks of the prompt each node holds (none: no index)
        if self._lookup is not None:
            hashes = self._lookup.block_hashes(params.prompt_token_ids, params.cache_salt)
            t0 = time.monotonic()
            reg = self._registry
            nodes = {n.address: n for pool in (reg.prefill, reg.decode) for n in pool.nodes}
            held = await self._lookup.cached_blocks(hashes, list(nodes))
            cached = CachedPrefix(held, nodes, self._block_size)  # priced by the tier holding them
            t1 = time.monotonic()
            self._stage("lookup", t1 - t0)
            most = max((h.blocks for h in cached.held.values()), default=0)
            tracing.record("lookup", t0, t1, {"splitserve.most_cached_blocks": most})
        demand = KVDemand.of(
            params.prompt_token_ids,
            params.cache_salt,
            params.sampling.max_tokens,
            self._block_size,
            self._policy.kv_reserve_tokens,
            hashes,
        )
        n_prompt = len(params.prompt_token_ids)
        work = self._uncached_tokens(n_prompt, cached)
        tpot_s = slo.tpot_s if slo is not None else None
        admission = self._admission
        for attempt in range(self._policy.max_attempts):
            if attempt:
                self._metrics.retries.inc()
                if tried.busy:  # a node refused: give it a moment (before queueing again)
                    await asyncio.sleep(min(0.05 * 2**attempt, max(deadline - time.monotonic(), 0)))
            admitted = None
            if admission is not None:
                t0 = time.monotonic()
                try:
                    admitted = await admission.enter(deadline, demand, work, slo, arrival, client)
                except GenerateError as exc:  # refused: the reason goes in the trace
                    why = {"splitserve.refusal_reason": exc.reason} if exc.reason else None
                    tracing.record("admission", t0, time.monotonic(), why, exc.message)
                    raise
                t1 = time.monotonic()
                self._stage("queue", t1 - t0)
                tracing.record("admission", t0, t1, {"splitserve.attempt": attempt})
            # NOTE: from here to the claim on D and the stage's acquire of P nothing awaits: the
            # room just found is this request's.
            d = _choose(self._registry.decode, tried, cached, demand=demand, tpot_s=tpot_s)
            route = choose_route(
                self._policy,
                self._registry.prefill,
                d,
                cached,
                n_prompt,
                self._block_size,
                tried.unreachable,
            )
            p = None
            if route == DISAGGREGATED:
                p = _choose(self._registry.prefill, tried, cached, n_prompt, self._block_size)
            if deadline - time.monotonic() <= 0:
                raise GenerateError(Failure.DEADLINE, "the request's deadline passed in prefill")
            t0 = time.monotonic()
            if tracing.enabled():
                attributes = _route_attributes(route, p, d, cached, work, attempt)
                tracing.record("route", t0, t0, attributes)
            with tracing.span("prefill" if p is not None else "direct") as attempt_span:
                result = await self._attempt(params, (p, d), demand, cached, tried, deadline)
                if attempt_span.is_recording():
                    _note_attempt(attempt_span, result)
            if not isinstance(result, GenerateError):
                self._metrics.routes.labels(route=route).inc()
                self._first_token_stages(result.first, p is not None, time.monotonic() - t0)
                if admission is None or admitted is None:
                    return result._replace(admitted_at=arrival)
                admission.first_token(admitted, arrival)
                return result._replace(admitted_at=admitted.at)
            error = result
            logger.info(
                "request %s: prefill attempt %d/%d failed: %s",
                params.request_id,
                attempt + 1,
                self._policy.max_attempts,
                error.message,
            )
        raise error

    def _stage(self, stage: str, seconds: float, path: str = "") -> None:
        self._metrics.stage_seconds.labels(stage=stage, path=path).observe(seconds)

    def _first_token_stages(self, first: FirstToken, disaggregated: bool, seconds: float) -> None:
        """The successful attempt's stages: the Prefill call and what P reported of it, or the
        direct route's Generate up to its first token."""
        if not disaggregated:
            self._stage("direct", seconds)
            return
        self._stage("prefill", seconds)
        self._stage("compute", first.compute_s)
        if first.transfer_path:  # (nothing shipped: it ended at its first token)
            # A label from another node: bounded to the paths there are (transfer/chooser.py's,
            # named here because the router imports no torch), anything else as "other".
            path = first.transfer_path if first.transfer_path in TRANSFER_PATHS else "other"
            self._stage("transfer", first.transfer_s, path)
            self._metrics.kv_transfers.labels(path=path).inc()
            self._metrics.kv_shipped_blocks.labels(path=path).inc(first.blocks_shipped)
            self._metrics.kv_shipped_bytes.labels(path=path).inc(first.bytes_shipped)

    async def _attempt(
        self,
        params: GenerateParams,
        pair: tuple[Node | None, DecodeNode],
        demand: KVDemand,
        cached: CachedPrefix,
        tried: Tried,
        deadline: float,
    ) -> Started | GenerateError:
        """One attempt on D (with P: disaggregated; without: direct). The request's slot on D is
        claimed here and handed on in ``Started``, or given back when the attempt fails."""
        p, d = pair
        session = self._decode.claim(d, demand, f"{params.request_id}-{secrets.token_hex(4)}")
        try:
            if p is None:
                first = await self._direct.attempt(params, session, tried, deadline)
            else:
                first = await self._prefill.attempt(params, p, session, cached, tried, deadline)
        except BaseException:
            # NOTE: cancelled (the client left, its deadline passed) while P may already have
            # shipped the KV into D: D frees it now (``Release``), not at its transfer deadline.
            session.close(release_kv=p is not None)
            raise
        if isinstance(first, GenerateError):
            session.close(release_kv=p is not None)
            return first
        return Started(first, session, 0.0, time.monotonic())

    def _uncached_tokens(self, n_prompt: int, cached: CachedPrefix) -> int:
        """The prompt tokens a node will compute, by the prefix index's estimate: the prompt less
        the longest prefix any node of the pool that computes it holds."""
        reg = self._registry
        pool = reg.prefill if reg.prefill.usable() else reg.decode
        held = max((cached.get(n.address, 0) for n in pool.nodes), default=0)
        return prompt_tokens_to_compute(n_prompt, held, self._block_size)


def _route_attributes(
    route: str, p: Node | None, d: Node, cached: CachedPrefix, work: int, attempt: int
) -> dict[str, str | int]:
    """The routing decision as a trace sees it: where, and what each node chosen held."""
    out: dict[str, str | int] = {
        "splitserve.route": route,
        "splitserve.attempt": attempt,
        "splitserve.decode_node": d.address,
        "splitserve.decode_cached_blocks": _held(cached, d.address),
        "splitserve.decode_in_flight": d.in_flight,
        "splitserve.uncached_tokens_estimate": work,
    }
    if p is not None:
        out["splitserve.prefill_node"] = p.address
        out["splitserve.prefill_cached_blocks"] = _held(cached, p.address)
    return out


def _held(cached: CachedPrefix, address: str) -> int:
    held = cached.held.get(address)
    return held.blocks if held is not None else 0


def _note_attempt(span: Any, result: Started | GenerateError) -> None:
    """What the attempt's node reported (P: its compute and the KV transfer), or its error."""
    if isinstance(result, GenerateError):
        tracing.fail(span, f"{result.code.value}: {result.message}")
        return
    first = result.first
    span.set_attributes(
        {
            "splitserve.cached_tokens": first.cached_tokens,
            "splitserve.computed_tokens": first.computed_tokens,
            "splitserve.compute_s": first.compute_s,
            "splitserve.transfer_s": first.transfer_s,
            "splitserve.transfer_path": first.transfer_path,
        }
    )


def _choose(
    pool: NodePool[N],
    tried: Tried,
    cached: CachedPrefix,
    prompt_tokens: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    demand: KVDemand | None = None,
    tpot_s: float | None = None,
) -> N:
    """A node not yet tried by this request if any, else one that only refused (full).
    ``UNAVAILABLE`` when none is left (for prefill not reached: ``choose_route`` goes direct when
    no prefill node is usable)."""
    args = (cached, prompt_tokens, block_size, demand, tpot_s)
    node = pool.pick(tried.unreachable | tried.busy, *args) or pool.pick(tried.unreachable, *args)
    if node is None:
        raise GenerateError(
            Failure.UNAVAILABLE,
            f"no {pool.role} node is reachable ({pool.describe()}); "
            "start one or check the router's --prefill/--decode addresses",
        )
    return node
