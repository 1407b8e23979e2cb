"""Decode node process: load the model, serve DecodeNode (+ health, reflection, metrics) until
SIGTERM, then drain."""

from __future__ import annotations

import asyncio

from decode_node.service import DecodeService
from proto import nodes_pb2, nodes_pb2_grpc
from splitserve.config import NodeConfig
from splitserve.serving import serve_node

SERVICE_NAME = nodes_pb2.DESCRIPTOR.services_by_name["DecodeNode"].full_name


def serve(config: NodeConfig) -> None:
    asyncio.run(
        serve_node(
            config,
            "decode",
            lambda engine, identity, cfg: DecodeService(engine, identity, cfg.transfer_deadline_s),
            nodes_pb2_grpc.add_DecodeNodeServicer_to_server,
            SERVICE_NAME,
        )
    )
