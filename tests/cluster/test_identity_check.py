"""The router checks every node's model identity (root hash) against its own: a node started
with another block size (or dtype, or checkpoint) would hash prompts differently, so prefix hits
would silently never match and its KV would be unusable. Such a node is named in the router's
log and never routed to; requests keep succeeding on the matching nodes."""

import time

import grpc
import pytest
from support.processes import start_node, start_redis, start_router

from splitserve.client import Client
from splitserve.models.tiny import write_random_checkpoint
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_checkpoint(
        tmp_path_factory.mktemp("identity") / "m", seed=5, with_tokenizer=True, num_hidden_layers=1
    )


def adopted(address: str) -> float:
    with grpc.insecure_channel(address) as channel:
        stats = nodes_pb2_grpc.NodeStatsServiceStub(channel).GetStats(nodes_pb2.GetStatsRequest())
    return stats.counters["transfers"]


def test_node_with_another_identity_is_reported_and_never_used(model_dir, tmp_path):
    redis = start_redis(tmp_path)
    procs = [redis]
    try:
        flags = ("--redis-url", redis.address)
        prefill = start_node("prefill", model_dir, tmp_path, *flags)
        good = start_node("decode", model_dir, tmp_path, *flags)
        odd = start_node("decode", model_dir, tmp_path, *flags, "--block-size", "32")
        procs += [prefill, good, odd]
        router = start_router(
            model_dir, tmp_path, [prefill.address], [good.address, odd.address], *flags
        )
        procs.append(router)
        with Client(router.address) as client:
            for i in range(6):
                r = client.generate(prompt_token_ids=[i + 1] * 40, max_tokens=3, temperature=0.0)
                assert len(r.token_ids) == 3
        assert adopted(odd.address) == 0
        assert adopted(good.address) == 6
        deadline = time.monotonic() + 10
        while "registered for" not in router.log.read_text():
            assert time.monotonic() < deadline, router.log.read_text()[-2000:]
            time.sleep(0.2)
        log = router.log.read_text()
        assert f"decode node {odd.address} is not used" in log
        assert "block_size=32" in log, log[-2000:]
    finally:
        for proc in reversed(procs):
            proc.stop()
