"""`splitserve up` as a user runs it: a local cluster comes up with a cluster token of its own,
serves `generate --target` and the HTTP API, every component serves the /metrics URL it prints
(no metric name in two of them), and Ctrl-C stops every process it started. A decode node that
is out of KV blocks refuses with RESOURCE_EXHAUSTED and the router retries on another."""

import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from support.metrics import assert_no_name_shared, families_of
from support.processes import start_node, start_router, wait_healthy

from splitserve.client import Client
from splitserve.models.tiny import write_random_checkpoint
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_checkpoint(
        tmp_path_factory.mktemp("up") / "m",
        with_tokenizer=True,
        num_hidden_layers=4,
        num_key_value_heads=1,
        head_dim=64,
        num_attention_heads=2,
    )


def _port_open(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=1)
            return True
        except grpc.FutureTimeoutError:
            return False


def test_up_serves_and_ctrl_c_stops_everything(model_dir, tmp_path):
    log = (tmp_path / "up.log").open("w")
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "splitserve.cli",
            "up",
            "--model",
            str(model_dir),
            "--port",
            "0",  # every port is one its process binds (a picked one may be taken first)
            "--num-prefill",
            "1",
            "--num-decode",
            "1",
            "--metrics-port",
            "0",
            "--http-port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    try:
        # router, http, prefill, decode, redis, token, api-key
        lines = [up.stdout.readline() for _ in range(7)]
        assert all(lines), f"up printed {lines} and stopped:\n{(tmp_path / 'up.log').read_text()}"
        addresses = {line.split()[0]: line.split()[1] for line in lines}
        # "router 127.0.0.1:P metrics http://127.0.0.1:M/metrics", and so on for each node
        urls = {line.split()[0]: line.split()[3] for line in lines if " metrics " in line}
        assert set(urls) == {"router", "prefill", "decode"}
        # --http-port 0: the port the router bound, read from its --http-port-file. up made an
        # API key for it (printed): /v1/* wants it, /health does not.
        with pytest.raises(urllib.error.HTTPError) as refused_http:
            urllib.request.urlopen(f"http://{addresses['http']}/v1/models", timeout=10)
        assert refused_http.value.code == 401
        key = Path(addresses["api-key"]).read_text().split()[-1]
        request = urllib.request.Request(
            f"http://{addresses['http']}/v1/models", headers={"Authorization": f"Bearer {key}"}
        )
        models = urllib.request.urlopen(request, timeout=10)
        assert models.status == 200
        health = urllib.request.urlopen(f"http://{addresses['http']}/health", timeout=10)
        assert health.status in (200, 503)
        wait_healthy(addresses["router"])
        # up made a cluster token: the nodes' internal services want it, from anyone.
        token = Path(addresses["token"]).read_text().strip()
        with grpc.insecure_channel(addresses["decode"]) as channel:
            stub = nodes_pb2_grpc.NodeStatsServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetStats(nodes_pb2.GetStatsRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            auth = (("authorization", f"Bearer {token}"),)
            assert stub.GetStats(nodes_pb2.GetStatsRequest(), timeout=10, metadata=auth).role
        generate = [sys.executable, "-m", "splitserve.cli", "generate", "--target"]
        generate += [addresses["router"], "--max-tokens", "5", "--temperature", "0", "hello"]
        # One key for both doors: the gRPC API refuses a call without up's key too.
        bare = subprocess.run(generate, capture_output=True, text=True, timeout=60)
        assert bare.returncode != 0 and "UNAUTHENTICATED" in bare.stderr, bare.stderr
        with_key = [*generate, "--api-key-file", addresses["api-key"]]
        gen = subprocess.run(with_key, capture_output=True, text=True, timeout=60)
        assert gen.returncode == 0, gen.stderr
        assert "prompt_tokens=5 " in gen.stderr and "completion_tokens=5 " in gen.stderr
        exported = {
            role: families_of(urllib.request.urlopen(url, timeout=10).read().decode())
            for role, url in urls.items()
        }
        assert_no_name_shared(exported)
        assert "splitserve_time_to_first_token_seconds" in exported["router"]
        assert "splitserve_prefill_prompt_tokens" in exported["prefill"]  # moved by generate
        assert "splitserve_decode_transfers" in exported["decode"]
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
    finally:
        if up.poll() is None:
            up.kill()
    for role in ("router", "prefill", "decode"):
        assert not _port_open(addresses[role]), f"{role} still serving after Ctrl-C"


def test_a_decode_node_too_small_for_a_prompt_is_never_sent_it(model_dir, tmp_path):
    """The router knows each decode node's KV (GetStats): a prompt one cannot hold goes to the
    other, and no prefill is computed for a transfer that would be refused."""
    prefill = start_node("prefill", model_dir, tmp_path)
    # 1 MB holds 32 blocks of this model: a 600-token prompt (38 blocks) cannot fit.
    small = start_node("decode", model_dir, tmp_path, "--kv-cache-mb", "1")
    big = start_node("decode", model_dir, tmp_path)
    router = start_router(model_dir, tmp_path, [prefill.address], [small.address, big.address])
    try:
        with Client(router.address) as client:
            for i in range(4):
                r = client.generate(prompt_token_ids=[5 + i] * 600, max_tokens=3, temperature=0.0)
                assert len(r.token_ids) == 3
        stats = {}
        for name, proc in (("small", small), ("big", big), ("prefill", prefill)):
            with grpc.insecure_channel(proc.address) as channel:
                stats[name] = nodes_pb2_grpc.NodeStatsServiceStub(channel).GetStats(
                    nodes_pb2.GetStatsRequest()
                )
        assert stats["small"].counters.get("transfers", 0) == 0
        assert stats["small"].counters.get("transfers_failed", 0) == 0
        assert stats["big"].counters["transfers"] == 4
        assert stats["prefill"].counters["prefills"] == 4  # each prompt computed once
        assert stats["big"].num_free_blocks == stats["big"].num_blocks  # nothing leaked
    finally:
        for proc in (router, prefill, small, big):
            proc.stop()
