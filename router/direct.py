"""The direct route's stage (``router.route``): D's Generate prefills the prompt on D itself, no
prefill node, no KV transfer; the stage ends at D's first token, the stream stays open in the
request's ``DecodeSession`` for the decode stage to relay."""

from __future__ import annotations

import time

from splitserve.router.decode_stage import DecodeSession
from splitserve.router.errors import Failure, GenerateError
from splitserve.router.first_token import FirstToken, Tried
from splitserve.router.request import GenerateParams
from splitserve.runtime.protocol import sampling_to_proto
from splitserve.v1 import nodes_pb2


class DirectStage:
    """One direct attempt: D's Generate up to its first token."""

    async def attempt(
        self, params: GenerateParams, session: DecodeSession, tried: Tried, deadline: float
    ) -> FirstToken | GenerateError:
        """The first token; the error when another attempt may succeed (raised when none can).
        The stream stays in ``session`` either way: its owner closes it."""
        d = session.node
        request = nodes_pb2.GenerateOnNodeRequest(
            request_id=session.request_id,
            prompt_token_ids=params.prompt_token_ids,
            sampling=sampling_to_proto(params.sampling),
            cache_salt=params.cache_salt,
        )
        # D's busy rate while it prefills our prompts (tokens per busy second): what its tiers'
        # loads are priced against (router.prefix.CachedPrefix), as a prefill node's are.
        d.rate.start()
        computed = 0
        try:
            reply = await session.open_generate(request, deadline).read()  # marks D down when
            if len(reply.token_ids) != 1:  # it is unreachable
                raise GenerateError(
                    Failure.INTERNAL,
                    f"decode node {d.address} sent {len(reply.token_ids)} first tokens",
                )
            computed = max(len(params.prompt_token_ids) - reply.cached_tokens, 0)
        except GenerateError as exc:
            if exc.code == Failure.REFUSED:
                tried.busy.add(d)
                return exc
            if exc.code == Failure.UNAVAILABLE and time.monotonic() < deadline:
                tried.unreachable.add(d)
                return exc
            raise
        finally:
            d.rate.end(computed)
        return FirstToken(
            token_id=reply.token_ids[0],
            logprob=reply.logprobs[0] if reply.logprobs else 0.0,
            finish_reason=reply.finish_reason,
            cached_tokens=reply.cached_tokens,
        )
