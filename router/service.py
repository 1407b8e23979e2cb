"""The public ``RouterService.Generate`` servicer: protobuf in, a checked request to the
orchestrator, its plain output back out as protobuf (``router.orchestrator`` serves the request)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator

import grpc

from splitserve.kvstore.hashing import DEFAULT_BLOCK_SIZE
from splitserve.kvstore.redis_index import PrefixIndex
from splitserve.router.admission import Admission
from splitserve.router.decode_stage import DecodeStage
from splitserve.router.errors import GenerateError
from splitserve.router.observe import RequestObserver
from splitserve.router.orchestrator import Orchestrator, Step
from splitserve.router.prefill_stage import PrefillStage
from splitserve.router.prefix import PrefixLookup
from splitserve.router.registry import NodeRegistry
from splitserve.router.request import GenerateParams, InvalidRequest, ModelInfo, parse_request
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
    ) -> None:
        self._max_per_client = max_requests_per_client
        self._in_flight: Counter[str] = Counter()  # client → its requests in flight
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self._model = model
        self._request_timeout_s = request_timeout_s
        self._metrics = metrics or RouterMetrics()
        lookup = PrefixLookup(index, block_size) if index is not None else None
        admission = Admission(registry.decode, self._metrics, max_queue, queue_timeout_s)
        prefill = PrefillStage(registry, self._metrics, max_attempts, block_size, lookup, admission)
        self._orchestrator = Orchestrator(model, registry, prefill, DecodeStage(registry))

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        client = client_of(context)
        if self._in_flight[client] >= self._max_per_client:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"client {client} has {self._in_flight[client]} requests in flight (the "
                "router's --max-requests-per-client); wait for one to end",
            )
        self._in_flight[client] += 1
        try:
            async with contextlib.aclosing(self._generate(request, context)) as messages:
                async for msg in messages:
                    yield msg
        finally:
            self._in_flight[client] -= 1
            if not self._in_flight[client]:
                del self._in_flight[client]

    async def _generate(self, request, context) -> AsyncIterator[router_pb2.GenerateResponse]:
        start = time.monotonic()
        try:
            # Off the event loop: tokenizing a long text takes long, and other streams go on.
            params = await asyncio.to_thread(parse_request, request, self._model)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        remaining = context.time_remaining()
        budget = self._request_timeout_s if remaining is None else remaining
        deadline = start + min(budget, self._request_timeout_s)
        observer = RequestObserver(self._metrics, start)
        try:
            async for step in self._orchestrator.run(params, start, deadline):
                msg = _message(params, step)
                observer.tokens(len(msg.token_ids))
                if step.usage is not None:
                    observer.finished(step.usage)
                yield msg
        except GenerateError as exc:
            observer.failed(exc.code.name)
            logger.info("request %s failed: %s %s", params.request_id, exc.code.name, exc)
            await context.abort(exc.code, exc.message)
        finally:
            observer.end()


CLIENT_KEY = "x-splitserve-client"  # metadata naming the client (a tenant, a user)


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
