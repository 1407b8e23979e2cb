"""Prefill node process: load the model, serve PrefillNode (+ health, reflection) until SIGTERM."""

from __future__ import annotations

import asyncio
import logging

from models.engine_loop import AsyncEngine
from prefill_node.service import PrefillService
from proto import nodes_pb2, nodes_pb2_grpc
from splitserve.config import NodeConfig
from splitserve.serving import Server, build_engine, index_publisher

logger = logging.getLogger(__name__)
SERVICE_NAME = nodes_pb2.DESCRIPTOR.services_by_name["PrefillNode"].full_name


async def _serve(config: NodeConfig) -> None:
    engine, identity = build_engine(config, prefill_only=True)
    logger.info("prefill node: %s", identity)
    loop_engine = AsyncEngine(engine)
    loop_engine.start()
    service = PrefillService(loop_engine, identity, config.transfer_deadline_s)
    server = Server(config.host, config.port, [SERVICE_NAME])
    nodes_pb2_grpc.add_PrefillNodeServicer_to_server(service, server.server)

    publisher = index_publisher(config, "prefill", loop_engine, identity, server.address)
    publishing = asyncio.create_task(publisher.run()) if publisher else None

    async def on_stop() -> None:
        if publishing is not None:
            publishing.cancel()
            await asyncio.gather(publishing, return_exceptions=True)
            await publisher.stop()
        await loop_engine.stop()
        for channel in service.channels.values():
            await channel.close()

    await server.run(config.port_file, on_stop)


def serve(config: NodeConfig) -> None:
    asyncio.run(_serve(config))
