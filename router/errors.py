"""How a request ends when it cannot be served: a ``GenerateError``, its failure
(``runtime.failure.Failure``) and a message for the client, with a retry hint when refused.
"""

from __future__ import annotations

from splitserve.runtime.failure import Failure


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
