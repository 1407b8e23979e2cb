"""A node that stops answering (SIGSTOP: frozen, or its host gone quiet) does not burn its
requests' deadlines: the router's health checks find it silent within ~2-3 s; the prefills
waiting on a frozen prefill node are given up and retried on the other one (every request
completes, token-exact with transformers, and the node is used again once it thaws); a stream
on a frozen decode node fails with UNAVAILABLE at once (its KV lives there)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest
from support.processes import start_node, start_router
from support.reference import hf_greedy

from splitserve.client import AsyncClient, Client
from splitserve.models.tiny import write_random_checkpoint


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("stall")
    model = write_random_checkpoint(
        tmp_path / "m", seed=12, with_tokenizer=True, num_hidden_layers=2
    )
    nodes = [start_node("prefill", model, tmp_path) for _ in range(2)]
    nodes.append(start_node("decode", model, tmp_path))
    router = start_router(model, tmp_path, [nodes[0].address, nodes[1].address], [nodes[2].address])
    try:
        yield model, nodes, router
    finally:
        for proc in (router, *nodes):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.popen.pid, signal.SIGCONT)
            proc.stop()


def test_requests_on_a_frozen_prefill_node_are_retried_elsewhere(cluster):
    model, (frozen, _, _), router = cluster
    prompts = [[(7 * i + j) % 200 + 1 for j in range(300)] for i in range(8)]
    with Client(router.address) as client:  # warm: both prefill nodes have served
        for p in prompts[:2]:
            client.generate(prompt_token_ids=p[:20], max_tokens=1)

    async def burst():
        async with AsyncClient(router.address) as client:

            async def one(p):
                t0 = time.monotonic()
                out = await client.generate(prompt_token_ids=p, max_tokens=4, temperature=0.0,
                                            ignore_eos=True, timeout=60)  # fmt: skip
                return list(out.token_ids), time.monotonic() - t0

            # Frozen just before the burst: the router learns it only from its health checks
            # (~1-2 s), so about half the requests are sent to the frozen node meanwhile.
            os.kill(frozen.popen.pid, signal.SIGSTOP)
            return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(burst())
    for prompt, (tokens, seconds) in zip(prompts, results, strict=True):
        assert tokens == hf_greedy(model, prompt, 4)
        assert seconds < 20, f"a request took {seconds:.1f} s: it waited on the frozen node"
    assert "stopped answering health checks" in router.log.read_text()
    os.kill(frozen.popen.pid, signal.SIGCONT)
    time.sleep(3)  # the router sees it back
    with Client(router.address) as client:
        for p in prompts[:4]:
            reply = client.generate(prompt_token_ids=p[:50], max_tokens=2, ignore_eos=True)
            assert len(reply.token_ids) == 2


def test_a_decode_node_frozen_mid_stream_fails_the_stream_fast(cluster):
    """The tokens of a request live on its decode node: when that node freezes mid-stream the
    client hears UNAVAILABLE within seconds (retry the request), not at its deadline."""
    from splitserve.client import SplitserveError

    _, (_, _, decode), router = cluster
    with Client(router.address) as client:
        stream = client.stream(prompt_token_ids=[3] * 20, max_tokens=1000, ignore_eos=True,
                               temperature=0.0, timeout=120)  # fmt: skip
        chunks = iter(stream)
        next(chunks)
        next(chunks)  # decoding on the decode node
        os.kill(decode.popen.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(SplitserveError) as err:
            for _ in chunks:
                pass
        assert err.value.code.name == "UNAVAILABLE" and "health checks" in err.value.message
        assert time.monotonic() - t0 < 15
