"""Goodput under overload (real processes: `splitserve up`'s launcher with `--slo`, driven by
`splitserve bench`): the cluster's capacity is measured first; then at 3x it, requests predicted
to miss their TTFT target are refused at once and goodput (requests/s within the target) stays
near what it is at 0.4x (>= 70% of it) and >= 30% of the capacity; nothing leaks.

Its nodes' steps take a fixed 50 ms (``SPLITSERVE_MIN_STEP_MS``; the tiny model's forward takes a
few): the cluster's capacity is then set by that floor, not by how busy the machine's cores are
(under a second suite on 2 cores, the tiny model's capacity swung mid-run and requests admitted
on the rates of a moment before missed their target). A sleeping node also leaves the cores to the
load generator and the router, whose time TTFT at the client counts too.

Before admission by predicted latency the queue let every request wait its turn: at 3x the
capacity each arrival queued behind the backlog and almost none met its TTFT target."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from support.processes import scrape_metrics

from splitserve.launcher import ClusterSpec, LocalCluster
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

TTFT_S = 2.0
WORKLOAD = "--input-len 48 --output-len 16 --ignore-eos --prompt-format ids --vocab 250"


def _bench(target: str, out: Path, name: str, load: str) -> dict:
    result = out / f"{name}.json"
    cmd = [
        sys.executable, "-m", "splitserve.cli", "bench", "--target", target,
        *WORKLOAD.split(), *load.split(), "--timeout", "30", "--slo", f"ttft={TTFT_S}",
        "--seed", "3", "--cache-salt", name, "--no-progress", "--result-json", str(result),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.exists(), done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(result.read_text())["results"]


@pytest.mark.slow
def test_goodput_holds_past_the_knee(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_MIN_STEP_MS", "50")  # the nodes started below inherit it
    spec = ClusterSpec(
        model_path="tiny",
        num_prefill=1,
        num_decode=1,
        port=0,  # the router binds a free one (a port picked here could be taken first)
        slo=f"ttft={TTFT_S:g}",
        auth_token_file="none",
        metrics_port=0,
        # A decode node that runs 8 requests at a time: the cluster's knee is the decode pool
        # (~8 / (17 steps x 50 ms) ~ 9 requests/s).
        node_args=("--max-num-seqs", "8", "--kv-cache-mb", "64"),
    )
    with LocalCluster(spec) as cluster:
        target = cluster.addresses.router
        # Capacity: a closed loop of as many requests as the decode node has slots, so none
        # queues (a queued request's predicted TTFT, on a machine loaded by another suite, could
        # pass the target and be refused: a bet on the machine's speed, seen once at concurrency
        # 12). A refusal here is admission at work, not an error: the capacity is what completed.
        closed = _bench(target, tmp_path, "capacity", "--num-requests 48 --max-concurrency 8")
        assert closed["failed"] == 0 and closed["completed"] > 0, closed
        assert set(closed["refusals"]) <= {"RESOURCE_EXHAUSTED"}, closed["refusals"]
        capacity = closed["request_throughput"]
        low = _bench(target, tmp_path, "low", f"--request-rate {0.4 * capacity:.2f} --duration 10")
        high = _bench(target, tmp_path, "high", f"--request-rate {3 * capacity:.2f} --duration 10")
        url = cluster.addresses.metrics[target]
        router = scrape_metrics(int(url.rsplit(":", 1)[1].split("/")[0]))
        reasons = {k: v for k, v in router.items() if k.startswith("splitserve_router_refused_t")}
        print(f"capacity {capacity:.1f} req/s; goodput at 0.4x {low['goodput']:.2f}, at 3x "
              f"{high['goodput']:.2f}; refused at 3x {high['refused']}, by the router {reasons}; "
              f"refusal latency at the client {high['refusal_latency_s']}")  # fmt: skip
        assert low["failed"] == 0 and high["failed"] == 0, (low["failures"], high["failures"])
        assert high["refused"] > 0, "3x the capacity: some requests must be refused"
        assert set(high["refusals"]) <= {"RESOURCE_EXHAUSTED"}, high["refusals"]
        # Refused at once: before any node worked on them, far within the TTFT target (a
        # request refused only once its target passed waits TTFT_S). The bounds separate
        # admission by prediction from the collapse before it (goodput near 0 at 3x), with room
        # for a machine busy with other tests: how close to the capacity it stays is
        # benchmarks/overload.py's figure, not this test's.
        assert high["refusal_latency_s"]["p50"] < 0.5 * TTFT_S, high["refusal_latency_s"]
        assert high["goodput"] >= 0.7 * low["goodput"], (low, high)
        assert high["goodput"] >= 0.3 * capacity, (capacity, high)
        for address in (*cluster.addresses.prefill, *cluster.addresses.decode):
            with grpc.insecure_channel(address) as channel:
                stub = nodes_pb2_grpc.NodeStatsServiceStub(channel)
                stats = stub.GetStats(nodes_pb2.GetStatsRequest(), timeout=10)
            assert stats.num_free_blocks == stats.num_blocks, address  # nothing leaked
