"""No Prometheus metric name is exported by two kinds of process (router, prefill node, decode
node): a sum over every scraped job must not count one thing twice (it did: the router and the
prefill nodes both exported ``splitserve_cached_tokens_total``). Node metrics carry their role's
prefix (``splitserve_prefill_*``, ``splitserve_decode_*``); the router's carry neither.

Starts nothing: the router's registry is built as the router builds it, and each node's collector
is fed every counter its service can produce (``all_counters`` of the real service classes, over
the counter names declared in runtime/counter_names.py, which the node packages count by)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from support.metrics import ROLES, assert_no_name_shared, families_of

import splitserve.decode_node
import splitserve.prefill_node
from splitserve.decode_node.service import DecodeService
from splitserve.engine.api import EngineFigures
from splitserve.engine.kv_port import KVPort
from splitserve.engine.kv_tiers import HostTier
from splitserve.engine.loop import AsyncEngine
from splitserve.kvstore import BlockPool
from splitserve.kvstore.kv_cache_manager import PrefixCacheStats
from splitserve.prefill_node.service import PrefillService
from splitserve.router.metrics import RouterMetrics
from splitserve.runtime import counter_names
from splitserve.runtime.metrics import LoadFigures, NodeCollector
from splitserve.transfer import PATHS


def _counter_names(role: str) -> Counter[str]:
    """Every counter a ``role`` node declares (each transfer path's too), with a value."""
    names = Counter(counter_names.for_role(role, PATHS))
    assert len(names) == len(counter_names.for_role(role, PATHS)), "a name declared twice"
    return names


def _node_counters(role: str) -> dict[str, float]:
    """What ``all_counters`` of the real service returns once every counter has moved."""
    kv = SimpleNamespace(stats=PrefixCacheStats(1, 1, 1, 1))
    tier = HostTier(torch.zeros(4, 1, 2, 16, 1, 8), BlockPool(4), 4)  # a real tier's counters
    port = SimpleNamespace(
        prefix_stats=lambda: KVPort.prefix_stats(SimpleNamespace(_kv=kv, _tier=tier))
    )
    loop = SimpleNamespace(steps=1, step_seconds=0.1, job_seconds=0.1)
    # A NodeEngine's figures carry the same counters (as engine.local.LocalEngine joins them).
    figures = EngineFigures(
        counters={"preemptions": 1, **port.prefix_stats(), **AsyncEngine.counters(loop)}
    )
    engine = SimpleNamespace(
        kv_port=port,
        counters=lambda: AsyncEngine.counters(loop),
        engine=SimpleNamespace(num_preemptions=1),
        last_figures=lambda: figures,
    )
    if role == "prefill":
        service = SimpleNamespace(counters=_counter_names(role), engine=engine)
        return PrefillService.all_counters(service)
    service = SimpleNamespace(counters=_counter_names(role), engine=engine)
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
        fixed = {"tensor_parallel_size": ("ranks", 2)}
        registry.register(NodeCollector(role, lambda: load, lambda c=counters: c, fixed))
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
    assert "splitserve_decode_tensor_parallel_size" in exported["decode"]
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


def _literal_counter_keys(package) -> list[str]:
    """``file:line`` of every ``counters[...]`` in ``package`` keyed by a string literal or an
    f-string instead of a runtime.counter_names declaration."""
    found = []
    for source in sorted(Path(package.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.value, ast.Name | ast.Attribute)
                and (node.value.id if isinstance(node.value, ast.Name) else node.value.attr)
                == "counters"
                and isinstance(node.slice, ast.Constant | ast.JoinedStr)
            ):
                found.append(f"{source.name}:{node.lineno}")
    return found


def test_nodes_count_by_the_declared_names_only():
    for package in (splitserve.prefill_node, splitserve.decode_node):
        literal = _literal_counter_keys(package)
        assert not literal, f"declare these counters in runtime/counter_names.py: {literal}"


def test_the_declared_names_check_sees_a_literal(tmp_path):
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "mod.py").write_text('def f(self):\n    self.counters["x"] += 1\n')
    package = SimpleNamespace(__file__=str(tmp_path / "__init__.py"))
    assert _literal_counter_keys(package) == ["mod.py:2"]


def test_the_router_exports_its_own_cpu():
    """The router's CPU per relayed token is read off its /metrics: rate of
    process_cpu_seconds_total over rate of splitserve_generation_tokens_total."""
    registry = RouterMetrics().registry
    assert (registry.get_sample_value("process_cpu_seconds_total") or 0.0) > 0.0
    assert registry.get_sample_value("splitserve_generation_tokens_total") == 0.0
