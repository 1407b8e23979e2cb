"""The prefill stage of a disaggregated request: P's Prefill, which computes the prompt and ships
its KV into the request's decode node D, up to the first token (``PrefillStage.attempt``; the
dispatcher, ``router.dispatch``, retries elsewhere).

- ``RESOURCE_EXHAUSTED`` (P or D full): both are marked busy for this request; the dispatcher
  tries another pair.
- ``UNAVAILABLE`` / ``DEADLINE_EXCEEDED`` (before the request's own deadline): P is probed with
  grpc.health.v1; a healthy P means D was unreachable. The failed node is marked down and the
  error returned, for the dispatcher to retry elsewhere.
- Any other status ends the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from splitserve.router.decode_stage import DecodeSession, FirstToken, Tried
from splitserve.router.pool import Node, NodePool, prompt_tokens_to_compute
from splitserve.router.prefix import CachedPrefix
from splitserve.router.registry import NodeRegistry
from splitserve.router.request import GenerateError, GenerateParams
from splitserve.runtime.auth import call_metadata
from splitserve.runtime.failure import UNREACHABLE, Failure
from splitserve.runtime.protocol import sampling_to_proto
from splitserve.runtime.status import from_grpc
from splitserve.v1 import nodes_pb2

logger = logging.getLogger(__name__)


class PrefillStage:
    """One disaggregated attempt: P's Prefill, shipping the KV to the request's D."""

    def __init__(
        self,
        registry: NodeRegistry,
        block_size: int,
        on_computed: Callable[[int], None] | None = None,
    ) -> None:
        self._registry = registry
        self._block_size = block_size
        self._on_computed = on_computed  # prompt tokens a prefill node computed (pressure)

    async def attempt(
        self,
        params: GenerateParams,
        p: Node,
        session: DecodeSession,
        cached: CachedPrefix,
        tried: Tried,
        deadline: float,
    ) -> FirstToken | GenerateError:
        """One Prefill call on ``p`` shipping to the session's D; the error when another pair may
        succeed (raised when none can). P's share of the request (one in flight, the prompt
        tokens it computes) is taken and given back here, the one place that does."""
        reg = self._registry
        d = session.node
        request = nodes_pb2.PrefillRequest(
            request_id=session.request_id,
            prompt_token_ids=params.prompt_token_ids,
            sampling=sampling_to_proto(params.sampling),
            cache_salt=params.cache_salt,
            decode_address=d.address,
            **_peer_hint(reg.prefill, p, cached, tried.unreachable),
        )
        n_prompt = len(params.prompt_token_ids)
        work = prompt_tokens_to_compute(n_prompt, cached.get(p.address, 0), self._block_size)
        remaining = max(deadline - time.monotonic(), 0.001)
        reg.prefill.acquire(p, work)
        computed = 0
        try:
            call = reg.prefill_stub(p).Prefill(request, timeout=remaining, metadata=call_metadata())
            try:
                response = await _unless_stalled(call, p, d)
            finally:
                call.cancel()
            computed = max(n_prompt - response.cached_tokens, 0)
            if self._on_computed is not None:
                self._on_computed(computed)
            return FirstToken(
                token_id=response.first_token_id,
                logprob=response.first_logprob,
                finish_reason=response.finish_reason,
                cached_tokens=response.cached_tokens,
                computed_tokens=computed,
                compute_s=response.compute_seconds,
                transfer_s=response.transfer_seconds,
                transfer_path=response.transfer_path,
                blocks_shipped=response.blocks_shipped,
                bytes_shipped=response.bytes_shipped,
            )
        except grpc.aio.AioRpcError as exc:
            # NOTE: classified while p and d still count this request: a probe may take a while.
            return await self._classify(p, d, exc, deadline, tried)
        finally:
            reg.prefill.release(p, work, computed=computed)

    async def _classify(
        self, p: Node, d: Node, exc: grpc.aio.AioRpcError, deadline: float, tried: Tried
    ) -> GenerateError:
        """Classify a failed Prefill; raise when retrying cannot help, else return the error."""
        code, details = from_grpc(exc.code()), exc.details()
        if code == Failure.REFUSED:
            tried.busy.update((p, d))
            return GenerateError(
                code, f"every node tried is full (last: {details}); retry later or add nodes"
            )
        if code not in UNREACHABLE:
            raise GenerateError(code, details or f"prefill node {p.address} failed: {code.value}")
        if time.monotonic() >= deadline:
            raise GenerateError(Failure.DEADLINE, "the request's deadline passed in prefill")
        probe_timeout = min(1.0, max(deadline - time.monotonic(), 0.01))
        if await self._registry.probe(p, timeout=probe_timeout):
            culprit, pool = d, self._registry.decode  # P answers: its target D was the problem
        else:
            culprit, pool = p, self._registry.prefill
        pool.mark_down(culprit, f"{code.value}: {details}")
        tried.unreachable.add(culprit)
        return GenerateError(
            Failure.UNAVAILABLE,
            f"no {pool.role} node reachable: {culprit.address} failed ({details}); "
            f"nodes: {pool.describe()}",
        )


async def _unless_stalled(
    call: grpc.aio.UnaryUnaryCall, p: Node, d: Node
) -> nodes_pb2.PrefillResponse:
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
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        f"{'prefill' if silent is p else 'decode'} node {silent.address} stopped answering "
        "health checks",
    )


def _peer_hint(
    pool: NodePool, chosen: Node, cached: CachedPrefix, unreachable: set[Node]
) -> dict[str, Any]:
    """When another prefill node holds a longer prefix in its accelerator pool or host tier than
    the chosen one holds in any tier (the imbalance guard sent the request elsewhere), name it:
    the chosen node fetches those blocks from it rather than computing them. (A peer serves
    blocks from its pool and its host tier's memory; those on its disk are not counted.)"""
    here = cached.held[chosen.address].blocks if chosen.address in cached.held else 0
    peers = [n for n in pool.nodes if n is not chosen and n not in unreachable]
    best = max(peers, key=lambda n: cached.peer_blocks(n.address), default=None)
    if best is None or cached.peer_blocks(best.address) <= here:
        return {}
    return {"peer_address": best.address, "peer_blocks": cached.peer_blocks(best.address)}
