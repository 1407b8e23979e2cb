"""The router's side of the Relay streams (``router.relay``) against scripted decode nodes
(``router_fakes``): one stream per decode node once it answered, every request of the router on
it; a read takes every token that arrived (a client that reads slowly gets fuller messages); a
node without Relay served by calls of their own; a stream that fails resumes its requests
elsewhere; a request's deadline ends it on the node.

The node's side (one message per engine step, cancels, the stream's end freeing every block):
tests/cluster/test_relay_stream.py."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from router_fakes import FakeNodes, FakeRegistry, all_given_back
from support.router_helpers import EOS, request
from test_router_stages import collect, front_for, settle

from splitserve.router.decode_stage import DecodeStage
from splitserve.router.relay import RelayCall
from splitserve.router.request import GenerateError
from splitserve.runtime.failure import Failure
from splitserve.v1 import nodes_pb2


async def warm(front, nodes: FakeNodes, decode_nodes: int) -> None:
    """Requests until every decode node's stream has answered (the first go as calls)."""
    for _ in range(20):
        if sum(1 for r in nodes.relays if r._answered.done()) >= decode_nodes:
            await settle()
            return
        await collect(front, prompt="warm")
    raise AssertionError("the relay streams never opened")


def test_requests_share_one_relay_stream_per_decode_node():
    async def main():
        nodes = FakeNodes(max_delay_s=0.01)
        front, registry = front_for(nodes, num_decode=2)
        await warm(front, nodes, 2)
        opened = len(nodes.relays)
        prompts = [f"p{i}-" + "x" * (i % 8) for i in range(16)]
        results = await asyncio.gather(*(collect(front, prompt=p) for p in prompts))
        for prompt, steps in zip(prompts, results, strict=True):
            assert "".join(s.delta.text for s in steps) == prompt[::-1]
            assert steps[-1].delta.finish_reason == "stop"
        assert len(nodes.relays) == opened == 2  # no stream more: all 16 went on the two
        assert sum(len(r.started) for r in nodes.relays) >= len(prompts)
        await settle()
        assert not all_given_back(registry) and not nodes.held

    asyncio.run(main())


def feed(call: RelayCall, tokens: list[int], finish: str = "", cached: int = 0) -> None:
    call.feed(
        nodes_pb2.RelayOutput(
            request_id=call.request_id, token_ids=tokens, finish_reason=finish, cached_tokens=cached
        )
    )


def test_a_read_takes_every_token_that_arrived_and_a_direct_first_token_alone():
    async def main():
        nodes = FakeNodes()
        registry = FakeRegistry(nodes)
        stage = DecodeStage(registry)
        d = registry.decode.nodes[0]
        stage.open(d, "warm", time.monotonic() + 5).close()  # a call of its own; opens the stream
        await settle()
        channel = stage._channel(d)
        assert channel is not None and channel.ready

        direct = channel.start(
            nodes_pb2.RelayCommand(generate=nodes_pb2.GenerateOnNodeRequest(request_id="g")),
            "g",
            time.monotonic() + 5,
            first_alone=True,
        )
        feed(direct, [11], cached=4)
        feed(direct, [12, 13])
        feed(direct, [14])
        first = await direct.read()
        assert (first.token_ids, first.cached_tokens, first.finish_reason) == ([11], 4, "")
        assert (await direct.read()).token_ids == [12, 13, 14]  # what came meanwhile, at once
        feed(direct, [15, EOS], finish="stop")
        last = await direct.read()
        assert (last.token_ids, last.finish_reason) == ([15, EOS], "stop")
        direct.close()

        decode = channel.start(
            nodes_pb2.RelayCommand(decode=nodes_pb2.DecodeRequest(request_id="d")),
            "d",
            time.monotonic() + 5,
            first_alone=False,
        )
        feed(decode, [1])
        feed(decode, [2, 3], finish="length")
        whole = await decode.read()
        assert (whole.token_ids, whole.finish_reason) == ([1, 2, 3], "length")
        decode.close()
        await settle()
        assert not channel._calls
        relay = nodes.relays[0]
        assert "g" not in relay.cancels and "d" not in relay.cancels  # they ended on the node

    asyncio.run(main())


def test_a_node_without_relay_is_marked_down_and_its_request_fails_saying_why():
    # Tokens come only on the Relay stream: a node of an older version serves no request.
    async def main():
        nodes = FakeNodes(max_delay_s=0.01)
        nodes.relay_implemented = False
        front, registry = front_for(nodes, num_decode=1)
        with pytest.raises(GenerateError) as err:
            await collect(front, prompt="abc")
        assert err.value.code == Failure.UNAVAILABLE
        assert "serves no Relay stream" in err.value.message
        d = registry.decode.nodes[0]
        assert not d.is_up(time.monotonic()) and "UNIMPLEMENTED" in d.last_error
        await settle()
        assert not all_given_back(registry)  # (the KV shipped to it: freed at its deadline there)

    asyncio.run(main())


def test_a_failed_stream_resumes_its_requests_on_another_decode_node():
    async def main():
        nodes = FakeNodes(max_delay_s=0.02)
        front, registry = front_for(nodes, num_decode=2)
        await warm(front, nodes, 2)
        prompt = "abcdefghijklmn"
        before = len(nodes.prefill_calls)
        runs = [asyncio.ensure_future(collect(front, prompt=prompt)) for _ in range(4)]
        # Every request is decoding on some stream: then both streams fail (their nodes went).
        while sum(len(r._handlers) for r in nodes.relays) < len(runs):
            await asyncio.sleep(0.005)
        for relay in list(nodes.relays):
            relay.fail(grpc.StatusCode.UNAVAILABLE, "connection reset")
        for steps in await asyncio.gather(*runs):
            # (The scripted model is no language model: a resumed prompt, the prompt and the
            # tokens sent, is answered differently; test_decode_resume checks the real one.)
            assert steps[-1].delta.finish_reason in ("stop", "length") and steps[-1].usage
        assert len(nodes.prefill_calls) - before == 2 * len(runs), nodes.prefill_calls[before:]
        await settle()
        assert not all_given_back(registry)

    asyncio.run(main())


def test_a_request_past_its_deadline_fails_and_is_cancelled_on_the_node():
    async def main():
        nodes = FakeNodes(max_delay_s=0.5)  # the node is slow to answer
        registry = FakeRegistry(nodes)
        stage = DecodeStage(registry)
        d = registry.decode.nodes[0]
        stage.open(d, "warm", time.monotonic() + 5).close()
        await settle()
        nodes.held["r"] = list(range(5, 60))
        session = stage.claim(d, None, "r")
        call = session.stream(time.monotonic() + 0.05)
        assert isinstance(call, RelayCall)
        with pytest.raises(GenerateError) as err:
            while True:
                await call.read()
        assert err.value.code == Failure.DEADLINE
        session.close()
        await settle()
        assert "r" in nodes.relays[0].cancels and not nodes.held
        assert not all_given_back(registry)

    asyncio.run(main())


def test_a_client_that_reads_slowly_gets_every_ready_token_in_one_message():
    async def main():
        nodes = FakeNodes()
        front, registry = front_for(nodes, num_decode=1)
        await warm(front, nodes, 1)
        relay = nodes.relays[0]
        prompt = "abcdefghijkl"  # 12 tokens and EOS: the first from P, six messages from D
        run = front.run(request(prompt=prompt), "client", 10)
        _, first = await anext(run)
        assert len(first.delta.token_ids) == 1  # the first token alone, at once
        while relay._handlers or not relay.started:  # D has sent every message meanwhile
            await asyncio.sleep(0.005)
        await settle()
        rest = [step async for _, step in run]
        assert len(rest) == 1 and len(rest[0].delta.token_ids) == len(prompt)
        assert first.delta.text + rest[0].delta.text == prompt[::-1]
        assert not all_given_back(registry)

    asyncio.run(main())
