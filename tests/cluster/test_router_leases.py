"""Two routers in front of one real decode node share its capacity through the node's leases
(decode_node.leases): together they never send it more requests than one router may (its
max_num_seqs times the routers' overcommit), and a router alone in using it may fill far more
than a static half. The engine is held between steps, so requests stay in flight for as long as
the test needs: nothing is timed."""

from __future__ import annotations

import asyncio

import grpc
from support.held_node import HeldNode
from support.router_helpers import request_message

from splitserve.router.config import RouterConfig
from splitserve.router.request import ModelInfo
from splitserve.router.server import start_router
from splitserve.v1 import router_pb2_grpc

MAX_NUM_SEQS = 4
OVERCOMMIT = 1.5  # RouterConfig's default decode_overcommit
WHOLE = int(MAX_NUM_SEQS * OVERCOMMIT)  # requests all routers together may have on the node
PER_ROUTER = 8
MAX_TOKENS = 4


async def until(condition, what: str, timeout_s: float = 60.0) -> None:
    """Wait for ``condition()`` (a state the test sets up, not a duration)."""
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never happened: {what}")


def test_two_routers_share_one_nodes_slots_without_over_admitting(tmp_path):
    node = HeldNode(tmp_path, max_num_seqs=MAX_NUM_SEQS)

    async def scenario():
        async with node.serving():
            service = node.service
            live: set[str] = set()
            most = [0]  # the most requests the node held at once
            start, end = service.start_generate, service.end

            def start_generate(request, sink):
                live.add(request.request_id)
                most[0] = max(most[0], len(live))
                return start(request, sink)

            async def ended(rid, finished):
                try:
                    await end(rid, finished)
                finally:
                    live.discard(rid)

            service.start_generate = start_generate
            service.end = ended
            info = node.engine.info
            model = ModelInfo(None, info.vocab_size, info.max_model_len)
            routers = []
            for _ in range(2):
                config = RouterConfig("unused", (), (node.address,), port=0)
                server, registry = await start_router(config, model)
                await registry.check_all()  # verifies the node: it grants leases
                channel = grpc.aio.insecure_channel(server.address)
                routers.append((server, registry, channel))
            pools = [registry.decode for _, registry, _ in routers]
            (a,), (b,) = pools[0].nodes, pools[1].nodes
            assert a.lease is not None and b.lease is not None, "the node grants no leases"

            async def one(channel, i: int) -> list[int]:
                stub = router_pb2_grpc.RouterServiceStub(channel)
                prompt = list(range(5 + i, 20 + i))
                sampling = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0}
                req = request_message(prompt_token_ids=prompt, sampling=sampling)
                messages = [m async for m in stub.Generate(req, timeout=120)]
                return [t for m in messages for t in m.token_ids]

            gate, held = node.hold()
            try:
                first = [asyncio.ensure_future(one(routers[0][2], i)) for i in range(PER_ROUTER)]
                # Alone in using the node, router A fills more than a static half of it (its lease
                # grows while B, idle, wants only a little).
                await until(
                    lambda: a.in_flight > WHOLE // 2 and pools[0].waiting > 0,
                    f"router A holding more than {WHOLE // 2} requests",
                )
                second = [asyncio.ensure_future(one(routers[1][2], i)) for i in range(PER_ROUTER)]
                await until(
                    lambda: pools[1].waiting > 0 and len(live) == a.in_flight + b.in_flight,
                    "router B's requests waiting, every admitted one on the node",
                )
                assert a.in_flight + b.in_flight <= WHOLE, (a.in_flight, b.in_flight)
            finally:
                gate.set()
                await held
            answers = await asyncio.gather(*first, *second)
            assert all(len(tokens) == MAX_TOKENS for tokens in answers)
            # However the leases moved while the requests finished and the waiting ones went, the
            # node never held more than the two routers together may send it.
            assert most[0] <= WHOLE, f"the node held {most[0]} requests at once, more than {WHOLE}"
            assert a.in_flight == b.in_flight == 0 and not a.kv.used and not b.kv.used
            for server, registry, channel in routers:
                await channel.close()
                await server.stop(0)
                await registry.close()
            await node.settled()

    asyncio.run(scenario())


def test_a_stream_opened_before_the_node_was_known_to_lease_starts_asking(tmp_path):
    """A request sent before the router's first health round opens the node's Relay stream
    without a lease; once the node is found to grant leases the router must ask on that stream
    (else its share stays 0 and every later request waits for ever)."""
    node = HeldNode(tmp_path, max_num_seqs=MAX_NUM_SEQS)

    async def scenario():
        async with node.serving():
            info = node.engine.info
            model = ModelInfo(None, info.vocab_size, info.max_model_len)
            config = RouterConfig("unused", (), (node.address,), port=0)
            server, registry = await start_router(config, model)
            channel = grpc.aio.insecure_channel(server.address)
            stub = router_pb2_grpc.RouterServiceStub(channel)
            sampling = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0}
            try:
                for i in range(2):
                    if i == 1:
                        await registry.check_all()  # the node is verified: it grants leases
                        assert registry.decode.nodes[0].lease is not None
                    req = request_message(prompt_token_ids=list(range(5, 20)), sampling=sampling)
                    reply = await stub.Complete(req, timeout=30)
                    assert len(reply.token_ids) == MAX_TOKENS
            finally:
                await channel.close()
                await server.stop(0)
                await registry.close()
            await node.settled()

    asyncio.run(scenario())
