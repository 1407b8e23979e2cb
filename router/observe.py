"""The router's request metrics, observed on the public stream as the client receives it."""

from __future__ import annotations

import time

from splitserve.router.errors import Failure
from splitserve.runtime.metrics import RouterMetrics
from splitserve.runtime.protocol import Usage
from splitserve.runtime.slo import Slo


class RequestObserver:
    """Time to first token, inter-token latency, token counts, and how the request ended."""

    def __init__(self, metrics: RouterMetrics, start: float) -> None:
        self._m = metrics
        self._start = start
        self._last: float | None = None
        self._first: float | None = None
        self._tokens = 0
        self.code = "CANCELLED"  # unless the stream ends otherwise: the client went away
        self.slo: Slo | None = None  # its targets: the stream's end counts met, missed, failed

    def tokens(self, count: int) -> None:
        """``count`` tokens (one message's) are about to reach the client."""
        if not count:
            return
        now = time.monotonic()
        self._tokens += count
        if self._last is None:
            self._first = now
            self._m.ttft.observe(now - self._start)
        else:
            for _ in range(count):  # a batch's tokens share the gap since the previous one
                self._m.itl.observe((now - self._last) / count)
        self._last = now

    def finished(self, usage: Usage) -> None:
        self.code = "OK"
        self._m.prompt_tokens.inc(usage.prompt_tokens)
        self._m.cached_tokens.inc(usage.cached_tokens)
        self._m.generation_tokens.inc(usage.completion_tokens)

    def failed(self, failure: Failure) -> None:
        self.code = failure.value  # the status name /metrics counts endings under

    def end(self) -> None:
        """The stream is over, however it ended."""
        self._m.requests.labels(self.code).inc()
        self._m.latency.observe(time.monotonic() - self._start)
        if self.slo is not None:
            self._m.slo_requests.labels(outcome=self._slo_outcome(self.slo)).inc()

    def _slo_outcome(self, slo: Slo) -> str:
        if self.code != "OK" or self._first is None or self._last is None:
            return "failed"
        ttft = self._first - self._start
        tpot = (self._last - self._first) / (self._tokens - 1) if self._tokens > 1 else 0.0
        late = (slo.ttft_s is not None and ttft > slo.ttft_s) or (
            slo.tpot_s is not None and tpot > slo.tpot_s
        )
        return "missed" if late else "met"
