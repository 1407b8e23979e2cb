"""Where a request's time went, on the router's /metrics without traces: one disaggregated
request (over tcp, streamed layer by layer) and one short enough to go direct fill every stage
of ``splitserve_router_stage_seconds`` — the prefix index look-up, the admission queue, the
Prefill call, the prefill node's compute, the KV transfer labelled with its path, the decode
node's first step — and ``direct``, and the prefill node's figures add up: compute plus transfer
fit inside the Prefill call the router timed. Then the Grafana dashboard
(deploy/grafana/dashboards/splitserve.json): every metric its queries name is one these running
components (or the planner) export."""

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.processes import scrape_metrics, start_node, start_redis, start_router

from splitserve.client import Client
from splitserve.models.tiny import write_random_checkpoint
from splitserve.router.metrics import STAGES


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stages")
    model = write_random_checkpoint(tmp / "m", seed=8, with_tokenizer=True)
    procs = [redis := start_redis(tmp)]
    try:
        url = redis.address  # (already redis://host:port)
        flags = ("--redis-url", url, "--kv-transfer", "tcp")
        streamed = ("--kv-stream-min-tokens", "1", "--metrics-port", "0")
        procs.append(prefill := start_node("prefill", model, tmp, *flags, *streamed))
        procs.append(decode := start_node("decode", model, tmp, *flags, "--metrics-port", "0"))
        args = ("--redis-url", url, "--metrics-port", "0", "--direct-prefill-tokens", "8")
        procs.append(router := start_router(model, tmp, [prefill.address], [decode.address], *args))
        yield router, [p.metrics_port for p in (router, prefill, decode)]
    finally:
        for proc in reversed(procs):
            proc.stop()


def _count(figures, stage, path=""):
    return figures.get(f'splitserve_router_stage_seconds_count{{path="{path}",stage="{stage}"}}', 0)


def _sum(figures, stage, path=""):
    return figures.get(f'splitserve_router_stage_seconds_sum{{path="{path}",stage="{stage}"}}', 0)


def test_every_stage_of_a_request_is_timed(cluster):
    router, (port, *_) = cluster
    with Client(router.address) as client:
        long = client.generate(prompt_token_ids=list(range(3, 103)), max_tokens=3, ignore_eos=True)
        short = client.generate(prompt_token_ids=[7, 8, 9], max_tokens=3, ignore_eos=True)
    assert len(long.token_ids) == len(short.token_ids) == 3
    figures = scrape_metrics(port)
    for stage in STAGES:
        path = "tcp" if stage == "transfer" else ""
        assert _count(figures, stage, path) >= 1, (
            stage,
            sorted(k for k in figures if "stage" in k),
        )
    assert _count(figures, "direct") == 1 and _count(figures, "prefill") == 1
    prefill = _sum(figures, "prefill")
    assert 0 < _sum(figures, "compute") + _sum(figures, "transfer", "tcp") <= prefill


DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards"
SUFFIXES = ("", "_total", "_bucket", "_sum", "_count", "_created")


def _exported(text: str) -> set[str]:
    """Every series name a /metrics page can answer: its samples' and its families' with the
    suffixes Prometheus gives them (a labelled family without children has no sample yet)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in SUFFIXES)
        names.update(sample.name for sample in family.samples)
    return names


def _planner_metrics() -> str:
    from splitserve.planner.loop import Planner
    from splitserve.planner.policy import Bounds
    from splitserve.runtime.slo import Slo

    planner = Planner(None, None, Bounds(), Slo(ttft_s=1.0))  # type: ignore[arg-type]
    return generate_latest(planner.registry).decode()


def test_every_dashboard_query_names_an_exported_metric(cluster):
    router, ports = cluster
    with Client(router.address) as client:  # (a transfer, so that its labelled series exist)
        client.generate(prompt_token_ids=list(range(5, 90)), max_tokens=2, ignore_eos=True)
    pages = [
        urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=5).read().decode()
        for p in ports
    ]
    exported = set().union(*map(_exported, [*pages, _planner_metrics()]))
    for path in DASHBOARD.glob("*.json"):
        dashboard = json.loads(path.read_text())
        queries = [
            target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
        ]
        assert len(queries) >= 20, path
        for expr in queries:
            for name in re.findall(r"\bsplitserve_[a-z0-9_]+", expr):
                assert name in exported, f"{path.name}: {name} is not exported ({expr})"
