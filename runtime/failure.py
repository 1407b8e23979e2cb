"""Why a request or a call failed, in the system's own terms: a :class:`Failure`.

Router and nodes raise and pass these; no transport's type is the domain's. The gRPC servicers and
clients map them to and from status codes in one place (``runtime/status.py``); the HTTP front to
HTTP statuses in one place (``router.openai_api.HTTP_STATUS``).
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
