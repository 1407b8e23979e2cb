"""OpenTelemetry traces of requests: one trace per request across the router, the prefill node
and the decode node (the W3C ``traceparent`` carried in gRPC metadata and HTTP headers).

Off unless asked for: ``--otlp-endpoint URL`` (or the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) turns it on; spans go in batches to URL/v1/traces over
OTLP HTTP/protobuf, or to URL over gRPC with ``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``. The SDK reads
the other ``OTEL_*`` variables itself (headers, timeouts, ``OTEL_TRACES_SAMPLER[_ARG]``,
``OTEL_BSP_*``, ``OTEL_RESOURCE_ATTRIBUTES``); ``--otlp-sample-ratio`` sets a parent-based
ratio sampler (a node follows the router's decision for the requests it serves). The packages
are the ``otel`` extra (``pip install 'splitserve[otel]'``): asked for without them, the process
refuses to start, saying so.

Off, nothing of OpenTelemetry is imported and every call here is a check of one global: the
request path pays nothing measurable. On, an unsampled request's spans are the SDK's
non-recording spans (no export, no attributes kept).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import splitserve.settings as settings

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_ENDPOINT_VARIABLES = (
    settings.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    settings.OTEL_EXPORTER_OTLP_ENDPOINT,
)

_tracer: Any = None  # the SDK's tracer once configured; None: tracing is off
_provider: Any = None


class _NoSpan:
    """What a span is when tracing is off: takes every call, keeps nothing."""

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        pass

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        pass

    def is_recording(self) -> bool:
        return False


NO_SPAN = _NoSpan()


def enabled() -> bool:
    return _tracer is not None


def check_installed() -> None:
    """``RuntimeError`` saying what to install when the ``otel`` extra's packages are missing."""
    try:
        import opentelemetry.exporter.otlp.proto.http
        import opentelemetry.sdk  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(_MISSING.format(exc.name)) from None


_MISSING = (
    "tracing asked for (--otlp-endpoint or OTEL_EXPORTER_OTLP_ENDPOINT) but OpenTelemetry is not "
    "installed ({}): pip install 'splitserve[otel]'"
)


def configure(service: str, endpoint: str | None = None, sample_ratio: float | None = None) -> bool:
    """Turn tracing on for this process as ``service`` (its ``service.name``; the standard
    ``OTEL_SERVICE_NAME`` wins) when an endpoint is given here or in the environment; whether
    it is on. ``RuntimeError`` saying what to install when the packages are missing,
    ``ValueError`` for a ratio outside [0, 1]."""
    global _tracer, _provider
    if sample_ratio is not None and not 0.0 <= sample_ratio <= 1.0:
        raise ValueError(f"--otlp-sample-ratio {sample_ratio}: give a fraction in [0, 1]")
    if not endpoint and not any(s.get() for s in _ENDPOINT_VARIABLES):
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as exc:
        raise RuntimeError(_MISSING.format(exc.name)) from None
    exporter = _exporter(endpoint)
    name = settings.OTEL_SERVICE_NAME.get() or service
    resource = Resource.create({SERVICE_NAME: name})
    sampler = None if sample_ratio is None else ParentBased(TraceIdRatioBased(sample_ratio))
    provider = TracerProvider(resource=resource, sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    _tracer = provider.get_tracer("splitserve")
    logger.info(
        "tracing on: service.name %s, to %s (%s), sampling %s",
        name,
        endpoint or "the OTEL_EXPORTER_OTLP_* endpoint",
        _protocol(),
        "the SDK's (OTEL_TRACES_SAMPLER)" if sample_ratio is None else f"{sample_ratio:g}",
    )
    return True


def _protocol() -> str:
    return (
        settings.OTEL_EXPORTER_OTLP_TRACES_PROTOCOL.get()
        or settings.OTEL_EXPORTER_OTLP_PROTOCOL.get()
    )


def _exporter(endpoint: str | None) -> Any:
    """The OTLP exporter of the configured protocol: HTTP/protobuf posts to ENDPOINT/v1/traces
    (the specification's default), gRPC sends to ENDPOINT itself."""
    protocol = _protocol()
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise RuntimeError(
                f"OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the OTLP gRPC exporter ({exc.name}): "
                "pip install 'splitserve[otel]'"
            ) from None
        return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
    if protocol != "http/protobuf":
        raise ValueError(f"OTLP protocol {protocol!r}: give http/protobuf (default) or grpc")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    if not endpoint:
        return OTLPSpanExporter()  # the OTEL_EXPORTER_OTLP_* variables say where
    return OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")


def shutdown() -> None:
    """Export what is still queued (at most a few seconds) and stop; idempotent."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


# ---------------------------------------------------------------------- spans


def _parent(carrier: Mapping[str, str] | None) -> Any:
    if not carrier or TRACEPARENT not in carrier:
        return None
    from opentelemetry.propagate import extract

    return extract(carrier)


def carrier_of(metadata: Iterable[tuple[str, Any]] | None) -> dict[str, str]:
    """The trace headers among gRPC call metadata (or HTTP headers' items); empty when
    tracing is off."""
    out: dict[str, str] = {}
    if _tracer is None:
        return out
    for key, value in metadata or ():
        key = key.lower()
        if key in (TRACEPARENT, TRACESTATE):
            out[key] = value if isinstance(value, str) else value.decode("latin-1")
    return out


@contextlib.contextmanager
def span(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    *,
    carrier: Mapping[str, str] | None = None,
    server: bool = False,
) -> Iterator[Any]:
    """A span around the block, the current one's child (or, given ``carrier``, the child of
    the remote span it names: a call from another component). An exception leaving the block
    marks the span as an error with its message; ``NO_SPAN`` when tracing is off."""
    tracer = _tracer
    if tracer is None:
        yield NO_SPAN
        return
    from opentelemetry.trace import SpanKind

    kind = SpanKind.SERVER if server else SpanKind.INTERNAL
    with tracer.start_as_current_span(
        name, context=_parent(carrier), kind=kind, attributes=attributes
    ) as current:
        yield current


class Started:
    """A span made current until ``end`` (for a request whose life is not one block of code:
    an async generator's, ended in its ``finally``)."""

    __slots__ = ("_token", "span")

    def __init__(self, current: Any, token: Any) -> None:
        self.span = current
        self._token = token

    def end(self, error: str | None = None) -> None:
        """End it (``error``: it failed, saying why); idempotent."""
        token, self._token = self._token, None
        if token is None:
            return
        from opentelemetry import context

        try:
            context.detach(token)
        finally:
            if error is not None:
                fail(self.span, error)
            self.span.end()


class _NotStarted:
    span = NO_SPAN

    def end(self, error: str | None = None) -> None:
        pass


NOT_STARTED = _NotStarted()


def start(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    *,
    carrier: Mapping[str, str] | None = None,
    server: bool = False,
) -> Started | _NotStarted:
    """``span``'s work in two calls: the span starts and becomes current here, ``end`` ends
    it. ``NOT_STARTED`` when tracing is off."""
    tracer = _tracer
    if tracer is None:
        return NOT_STARTED
    from opentelemetry import context, trace
    from opentelemetry.trace import SpanKind

    kind = SpanKind.SERVER if server else SpanKind.INTERNAL
    current = tracer.start_span(name, context=_parent(carrier), kind=kind, attributes=attributes)
    return Started(current, context.attach(trace.set_span_in_context(current)))


def record(
    name: str,
    start: float,
    end: float,
    attributes: Mapping[str, Any] | None = None,
    error: str | None = None,
) -> None:
    """A span of a stage already over, the current span's child: ``start`` and ``end`` are
    ``time.monotonic()`` readings (a stage timed where a span could not be open around it);
    ``error``: the stage failed, saying why."""
    tracer = _tracer
    if tracer is None:
        return
    now_ns, now = time.time_ns(), time.monotonic()
    child = tracer.start_span(
        name, start_time=now_ns - int((now - start) * 1e9), attributes=attributes
    )
    if error is not None:
        fail(child, error)
    child.end(end_time=now_ns - int((now - end) * 1e9))


def event(name: str, attributes: Mapping[str, Any] | None = None) -> None:
    """An event on the current span (nothing when tracing is off)."""
    if _tracer is None:
        return
    from opentelemetry import trace

    trace.get_current_span().add_event(name, attributes)


def fail(current: Any, reason: str) -> None:
    """Mark ``current`` as failed with ``reason`` (a refusal, an error status)."""
    if not current.is_recording():
        return
    from opentelemetry.trace import Status, StatusCode

    current.set_status(Status(StatusCode.ERROR, reason))
    current.set_attribute("splitserve.error", reason)


def outgoing() -> tuple[tuple[str, str], ...]:
    """The current span's context as the metadata of a call to another component (empty when
    tracing is off or the request is not sampled)."""
    if _tracer is None:
        return ()
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier)
    return tuple(carrier.items())
