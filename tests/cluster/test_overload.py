"""Overload queues at the router instead of failing (real processes): a decode node that runs 2
requests at a time, a router that gives it at most 2; a burst of 12 all completes, token-exact
with transformers, the excess having waited in the router's queue. With a queue of 2, the
requests beyond it are refused at once with RESOURCE_EXHAUSTED naming the limit."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from support.processes import greedy_burst, node_stats, start_node, start_router
from support.reference import hf_greedy

from splitserve.models.tiny import write_random_checkpoint


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overload")
    model = write_random_checkpoint(tmp / "m", seed=8, with_tokenizer=True, num_hidden_layers=2)
    prefill = start_node("prefill", model, tmp)
    decode = start_node("decode", model, tmp, "--max-num-seqs", "2")
    try:
        yield model, tmp, prefill, decode
    finally:
        prefill.stop()
        decode.stop()


def test_a_burst_beyond_decode_capacity_waits_and_completes(nodes):
    model, tmp, prefill, decode = nodes
    router = start_router(model, tmp, [prefill.address], [decode.address],
                          "--decode-overcommit", "1")  # fmt: skip
    try:
        rng = random.Random(5)
        prompts = [[rng.randrange(256) for _ in range(rng.randrange(10, 60))] for _ in range(12)]
        results = greedy_burst(router.address, prompts, 6)
        assert [r for r in results if isinstance(r, Exception)] == []
        for prompt, tokens in zip(prompts, results, strict=True):
            assert tokens == hf_greedy(model, prompt, 6)
        stats = node_stats(decode)
        assert stats.max_num_seqs == 2 and stats.num_free_blocks == stats.num_blocks
    finally:
        router.stop()


def test_beyond_the_queue_requests_are_refused_at_once(nodes):
    model, tmp, prefill, decode = nodes
    router = start_router(model, tmp, [prefill.address], [decode.address],
                          "--decode-overcommit", "1", "--max-queue", "2")  # fmt: skip
    try:
        prompts = [[7 + i] * 40 for i in range(10)]
        results = greedy_burst(router.address, prompts, 30)
        refused = [r for r in results if isinstance(r, Exception)]
        assert refused, "10 requests for 2 slots and 2 queue places: some must be refused"
        assert all(r.code == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
        assert all("max-queue" in r.message for r in refused)
        assert len(refused) <= 6  # 2 running and 2 waiting were always accepted
    finally:
        router.stop()


def test_one_client_cannot_take_every_slot(nodes):
    """At most --max-requests-per-client of one client's requests are in flight; others (another
    x-splitserve-client) are served meanwhile."""
    from splitserve.v1 import common_pb2, router_pb2, router_pb2_grpc

    model, tmp, prefill, decode = nodes
    router = start_router(model, tmp, [prefill.address], [decode.address],
                          "--max-requests-per-client", "2")  # fmt: skip

    async def burst(clients):
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)

            async def one(i, client):
                request = router_pb2.GenerateRequest(
                    token_ids=router_pb2.TokenIds(ids=[5 + i] * 30),
                    sampling=common_pb2.SamplingParams(max_tokens=20, ignore_eos=True),
                )
                try:
                    async for _ in stub.Generate(
                        request, timeout=60, metadata=(("x-splitserve-client", client),)
                    ):
                        pass
                    return None
                except grpc.aio.AioRpcError as exc:
                    return exc

            return await asyncio.gather(*(one(i, c) for i, c in enumerate(clients)))

    try:
        same = asyncio.run(burst(["tenant-a"] * 6))
        refused = [e for e in same if e is not None]
        assert refused and all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
        assert all("max-requests-per-client" in e.details() for e in refused)
        assert len(refused) <= 4
        assert asyncio.run(burst([f"tenant-{i}" for i in range(6)])) == [None] * 6
    finally:
        router.stop()
