"""The direct route's start (``router.route``): D's Generate prefills the prompt itself; its
first token makes the request ``Prefilled`` like a Prefill call's answer does."""

from __future__ import annotations

import secrets
import time

import grpc

from splitserve.router.decode_stage import DecodeStage
from splitserve.router.errors import GenerateError
from splitserve.router.kv_budget import KVDemand
from splitserve.router.pool import Node, NodePool
from splitserve.router.prefilled import Prefilled, Tried
from splitserve.router.request import GenerateParams
from splitserve.runtime.protocol import sampling_to_proto
from splitserve.v1 import nodes_pb2


async def open_direct(
    stage: DecodeStage,
    pool: NodePool,
    params: GenerateParams,
    target: tuple[Node, KVDemand],
    tried: Tried,
    deadline: float,
) -> Prefilled | GenerateError:
    """D's Generate up to its first token; the error when another attempt may succeed
    (raised when none can). D stays counted as in flight (with the request's KV ``demand``) on
    success: the caller releases it."""
    d, demand = target
    node_request_id = f"{params.request_id}-{secrets.token_hex(4)}"
    request = nodes_pb2.GenerateOnNodeRequest(
        request_id=node_request_id,
        prompt_token_ids=params.prompt_token_ids,
        sampling=sampling_to_proto(params.sampling),
        cache_salt=params.cache_salt,
    )
    pool.acquire(d, demand=demand)
    call = None
    ok = False
    try:
        call = stage.open_direct(d, request, deadline)
        reply = await call.read()  # marks D down when it is unreachable
        if len(reply.token_ids) != 1:
            raise GenerateError(
                grpc.StatusCode.INTERNAL,
                f"decode node {d.address} sent {len(reply.token_ids)} first tokens",
            )
        ok = True
    except GenerateError as exc:
        if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            tried.busy.add(d)
            return exc
        if exc.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline:
            tried.unreachable.add(d)
            return exc
        raise
    finally:
        if not ok:
            if call is not None:
                call.close()
            pool.release(d, demand=demand)
    first = nodes_pb2.PrefillResponse(
        first_token_id=reply.token_ids[0],
        first_logprob=reply.logprobs[0] if reply.logprobs else 0.0,
        finish_reason=reply.finish_reason,
        cached_tokens=reply.cached_tokens,
    )
    return Prefilled(first, d, node_request_id, call, demand)
