"""The public ``RouterService`` servicer (``Generate`` streams, ``Complete`` answers once):
protobuf in, the shared request path (``router.front``) serves it, its plain output back out as
protobuf. With API keys (``--api-key-file``, the HTTP API's too: one key for both doors) a call
without ``authorization: Bearer <key>`` metadata of the file is refused UNAUTHENTICATED, and the
key is the call's client (fair share, the per-client cap), as on HTTP."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import NoReturn

import grpc

from splitserve.router.api_keys import ApiKeys
from splitserve.router.front import CLIENT_KEY, RequestFront
from splitserve.router.output import Delta, Step
from splitserve.router.request import GenerateError, GenerateInput, GenerateParams, InvalidRequest
from splitserve.runtime import tracing
from splitserve.runtime.failure import Failure
from splitserve.runtime.protocol import sampling_from_proto, usage_to_proto
from splitserve.runtime.slo import Slo
from splitserve.runtime.status import to_grpc
from splitserve.v1 import router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)

UNAUTHENTICATED = (
    "this router needs an API key: send the metadata `authorization: Bearer <key>` with a key of "
    "its --api-key-file (Client(api_key=...), $SPLITSERVE_API_KEY, or --api-key of splitserve "
    "generate and bench)"
)


class RouterService(router_pb2_grpc.RouterServiceServicer):
    """Serves ``front`` (``router.assembly.build_front`` puts it together)."""

    def __init__(self, front: RequestFront, keys: ApiKeys | None = None) -> None:
        self.front = front  # the request path the HTTP front shares (router.http)
        self._keys = keys

    async def _client(self, context: grpc.aio.ServicerContext) -> str:
        """Who the call counts against; without a valid key (when keys are set) it ends here."""
        if self._keys is None:
            return client_of(context)
        presented = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                presented = value if isinstance(value, str) else value.decode("latin-1")
        client = self._keys.client_of(presented)
        if client is None:
            self.front.count_refused(Failure.UNAUTHENTICATED)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)
        return client  # pyright: ignore[reportReturnType] (abort raises)

    async def _input(
        self, request: router_pb2.GenerateRequest, client: str, context: grpc.aio.ServicerContext
    ) -> GenerateInput:
        """The request as plain values; a value out of range ends the call here, counted and
        logged as the front counts and logs the refusals it makes."""
        try:
            return input_of(request)
        except InvalidRequest as exc:
            self.front.count_refused(Failure.INVALID)
            rid = request.request_id or "-"
            logger.info("request %s from %s: %s %s", rid, client, Failure.INVALID.value, exc)
            await _abort(context, GenerateError(Failure.INVALID, str(exc)))

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        trace = tracing.carrier_of(context.invocation_metadata())
        client = await self._client(context)
        plain = await self._input(request, client, context)
        steps = self.front.run(plain, client, context.time_remaining(), trace)
        try:
            async with contextlib.aclosing(steps):
                async for params, step in steps:
                    yield _message(params, step)
        except GenerateError as exc:
            await _abort(context, exc)

    async def Complete(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.GenerateResponse:
        client = await self._client(context)
        plain = await self._input(request, client, context)
        trace = tracing.carrier_of(context.invocation_metadata())
        try:
            params, steps = await self.front.complete(
                plain, client, context.time_remaining(), trace
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


async def _abort(context: grpc.aio.ServicerContext, exc: GenerateError) -> NoReturn:
    """End the call with the error's status; a refusal for want of room says when to retry
    (the ``grpc-retry-pushback-ms`` trailer of gRPC's retry design, gRFC A6)."""
    if exc.retry_after_s is not None:
        context.set_trailing_metadata(
            (("grpc-retry-pushback-ms", str(int(exc.retry_after_s * 1000))),)
        )
    await context.abort(to_grpc(exc.code), exc.message)


def input_of(request: router_pb2.GenerateRequest) -> GenerateInput:
    """A ``GenerateRequest`` as plain values; ``InvalidRequest`` naming the field when a sampling
    value or an SLO bound is out of range."""
    try:
        sampling = sampling_from_proto(request.sampling)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    slo = None
    if request.HasField("slo"):  # a bound of 0 is unset; both 0: none
        try:
            slo = Slo.checked(request.slo.ttft_s, request.slo.tpot_s)
        except ValueError as exc:
            raise InvalidRequest(f"{exc}, or 0 to leave it unset") from None
    kind = request.WhichOneof("prompt")
    return GenerateInput(
        request_id=request.request_id,
        text=request.text,
        token_ids=tuple(request.token_ids.ids) if kind == "token_ids" else None,
        messages=tuple((m.role, m.content) for m in request.messages.messages)
        if kind == "messages"
        else None,
        sampling=sampling,
        max_tokens_set=request.sampling.HasField("max_tokens"),
        stop=tuple(request.stop),
        cache_salt=request.cache_salt,
        slo=slo,
    )


def client_of(context: grpc.aio.ServicerContext) -> str:
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
        msg.usage.CopyFrom(usage_to_proto(step.usage))
    return msg
