"""The one request path behind both public fronts (gRPC ``RouterService`` and the OpenAI-compatible
HTTP API), start to end: the per-client cap, checking and tokenizing, the first token
(``router.dispatch``: prefill on P shipping to D, or, the direct route, on D itself), then D's
tokens read from its relay stream (``router.relay``) and turned into public steps by the output
step (``router.output``). Every way a request ends - served, refused, failed, cancelled, timed
out - is counted once; the fronts only translate messages and errors.

The stages own their failure handling (``router.dispatch``, ``router.prefill_stage``,
``router.decode_stage``); this joins them and closes the request's
``DecodeSession`` (its slot and stream on D) when it ends.

A decode node that fails mid-answer (UNAVAILABLE: gone, or silent to health checks) does not end
the stream: the prompt and the tokens already sent become a new request, prefilled (its blocks
found in the index or recomputed) and decoded elsewhere, and the client's stream goes on with
the next token (``resumed_params``; at most ``MAX_RESUMES`` times).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncGenerator, Mapping

from splitserve.router.admission import Admission
from splitserve.router.config import RouterConfig
from splitserve.router.decode_stage import DecodeSession
from splitserve.router.dispatch import Dispatcher
from splitserve.router.metrics import RouterMetrics
from splitserve.router.output import RequestObserver, RequestOutput, Step
from splitserve.router.request import (
    GenerateError,
    GenerateInput,
    GenerateParams,
    InvalidRequest,
    ModelInfo,
    parse_request,
)
from splitserve.runtime import tracing
from splitserve.runtime.failure import Failure
from splitserve.runtime.protocol import Usage
from splitserve.runtime.slo import Slo

logger = logging.getLogger(__name__)

CLIENT_KEY = "x-splitserve-client"  # gRPC metadata / HTTP header naming the client (a tenant)

MAX_RESUMES = 2  # a stream whose decode node fails goes on elsewhere at most this many times

# A request that ended this close to its deadline was cut off by it (timed out, not cancelled):
# the client's clock and ours start a few milliseconds apart.
DEADLINE_SLACK_S = 0.05


class RequestFront:
    def __init__(
        self,
        config: RouterConfig,
        model: ModelInfo,
        dispatch: Dispatcher,
        metrics: RouterMetrics,
        admission: Admission | None = None,
        loop_lag: LoopLag | None = None,
    ) -> None:
        self.model = model
        self._dispatch = dispatch
        self._metrics = metrics
        self._request_timeout_s = config.request_timeout_s
        self._max_per_client = config.max_requests_per_client
        self._in_flight: Counter[str] = Counter()  # client → its requests in flight
        # Admission's refusals that need no prompt (``Admission.check_arrival``) are made before
        # the request is parsed, so a refusal under overload costs next to nothing; it learns
        # how long serving takes from the requests that end.
        self._admission = admission
        self._default_slo = config.slo  # the router's --slo: a request's own bounds win
        # The wait before a handler runs (``LoopLag``): a request's clock starts that much
        # earlier; past --max-loop-lag-s (0: never) new requests are refused at once.
        self.loop_lag = loop_lag
        self._max_loop_lag_s = config.max_loop_lag_s

    async def run(
        self,
        request: GenerateInput,
        client: str,
        time_remaining: float | None = None,
        trace: Mapping[str, str] | None = None,
    ) -> AsyncGenerator[tuple[GenerateParams, Step], None]:
        """The request's output steps; raises ``GenerateError`` when it is refused or cannot be
        served. ``time_remaining``: the caller's deadline, seconds from now (None: none; the
        router's --request-timeout-s applies either way); ``trace``: the caller's trace context
        (``traceparent``), the parent of the request's trace. Close the iterator (``aclosing``)
        to cancel: the pools free the request's blocks."""
        now = time.monotonic()
        lag = self.loop_lag.seconds if self.loop_lag is not None else 0.0
        start = now - lag  # when the call reached the host, as near as the router can tell
        budget = self._request_timeout_s if time_remaining is None else time_remaining
        deadline = now + min(budget, self._request_timeout_s)  # the client's clock: from now
        observer = RequestObserver(self._metrics, start)
        counted = False
        params: GenerateParams | None = None
        traced = tracing.start("request", {"splitserve.client": client}, carrier=trace, server=True)
        failure: str | None = None
        try:
            slo = self._slo(request, time_remaining)
            observer.slo = slo
            if self._in_flight[client] >= self._max_per_client:
                raise self._refused(
                    "client_cap",
                    f"client {client} has {self._in_flight[client]} requests in flight (the "
                    "router's --max-requests-per-client); wait for one to end",
                )
            if self._max_loop_lag_s and lag > self._max_loop_lag_s:
                raise self._refused(
                    "router_busy",
                    f"the router is {lag * 1000:.0f} ms behind (its --max-loop-lag-s is "
                    f"{self._max_loop_lag_s * 1000:.0f} ms): retry shortly, or on another router",
                )
            self._in_flight[client] += 1
            counted = True
            if self._admission is not None:
                self._admission.check_arrival(deadline, slo, client, start)
            try:
                if request.token_ids is not None:  # nothing to tokenize: at once
                    params = parse_request(request, self.model)
                else:  # off the event loop: tokenizing a long text takes long
                    params = await asyncio.to_thread(parse_request, request, self.model)
            except InvalidRequest as exc:
                raise GenerateError(Failure.INVALID, str(exc)) from None
            if traced.span.is_recording():
                traced.span.set_attributes(_request_attributes(params))
            # Closed here, not by the event loop's finalizer later: a cancelled request gives its
            # nodes back (and its KV ledger charge) at once.
            steps = self._serve(params, start, deadline, slo, client, observer)
            async with contextlib.aclosing(steps):
                async for step in steps:
                    if step.usage is not None and traced.span.is_recording():
                        traced.span.set_attributes(_usage_attributes(step))
                    yield params, step
        except GenerateError as exc:
            failure = f"{exc.code.value}: {exc.message}"
            if exc.reason and traced.span.is_recording():  # refused: why, as /metrics counts it
                traced.span.set_attribute("splitserve.refusal_reason", exc.reason)
            observer.failed(exc.code)
            if exc.retry_after_s is not None:  # refused for want of room
                self._metrics.refusal_latency.observe(time.monotonic() - start)
            rid = params.request_id if params is not None else request.request_id or "-"
            logger.info("request %s from %s: %s %s", rid, client, exc.code.value, exc.message)
            raise
        finally:
            if counted:
                self._in_flight[client] -= 1
                if not self._in_flight[client]:
                    del self._in_flight[client]
            if observer.code == "CANCELLED" and time.monotonic() >= deadline - DEADLINE_SLACK_S:
                observer.failed(Failure.DEADLINE)
            observer.end()
            if failure is None and observer.code not in ("", "OK"):
                failure = observer.code
            traced.end(failure)

    def _refused(self, reason: str, message: str) -> GenerateError:
        """A refusal before any work, counted under ``reason``: the client may retry in 1 s."""
        self._metrics.refused.labels(reason=reason).inc()
        return GenerateError(Failure.REFUSED, message, retry_after_s=1, reason=reason)

    async def _serve(
        self,
        params: GenerateParams,
        start: float,
        deadline: float,
        slo: Slo | None,
        client: str,
        observer: RequestObserver,
    ) -> AsyncGenerator[Step, None]:
        """The checked request's output; raises ``GenerateError`` when it cannot be served."""
        started = await self._dispatch.run(params, deadline, slo, start, client)
        first, session, admitted_at = started.first, started.session, started.admitted_at
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
            output = RequestOutput(self.model.tokenizer, params.stop, usage, observer)

            def served_by(step: Step) -> Step:
                if step.usage is not None:
                    served.append(time.monotonic() - admitted_at)
                    if self._admission is not None and started.first_at and not resumed:
                        self._admission.note_decoded(time.monotonic() - started.first_at)
                return step

            while True:  # once, and again for each resume on another decode node
                tokens.append(started.first.token_id)
                step = output.add(
                    [started.first.token_id], [started.first.logprob], started.first.finish_reason
                )
                if output.finished:
                    # NOTE: a stop string on the first token: D holds the shipped blocks until its
                    # transfer deadline unless told (direct: closing the stream ends it on D).
                    session.close(release_kv=not started.first.finish_reason)
                    yield served_by(step)
                    return
                call = session.stream(deadline)
                yield served_by(step)
                batch = session.node.in_flight  # the batch it met on D, at its first token
                try:
                    while True:
                        reply = await call.read()
                        tokens.extend(reply.token_ids)
                        step = output.add(reply.token_ids, reply.logprobs, reply.finish_reason)
                        session.grow(output.num_tokens)  # output past the reserve fills blocks
                        if output.finished and not resumed:
                            _note_tpot(session, started.first_at, output.num_tokens, batch)
                        yield served_by(step)
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
            if not served and first.computed_tokens:
                self._metrics.wasted_prompt_tokens.inc(first.computed_tokens)

    def _note_service(self, served: list[float], admitted_at: float, deadline: float) -> None:
        """Tell admission how long serving took; a request cut off at its deadline took at least
        that long (without it, an estimate drawn only from served requests trails a service time
        that grows with the load, and more requests are let go too late)."""
        if self._admission is None:
            return
        now = time.monotonic()
        if served:
            self._admission.note_served(served[0])
        elif now >= deadline - DEADLINE_SLACK_S:
            self._admission.note_served(now - admitted_at)

    def _slo(self, request: GenerateInput, time_remaining: float | None) -> Slo | None:
        """The request's targets: its own bounds, the router's ``--slo`` for those it left
        unset, the TTFT one no later than the client's deadline."""
        own = request.slo
        slo = own.within(self._default_slo) if own is not None else self._default_slo
        if time_remaining is not None:
            slo = (slo or Slo()).capped(max(time_remaining, 0.0))
        return slo

    def count_refused(self, code: Failure) -> None:
        """A request a front refused before ``run`` (the HTTP front's JSON checks): counted
        like every other ending."""
        observer = RequestObserver(self._metrics, time.monotonic())
        observer.failed(code)
        observer.end()

    async def complete(
        self,
        request: GenerateInput,
        client: str,
        time_remaining: float | None = None,
        trace: Mapping[str, str] | None = None,
    ) -> tuple[GenerateParams, list[Step]]:
        """The whole output at once (for unary calls)."""
        async with contextlib.aclosing(self.run(request, client, time_remaining, trace)) as gen:
            steps = [item async for item in gen]
        return steps[0][0], [step for _, step in steps]


def _request_attributes(params: GenerateParams) -> dict[str, str | int]:
    return {
        "splitserve.request_id": params.request_id,
        "splitserve.prompt_tokens": len(params.prompt_token_ids),
        "splitserve.max_tokens": params.sampling.max_tokens,
    }


def _usage_attributes(step: Step) -> dict[str, str | int | float]:
    usage = step.usage
    assert usage is not None
    return {
        "splitserve.completion_tokens": usage.completion_tokens,
        "splitserve.cached_tokens": usage.cached_tokens,
        "splitserve.ttft_s": usage.time_to_first_token_s,
        "splitserve.finish_reason": step.delta.finish_reason or "",
    }


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


INTERVAL_S = 0.01  # a probe every 10 ms
WINDOW = 25  # the lag is the worst of the last 25 probes (~0.25 s when the loop keeps up)


class LoopLag:
    """The event loop's recent lateness, in seconds (``seconds``); 0 until ``run`` runs: the wait
    a request had before its handler.

    A call that reached the host waits for the event loop before its handler runs (grpc.aio
    hands the handler to the loop, which may be busy relaying tokens); the router's clock for a
    request starts only there. A probe asks to wake every ``interval_s`` and records how much
    later it woke. The recent worst lateness is what a request arriving now waited (an estimate:
    it is the same queue of callbacks), so the front takes a request's arrival as ``now - lag``
    and refuses at once, as ``router_busy``, while the lag alone is past ``--max-loop-lag-s``: a
    router that falls behind sheds load instead of serving it late."""

    def __init__(self, interval_s: float = INTERVAL_S, window: int = WINDOW) -> None:
        self._interval_s = interval_s
        self._samples: deque[float] = deque(maxlen=window)
        self.seconds = 0.0

    def note(self, late_s: float) -> None:
        """One probe's lateness."""
        self._samples.append(max(late_s, 0.0))
        self.seconds = max(self._samples)

    async def run(self) -> None:
        """Probe until cancelled (a task of the router's, beside its server)."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self._interval_s
            await asyncio.sleep(self._interval_s)
            self.note(loop.time() - due)
