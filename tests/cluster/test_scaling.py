"""Scaling at run time, standing in for ``docker compose up --scale``: router + Redis + one prefill
and one decode node serve a steady stream of requests; a second decode node joins and gets
traffic within 5 s; the first decode node is drained (SIGTERM) mid-stream; a second prefill node
joins and the first is drained likewise. No request fails, drained nodes exit 0, and the
router's and a node's /metrics move with the traffic."""

import time

import grpc
import pytest
from support.processes import (
    Traffic,
    scrape_metrics,
    start_node,
    start_redis,
    start_router_discovering,
)

from splitserve.client import Client, SplitserveError
from splitserve.models.tiny import write_random_checkpoint
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_checkpoint(
        tmp_path_factory.mktemp("scaling") / "m", seed=3, with_tokenizer=True, num_hidden_layers=1
    )


def counter(address: str, role: str, name: str) -> float:
    with grpc.insecure_channel(address) as channel:
        stub = nodes_pb2_grpc.NodeStatsServiceStub(channel)
        return stub.GetStats(nodes_pb2.GetStatsRequest(), timeout=10).counters[name]


def wait_for(predicate, timeout: float) -> float:
    """Seconds until ``predicate()`` held; fails after ``timeout``."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s"
        time.sleep(0.1)
    return time.monotonic() - t0


def drain(proc) -> int:
    proc.popen.terminate()
    return proc.popen.wait(60)


def test_scale_out_and_drain_lose_no_request(model_dir, tmp_path):
    redis = start_redis(tmp_path)
    procs = [redis]
    traffic = None
    try:
        flags = ("--redis-url", redis.address)
        p1 = start_node("prefill", model_dir, tmp_path, *flags)
        d1 = start_node("decode", model_dir, tmp_path, *flags)
        procs += [p1, d1]
        router = start_router_discovering(model_dir, tmp_path, redis.address, "--metrics-port", "0")
        procs.append(router)
        router_metrics = router.metrics_port
        with Client(router.address) as client:
            wait_for(lambda: _ok(client), 20)
        before = scrape_metrics(router_metrics)
        traffic = Traffic(router.address)
        wait_for(lambda: traffic.ok >= 5, 30)

        # Scale out decode: the new node gets transfers within 5 s of serving.
        d2 = start_node("decode", model_dir, tmp_path, *flags, "--metrics-port", "0")
        procs.append(d2)
        node_metrics = d2.metrics_port
        wait_for(lambda: counter(d2.address, "decode", "transfers") > 0, 5)

        # Drain the first decode node mid-stream: it exits 0, nothing fails.
        assert drain(d1) == 0, d1.log.read_text()[-3000:]
        assert "draining" in d1.log.read_text()
        served = traffic.ok
        wait_for(lambda: traffic.ok >= served + 5, 30)

        # Scale out prefill, then drain the first prefill node.
        p2 = start_node("prefill", model_dir, tmp_path, *flags)
        procs.append(p2)
        wait_for(lambda: counter(p2.address, "prefill", "prefills") > 0, 5)
        assert drain(p1) == 0, p1.log.read_text()[-3000:]
        served = traffic.ok
        wait_for(lambda: traffic.ok >= served + 5, 30)
        traffic.stop()
        assert traffic.failures == [], traffic.failures[:5]

        check_metrics(router_metrics, before, node_metrics, d2.address, traffic.ok)
    finally:
        if traffic is not None:
            traffic.stop()
        for proc in reversed(procs):
            proc.stop()


def check_metrics(router_port: int, before: dict, node_port: int, d2: str, ok: int) -> None:
    """The router's and decode node d2's /metrics moved with the ``ok`` requests served."""
    after = scrape_metrics(router_port)
    key = "splitserve_time_to_first_token_seconds_count"
    assert after[key] - before.get(key, 0) == ok
    assert after["splitserve_inter_token_latency_seconds_count"] >= 11 * ok
    assert after['splitserve_requests_total{code="OK"}'] >= ok
    assert after["splitserve_request_latency_seconds_sum"] > 0
    node = scrape_metrics(node_port)
    assert node['splitserve_decode_transfers_total{role="decode"}'] > 0
    assert 'splitserve_decode_kv_usage{role="decode"}' in node
    running = f'splitserve_node_running{{node="{d2}",role="decode"}}'
    wait_for(lambda: running in scrape_metrics(router_port), 10)


def _ok(client) -> bool:
    try:
        client.generate(prompt_token_ids=[1, 2, 3], max_tokens=1, temperature=0.0)
        return True
    except SplitserveError:
        return False
