"""One request end to end: its first token (``router.dispatch``: prefill on P shipping to D, or,
the direct route, on D itself), then D's stream relayed as public deltas.

The stages own their failure handling (``router.dispatch``, ``router.prefill_stage``,
``router.direct``, ``router.decode_stage``); this joins them, closes the request's
``DecodeSession`` (its slot and stream on D) when it ends, and turns the nodes' tokens into text
(``router.output``). Plain values out: the servicer makes the protobuf messages.

A decode node that fails mid-answer (UNAVAILABLE: gone, or silent to health checks) does not end
the stream: the prompt and the tokens already sent become a new request, prefilled (its blocks
found in the index or recomputed) and decoded elsewhere, and the client's stream goes on with
the next token (``resumed_params``; at most ``MAX_RESUMES`` times).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import NamedTuple

from splitserve.router.decode_stage import DecodeSession
from splitserve.router.dispatch import Dispatcher
from splitserve.router.errors import Failure, GenerateError
from splitserve.router.output import Delta, OutputAssembler
from splitserve.router.request import GenerateParams, ModelInfo
from splitserve.runtime import tracing
from splitserve.runtime.protocol import Usage
from splitserve.runtime.slo import Slo

logger = logging.getLogger(__name__)

MAX_RESUMES = 2  # a stream whose decode node fails goes on elsewhere at most this many times

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
        dispatch: Dispatcher,
        on_served: Callable[[float], None] | None = None,
        on_wasted: Callable[[int], None] | None = None,
        on_decoded: Callable[[float], None] | None = None,
    ) -> None:
        self._on_served = on_served  # seconds from admission to the end of a served request
        # prompt tokens computed for a request that then did not complete
        self._on_wasted = on_wasted
        self._on_decoded = on_decoded  # seconds from the first token to the end of a served one
        self._model = model
        self._dispatch = dispatch

    async def run(
        self,
        params: GenerateParams,
        start: float,
        deadline: float,
        slo: Slo | None = None,
        client: str = "",
    ) -> AsyncGenerator[Step, None]:
        """The request's output; raises ``GenerateError`` when it cannot be served. ``slo``: its
        targets, ``client``: who sent it (both for admission)."""
        started = await self._dispatch.run(params, deadline, slo, start, client)
        first, session = started.first, started.session
        admitted_at = started.admitted_at
        tracing.event("first_token", {"splitserve.decode_node": session.node.address})
        decoding = tracing.start("decode", {"splitserve.decode_node": session.node.address})
        failure: str | None = None
        served: list[float] = []  # seconds from admission to its last token, once served
        tokens: list[int] = []  # its output so far (a resumed request's prompt carries them)
        resumed = 0
        try:
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
                served.append(time.monotonic() - admitted_at)
                if self._on_decoded is not None and started.first_at and not resumed:
                    self._on_decoded(time.monotonic() - started.first_at)
                return Step(delta, dataclasses.replace(usage, completion_tokens=output.num_tokens))

            while True:  # once, and again for each resume on another decode node
                tokens.append(started.first.token_id)
                delta = output.add(
                    [started.first.token_id], [started.first.logprob], started.first.finish_reason
                )
                if output.finished:
                    # NOTE: a stop string on the first token: D holds the shipped blocks until its
                    # transfer deadline unless told (direct: closing the stream ends it on D).
                    session.close(release_kv=not started.first.finish_reason)
                    yield step(delta)
                    return
                call = session.stream(deadline)
                yield step(delta)
                batch = session.node.in_flight  # the batch it met on D, at its first token
                try:
                    while True:
                        reply = await call.read()
                        tokens.extend(reply.token_ids)
                        delta = output.add(reply.token_ids, reply.logprobs, reply.finish_reason)
                        session.grow(output.num_tokens)  # output past the reserve fills blocks
                        if output.finished and not resumed:
                            _note_tpot(session, started.first_at, output.num_tokens, batch)
                        yield step(delta)
                        if output.finished:
                            return
                except GenerateError as exc:
                    if exc.code != Failure.UNAVAILABLE or resumed >= MAX_RESUMES:
                        failure = f"{exc.code.value}: {exc.message}"
                        raise
                    tracing.event("resumed", {"splitserve.after_tokens": len(tokens)})
                    logger.warning(
                        "request %s: %s; resuming after %d tokens on another decode node",
                        params.request_id,
                        exc.message,
                        len(tokens),
                    )
                session.close()  # the failed node's slot and stream
                resumed += 1
                started = await self._dispatch.run(
                    resumed_params(params, tokens), deadline, None, time.monotonic(), client
                )
                session = started.session
        finally:
            session.close()  # idempotent
            if decoding.span.is_recording():
                decoding.span.set_attribute("splitserve.output_tokens", len(tokens))
            decoding.end(failure if not served else None)
            self._note_service(served, admitted_at, deadline)
            if not served and first.computed_tokens and self._on_wasted is not None:
                self._on_wasted(first.computed_tokens)

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


def _note_tpot(session: DecodeSession, first_at: float, tokens: int, batch: int) -> None:
    """Teach D's TPOT line (``router.predictor``) what a request among ``batch`` (the mean of
    D's requests at its first and last token) saw: its time per output token after the first."""
    if tokens < 2 or not first_at:
        return
    node = session.node
    tpot = (time.monotonic() - first_at) / (tokens - 1)
    node.tpot.add((batch + node.in_flight) / 2, tpot)


def resumed_params(params: GenerateParams, tokens: list[int]) -> GenerateParams:
    """The rest of a request whose decode node failed after ``tokens``: its prompt and those
    tokens as the new prompt, the output budget less what was sent. Greedy output goes on exactly
    as it would have; penalties over the output and seeded sampling see the sent tokens as
    prompt."""
    n = len(tokens)
    sampling = dataclasses.replace(
        params.sampling,
        max_tokens=params.sampling.max_tokens - n,
        min_tokens=max(params.sampling.min_tokens - n, 0),
    )
    return dataclasses.replace(
        params, prompt_token_ids=(*params.prompt_token_ids, *tokens), sampling=sampling
    )
