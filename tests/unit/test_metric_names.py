"""No Prometheus metric name is exported by two kinds of process (router, prefill node, decode
node): a sum over every scraped job must not count one thing twice (it did: the router and the
prefill nodes both exported ``splitserve_cached_tokens_total``). Node metrics carry their role's
prefix (``splitserve_prefill_*``, ``splitserve_decode_*``); the router's carry neither.

Starts nothing: the router's registry is built as the router builds it, and each node's collector
is fed every counter its service can produce (``all_counters`` of the real service classes, over
the counter names incremented anywhere in their packages)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from support.metrics import ROLES, assert_no_name_shared, families_of

import splitserve.decode_node
import splitserve.prefill_node
from splitserve.decode_node.service import DecodeService
from splitserve.models.engine_loop import AsyncEngine
from splitserve.models.kv_port import KVPort
from splitserve.prefill_node.service import PrefillService
from splitserve.runtime.metrics import LoadFigures, NodeCollector, RouterMetrics
from splitserve.transfer import PATHS

_COUNTER_KEY = re.compile(r"""counters\[(f?)"([^"]+)"\]""")


def _counter_names(package) -> Counter[str]:
    """Every counter key incremented in ``package``'s modules (an f-string's ``{...}``: each
    transfer path), with a value."""
    names: Counter[str] = Counter()
    for source in Path(package.__file__).parent.glob("*.py"):
        for is_f, key in _COUNTER_KEY.findall(source.read_text()):
            keys = [re.sub(r"\{[^}]*\}", p, key) for p in PATHS] if is_f else [key]
            names.update(keys)
    assert names, f"no counters found in {package.__name__}: has the service changed?"
    return names


def _node_counters(role: str) -> dict[str, float]:
    """What ``all_counters`` of the real service returns once every counter has moved."""
    kv = SimpleNamespace(stats=SimpleNamespace(requests=1, queried_tokens=1, hit_tokens=1))
    port = SimpleNamespace(prefix_stats=lambda: KVPort.prefix_stats(SimpleNamespace(_kv=kv)))
    loop = SimpleNamespace(steps=1, step_seconds=0.1, job_seconds=0.1)
    engine = SimpleNamespace(
        kv_port=port,
        counters=lambda: AsyncEngine.counters(loop),
        engine=SimpleNamespace(num_preemptions=1),
    )
    if role == "prefill":
        service = SimpleNamespace(counters=_counter_names(splitserve.prefill_node), engine=engine)
        return PrefillService.all_counters(service)
    service = SimpleNamespace(counters=_counter_names(splitserve.decode_node), engine=engine)
    return DecodeService.all_counters(service)


def _scrape(registry: CollectorRegistry) -> set[str]:
    return families_of(generate_latest(registry).decode())


def exported_names() -> dict[str, set[str]]:
    router = RouterMetrics()
    router.requests.labels(code="OK").inc()
    load = LoadFigures(
        running=1, waiting=1, num_blocks=4, num_free_blocks=2, prefill_tokens_waiting=3
    )
    router.nodes[("prefill", "p:1")] = router.nodes[("decode", "d:1")] = load
    exported = {"router": _scrape(router.registry)}
    for role in ROLES:
        counters = _node_counters(role)
        registry = CollectorRegistry()
        registry.register(NodeCollector(role, lambda: load, lambda c=counters: c))
        exported[role] = _scrape(registry)
    return exported


def test_no_metric_name_is_exported_by_two_kinds_of_process():
    exported = exported_names()
    assert_no_name_shared(exported)
    # The collectors really exported what the services count (not an empty page).
    assert {"splitserve_prefill_cached_tokens", "splitserve_prefill_transfers_failed"} <= exported[
        "prefill"
    ]
    assert {"splitserve_decode_transfers_failed", "splitserve_decode_running"} <= exported["decode"]
    assert {"splitserve_cached_tokens", "splitserve_node_running"} <= exported["router"]


def test_the_check_catches_a_shared_name():
    exported = exported_names()
    exported["router"].add("splitserve_decode_running")
    with pytest.raises(AssertionError, match="splitserve_decode_running"):
        assert_no_name_shared(exported)
    exported = exported_names()
    exported["prefill"].add("splitserve_cached_tokens")  # the old name of the issue
    with pytest.raises(AssertionError, match="splitserve_cached_tokens"):
        assert_no_name_shared(exported)
