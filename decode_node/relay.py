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


def stream_failure_code(exc: BaseException) -> grpc.StatusCode:
    """The status of a stream the engine failed: UNAVAILABLE when the engine itself is gone (an
    engine process that died raises ``ConnectionError``s: the node exits, and the router resumes
    the stream on another decode node on that status only), else ``failure_code``'s."""
    if isinstance(exc, ConnectionError):
        return grpc.StatusCode.UNAVAILABLE
    return failure_code(exc)


async def relay_tokens(
    queue: asyncio.Queue[StepOutput | BaseException],
    context: grpc.aio.ServicerContext,
    doing: str,
    counters: Counter[str],
    first_alone: bool = False,
    interval: int = 1,
) -> AsyncIterator[nodes_pb2.DecodeResponse]:
    """The request's tokens from the engine until it finishes (counted in ``counters``); an
    engine failure ends the call with its status. Tokens that queued up while the event loop was
    busy go out in one message (``first_alone``: not the first token, which the router reads
    alone), so a node with hundreds of streams sends fewer, fuller messages instead of falling
    further behind. The message with the request's first token sampled on this engine carries
    its ``cached_tokens`` (the prompt tokens found in the prefix cache: ``StepOutput.facts``).
    ``interval`` (``--stream-interval``): after the first message, one message per ``interval``
    tokens at most (the last one at once): the router relays per message."""
    alone = first_alone
    first = True
    while True:
        out = await queue.get()
        if isinstance(out, BaseException):
            await context.abort(stream_failure_code(out), f"{doing} failed: {out}")
        batch, failed = [out], None
        while not alone and batch[-1].finish_reason is None:
            if queue.empty():
                if first or len(batch) >= interval:
                    break
                more = await queue.get()  # --stream-interval: wait for the batch to fill
            else:
                more = queue.get_nowait()
            if isinstance(more, BaseException):
                failed = more  # sent after the tokens before it
                break
            batch.append(more)
        alone = first = False
        finish = batch[-1].finish_reason
        facts = next((o.facts for o in batch if o.facts is not None), None)
        yield nodes_pb2.DecodeResponse(
            token_ids=[o.new_token_id for o in batch],
            # A request asks for logprobs or not: every token of its batch has one, or none has.
            logprobs=cast(list[float], [o.logprob for o in batch])
            if out.logprob is not None
            else [],
            finish_reason=finish or "",
            cached_tokens=facts.num_cached_tokens if facts is not None else 0,
        )
        if finish is not None:
            counters[names.REQUESTS_FINISHED] += 1
            return
        if failed is not None:
            await context.abort(stream_failure_code(failed), f"{doing} failed: {failed}")
