"""The router's request path put together from its configuration: admission, the stages, the
dispatcher and the front that both public fronts (gRPC, HTTP) serve through.

The one place the router's parts are wired: ``build_front``. The servicers only serve.
"""

from __future__ import annotations

from splitserve.kvstore.redis_index import PrefixIndex
from splitserve.router.admission import Admission
from splitserve.router.config import RouterConfig
from splitserve.router.decode_stage import DecodeStage, DirectStage
from splitserve.router.dispatch import Dispatcher, DispatchPolicy, Stages
from splitserve.router.front import RequestFront
from splitserve.router.loop_lag import LoopLag
from splitserve.router.metrics import RouterMetrics
from splitserve.router.prefill_stage import PrefillStage
from splitserve.router.prefix import PrefixLookup
from splitserve.router.pressure import Pressure
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
