"""The router's request path put together from its configuration: admission, the stages, the
dispatcher and the front that both public fronts (gRPC, HTTP) serve through.

The one place the router's parts are wired: ``build_front``. The servicers only serve.
"""

from __future__ import annotations

import time
from collections import deque

from splitserve.kvstore.redis_index import PrefixIndex
from splitserve.router.admission import Admission
from splitserve.router.config import RouterConfig
from splitserve.router.decode_stage import DecodeStage, DirectStage
from splitserve.router.dispatch import Dispatcher, DispatchPolicy, Stages
from splitserve.router.front import LoopLag, RequestFront
from splitserve.router.metrics import PoolPressure, PressureFigures, RouterMetrics
from splitserve.router.pool import DecodeNode, DecodePool, PrefillPool
from splitserve.router.prefill_stage import PrefillStage
from splitserve.router.prefix import PrefixLookup
from splitserve.router.registry import NodeRegistry
from splitserve.router.request import ModelInfo


def build_front(
    config: RouterConfig,
    model: ModelInfo,
    registry: NodeRegistry,
    index: PrefixIndex | None = None,
    metrics: RouterMetrics | None = None,
) -> RequestFront:
    """The request path over ``registry``'s pools (``index``: the prefix index, if any;
    ``metrics``: where its figures go, a fresh set if None)."""
    metrics = metrics or RouterMetrics()
    policy = DispatchPolicy(
        config.direct_prefill_tokens,
        config.direct_prefill_backlog_tokens,
        config.max_attempts,
        config.block_size,
        config.decode_kv_reserve_tokens,
    )
    lookup = PrefixLookup(index, config.block_size) if index is not None else None
    # NOTE: with --direct-prefill-backlog-tokens, backlogged prefill nodes are a reason to go
    # direct, not to wait: requests then wait for decode room only.
    prefill_room = registry.prefill if not policy.direct_prefill_backlog_tokens else None
    admission = Admission(
        registry.decode,
        metrics,
        config.max_queue,
        config.queue_timeout_s,
        prefill=prefill_room,
        rates=registry.prefill,
        weights=config.client_weights,
    )
    pressure = Pressure(registry, admission)
    metrics.watch_pressure(pressure.figures)

    def computed(tokens: int) -> None:
        metrics.prefill_computed_tokens.inc(tokens)
        pressure.computed(tokens)

    decode = DecodeStage(
        registry,
        on_first_decode=metrics.stage_seconds.labels(stage="first_decode", path="").observe,
    )
    prefill = PrefillStage(registry, config.block_size, on_computed=computed)
    stages = Stages(prefill, DirectStage(), decode)
    dispatch = Dispatcher(registry, metrics, stages, policy, lookup, admission)
    loop_lag = LoopLag()  # measured once the router runs it (router.server)
    metrics.loop_lag.set_function(lambda: loop_lag.seconds)
    return RequestFront(config, model, dispatch, metrics, admission, loop_lag)


RATE_WINDOW_S = 10.0


class Pressure:
    """The pools' pressure as the router sees it, read at scrape time (``RouterMetrics``): the
    autoscaler's inputs (docs/deploy.md, "Overload")."""

    def __init__(self, registry: NodeRegistry, admission: Admission) -> None:
        self._registry = registry
        self._admission = admission
        self._computed: deque[tuple[float, int]] = deque()  # (when, prompt tokens computed)

    def computed(self, tokens: int) -> None:
        """A prefill node computed ``tokens`` prompt tokens for one of this router's requests."""
        now = time.monotonic()
        self._computed.append((now, tokens))
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
