"""Where a request's time went, on the router's /metrics without traces: one disaggregated
request (over tcp, streamed layer by layer) and one short enough to go direct fill every stage
of ``splitserve_router_stage_seconds`` — the prefix index look-up, the admission queue, the
Prefill call, the prefill node's compute, the KV transfer labelled with its path, the decode
node's first step — and ``direct``, and the prefill node's figures add up: compute plus transfer
fit inside the Prefill call the router timed."""

import pytest
from support.processes import scrape_metrics, start_node, start_redis, start_router

from splitserve.client import Client
from splitserve.launcher import free_port
from splitserve.models.tiny import write_random_checkpoint
from splitserve.runtime.metrics import STAGES


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stages")
    model = write_random_checkpoint(tmp / "m", seed=8, with_tokenizer=True)
    procs = [redis := start_redis(tmp)]
    try:
        url = f"redis://{redis.address}"
        flags = ("--redis-url", url, "--kv-transfer", "tcp")
        procs.append(
            prefill := start_node("prefill", model, tmp, *flags, "--kv-stream-min-tokens", "1")
        )
        procs.append(decode := start_node("decode", model, tmp, *flags))
        port = free_port()
        args = ("--redis-url", url, "--metrics-port", str(port), "--direct-prefill-tokens", "8")
        procs.append(router := start_router(model, tmp, [prefill.address], [decode.address], *args))
        yield router, port
    finally:
        for proc in reversed(procs):
            proc.stop()


def _count(figures, stage, path=""):
    return figures.get(f'splitserve_router_stage_seconds_count{{path="{path}",stage="{stage}"}}', 0)


def _sum(figures, stage, path=""):
    return figures.get(f'splitserve_router_stage_seconds_sum{{path="{path}",stage="{stage}"}}', 0)


def test_every_stage_of_a_request_is_timed(cluster):
    router, port = cluster
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
