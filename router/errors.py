"""How a request ends when it cannot be served: a gRPC status and a message for the client."""

from __future__ import annotations

import grpc

# A node that did not answer (as opposed to one that answered with an error): it is marked down
# and, where the stage allows, the request is retried elsewhere. CANCELLED is here because only
# the node can have sent it (a call the router cancels itself raises asyncio.CancelledError, not
# a status): the node's server stopped the call, as one does when it shuts down.
UNREACHABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
)


class GenerateError(Exception):
    """Ends a request with a gRPC status."""

    def __init__(
        self,
        code: grpc.StatusCode,
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
