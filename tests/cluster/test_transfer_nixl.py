"""The nixl path inside the services, on CPU (two NIXL agents in two node processes, UCX over
loopback): with `--kv-transfer nixl,dist,tcp` a prefill and a decode node move KV by nixl WRITEs
into the decode node's registered pool, token-exact with transformers, and count them
(``transfers_nixl``); the prefill node's log says which path the pair took. (When nixl is not
offered: tests/unit/test_transfer.py.)"""

import random

import grpc
import pytest
from support.processes import start_node, start_router
from support.reference import hf_greedy

from splitserve.client import Client
from splitserve.models.tiny import write_random_checkpoint
from splitserve.transfer import nixl
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

pytestmark = pytest.mark.skipif(
    not nixl.available(), reason="NIXL is not installed here (pip install 'splitserve[nixl]')"
)


def _counters(address: str) -> dict[str, float]:
    with grpc.insecure_channel(address) as channel:
        stub = nodes_pb2_grpc.NodeStatsServiceStub(channel)
        return dict(stub.GetStats(nodes_pb2.GetStatsRequest()).counters)


def test_nixl_is_taken_before_dist_and_tcp_and_answers_token_exact(tmp_path):
    model = write_random_checkpoint(tmp_path / "m", seed=23, with_tokenizer=True)
    paths = ("--kv-transfer", "nixl,dist,tcp")
    prefill = start_node("prefill", model, tmp_path, *paths)
    decode = start_node("decode", model, tmp_path, *paths)
    router = start_router(model, tmp_path, [prefill.address], [decode.address])
    try:
        rng = random.Random(4)
        prompts = [[rng.randrange(256) for _ in range(n)] for n in (37, 64, 5, 90)]
        with Client(router.address) as client:
            for prompt in prompts:
                out = client.generate(
                    prompt_token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True
                )
                assert list(out.token_ids) == hf_greedy(model, prompt, 6)
        counters = _counters(decode.address)
        assert counters["transfers_nixl"] == counters["transfers"] == len(prompts), counters
    finally:
        for proc in (router, prefill, decode):
            proc.stop()
    assert ": nixl" in prefill.log.read_text()  # "transfer to <decode> (host ...): nixl"
