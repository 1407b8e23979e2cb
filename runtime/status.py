"""The one mapping between failures (``runtime/failure.py``) and gRPC status codes: servicers
answer with ``to_grpc``; clients read a peer's status with ``from_grpc``."""

from __future__ import annotations

import grpc

from splitserve.runtime.failure import Failure


def to_grpc(failure: Failure) -> grpc.StatusCode:
    return grpc.StatusCode[failure.value]


def from_grpc(code: grpc.StatusCode) -> Failure:
    """A node's status as a failure (OK, which no error carries, reads as UNKNOWN)."""
    try:
        return Failure(code.name)
    except ValueError:
        return Failure.UNKNOWN
