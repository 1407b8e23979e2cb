"""``splitserve health``: ask a component's grpc.health.v1 service whether it is SERVING.

Container health checks run it (``HEALTHCHECK CMD ["splitserve", "health"]``): exit status 0
when the answer is SERVING, 1 otherwise, with one line saying what was asked and what came back.
Without ``--address`` it asks the component of this container: ``127.0.0.1:$SPLITSERVE_PORT``
(or ``$SPLITSERVE_HOST`` when that is a specific address rather than a wildcard).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.runtime.config import WILDCARD_HOSTS
from splitserve.settings import option_value

if TYPE_CHECKING:
    from splitserve.runtime.tls import TlsFiles

DEFAULT_PORT = 8000  # the image's SPLITSERVE_PORT and the router's default


@dataclass(frozen=True, slots=True)
class HealthResult:
    serving: bool
    message: str


def default_address(environ: Mapping[str, str] | None = None) -> str:
    """The address of the component configured by SPLITSERVE_HOST/SPLITSERVE_PORT (a port of 0:
    the one the component wrote to SPLITSERVE_PORT_FILE)."""
    host = option_value("SPLITSERVE_HOST", environ)
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal
    port = option_value("SPLITSERVE_PORT", environ) or str(DEFAULT_PORT)
    port_file = option_value("SPLITSERVE_PORT_FILE", environ)
    if port == "0" and port_file:  # a port picked at start: the component wrote it there
        # Not written yet: the check then fails as "not reachable", as it should.
        with contextlib.suppress(OSError):
            port = Path(port_file).read_text().strip() or port
    return f"{host}:{port}"


def check_address(address: str) -> str:
    """``address`` if it is host:port, else ValueError with the reason."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not host:port")
    return address


def tls_from_env(environ: Mapping[str, str] | None = None) -> TlsFiles | None:
    """The component's mTLS files from SPLITSERVE_TLS_CERT/KEY/CA (None: plaintext)."""
    from splitserve.runtime.tls import TlsFiles

    names = ("SPLITSERVE_TLS_CERT", "SPLITSERVE_TLS_KEY", "SPLITSERVE_TLS_CA")
    return TlsFiles.load(*(option_value(n, environ) or None for n in names))


def check(
    address: str, service: str = "", timeout_s: float = 5.0, tls: TlsFiles | None = None
) -> HealthResult:
    """One grpc.health.v1 ``Check`` of ``service`` ("" = the whole server) at ``address``
    (``tls``: runtime.tls.TlsFiles when the component serves mTLS)."""
    from splitserve.runtime.tls import sync_channel

    what = f"{address} ({f'service {service!r}' if service else 'server'})"
    with sync_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            # NOTE: typeshed's grpcio-health-checking stubs declare no methods on HealthStub.
            reply = stub.Check(  # pyright: ignore[reportAttributeAccessIssue]
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code == grpc.StatusCode.UNAVAILABLE:
                reason = "not reachable (nothing listening, or still starting)"
            elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
                reason = f"no answer within {timeout_s:g} s"
            elif code == grpc.StatusCode.NOT_FOUND:
                reason = "unknown service (not registered with the health service)"
            elif code == grpc.StatusCode.UNIMPLEMENTED:
                reason = "no grpc.health.v1 service there"
            else:
                details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
                reason = f"{code.name if code else 'error'}: {details}"
            return HealthResult(False, f"{what}: {reason}")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return HealthResult(reply.status == health_pb2.HealthCheckResponse.SERVING, f"{what}: {status}")
