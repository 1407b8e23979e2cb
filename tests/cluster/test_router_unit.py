"""The router's orchestration against fake prefill/decode servicers on loopback (real gRPC, fake
model): relay, spreading, stop strings, cancels, retries, dead nodes, deadlines, health checks.
The router's pieces alone: test_router_output.py, test_router_pick.py, test_router_request.py."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from support.relay import serve_relay
from support.router_helpers import EOS, MODEL, TOKENIZER, byte_ids, request_message

from splitserve.router.config import RouterConfig
from splitserve.router.server import start_router
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc, router_pb2_grpc


class FakeCluster:
    """A fake 'model' answering the prompt's bytes in reverse, then EOS; shared state lets the
    fake prefill 'ship' into the fake decode node."""

    def __init__(self) -> None:
        self.transferred: dict[str, list[int]] = {}  # decode side: request id -> tokens to send
        self.prefill_calls: list[tuple[str, str]] = []  # (prefill address, decode address)
        self.refuse = 0  # the next n Prefill calls answer RESOURCE_EXHAUSTED
        self.stopped = 0  # the next n Prefill calls end CANCELLED, as a node's server stopping
        self.decode_cancelled: list[str] = []
        self.decode_delay_s = 0.0
        self.live_decode: set[str] = set()
        self.generate_calls: list[str] = []  # decode addresses of the generate commands (direct)
        self.refuse_generate = 0  # the next n generate commands fail RESOURCE_EXHAUSTED


class FakePrefill(nodes_pb2_grpc.PrefillNodeServiceServicer):
    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster
        self.address = ""

    async def Prefill(self, request, context):
        c = self.cluster
        c.prefill_calls.append((self.address, request.decode_address))
        if request.decode_address not in c.live_decode:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode node unreachable")
        if c.refuse:
            c.refuse -= 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free blocks")
        if c.stopped:
            c.stopped -= 1
            await context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
        answer = [*list(request.prompt_token_ids)[::-1], EOS]
        answer = answer[: request.sampling.max_tokens]
        finish = ""
        if len(answer) == 1:
            finish = "stop" if answer[0] == EOS else "length"
        else:
            c.transferred[request.request_id] = answer[1:]
        return nodes_pb2.PrefillResponse(
            first_token_id=answer[0], finish_reason=finish, cached_tokens=3
        )


class FakeDecode(nodes_pb2_grpc.DecodeNodeServiceServicer):
    """Serves each request of the router's Relay stream with a generator of its own."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster
        self.address = ""

    async def Relay(self, request_iterator, context):
        async for batch in serve_relay(request_iterator, context, self._request):
            yield batch

    def _request(self, command, context):
        if command.HasField("generate"):
            return self._generate(command.generate, context)
        return self._decode(command.decode, context)

    async def _generate(self, request, context):
        """The direct route: the same fake answer, the first token alone with cached_tokens."""
        c = self.cluster
        c.generate_calls.append(self.address)
        if c.refuse_generate:
            c.refuse_generate -= 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free blocks")
        answer = [*list(request.prompt_token_ids)[::-1], EOS][: request.sampling.max_tokens]
        try:
            for i, token in enumerate(answer):
                if i:
                    await asyncio.sleep(c.decode_delay_s)
                last = i == len(answer) - 1
                finish = ("stop" if token == EOS else "length") if last else ""
                yield nodes_pb2.RelayOutput(
                    token_ids=[token], finish_reason=finish, cached_tokens=5 if i == 0 else 0
                )
        except asyncio.CancelledError:
            c.decode_cancelled.append(request.request_id)
            raise

    async def _decode(self, request, context):
        tokens = self.cluster.transferred.pop(request.request_id, None)
        if tokens is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown request")
            return
        try:
            for i in range(0, len(tokens), 2):
                await asyncio.sleep(self.cluster.decode_delay_s)
                last = i + 2 >= len(tokens)
                finish = ("stop" if tokens[-1] == EOS else "length") if last else ""
                yield nodes_pb2.RelayOutput(token_ids=tokens[i : i + 2], finish_reason=finish)
        except asyncio.CancelledError:
            self.cluster.decode_cancelled.append(request.request_id)
            raise


async def start_fake_node(servicer, add) -> tuple[grpc.aio.Server, str]:
    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.aio.server()
    add(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def unused_address() -> str:
    from splitserve.launcher import free_port

    return f"127.0.0.1:{free_port()}"


async def with_cluster(
    test, num_prefill=2, num_decode=2, dead_prefill=0, dead_decode=0, **router_options
):
    cluster = FakeCluster()
    servers, prefill, decode = [], [], []
    for _ in range(num_prefill):
        servicer = FakePrefill(cluster)
        server, servicer.address = await start_fake_node(
            servicer, nodes_pb2_grpc.add_PrefillNodeServiceServicer_to_server
        )
        servers.append(server)
        prefill.append(servicer.address)
    for _ in range(num_decode):
        servicer = FakeDecode(cluster)
        server, address = await start_fake_node(
            servicer, nodes_pb2_grpc.add_DecodeNodeServiceServicer_to_server
        )
        servicer.address = address
        servers.append(server)
        decode.append(address)
        cluster.live_decode.add(address)
    prefill += [unused_address() for _ in range(dead_prefill)]
    decode += [unused_address() for _ in range(dead_decode)]
    config = RouterConfig("unused", tuple(prefill), tuple(decode), **router_options)
    router, registry = await start_router(config, MODEL)
    channel = grpc.aio.insecure_channel(router.address)
    try:
        await test(router_pb2_grpc.RouterServiceStub(channel), cluster, registry)
    finally:
        await channel.close()
        await router.stop(0)
        await registry.close()
        for server in servers:
            await server.stop(0)


async def collect(stub, **kwargs):
    return [msg async for msg in stub.Generate(request_message(**kwargs), timeout=10)]


def test_router_relays_prefill_then_decode_with_text_and_usage():
    async def test(stub, cluster, registry):
        prompt = "ab€"
        msgs = await collect(stub, prompt=prompt, sampling={"max_tokens": 50})
        tokens = [t for m in msgs for t in m.token_ids]
        assert tokens == [*byte_ids(prompt)[::-1], EOS]
        # "€" reversed is invalid UTF-8: it still comes through, as U+FFFD
        assert "".join(m.text for m in msgs) == TOKENIZER.decode(tokens, skip_special_tokens=True)
        last = msgs[-1]
        assert last.finish_reason == "stop" and all(not m.finish_reason for m in msgs[:-1])
        assert last.usage.prompt_tokens == len(prompt.encode())
        assert last.usage.completion_tokens == len(tokens) and last.usage.cached_tokens == 3
        assert last.usage.time_to_first_token_s > 0
        assert all(m.request_id == last.request_id for m in msgs)

    asyncio.run(with_cluster(test))


def test_requests_spread_over_nodes_and_finish_at_the_first_token_without_decode():
    async def test(stub, cluster, registry):
        for _ in range(4):
            await collect(stub, prompt="xy", sampling={"max_tokens": 4})
        assert len({p for p, _ in cluster.prefill_calls}) == 2
        assert len({d for _, d in cluster.prefill_calls}) == 2
        msgs = await collect(stub, prompt="xy", sampling={"max_tokens": 1})
        assert [m.finish_reason for m in msgs] == ["length"] and msgs[0].token_ids == [ord("y")]
        assert not cluster.transferred

    asyncio.run(with_cluster(test))


def test_stop_string_ends_the_stream_and_cancels_the_decode_call():
    async def test(stub, cluster, registry):
        cluster.decode_delay_s = 0.02
        msgs = await collect(stub, prompt="0123456789abcdef"[::-1], stop=["45"])
        assert "".join(m.text for m in msgs) == "0123"
        assert msgs[-1].finish_reason == "stop"
        await asyncio.sleep(0.2)
        assert len(cluster.decode_cancelled) == 1

    asyncio.run(with_cluster(test))


def test_client_cancel_reaches_the_decode_node():
    async def test(stub, cluster, registry):
        cluster.decode_delay_s = 0.05
        call = stub.Generate(request_message(prompt="z" * 30, sampling={"max_tokens": 30}))
        await call.read()
        call.cancel()
        for _ in range(50):
            if cluster.decode_cancelled:
                break
            await asyncio.sleep(0.02)
        assert len(cluster.decode_cancelled) == 1
        assert all(n.in_flight == 0 for n in registry.prefill.nodes + registry.decode.nodes)

    asyncio.run(with_cluster(test))


def test_full_nodes_are_retried_elsewhere():
    async def test(stub, cluster, registry):
        cluster.refuse = 2
        msgs = await collect(stub, prompt="ab")
        assert msgs[-1].finish_reason == "stop"
        assert len(cluster.prefill_calls) == 3
        cluster.refuse = 10
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, prompt="ab")
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    asyncio.run(with_cluster(test))


def test_a_call_a_stopping_node_cancels_is_retried_elsewhere():
    """A node whose server stops mid-call ends it CANCELLED: that is the node going away, not
    the client cancelling, so the request is retried on another node."""

    async def test(stub, cluster, registry):
        cluster.stopped = 1
        msgs = await collect(stub, prompt="ab")
        assert msgs[-1].finish_reason == "stop"
        assert len(cluster.prefill_calls) == 2

    asyncio.run(with_cluster(test))


def test_dead_nodes_are_marked_down_and_avoided():
    async def test(stub, cluster, registry):
        for _ in range(6):  # a request meeting a dead node retries on a live one
            msgs = await collect(stub, prompt="ab")
            assert msgs[-1].finish_reason == "stop"
        now = time.monotonic()
        live_p, dead_p = registry.prefill.nodes
        live_d, dead_d = registry.decode.nodes
        assert live_p.is_up(now) and live_d.is_up(now)
        assert not dead_p.is_up(now) and not dead_d.is_up(now)
        calls = len(cluster.prefill_calls)
        for _ in range(4):  # while they are down, no attempt goes to them
            await collect(stub, prompt="ab")
        assert cluster.prefill_calls[calls:] == [(live_p.address, live_d.address)] * 4

    asyncio.run(with_cluster(test, num_prefill=1, num_decode=1, dead_prefill=1, dead_decode=1))


def test_no_reachable_node_is_unavailable_and_bad_input_touches_no_node():
    async def test(stub, cluster, registry):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, prompt="hi", sampling={"temperature": -1.0})
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "temperature" in err.value.details()
        assert not cluster.prefill_calls and not cluster.generate_calls
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, prompt="hi")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no decode node is reachable" in err.value.details()

    asyncio.run(with_cluster(test, num_prefill=1, num_decode=0, dead_decode=2))


def test_dead_prefill_pool_is_served_by_the_decode_node_directly():
    async def test(stub, cluster, registry):
        msgs = await collect(stub, prompt="hi")  # both prefill nodes fail: then direct
        assert [t for m in msgs for t in m.token_ids] == [*byte_ids("hi")[::-1], EOS]
        assert len(cluster.generate_calls) == 1
        assert all(not n.is_up(time.monotonic()) for n in registry.prefill.nodes)
        await collect(stub, prompt="hi")  # the prefill pool is down: direct at once
        assert len(cluster.generate_calls) == 2
        assert all(n.in_flight == 0 for n in registry.prefill.nodes + registry.decode.nodes)

    asyncio.run(with_cluster(test, num_prefill=0, num_decode=1, dead_prefill=2))


def test_decode_only_router_sends_every_request_direct_with_usage():
    async def test(stub, cluster, registry):
        msgs = await collect(stub, prompt="abc", sampling={"max_tokens": 50})
        assert [t for m in msgs for t in m.token_ids] == [*byte_ids("abc")[::-1], EOS]
        last = msgs[-1]
        assert last.finish_reason == "stop" and last.usage.cached_tokens == 5
        assert last.usage.prompt_tokens == 3 and last.usage.completion_tokens == 4
        assert last.usage.time_to_first_token_s > 0
        msgs = await collect(stub, prompt="xy", sampling={"max_tokens": 1})  # done at once
        assert [m.finish_reason for m in msgs] == ["length"] and msgs[0].token_ids == [ord("y")]
        assert len(cluster.generate_calls) == 2 and not cluster.prefill_calls
        assert registry.decode.nodes[0].in_flight == 0

    asyncio.run(with_cluster(test, num_prefill=0, num_decode=1))


def test_short_prompts_go_direct_and_long_ones_through_prefill():
    async def test(stub, cluster, registry):
        await collect(stub, prompt="a" * 8)
        await collect(stub, prompt="b" * 9)
        assert len(cluster.generate_calls) == 1 and len(cluster.prefill_calls) == 1
        cluster.refuse_generate = 1  # a full decode node: retried on the other one
        msgs = await collect(stub, prompt="c" * 4)
        assert msgs[-1].finish_reason == "stop"
        assert len(set(cluster.generate_calls[1:])) == 2 and len(cluster.prefill_calls) == 1
        assert all(n.in_flight == 0 for n in registry.prefill.nodes + registry.decode.nodes)

    asyncio.run(with_cluster(test, num_prefill=1, num_decode=2, direct_prefill_tokens=8))


def test_a_cancelled_direct_stream_reaches_the_decode_node():
    async def test(stub, cluster, registry):
        cluster.decode_delay_s = 0.05
        call = stub.Generate(request_message(prompt="z" * 30, sampling={"max_tokens": 30}))
        await call.read()
        call.cancel()
        for _ in range(50):
            if cluster.decode_cancelled:
                break
            await asyncio.sleep(0.02)
        assert len(cluster.decode_cancelled) == 1 and not cluster.prefill_calls
        assert registry.decode.nodes[0].in_flight == 0

    asyncio.run(with_cluster(test, num_prefill=0, num_decode=1))


def test_client_deadline_reaches_the_nodes():
    async def test(stub, cluster, registry):
        cluster.decode_delay_s = 0.1
        call = stub.Generate(
            request_message(prompt="q" * 30, sampling={"max_tokens": 30}), timeout=0.4
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            _ = [msg async for msg in call]
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(50):
            if cluster.decode_cancelled:
                break
            await asyncio.sleep(0.02)
        assert len(cluster.decode_cancelled) == 1
        msgs = await collect(stub, prompt="ok")  # the next request is served
        assert msgs[-1].finish_reason == "stop"

    asyncio.run(with_cluster(test, num_prefill=1, num_decode=1))


def test_health_checks_mark_dead_nodes_down_and_live_ones_up():
    async def test(stub, cluster, registry):
        live = registry.prefill.nodes[0]
        registry.prefill.mark_down(live, "pretend")
        await registry.check_all()
        now = time.monotonic()
        assert live.is_up(now) and registry.decode.nodes[0].is_up(now)
        assert not registry.prefill.nodes[1].is_up(now)
        assert "health check" in registry.prefill.nodes[1].last_error

    asyncio.run(with_cluster(test, num_prefill=1, num_decode=1, dead_prefill=1))


def test_a_registry_that_lost_every_node_of_a_role_is_not_believed_at_once(monkeypatch):
    """Redis restarted empty: the registry says there are no decode nodes until they register
    again (within a heartbeat). The router keeps the known ones meanwhile; nodes gone for good
    are dropped after the grace."""
    import asyncio as _asyncio

    from splitserve.kvstore.redis_index import NodeInfo
    from splitserve.router import registry as registry_module
    from splitserve.router.registry import NodeRegistry

    async def run():
        reg = NodeRegistry((), ())
        live = [NodeInfo("d1", "decode", "d1:1", 10, 10, 0, 0),
                NodeInfo("p1", "prefill", "p1:1", 10, 10, 0, 0)]  # fmt: skip
        await reg.sync(live)
        assert [n.address for n in reg.decode.nodes] == ["d1:1"]
        await reg.sync([])  # Redis came back empty
        assert [n.address for n in reg.decode.nodes] == ["d1:1"]
        assert [n.address for n in reg.prefill.nodes] == ["p1:1"]
        await reg.sync(live[1:])  # one role back, the other still empty
        assert [n.address for n in reg.decode.nodes] == ["d1:1"]
        monkeypatch.setattr(registry_module, "EMPTY_GRACE_S", 0.0)
        await reg.sync(live[1:])  # past the grace: gone for good
        assert reg.decode.nodes == []
        await reg.close()

    _asyncio.run(run())
