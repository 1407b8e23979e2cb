"""Decode node process: load the model, serve DecodeNodeService (+ NodeStatsService, health,
reflection, metrics) until SIGTERM, then drain."""

from __future__ import annotations

import asyncio
import uuid

from splitserve.decode_node.peer_caps import PeerLimits
from splitserve.decode_node.service import DecodeService
from splitserve.engine.loop import AsyncEngine
from splitserve.kvstore import ModelIdentity
from splitserve.runtime.config import NodeConfig
from splitserve.runtime.node import kv_security, serve_node, transfer_paths
from splitserve.transfer import open_receiver
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

SERVICE_NAME = nodes_pb2.DESCRIPTOR.services_by_name["DecodeNodeService"].full_name


def make_service(
    engine: AsyncEngine, identity: ModelIdentity, config: NodeConfig, address: str
) -> DecodeService:
    # Always a receiver: gRPC bytes go through its reservations too; the others only if allowed
    # (listening on the advertised host). A new id per process life: a sender still holding a
    # restarted node's old pool mapping or pair group never mistakes it for this one.
    receiver = open_receiver(
        engine.kv_port.kv_pool,
        f"{address}#{uuid.uuid4().hex[:8]}",
        paths=transfer_paths(config),
        host=config.advertised_host(),
        security=kv_security(config),
    )
    limits = PeerLimits.of_node(
        config.max_transfers_per_peer,
        config.max_kv_share_per_peer,
        engine.kv_port.num_usable_blocks,
    )
    return DecodeService(engine, identity, config.transfer_deadline_s, receiver, limits)


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
