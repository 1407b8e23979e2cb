"""The KV transfer layer inside the services, on CPU: a prefill and a decode node started with
``--kv-transfer dist`` move blocks through torch.distributed (gloo) instead of the gRPC byte
stream, and greedy output is still token-exact with transformers. A node without the layer
(``--kv-transfer none``) next to it is served over gRPC bytes: each pair picks its own path."""

import random

import grpc
import pytest
from support.processes import start_node, start_router
from support.reference import hf_greedy

from splitserve.client import Client
from splitserve.models.tiny import write_random_checkpoint
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_checkpoint(
        tmp_path_factory.mktemp("xfer") / "m", seed=21, with_tokenizer=True, num_hidden_layers=2
    )


def counters(address):
    with grpc.insecure_channel(address) as channel:
        stats = nodes_pb2_grpc.NodeStatsServiceStub(channel).GetStats(nodes_pb2.GetStatsRequest())
    return stats.counters


def test_dist_path_through_the_services_is_token_exact(model_dir, tmp_path):
    prefill = start_node("prefill", model_dir, tmp_path, "--kv-transfer", "dist")
    dist = start_node("decode", model_dir, tmp_path, "--kv-transfer", "dist")
    plain = start_node("decode", model_dir, tmp_path, "--kv-transfer", "none")
    router = start_router(model_dir, tmp_path, [prefill.address], [dist.address, plain.address])
    procs = [router, prefill, dist, plain]
    try:
        rng = random.Random(0)
        prompts = [[rng.randrange(256) for _ in range(n)] for n in (37, 64, 5, 90)]
        with Client(router.address) as client:
            for prompt in prompts:
                r = client.generate(
                    prompt_token_ids=prompt, max_tokens=5, temperature=0.0, ignore_eos=True
                )
                assert list(r.token_ids) == hf_greedy(model_dir, prompt, 5)
        via_dist, via_bytes = counters(dist.address), counters(plain.address)
        assert via_dist["transfers_dist"] >= 1, via_dist
        assert via_dist["transfers"] == via_dist["transfers_dist"]
        assert via_bytes["transfers"] >= 1 and via_bytes.get("transfers_dist", 0) == 0
    finally:
        for proc in procs:
            proc.stop()
