"""A draining decode node waits for every call it has accepted, including one that has not yet
reached the engine: the real node service and engine behind a real gRPC server, in one process so
the engine thread can be held busy at will. And the node offers its receiver's endpoint only
when it has a transfer path besides the gRPC bytes."""

import asyncio
import time

import grpc
import pytest
from support.relay import relay_one, tokens_of

from splitserve.decode_node.server import make_service
from splitserve.engine.api import KVSpec
from splitserve.engine.local import LocalEngine
from splitserve.runtime.config import NodeConfig
from splitserve.runtime.node import build_engine
from splitserve.transfer import GRPC, TCP
from splitserve.v1 import common_pb2, nodes_pb2, nodes_pb2_grpc


def _spec(*paths: str) -> KVSpec:
    return KVSpec(role="decode", address="127.0.0.1:1", paths=paths, host="127.0.0.1")


def test_drain_waits_for_a_call_not_yet_in_the_engine(tmp_path):
    from splitserve.models.tiny import write_random_checkpoint

    model = write_random_checkpoint(tmp_path / "model", with_tokenizer=False)
    config = NodeConfig(model_path=str(model), kv_cache_mb=16, kv_transfer="none")
    core, identity = build_engine(config, prefill_only=False)

    async def scenario():
        engine = LocalEngine(core)
        engine.start()
        await engine.open_kv(_spec(GRPC))
        service = make_service(engine, identity, config, "127.0.0.1:0")
        server = grpc.aio.server()
        nodes_pb2_grpc.add_DecodeNodeServiceServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = nodes_pb2_grpc.DecodeNodeServiceStub(channel)
                # The engine thread is busy for a while: the call's add_request waits behind it,
                # so the call is accepted but nothing of it is in the engine yet.
                busy = asyncio.ensure_future(engine.loop_engine.call(time.sleep, 1.0))
                await asyncio.sleep(0.1)
                request = nodes_pb2.GenerateOnNodeRequest(
                    request_id="r1",
                    prompt_token_ids=list(range(3, 40)),
                    sampling=common_pb2.SamplingParams(max_tokens=6, ignore_eos=True),
                )
                command = nodes_pb2.RelayCommand(generate=request)
                tokens = asyncio.ensure_future(relay_one(stub, command, timeout=60))
                await asyncio.sleep(0.3)  # the request has started; the engine is still busy
                assert not core.requests
                service.draining = True
                await service.drain(30)
                # The call could not have finished before the engine thread was free again: a
                # drain that ended earlier did not wait for it.
                assert busy.done(), "the drain ended while a request was still in flight"
                assert len(tokens_of(await tokens)) == 6
                assert not service.inbox.live  # the node's own table of requests in the engine
        finally:
            await server.stop(None)
            await engine.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize(("paths", "offered"), [((GRPC,), False), ((TCP, GRPC), True)])
def test_the_endpoint_is_offered_only_with_a_path_besides_bytes(tmp_path, paths, offered):
    from splitserve.models.tiny import write_random_checkpoint

    model = write_random_checkpoint(tmp_path / "model", with_tokenizer=False)
    config = NodeConfig(model_path=str(model), kv_cache_mb=16, kv_transfer="none")
    core, identity = build_engine(config, prefill_only=False)

    async def scenario():
        engine = LocalEngine(core)
        engine.start()
        try:
            sides = await engine.open_kv(_spec(*paths))
            service = make_service(engine, identity, config, "127.0.0.1:1")
            stats = await service.GetStats(nodes_pb2.GetStatsRequest(), None)
            assert bool(stats.transfer_endpoint) is offered
            assert stats.transfer_endpoint == sides.rx_endpoint == service.inbox.endpoint
            assert service.inbox.rx_id == sides.rx_id and sides.rx_id.startswith("127.0.0.1:1#")
            assert stats.num_free_blocks == stats.num_blocks == engine.info.num_usable_blocks
        finally:
            await engine.stop()

    asyncio.run(scenario())
