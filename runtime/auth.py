"""The cluster credential: one shared token that every internal call carries and every node checks.

Internal services (``PrefillNodeService``, ``DecodeNodeService``, ``NodeStatsService``) of a node
started with ``--auth-token-file`` answer ``UNAUTHENTICATED`` to a call whose metadata lacks
``authorization: Bearer <token>`` — checked in constant time by a server interceptor before the
request is even parsed, so no block is read and no engine work is done for it. Health and
reflection stay open (load balancers and probes carry no token); the router's public
``RouterService`` is not internal and stays open too. A process holds one credential
(``use_token`` at start); its outgoing internal calls add ``call_metadata()``.

The tcp KV path needs no token of its own: a chunk names its reservation by the random token of a
ticket that only a caller of the (authenticated) ``TransferKV``/``FetchBlocks`` can learn.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from splitserve.runtime import tracing

METADATA_KEY = "authorization"
MIN_TOKEN_CHARS = 16
INTERNAL_SERVICES = (
    "splitserve.v1.PrefillNodeService",
    "splitserve.v1.DecodeNodeService",
    "splitserve.v1.NodeStatsService",
)
REFUSAL = "this node requires the cluster token (metadata authorization: Bearer <token>)"

_metadata: tuple[tuple[str, str], ...] | None = None


def read_token_file(path: str) -> str:
    """The token in ``path`` (surrounding whitespace dropped); ``ValueError`` saying what to fix."""
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--auth-token-file {path}: cannot read it ({exc})") from None
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"--auth-token-file {path}: the token must have at least {MIN_TOKEN_CHARS} "
            "characters (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise ValueError(f"--auth-token-file {path}: the token must be printable ASCII, no spaces")
    return token


def write_token_file(path: str | Path) -> str:
    """A new random token in a new file ``path`` readable by its owner only; returns it."""
    import secrets

    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def registry_key(token: str | None) -> bytes | None:
    """The key that signs this cluster's registry and identity entries in Redis (derived from
    the token, so a leaked signature never reveals it); None without a token."""
    if not token:
        return None
    return hmac.new(token.encode(), b"splitserve registry v1", "sha256").digest()


def metadata_for(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return ((METADATA_KEY, f"Bearer {token}"),) if token else None


def use_token(token: str | None) -> None:
    """This process's credential for its outgoing internal calls (None: it sends none)."""
    global _metadata
    _metadata = metadata_for(token)


def credentials() -> tuple[tuple[str, str], ...] | None:
    """This process's credential alone, as call metadata: for a call that outlives any one
    request (no trace context)."""
    return _metadata


def call_metadata() -> tuple[tuple[str, str], ...] | None:
    """The metadata every internal call of this process carries (``metadata=`` of the call):
    the credential, and the current request's trace context when tracing is on."""
    if not tracing.enabled():
        return _metadata
    return (*(_metadata or ()), *tracing.outgoing()) or None


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses internal calls without the token; everything else passes untouched."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def _internal(self, method: str) -> bool:
        service = method.lstrip("/").rpartition("/")[0]
        return service in INTERNAL_SERVICES

    def _allowed(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        for key, value in metadata or ():
            if key == METADATA_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._expected)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or not self._internal(handler_call_details.method):
            return handler
        if self._allowed(handler_call_details.invocation_metadata):
            return handler
        return _refusing(handler)


async def _refuse(_request: object, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind that aborts before reading the request (no deserializer: the
    bytes are never parsed)."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse)
    return grpc.unary_unary_rpc_method_handler(_refuse)
