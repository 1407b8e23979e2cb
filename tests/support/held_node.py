"""A real decode node (its service and engine, the tiny random model) served on a loopback port in
the test's own process, so that the engine thread can be held between two steps at will (a job
that waits on an event: no bet on the machine's speed)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import grpc

from splitserve.decode_node.server import make_service
from splitserve.engine.api import KVSpec
from splitserve.engine.local import LocalEngine
from splitserve.runtime.config import NodeConfig
from splitserve.runtime.node import build_engine
from splitserve.runtime.server import Server
from splitserve.transfer import GRPC
from splitserve.v1 import nodes_pb2_grpc


class HeldNode:
    """The decode node's service and engine, served on a loopback port with its stats and health
    services (a router can use it as it uses any decode node)."""

    def __init__(self, tmp_path, **config) -> None:
        from splitserve.models.tiny import write_random_checkpoint

        model = write_random_checkpoint(tmp_path / "model", with_tokenizer=False)
        self.config = NodeConfig(
            model_path=str(model), kv_cache_mb=16, kv_transfer="none", **config
        )
        self.core, self.identity = build_engine(self.config, prefill_only=False)
        self.address = ""

    @contextlib.asynccontextmanager
    async def serving(self):
        """Serve it; yields a DecodeNodeService stub on its own channel."""
        engine = self.engine = LocalEngine(self.core)
        engine.start()
        await engine.open_kv(
            KVSpec(role="decode", address="127.0.0.1:1", paths=(GRPC,), host="127.0.0.1")
        )
        self.service = make_service(engine, self.identity, self.config, "127.0.0.1:0")
        server = Server("127.0.0.1", 0, ("splitserve.v1.DecodeNodeService",))
        nodes_pb2_grpc.add_DecodeNodeServiceServicer_to_server(self.service, server.server)
        nodes_pb2_grpc.add_NodeStatsServiceServicer_to_server(self.service, server.server)
        await server.start()
        self.address = server.address
        try:
            async with grpc.aio.insecure_channel(self.address) as channel:
                yield nodes_pb2_grpc.DecodeNodeServiceStub(channel)
        finally:
            await server.server.stop(None)
            await engine.stop()

    async def settled(self, timeout_s: float = 60.0) -> None:
        """Wait until the node holds nothing of any request: no call, no request in the engine,
        every block free."""
        for _ in range(int(timeout_s / 0.05)):
            figures = await self.engine.figures()
            if (
                not self.service.calls
                and not self.service.inbox.live
                and not self.service.relay_tasks
                and figures.num_requests == 0
                and figures.num_free_blocks == figures.num_blocks
            ):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"the node did not settle: {figures}, calls {self.service.calls}")

    def hold(self) -> tuple[threading.Event, asyncio.Future]:
        """Hold the engine thread between two steps until the event is set."""
        gate = threading.Event()
        return gate, asyncio.ensure_future(self.engine.loop_engine.call(gate.wait, 60))
