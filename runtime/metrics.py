"""Prometheus metrics of every process, served at ``http://HOST:PORT/metrics`` (prometheus-client).

Names start with ``splitserve_``, and no name is exported by two kinds of process, so a sum over
every scraped job never counts one thing twice:

- the router: what users feel, once per request, its queue, and every node's load figures
  (``router.metrics``, beside the router's code);
- a prefill or decode node: its own load figures and counters (prefix hits, blocks and bytes
  shipped or fetched), read from the live engine at scrape time, under its role's prefix:
  ``splitserve_prefill_*`` and ``splitserve_decode_*`` (counters ``..._<name>_total``).

tests/unit/test_metric_names.py fails on a name two kinds of process would both export.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from splitserve.kvstore.kv_cache_manager import SlotUsage

if TYPE_CHECKING:
    from splitserve.engine.api import EngineFigures

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadFigures:
    """What a scaler needs of one node."""

    running: int
    waiting: int  # queued requests
    num_blocks: int
    num_free_blocks: int
    prefill_tokens_waiting: int
    pending_transfers: int = 0  # decode: transferred, waiting for their decode command
    # KV slot utilisation (kvstore.kv_cache_manager.SlotUsage): tokens held by the blocks in use
    # and their slots (blocks in use x block size), each block once however many requests share
    # it. None: not known (figures from a node that does not report them); not exported then.
    kv_tokens_held: int | None = None
    kv_token_slots: int | None = None

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(self.num_blocks, 1)

    @property
    def kv_slot_utilization(self) -> float | None:
        """``kv_tokens_held / kv_token_slots``; NaN when no block is in use (undefined: averaged
        over time, take the ratio of the sums of the two raw gauges); None when not known."""
        if self.kv_tokens_held is None or self.kv_token_slots is None:
            return None
        return SlotUsage(self.kv_tokens_held, self.kv_token_slots).utilization

    @classmethod
    def of_figures(cls, figures: EngineFigures, pending_transfers: int = 0) -> LoadFigures:
        """The figures of an engine as ``NodeEngine.figures``/``last_figures`` give them
        (``engine.api.EngineFigures``), wherever the engine runs."""
        return cls(
            running=figures.running,
            waiting=figures.waiting,
            num_blocks=figures.num_blocks,
            num_free_blocks=figures.num_free_blocks,
            prefill_tokens_waiting=figures.prefill_tokens_waiting,
            pending_transfers=pending_transfers,
            kv_tokens_held=figures.kv_tokens_held,
            kv_token_slots=figures.kv_token_slots,
        )


_LOAD_HELP = {
    "running": "Requests being computed",
    "waiting": "Requests queued for admission",
    "kv_usage": "Share of the KV cache blocks in use (0..1)",
    "num_free_blocks": "KV cache blocks free (cached prefix blocks included)",
    "prefill_tokens_waiting": "Prompt tokens admitted or queued but not computed yet",
    "pending_transfers": "Decode: requests whose KV arrived, waiting for their decode command",
    "kv_slot_utilization": "KV tokens held / token slots of the blocks in use, a shared block "
    "once (0..1; NaN when none is in use: average kv_tokens_held / kv_token_slots over time)",
    "kv_tokens_held": "Tokens held by the KV blocks in use (a block shared by requests once)",
    "kv_token_slots": "Token slots of the KV blocks in use (blocks in use x block size)",
}


def load_metric_families(prefix: str, labels: tuple[str, ...]) -> dict[str, GaugeMetricFamily]:
    return {
        name: GaugeMetricFamily(f"{prefix}_{name}", text, labels=labels)
        for name, text in _LOAD_HELP.items()
    }


def add_load_figures(
    families: Mapping[str, GaugeMetricFamily], labels: list[str], load: LoadFigures
):
    for name, family in families.items():
        value = getattr(load, name)
        if value is not None:  # a figure the node did not report
            family.add_metric(labels, float(value))


def node_metric_prefix(role: str) -> str:
    """What every metric of a ``role`` node (prefill, decode) starts with."""
    return f"splitserve_{role}"


class NodeCollector(Collector):
    """A node's load figures and counters, read from the live node at scrape time.

    ``load`` returns the current LoadFigures, exported as ``splitserve_<role>_<figure>``;
    ``counters`` the node's monotonic counters (name → value, e.g. blocks_shipped,
    bytes_shipped, prefix_hit_tokens), exported as ``splitserve_<role>_<name>_total``. Both keep
    a ``role`` label.
    """

    def __init__(
        self,
        role: str,
        load: Callable[[], LoadFigures],
        counters: Callable[[], Mapping[str, float]],
        fixed: Mapping[str, tuple[str, float]] | None = None,
    ) -> None:
        self.role = role
        self._load = load
        self._counters = counters
        self._fixed = dict(fixed or {})  # name → (help, value): figures of the node's make-up

    def collect(self) -> Iterable[Metric]:
        prefix = node_metric_prefix(self.role)
        families = load_metric_families(prefix, ("role",))
        add_load_figures(families, [self.role], self._load())
        yield from families.values()
        for name, (text, value) in sorted(self._fixed.items()):
            gauge = GaugeMetricFamily(f"{prefix}_{name}", text, labels=("role",))
            gauge.add_metric([self.role], float(value))
            yield gauge
        for name, value in sorted(self._counters().items()):
            family = CounterMetricFamily(
                f"{prefix}_{name}", f"{self.role} node counter {name}", labels=("role",)
            )
            family.add_metric([self.role], float(value))
            yield family


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> int:
    """Serve ``/metrics`` on a background thread; returns the bound port."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound = server.server_port
    logger.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
