"""One request end to end: prefill on P shipping to D (or, the direct route, on D itself), then
relay D's stream as public deltas.

The stages own their failure handling (``router.prefill_stage``, ``router.decode_stage``); this
joins them, keeps D counted as in flight while the request uses it, and turns the nodes' tokens
into text (``router.output``). Plain values out: the servicer makes the protobuf messages.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

from splitserve.router.decode_stage import DecodeStage
from splitserve.router.output import Delta, OutputAssembler, Usage
from splitserve.router.prefill_stage import PrefillStage
from splitserve.router.registry import NodeRegistry
from splitserve.router.request import GenerateParams, ModelInfo

# A request that ended this close to its deadline was cut off by it (timed out, not cancelled):
# the client's clock and ours start a few milliseconds apart.
DEADLINE_SLACK_S = 0.05


class Step(NamedTuple):
    """One public stream message's content; ``usage`` only on the last one."""

    delta: Delta
    usage: Usage | None


class Orchestrator:
    def __init__(
        self,
        model: ModelInfo,
        registry: NodeRegistry,
        prefill: PrefillStage,
        decode: DecodeStage,
        on_served: Callable[[float], None] | None = None,
    ) -> None:
        self._on_served = on_served  # seconds from admission to the end of a served request
        self._model = model
        self._registry = registry
        self._prefill = prefill
        self._decode = decode

    async def run(
        self, params: GenerateParams, start: float, deadline: float
    ) -> AsyncIterator[Step]:
        """The request's output; raises ``GenerateError`` when it cannot be served."""
        prefilled = await self._prefill.run(params, deadline)
        decode_pool = self._registry.decode
        node = prefilled.decode_node
        served: list[float] = []  # seconds from admission to its last token, once served
        try:
            first = prefilled.response
            usage = Usage(
                prompt_tokens=len(params.prompt_token_ids),
                cached_tokens=first.cached_tokens,
                completion_tokens=0,
                time_to_first_token_s=time.monotonic() - start,
            )
            output = OutputAssembler(self._model.tokenizer, params.stop)

            def step(delta: Delta) -> Step:
                if not delta.finish_reason:
                    return Step(delta, None)
                served.append(time.monotonic() - prefilled.admitted_at)
                return Step(delta, usage._replace(completion_tokens=output.num_tokens))

            delta = output.add([first.first_token_id], [first.first_logprob], first.finish_reason)
            if output.finished:
                decode_pool.release(node, demand=prefilled.demand)
                node = None
                if prefilled.stream is not None:
                    prefilled.stream.close()  # direct: D ends the request (a no-op if it did)
                elif not first.finish_reason:
                    # NOTE: a stop string on the first token: D holds the shipped blocks until
                    # its transfer deadline unless told; a Decode call cancelled at once frees
                    # them.
                    self._decode.discard(prefilled.decode_node, prefilled.node_request_id)
                yield step(delta)
                return
            call = prefilled.stream or self._decode.open(node, prefilled.node_request_id, deadline)
            try:
                yield step(delta)
                while True:
                    reply = await call.read()
                    delta = output.add(reply.token_ids, reply.logprobs, reply.finish_reason)
                    if prefilled.demand is not None:  # its output fills blocks beyond the reserve
                        node.kv.grow(prefilled.demand, output.num_tokens)
                    yield step(delta)
                    if output.finished:
                        return
            finally:
                call.close()
        finally:
            if prefilled.stream is not None:
                prefilled.stream.close()  # idempotent
            if node is not None:
                decode_pool.release(node, demand=prefilled.demand)
            self._note_service(served, prefilled.admitted_at, deadline)

    def _note_service(self, served: list[float], admitted_at: float, deadline: float) -> None:
        """Tell admission how long serving took; a request cut off at its deadline took at least
        that long (without it, an estimate drawn only from served requests trails a service time
        that grows with the load, and more requests are let go too late)."""
        if self._on_served is None:
            return
        now = time.monotonic()
        if served:
            self._on_served(served[0])
        elif now >= deadline - DEADLINE_SLACK_S:
            self._on_served(now - admitted_at)
