"""A request's tokens from the engine's queue to its gRPC stream (Decode and Generate)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from typing import cast

import grpc

from splitserve.engine.core import StepOutput
from splitserve.runtime import counter_names as names
from splitserve.runtime.node import failure_code
from splitserve.v1 import nodes_pb2


async def relay_tokens(
    queue: asyncio.Queue[StepOutput | BaseException],
    context: grpc.aio.ServicerContext,
    doing: str,
    counters: Counter[str],
    first_alone: bool = False,
) -> AsyncIterator[nodes_pb2.DecodeResponse]:
    """The request's tokens from the engine until it finishes (counted in ``counters``); an
    engine failure ends the call with its status. Tokens that queued up while the event loop was
    busy go out in one message (``first_alone``: not the first token, which the router reads
    alone), so a node with hundreds of streams sends fewer, fuller messages instead of falling
    further behind."""
    alone = first_alone
    while True:
        out = await queue.get()
        if isinstance(out, BaseException):
            await context.abort(failure_code(out), f"{doing} failed: {out}")
        batch, failed = [out], None
        while not alone and batch[-1].finish_reason is None and not queue.empty():
            more = queue.get_nowait()
            if isinstance(more, BaseException):
                failed = more  # sent after the tokens before it
                break
            batch.append(more)
        alone = False
        finish = batch[-1].finish_reason
        yield nodes_pb2.DecodeResponse(
            token_ids=[o.new_token_id for o in batch],
            # A request asks for logprobs or not: every token of its batch has one, or none has.
            logprobs=cast(list[float], [o.logprob for o in batch])
            if out.logprob is not None
            else [],
            finish_reason=finish or "",
        )
        if finish is not None:
            counters[names.REQUESTS_FINISHED] += 1
            return
        if failed is not None:
            await context.abort(failure_code(failed), f"{doing} failed: {failed}")
