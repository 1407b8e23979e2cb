"""What the prefill stage hands on: the request prefilled on some node (``Prefilled``), and the
nodes an attempt already tried (``Tried``)."""

from __future__ import annotations

from typing import NamedTuple

from splitserve.router.decode_stage import DecodeCall
from splitserve.router.kv_budget import KVDemand
from splitserve.router.pool import Node
from splitserve.v1 import nodes_pb2


class Prefilled(NamedTuple):
    response: nodes_pb2.PrefillResponse  # direct: made from D's first message
    decode_node: Node  # still counted as in flight: the caller releases it
    node_request_id: str
    stream: DecodeCall | None = None  # direct: D's Generate stream, its first message read
    demand: KVDemand | None = None  # D's KV blocks charged to it: released with D
    admitted_at: float = 0.0  # when admission let it go to the pools (time.monotonic())


class Tried(NamedTuple):
    """The nodes a request already tried: those that failed and those that only refused."""

    unreachable: set[Node]
    busy: set[Node]
