"""The public ``RouterService`` servicer (``Generate`` streams, ``Complete`` answers once):
protobuf in, the shared request path (``router.front``) serves it, its plain output back out as
protobuf."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from splitserve.kvstore.hashing import DEFAULT_BLOCK_SIZE
from splitserve.kvstore.redis_index import PrefixIndex
from splitserve.router.admission import Admission
from splitserve.router.decode_stage import DecodeStage
from splitserve.router.errors import GenerateError
from splitserve.router.front import CLIENT_KEY, RequestFront
from splitserve.router.orchestrator import Orchestrator, Step
from splitserve.router.output import Delta
from splitserve.router.prefill_stage import PrefillStage
from splitserve.router.prefix import PrefixLookup
from splitserve.router.pressure import Pressure
from splitserve.router.registry import NodeRegistry
from splitserve.router.request import GenerateParams, ModelInfo
from splitserve.router.route import NO_DIRECT, RoutePolicy
from splitserve.runtime.metrics import RouterMetrics
from splitserve.v1 import common_pb2, router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)


class RouterService(router_pb2_grpc.RouterServiceServicer):
    def __init__(
        self,
        model: ModelInfo,
        registry: NodeRegistry,
        max_attempts: int = 3,
        request_timeout_s: float = 600.0,
        index: PrefixIndex | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        metrics: RouterMetrics | None = None,
        max_queue: int = 4096,
        queue_timeout_s: float = 300.0,
        max_requests_per_client: int = 1024,
        route_policy: RoutePolicy = NO_DIRECT,
        kv_reserve_tokens: int = 256,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        metrics = metrics or RouterMetrics()
        lookup = PrefixLookup(index, block_size) if index is not None else None
        # NOTE: with --direct-prefill-backlog-tokens, backlogged prefill nodes are a reason to go
        # direct, not to wait: requests then wait for decode room only.
        prefill_room = registry.prefill if not route_policy.direct_prefill_backlog_tokens else None
        admission = Admission(
            registry.decode, metrics, max_queue, queue_timeout_s, prefill=prefill_room
        )
        pressure = Pressure(registry, admission)
        metrics.watch_pressure(pressure.figures)

        def computed(tokens: int) -> None:
            metrics.prefill_computed_tokens.inc(tokens)
            pressure.computed(tokens)

        decode = DecodeStage(registry)
        prefill = PrefillStage(
            registry,
            metrics,
            max_attempts,
            block_size,
            lookup,
            admission,
            decode,
            route_policy,
            kv_reserve_tokens=kv_reserve_tokens,
            on_computed=computed,
        )
        orchestrator = Orchestrator(
            model, registry, prefill, decode, on_served=admission.note_served
        )
        # The request path the HTTP front shares (router.http).
        self.front = RequestFront(
            model,
            orchestrator,
            metrics,
            request_timeout_s,
            max_requests_per_client,
            check_arrival=admission.check_arrival,
        )

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        steps = self.front.run(request, client_of(context), context.time_remaining())
        try:
            async with contextlib.aclosing(steps):
                async for params, step in steps:
                    yield _message(params, step)
        except GenerateError as exc:
            await _abort(context, exc)

    async def Complete(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.GenerateResponse:
        try:
            params, steps = await self.front.complete(
                request, client_of(context), context.time_remaining()
            )
        except GenerateError as exc:
            await _abort(context, exc)
        whole = Delta(
            text="".join(s.delta.text for s in steps),
            token_ids=[t for s in steps for t in s.delta.token_ids],
            logprobs=[x for s in steps for x in s.delta.logprobs],
            finish_reason=steps[-1].delta.finish_reason,
        )
        return _message(params, Step(whole, steps[-1].usage))


async def _abort(context: grpc.aio.ServicerContext, exc: GenerateError) -> None:
    """End the call with the error's status; a refusal for want of room says when to retry
    (the ``grpc-retry-pushback-ms`` trailer of gRPC's retry design, gRFC A6)."""
    if exc.retry_after_s is not None:
        context.set_trailing_metadata(
            (("grpc-retry-pushback-ms", str(int(exc.retry_after_s * 1000))),)
        )
    await context.abort(exc.code, exc.message)


def client_of(context) -> str:
    """Who a request is counted against: the ``x-splitserve-client`` metadata if given (at most
    64 characters), else the caller's host (its port varies from connection to connection)."""
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_KEY and value:
            return str(value)[:64]
    peer = context.peer() or "unknown"
    return peer.rpartition(":")[0] or peer


def _message(params: GenerateParams, step: Step) -> router_pb2.GenerateResponse:
    delta = step.delta
    msg = router_pb2.GenerateResponse(
        text=delta.text,
        token_ids=delta.token_ids,
        logprobs=delta.logprobs if params.sampling.logprobs else (),
        finish_reason=delta.finish_reason,
        request_id=params.request_id,
    )
    if step.usage is not None:
        msg.usage.CopyFrom(common_pb2.Usage(**step.usage._asdict()))
    return msg
