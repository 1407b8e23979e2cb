"""How a request ends when it cannot be served: a :class:`Failure` and a message for the client.

The router's own terms, no transport's: the gRPC front answers a failure with the status its value
names and the HTTP front with the status ``openai_api.HTTP_STATUS`` gives it; the stages that call
nodes turn a node's status into a failure (``router/status.py``, the one mapping both ways).
"""

from __future__ import annotations

import enum


class Failure(enum.Enum):
    """Why a request failed; the value is the gRPC status the public API answers with, and the
    ``code`` label /metrics counts the request under."""

    INVALID = "INVALID_ARGUMENT"  # the request is wrong: fix it before trying again
    OUT_OF_RANGE = "OUT_OF_RANGE"
    PRECONDITION = "FAILED_PRECONDITION"
    NOT_FOUND = "NOT_FOUND"
    REFUSED = "RESOURCE_EXHAUSTED"  # no room now: try again later (retry_after_s says when)
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    CANCELLED = "CANCELLED"
    UNAVAILABLE = "UNAVAILABLE"  # no node could serve it: another try may find one
    DEADLINE = "DEADLINE_EXCEEDED"  # its deadline passed
    UNIMPLEMENTED = "UNIMPLEMENTED"
    INTERNAL = "INTERNAL"
    UNKNOWN = "UNKNOWN"
    # Passed on as a node sent them (no router code raises them).
    ALREADY_EXISTS = "ALREADY_EXISTS"
    ABORTED = "ABORTED"
    DATA_LOSS = "DATA_LOSS"


# A node that did not answer (as opposed to one that answered with an error): it is marked down
# and, where the stage allows, the request is retried elsewhere. CANCELLED is here because only
# the node can have sent it (a call the router cancels itself raises asyncio.CancelledError, not
# a status): the node's server stopped the call, as one does when it shuts down.
UNREACHABLE = (Failure.UNAVAILABLE, Failure.DEADLINE, Failure.CANCELLED)


class GenerateError(Exception):
    """Ends a request with a failure."""

    def __init__(
        self,
        code: Failure,
        message: str,
        retry_after_s: int | None = None,
        reason: str = "",
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        # A refusal for want of room: when to try again (HTTP Retry-After; gRPC's
        # grpc-retry-pushback-ms trailer). None: not a refusal of that kind.
        self.retry_after_s = retry_after_s
        self.reason = reason  # a refusal's reason as /metrics counts it ("": not a refusal)
