"""Prefill calls cancelled at random moments (queued, computing, shipping, releasing, fetching a
peer's prefix) leave no KV blocks held: the prefill nodes' pools return to their idle free count
(cached prefix blocks count as free), on the node computing and on the peer serving blocks."""

import asyncio
import contextlib
import random
import time

import grpc
import pytest
from support.processes import start_node

from splitserve.models.tiny import write_random_checkpoint
from splitserve.v1 import common_pb2, nodes_pb2, nodes_pb2_grpc

NUM_CALLS = 64
CONCURRENCY = 12


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cancel")
    # Wider than the default tiny model so that a step takes long enough for cancellations to
    # land in every phase of a call, the release behind a step included.
    model = write_random_checkpoint(tmp / "m", seed=3, hidden_size=256, intermediate_size=1024)
    procs = [start_node("prefill", model, tmp) for _ in range(2)]
    procs.append(start_node("decode", model, tmp))
    yield procs
    for proc in procs:
        proc.stop()


def _free_blocks(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = nodes_pb2_grpc.NodeStatsServiceStub(channel)
        return stub.GetStats(nodes_pb2.GetStatsRequest(), timeout=10).num_free_blocks


def _wait_free(address: str, want: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while (free := _free_blocks(address)) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return free


def _request(rng, i, decode, peer, system):
    """Calls that ship (max_tokens > 1) and calls that finish at the first token (released at
    once); a third reuse a prefix the peer holds."""
    prompt = [rng.randrange(256) for _ in range(rng.randrange(40, 400))]
    hint = {}
    if i % 3 == 0:
        prompt = system + prompt[:40]
        hint = dict(peer_address=peer, peer_blocks=len(system) // 16)
    return nodes_pb2.PrefillRequest(
        request_id=f"c{i}",
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(
            temperature=0.0, max_tokens=rng.choice([1, 4]), ignore_eos=True
        ),
        decode_address=decode,
        **hint,
    )


async def _cancel_at_random(address, requests, rng) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = nodes_pb2_grpc.PrefillNodeServiceStub(channel)
        slots = asyncio.Semaphore(CONCURRENCY)

        async def one(request):
            # Half within the first 100 ms (queued, fetching, just added), half later.
            delay = rng.uniform(0, 0.1) if rng.random() < 0.5 else rng.uniform(0.1, 1.5)
            async with slots:
                call = stub.Prefill(request, timeout=30)
                await asyncio.sleep(delay)
                call.cancel()
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
                    await call

        await asyncio.gather(*(one(r) for r in requests))


def test_cancelled_prefills_release_their_blocks(nodes):
    p1, p2, d = nodes
    rng = random.Random(7)
    system = [rng.randrange(256) for _ in range(160)]  # ten full blocks, computed on the peer
    with grpc.insecure_channel(p2.address) as channel:
        nodes_pb2_grpc.PrefillNodeServiceStub(channel).Prefill(
            nodes_pb2.PrefillRequest(
                request_id="warm",
                prompt_token_ids=[*system, 1],
                sampling=common_pb2.SamplingParams(max_tokens=1),
                decode_address=d.address,
            ),
            timeout=60,
        )
    idle = {p.address: _free_blocks(p.address) for p in (p1, p2)}

    requests = [_request(rng, i, d.address, p2.address, system) for i in range(NUM_CALLS)]
    asyncio.run(_cancel_at_random(p1.address, requests, rng))

    for p in (p1, p2):
        assert _wait_free(p.address, idle[p.address]) == idle[p.address], p.address
