"""Decode node process: load the model, serve DecodeNodeService (+ NodeStatsService, health,
reflection, metrics) until SIGTERM, then drain."""

from __future__ import annotations

import asyncio

from splitserve.decode_node.peer_caps import PeerLimits
from splitserve.decode_node.service import DecodeService
from splitserve.engine.api import NodeEngine
from splitserve.kvstore import ModelIdentity
from splitserve.runtime.config import NodeConfig
from splitserve.runtime.node import serve_node
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

SERVICE_NAME = nodes_pb2.DESCRIPTOR.services_by_name["DecodeNodeService"].full_name


def make_service(
    engine: NodeEngine, identity: ModelIdentity, config: NodeConfig, address: str
) -> DecodeService:
    limits = PeerLimits.of_node(
        config.max_transfers_per_peer,
        config.max_kv_share_per_peer,
        engine.info.num_usable_blocks,
    )
    return DecodeService(
        engine, identity, config.transfer_deadline_s, limits, config.stream_interval
    )


def serve(config: NodeConfig) -> None:
    asyncio.run(
        serve_node(
            config,
            "decode",
            make_service,
            nodes_pb2_grpc.add_DecodeNodeServiceServicer_to_server,
            SERVICE_NAME,
        )
    )
