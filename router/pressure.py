"""The pools' pressure as the router sees it, read at scrape time (``router.metrics``): the
autoscaler's inputs (docs/deploy.md, "Overload")."""

from __future__ import annotations

import time
from collections import deque

from splitserve.router.admission import Admission
from splitserve.router.metrics import PoolPressure, PressureFigures
from splitserve.router.pool import DecodeNode, DecodePool, PrefillPool
from splitserve.router.registry import NodeRegistry

RATE_WINDOW_S = 10.0


class Pressure:
    def __init__(self, registry: NodeRegistry, admission: Admission) -> None:
        self._registry = registry
        self._admission = admission
        self._computed: deque[tuple[float, int]] = deque()  # (when, prompt tokens computed)

    def computed(self, tokens: int) -> None:
        """A prefill node computed ``tokens`` prompt tokens for one of this router's requests."""
        now = time.monotonic()
        self._computed.append((now, tokens))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._computed and self._computed[0][0] < now - RATE_WINDOW_S:
            self._computed.popleft()

    def figures(self) -> PressureFigures:
        """Read at scrape time, on the metrics server's thread: nothing here may change what
        the event loop changes (snapshots only)."""
        now = time.monotonic()
        computed = tuple(self._computed)  # one C-level copy: atomic under the GIL
        admission = self._admission
        p50, p99 = admission.wait_quantiles((0.5, 0.99))
        return PressureFigures(
            queued=len(admission),
            queued_prompt_tokens=admission.queued_prompt_tokens,
            oldest_wait_s=admission.oldest_wait_s(),
            wait_p50_s=p50,
            wait_p99_s=p99,
            prefill_tokens_per_s=sum(t for w, t in computed if w >= now - RATE_WINDOW_S)
            / RATE_WINDOW_S,
            prefill_capacity_tokens_per_s=admission.load().capacity or 0.0,
            ttft_base_s=admission.predictor.base_s(),
            ttft_margin_s=admission.predictor.margin_s(),
            prefill=_pool(self._registry.prefill),
            decode=_pool(self._registry.decode),
        )


def _pool(pool: PrefillPool | DecodePool) -> PoolPressure:
    nodes = pool.usable()
    decode = [n for n in nodes if isinstance(n, DecodeNode)]
    return PoolPressure(
        nodes=len(nodes),
        in_flight=sum(n.in_flight for n in nodes),
        slots=sum(n.slots or 0 for n in decode),
        prompt_tokens=sum(n.queued_tokens for n in nodes),
        kv_blocks_total=sum(n.kv.limit or 0 for n in decode),
        kv_blocks_charged=sum(n.kv.used for n in decode),
    )
