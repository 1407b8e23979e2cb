"""The one mapping between the router's failures (``router/errors.py``) and gRPC status codes:
the gRPC front answers with ``to_grpc``; the stages that call nodes read a node's status with
``from_grpc``."""

from __future__ import annotations

import grpc

from splitserve.router.errors import Failure


def to_grpc(failure: Failure) -> grpc.StatusCode:
    return grpc.StatusCode[failure.value]


def from_grpc(code: grpc.StatusCode) -> Failure:
    """A node's status as a failure (OK, which no error carries, reads as UNKNOWN)."""
    try:
        return Failure(code.name)
    except ValueError:
        return Failure.UNKNOWN
