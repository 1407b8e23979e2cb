"""Several routers behind one address (`up --num-routers 2`: SO_REUSEPORT, the decode node
leasing its capacity to both): clients on many connections are spread over both and every
request is served token-exact. (That two routers never over-admit one node:
test_router_leases.py.)"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from support.processes import scrape_metrics
from support.reference import hf_greedy

from splitserve.launcher import ClusterSpec, LocalCluster
from splitserve.models.tiny import write_random_checkpoint
from splitserve.v1 import common_pb2, router_pb2, router_pb2_grpc


@pytest.mark.slow
def test_two_routers_share_one_address_and_split_the_pools(tmp_path):
    model = write_random_checkpoint(tmp_path / "m", seed=4, with_tokenizer=True)
    spec = ClusterSpec(
        model_path=str(model),
        num_prefill=1,
        num_decode=1,
        num_routers=2,
        port=0,  # the router binds a free one (a port picked here could be taken first)
        metrics_port=0,
        auth_token_file="none",
        node_args=("--max-num-seqs", "4"),
    )
    rng = random.Random(9)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(8, 40))] for _ in range(24)]
    with LocalCluster(spec) as cluster:
        addresses = cluster.addresses
        assert len(addresses.router_metrics) == 2

        # One connection per request (a channel of its own subchannel pool: gRPC shares one
        # connection between channels to the same address otherwise); the kernel hashes each
        # connection to one of the routers.
        def one(prompt: list[int]) -> list[int]:
            options = [("grpc.use_local_subchannel_pool", 1)]
            with grpc.insecure_channel(addresses.router, options=options) as channel:
                stub = router_pb2_grpc.RouterServiceStub(channel)
                sampling = common_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
                request = router_pb2.GenerateRequest(
                    token_ids=router_pb2.TokenIds(ids=prompt), sampling=sampling
                )
                return list(stub.Complete(request, timeout=120).token_ids)

        with ThreadPoolExecutor(12) as pool:
            outputs = list(pool.map(one, prompts))
        for prompt, tokens in zip(prompts, outputs, strict=True):
            assert tokens == hf_greedy(model, prompt, 6)
        served = []
        for url in addresses.router_metrics:
            page = scrape_metrics(int(url.rsplit(":", 1)[1].split("/")[0]))
            served.append(page.get('splitserve_requests_total{code="OK"}', 0.0))
            assert page['splitserve_router_pool_slots{role="decode"}'] == 4.0
        assert sum(served) == len(prompts)
        assert all(n > 0 for n in served), served  # both routers took calls
