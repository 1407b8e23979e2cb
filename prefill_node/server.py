"""Prefill node process: load the model, serve PrefillNodeService (+ NodeStatsService, health,
reflection, metrics) until SIGTERM, then drain."""

from __future__ import annotations

import asyncio

from splitserve.engine.api import NodeEngine
from splitserve.kvstore import ModelIdentity
from splitserve.prefill_node.service import PrefillService
from splitserve.runtime.config import NodeConfig
from splitserve.runtime.node import serve_node
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

SERVICE_NAME = nodes_pb2.DESCRIPTOR.services_by_name["PrefillNodeService"].full_name


def make_service(
    engine: NodeEngine, identity: ModelIdentity, config: NodeConfig, address: str
) -> PrefillService:
    # The transfer sides (a sender shipping to decode nodes, a sender serving peers' fetches
    # and a receiver of fetched blocks: engine.local) are open where the engine runs.
    return PrefillService(engine, identity, config.transfer_deadline_s, config.kv_stream_min_tokens)


def serve(config: NodeConfig) -> None:
    asyncio.run(
        serve_node(
            config,
            "prefill",
            make_service,
            nodes_pb2_grpc.add_PrefillNodeServiceServicer_to_server,
            SERVICE_NAME,
        )
    )
