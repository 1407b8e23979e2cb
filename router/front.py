"""The one request path behind both public fronts (gRPC ``RouterService`` and the OpenAI-compatible
HTTP API): the per-client cap, checking and tokenizing, the orchestrator, and the request
metrics. Every way a request ends - served, refused, failed, cancelled, timed out - is counted
once, by its gRPC status code; the fronts only translate messages and errors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Mapping

from splitserve.router.errors import Failure, GenerateError
from splitserve.router.loop_lag import LoopLag
from splitserve.router.observe import RequestObserver
from splitserve.router.orchestrator import DEADLINE_SLACK_S, Orchestrator, Step
from splitserve.router.request import (
    GenerateParams,
    InvalidRequest,
    ModelInfo,
    parse_request,
    request_slo,
)
from splitserve.runtime import tracing
from splitserve.runtime.metrics import RouterMetrics
from splitserve.runtime.slo import Slo
from splitserve.v1 import router_pb2

logger = logging.getLogger(__name__)

CLIENT_KEY = "x-splitserve-client"  # gRPC metadata / HTTP header naming the client (a tenant)


class RequestFront:
    def __init__(
        self,
        model: ModelInfo,
        orchestrator: Orchestrator,
        metrics: RouterMetrics,
        request_timeout_s: float,
        max_requests_per_client: int,
        check_arrival: Callable[[float, Slo | None, str, float], None] | None = None,
        default_slo: Slo | None = None,
        loop_lag: LoopLag | None = None,
        max_loop_lag_s: float = 0.0,
    ) -> None:
        self.model = model
        self._orchestrator = orchestrator
        self._metrics = metrics
        self._request_timeout_s = request_timeout_s
        self._max_per_client = max_requests_per_client
        self._in_flight: Counter[str] = Counter()  # client → its requests in flight
        # Admission's refusals that need no prompt (router.admission.check_arrival): made before
        # the request is parsed, so a refusal under overload costs next to nothing.
        self._check_arrival = check_arrival
        self._default_slo = default_slo  # the router's --slo: a request's own bounds win
        # The wait before a handler runs (router.loop_lag): a request's clock starts that much
        # earlier; past max_loop_lag_s (0: never) new requests are refused at once.
        self.loop_lag = loop_lag
        self._max_loop_lag_s = max_loop_lag_s

    async def run(
        self,
        request: router_pb2.GenerateRequest,
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
                self._metrics.refused.labels(reason="client_cap").inc()
                raise GenerateError(
                    Failure.REFUSED,
                    f"client {client} has {self._in_flight[client]} requests in flight (the "
                    "router's --max-requests-per-client); wait for one to end",
                    retry_after_s=1,
                    reason="client_cap",
                )
            if self._max_loop_lag_s and lag > self._max_loop_lag_s:
                self._metrics.refused.labels(reason="router_busy").inc()
                raise GenerateError(
                    Failure.REFUSED,
                    f"the router is {lag * 1000:.0f} ms behind (its --max-loop-lag-s is "
                    f"{self._max_loop_lag_s * 1000:.0f} ms): retry shortly, or on another router",
                    retry_after_s=1,
                    reason="router_busy",
                )
            self._in_flight[client] += 1
            counted = True
            if self._check_arrival is not None:
                self._check_arrival(deadline, slo, client, start)
            try:
                if request.WhichOneof("prompt") == "token_ids":  # nothing to tokenize: at once
                    params = parse_request(request, self.model)
                else:  # off the event loop: tokenizing a long text takes long
                    params = await asyncio.to_thread(parse_request, request, self.model)
            except InvalidRequest as exc:
                raise GenerateError(Failure.INVALID, str(exc)) from None
            if traced.span.is_recording():
                traced.span.set_attributes(_request_attributes(params))
            # Closed here, not by the event loop's finalizer later: a cancelled request gives its
            # nodes back (and its KV ledger charge) at once.
            steps = self._orchestrator.run(params, start, deadline, slo, client)
            async with contextlib.aclosing(steps):
                async for step in steps:
                    observer.tokens(len(step.delta.token_ids))
                    if step.usage is not None:
                        observer.finished(step.usage)
                        if traced.span.is_recording():
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

    def _slo(self, request: router_pb2.GenerateRequest, time_remaining: float | None) -> Slo | None:
        """The request's targets: its own bounds, the router's ``--slo`` for those it left
        unset, the TTFT one no later than the client's deadline."""
        try:
            own = request_slo(request)
        except InvalidRequest as exc:
            raise GenerateError(Failure.INVALID, str(exc)) from None
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
        request: router_pb2.GenerateRequest,
        client: str,
        time_remaining: float | None = None,
        trace: Mapping[str, str] | None = None,
    ) -> tuple[GenerateParams, list[Step]]:
        """The whole output at once (for unary calls)."""
        steps: list[tuple[GenerateParams, Step]] = []
        gen = self.run(request, client, time_remaining, trace)
        try:
            async for item in gen:
                steps.append(item)
        finally:
            await gen.aclose()
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
