"""The router's Prometheus metrics: what users feel, once per request
(``splitserve_time_to_first_token_seconds``, ``splitserve_inter_token_latency_seconds``,
``splitserve_request_latency_seconds``, ``splitserve_requests_total{code}``,
``splitserve_{prompt,cached,generation}_tokens_total``), its own queue, retries and routes
(``splitserve_router_*``), and the load figures of every node it routes to
(``splitserve_node_*{role,node}``), so one scrape of the router is enough for a scaler. The
nodes' collectors and the server are ``runtime.metrics``; no name is exported by two kinds of
process (tests/unit/test_metric_names.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from splitserve.runtime.metrics import LoadFigures, add_load_figures, load_metric_families

# Buckets in seconds: a 4k-token prompt of an 8B model prefills in ~0.3 s on one GPU, and KV
# shipping or queueing can add seconds; decode steps are milliseconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
ITL_BUCKETS = REFUSAL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600)
# Signed: a prediction error is late (> 0) or early (< 0).
ERROR_BUCKETS = (-10, -5, -2.5, -1, -0.5, -0.25, -0.1, 0, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
STAGE_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    120,
)
# The stages of splitserve_router_stage_seconds, in a request's order.
STAGES = {
    "lookup": "the prefix index look-up of the prompt's blocks",
    "queue": "admission: waiting for a decode node with room",
    "prefill": "a prefill node's Prefill call: its queue, the prefill and the KV transfer",
    "compute": "the prefill node's engine, from the request joining it to its first token",
    "transfer": "what shipping the KV into the decode node added after the first token",
    "direct": "a decode node prefilling the prompt itself, to its first token",
    "first_decode": "from a decode command on a decode node's Relay stream to its first token",
}

REFUSAL_REASONS = {
    "queue_full": "the router's --max-queue requests were already waiting",
    "queue_wait": "the queue's recent pace put its wait past its deadline or --queue-timeout-s",
    "queue_timeout": "it waited --queue-timeout-s",
    "deadline": "its deadline passed while it waited",
    "prompt_too_large": "its prompt's KV is larger than any decode node's",
    "client_cap": "its client had --max-requests-per-client in flight",
    "router_busy": "the router's event loop ran later than --max-loop-lag-s",
    "slo_ttft": "at its arrival, its predicted time to first token was past its TTFT target",
    "slo_expired": "it waited until its TTFT target could no longer be met",
}


class RouterMetrics:
    """The router's request histograms and counters, and the nodes' last load figures."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        # The router's own CPU and memory (process_cpu_seconds_total, ...): its CPU per relayed
        # token is rate(process_cpu_seconds_total) / rate(splitserve_generation_tokens_total).
        ProcessCollector(registry=r)
        self.ttft = Histogram(
            "splitserve_time_to_first_token_seconds",
            "From request arrival to the first token sent",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "splitserve_inter_token_latency_seconds",
            "Between consecutive tokens of a request's stream",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "splitserve_request_latency_seconds",
            "From request arrival to its last token (or its error)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "splitserve_requests", "Requests ended, by gRPC status code", ["code"], registry=r
        )
        self.prompt_tokens = Counter(
            "splitserve_prompt_tokens", "Prompt tokens of the requests routed", registry=r
        )
        self.cached_tokens = Counter(
            "splitserve_cached_tokens",
            "Prompt tokens of the requests routed found in a prefix cache",
            registry=r,
        )
        self.generation_tokens = Counter(
            "splitserve_generation_tokens", "Tokens generated", registry=r
        )
        self.retries = Counter(
            "splitserve_router_prefill_retries",
            "Prefill attempts retried on another node",
            registry=r,
        )
        self.routes = Counter(
            "splitserve_router_routes",
            "Requests by route, counted at their first token: disaggregated (a prefill node "
            "shipped the KV to a decode node) or direct (the decode node prefilled it itself)",
            ["route"],
            registry=r,
        )
        for route in ("disaggregated", "direct"):
            self.routes.labels(route=route)
        self.loop_lag = Gauge(
            "splitserve_router_event_loop_lag_seconds",
            "How late the router's event loop recently ran what was due (the worst of the last "
            "quarter second): the wait a request has before the router's handler runs",
            registry=r,
        )
        self.queue_length = Gauge(
            "splitserve_router_queue_length",
            "Requests waiting at the router for a decode node with room",
            registry=r,
        )
        self.admission_headroom = Gauge(
            "splitserve_router_admission_headroom",
            "The share of its TTFT target a request that must queue is admitted to, the lowest "
            "of any client's (1: all of it; lower while a client's queued requests recently "
            "ran out of time and were refused late)",
            registry=r,
        )
        self.queue_wait = Histogram(
            "splitserve_router_queue_wait_seconds",
            "Time requests waited at the router for a decode node with room",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.refused = Counter(
            "splitserve_router_refused",
            "Requests refused for want of room before any node did work for them, by reason: "
            + ", ".join(f"{k} ({v})" for k, v in REFUSAL_REASONS.items()),
            ["reason"],
            registry=r,
        )
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason=reason)
        self.refusal_latency = Histogram(
            "splitserve_router_refusal_seconds",
            "From a request's arrival at the router to its refusal for want of room",
            buckets=REFUSAL_BUCKETS,
            registry=r,
        )
        self.prefill_computed_tokens = Counter(
            "splitserve_router_prefill_computed_tokens",
            "Prompt tokens prefill nodes computed for this router's requests (prompt less cached)",
            registry=r,
        )
        self.wasted_prompt_tokens = Counter(
            "splitserve_router_prefill_wasted_tokens",
            "Prompt tokens prefill nodes computed for requests that then did not complete (failed, "
            "timed out or cancelled after their prefill)",
            registry=r,
        )
        self.kv_shipped_bytes = Counter(
            "splitserve_router_kv_shipped_bytes",
            "KV bytes prefill nodes shipped to decode nodes for this router's requests (whole "
            "blocks in the pools' dtype: an FP8 KV cache ships half of bfloat16's), by path",
            ["path"],
            registry=r,
        )
        self.kv_shipped_blocks = Counter(
            "splitserve_router_kv_shipped_blocks",
            "KV blocks prefill nodes shipped with data for this router's requests, by path "
            "(blocks the decode node already held are not counted)",
            ["path"],
            registry=r,
        )
        self.kv_transfers = Counter(
            "splitserve_router_kv_transfers",
            "This router's requests whose KV a prefill node shipped, by path (bytes per request: "
            "kv_shipped_bytes / kv_transfers)",
            ["path"],
            registry=r,
        )
        self.ttft_prediction_error = Histogram(
            "splitserve_router_ttft_prediction_error_seconds",
            "Admission's time-to-first-token prediction error: actual less predicted (before "
            "the learned margin), per request that reached its first token",
            buckets=ERROR_BUCKETS,
            registry=r,
        )
        self.stage_seconds = Histogram(
            "splitserve_router_stage_seconds",
            "Where a request's time to its first token went, stage by stage: "
            + ", ".join(f"{k} ({v})" for k, v in STAGES.items())
            + "; path: the KV path of a transfer (ipc, nixl, dist, tcp, grpc), else empty",
            ["stage", "path"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        for stage in STAGES:
            if stage != "transfer":
                self.stage_seconds.labels(stage=stage, path="")
        self.slo_requests = Counter(
            "splitserve_router_slo_requests",
            "Requests that ended with a TTFT or TPOT target, by whether they met every target "
            "(met: completed within them; missed: completed late; failed: refused or not "
            "completed)",
            ["outcome"],
            registry=r,
        )
        for outcome in ("met", "missed", "failed"):
            self.slo_requests.labels(outcome=outcome)
        self.nodes: dict[tuple[str, str], LoadFigures] = {}  # (role, address) → last figures
        r.register(_NodesCollector(self.nodes))

    def watch_pressure(self, figures: Callable[[], PressureFigures]) -> None:
        """Export the pools' pressure (``PressureFigures``), read at scrape time."""
        self.registry.register(_PressureCollector(figures))


@dataclass(frozen=True, slots=True)
class PoolPressure:
    """One pool as the router sees it (usable nodes only)."""

    nodes: int  # usable: up, identity checked, not leaving
    in_flight: int  # this router's requests on them
    slots: int  # decode: their max_num_seqs summed (0: not known)
    prompt_tokens: int  # prefill: prompt tokens they have to compute for this router
    kv_blocks_total: int  # decode: usable KV blocks (0: not known)
    kv_blocks_charged: int  # decode: blocks this router's requests there will need


@dataclass(frozen=True, slots=True)
class PressureFigures:
    """What a scaler needs of the pools: the router's queue and each pool's load."""

    queued: int
    queued_prompt_tokens: int
    oldest_wait_s: float
    wait_p50_s: float  # over the requests that left the queue in the last minute
    wait_p99_s: float
    prefill_tokens_per_s: float  # computed by the prefill pool, recently
    prefill: PoolPressure
    decode: PoolPressure
    prefill_capacity_tokens_per_s: float = 0.0  # computed per busy second (0: not known)
    ttft_base_s: float = 0.0  # admission's learned time from leaving the queue to first token
    ttft_margin_s: float = 0.0  # the learned margin over its TTFT predictions


class _PressureCollector(Collector):
    def __init__(self, figures: Callable[[], PressureFigures]) -> None:
        self._figures = figures

    def collect(self) -> Iterable[Metric]:
        f = self._figures()

        def gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"splitserve_router_{name}", text, value=value)

        yield gauge(
            "queue_prompt_tokens",
            "Prompt tokens of the requests waiting in the router's queue",
            f.queued_prompt_tokens,
        )
        yield gauge(
            "queue_oldest_wait_seconds",
            "How long the head of the router's queue has waited",
            f.oldest_wait_s,
        )
        waits = GaugeMetricFamily(
            "splitserve_router_queue_wait_recent_seconds",
            "Queue wait quantiles of the requests that left the router's queue in the last minute",
            labels=("quantile",),
        )
        waits.add_metric(["0.5"], f.wait_p50_s)
        waits.add_metric(["0.99"], f.wait_p99_s)
        yield waits
        yield gauge(
            "prefill_tokens_per_second",
            "Prompt tokens the prefill pool computed per second for this router (last 10 s)",
            f.prefill_tokens_per_s,
        )
        yield gauge(
            "prefill_capacity_tokens_per_second",
            "Prompt tokens the prefill pool computes per second of being busy (summed over "
            "its usable nodes, each measured over its last 10 s; 0: not known yet)",
            f.prefill_capacity_tokens_per_s,
        )
        yield gauge(
            "ttft_prediction_base_seconds",
            "Admission's learned time from leaving the queue to the first token, less the "
            "request's own prefill (median of the last minute)",
            f.ttft_base_s,
        )
        yield gauge(
            "ttft_prediction_margin_seconds",
            "The margin admission adds to its TTFT predictions: the 95th percentile of the "
            "last minute's prediction errors (never below 0)",
            f.ttft_margin_s,
        )
        per_role = {  # splitserve_router_<name>{role}: PoolPressure.<name less "pool_">
            "pool_in_flight": "This router's requests on the pool's nodes",
            "pool_slots": "Decode: sequence slots (max_num_seqs) of the usable nodes",
            "pool_prompt_tokens": "Prefill: prompt tokens the pool has to compute for this router",
            "nodes": "Usable nodes the router routes to (up, identity checked, not leaving)",
        }
        for name, text in per_role.items():
            family = GaugeMetricFamily(f"splitserve_router_{name}", text, labels=("role",))
            for role, pool in (("prefill", f.prefill), ("decode", f.decode)):
                family.add_metric([role], float(getattr(pool, name.removeprefix("pool_"))))
            yield family
        kv = GaugeMetricFamily(
            "splitserve_router_decode_kv_blocks",
            "Decode pool KV blocks as the router's admission counts them: total (usable, less "
            "no headroom), charged (what its requests there will need), free (total - charged)",
            labels=("state",),
        )
        d = f.decode
        kv.add_metric(["total"], float(d.kv_blocks_total))
        kv.add_metric(["charged"], float(d.kv_blocks_charged))
        kv.add_metric(["free"], float(max(d.kv_blocks_total - d.kv_blocks_charged, 0)))
        yield kv


class _NodesCollector(Collector):
    def __init__(self, nodes: Mapping[tuple[str, str], LoadFigures]) -> None:
        self._nodes = nodes

    def collect(self) -> Iterable[Metric]:
        families = load_metric_families("splitserve_node", ("role", "node"))
        for (role, address), load in list(self._nodes.items()):
            add_load_figures(families, [role, address], load)
        yield from families.values()
