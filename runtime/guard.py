"""Corrupt request bytes get ``INVALID_ARGUMENT`` and one log line, never ``UNKNOWN`` with a
Python exception text and a traceback: a server interceptor that parses each request message
itself and answers a message that does not parse before the handler sees it (streamed requests:
when that message arrives)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

logger = logging.getLogger(__name__)


class _Malformed:
    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _tolerant(
    deserialize: Callable[[bytes], Any] | None,
) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # protobuf raises DecodeError, others on odd input
            return _Malformed(exc)

    return parse


async def _refuse(context: grpc.aio.ServicerContext, method: str, bad: _Malformed) -> None:
    logger.info("malformed %s request from %s: %s", method, context.peer(), bad.error)
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the request is not a valid {method.rpartition('/')[2]} message (corrupt bytes?)",
    )


def _checked_iterator(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext, method: str
) -> AsyncIterator[Any]:
    async def messages() -> AsyncIterator[Any]:
        async for msg in requests:
            if isinstance(msg, _Malformed):
                await _refuse(context, method, msg)
            yield msg

    return messages()


# NOTE: ``Any``: typeshed types a handler's behaviours as the blocking server's (iterators, not
# the async iterators and coroutines of grpc.aio).
def _guarded(handler: Any, method: str) -> grpc.RpcMethodHandler:
    parse = _tolerant(handler.request_deserializer)
    serialize = handler.response_serializer
    if handler.request_streaming:
        inner = handler.stream_stream or handler.stream_unary

        if handler.response_streaming and inspect.isasyncgenfunction(inner):

            async def streamed(requests, context):
                async for out in inner(_checked_iterator(requests, context, method), context):
                    yield out

            behaviour = streamed
        else:

            async def awaited(requests, context):
                return await inner(_checked_iterator(requests, context, method), context)

            behaviour = awaited
        make = (
            grpc.stream_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.stream_unary_rpc_method_handler
        )
        return make(behaviour, request_deserializer=parse, response_serializer=serialize)
    inner = handler.unary_stream or handler.unary_unary
    if handler.response_streaming and inspect.isasyncgenfunction(inner):

        async def streamed_reply(request, context):
            if isinstance(request, _Malformed):
                await _refuse(context, method, request)
            async for out in inner(request, context):
                yield out

        behaviour = streamed_reply
    else:

        async def awaited_reply(request, context):
            if isinstance(request, _Malformed):
                await _refuse(context, method, request)
            return await inner(request, context)

        behaviour = awaited_reply
    make = (
        grpc.unary_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.unary_unary_rpc_method_handler
    )
    return make(behaviour, request_deserializer=parse, response_serializer=serialize)


class MalformedRequests(grpc.aio.ServerInterceptor):
    """Answers requests that do not parse with INVALID_ARGUMENT (installed on every server)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _guarded(handler, handler_call_details.method)
