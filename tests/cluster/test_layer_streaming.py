"""Layer-wise KV streaming through the services, on CPU: a prefill node started with
``--kv-stream-min-tokens 1`` over the tcp path ships every prompt's blocks while its chunked
prefill computes them (each layer as the forward wrote it; the first token follows in
TransferEnd), and greedy output is token-exact with transformers. A request that ends at its
first token lets its decode reservation go; requests cancelled at random moments (in the
prefill, mid-stream, while decoding) leave no block held on either node. Each with the prefill
node's engine in the node's process and in an engine process of its own (the stream is then
opened by a command over the engine protocol)."""

import asyncio
import random

import pytest
from support.processes import (
    assert_settled,
    idle_free_blocks,
    node_stats,
    start_node,
    start_router,
)
from support.reference import hf_greedy

from splitserve.client import AsyncClient, Client
from splitserve.models.tiny import write_random_checkpoint

PREFILL_FLAGS = (
    "--kv-transfer",
    "tcp",
    "--kv-stream-min-tokens",
    "1",
    "--max-num-batched-tokens",
    "32",  # a prompt takes several steps: blocks complete step by step
    "--async-scheduling",
    "on",
)
DECODE_FLAGS = ("--kv-transfer", "tcp", "--transfer-deadline-s", "3")


@pytest.fixture(scope="module", params=["off", "on"], ids=["in-node", "engine-process"])
def cluster(tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("stream")
    model = write_random_checkpoint(tmp / "m", seed=31, with_tokenizer=True, num_hidden_layers=3)
    procs = []
    try:
        flags = (*PREFILL_FLAGS, "--engine-process", request.param)
        procs.append(start_node("prefill", model, tmp, *flags))
        procs.append(start_node("decode", model, tmp, *DECODE_FLAGS))
        prefill, decode = procs
        procs.append(start_router(model, tmp, [prefill.address], [decode.address]))
        yield model, procs
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_streamed_transfers_are_token_exact(cluster):
    model, (prefill, decode, router) = cluster
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 37, 64, 90, 150)]
    before = node_stats(prefill).counters
    with Client(router.address) as client:
        for prompt in prompts:
            r = client.generate(
                prompt_token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True
            )
            assert list(r.token_ids) == hf_greedy(model, prompt, 6)
    shipped, got = node_stats(prefill).counters, node_stats(decode).counters
    streamed = shipped["transfers_streamed"] - before.get("transfers_streamed", 0)
    assert streamed == len(prompts), dict(shipped)
    assert got["transfers_tcp"] >= len(prompts) and got.get("transfers_failed", 0) == 0


def test_prompts_sharing_a_new_prefix_stream_side_by_side(cluster):
    """Four prompts with one new 64-token prefix at once, each streamed: every answer is
    token-exact and the decode pool settles (where their streams overlap, each holds its own copy
    of the prefix's blocks and the first registered keeps the hashes). That a streamed transfer
    does not wait for another one of the same blocks is checked in tests/unit/test_kv_inbox.py:
    prefills this short end before the next transfer's handshake here."""
    model, (_, decode, router) = cluster
    idle = idle_free_blocks([decode])
    rng = random.Random(29)
    prefix = [rng.randrange(256) for _ in range(64)]
    prompts = [prefix + [rng.randrange(256) for _ in range(10 + 7 * i)] for i in range(4)]

    async def main():
        async with AsyncClient(router.address) as client:
            return await asyncio.gather(
                *(
                    client.generate(
                        prompt_token_ids=p, max_tokens=4, temperature=0.0, ignore_eos=True
                    )
                    for p in prompts
                )
            )

    results = asyncio.run(main())
    for prompt, r in zip(prompts, results, strict=True):
        assert list(r.token_ids) == hf_greedy(model, prompt, 4)
    assert_settled([decode], idle)


def test_a_request_ending_at_its_first_token_lets_the_reservation_go(cluster):
    _, (prefill, decode, router) = cluster
    idle = idle_free_blocks([decode])
    before = node_stats(prefill).counters.get("prefills_not_shipped", 0)
    with Client(router.address) as client:
        r = client.generate(prompt_token_ids=list(range(40, 140)), max_tokens=1, temperature=0.0)
    assert len(r.token_ids) == 1
    assert node_stats(prefill).counters["prefills_not_shipped"] == before + 1
    assert_settled([decode], idle)


async def cancel_at_random_moments(target: str, rng: random.Random, n: int) -> list:
    async def one(client: AsyncClient) -> None:
        prompt = [rng.randrange(250) for _ in range(rng.randrange(20, 200))]
        async for _ in client.stream(
            prompt_token_ids=prompt, max_tokens=rng.randrange(2, 30), temperature=0.0
        ):
            pass

    loop = asyncio.get_running_loop()
    async with AsyncClient(target) as client:
        tasks = []
        for i in range(n):
            task = asyncio.create_task(one(client))
            loop.call_later(rng.uniform(0, 0.1) if i % 2 else rng.uniform(0.1, 1.0), task.cancel)
            tasks.append(task)
            await asyncio.sleep(rng.uniform(0, 0.02))
        return await asyncio.gather(*tasks, return_exceptions=True)


def test_streams_cancelled_at_random_moments_leave_no_block_held(cluster):
    _, (prefill, decode, router) = cluster
    nodes = [prefill, decode]
    idle = idle_free_blocks(nodes)
    results = asyncio.run(cancel_at_random_moments(router.address, random.Random(17), 40))
    assert sum(isinstance(r, asyncio.CancelledError) for r in results) >= 15, results
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, errors[:3]
    assert_settled(nodes, idle)
    with Client(router.address) as client:
        r = client.generate(prompt_token_ids=list(range(1, 80)), max_tokens=4, ignore_eos=True)
    assert len(r.token_ids) == 4
