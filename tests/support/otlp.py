"""An OTLP/HTTP trace receiver for tests and benchmarks/tracing_overhead.py: what a collector
sees. It takes the exporters' POSTs to /v1/traces (protobuf ExportTraceServiceRequest, as the
OpenTelemetry SDK sends them), answers 200 with an empty ExportTraceServiceResponse and keeps
every span with its service.name (and the bytes it was sent)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    attributes: dict[str, Any]
    events: dict[str, dict[str, Any]]  # event name → its attributes
    error: str  # the status message of a failed span ("": not failed)
    failed: bool
    start_ns: int
    end_ns: int


def _value(any_value) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(pairs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


@dataclass
class Receiver:
    spans: list[Span] = field(default_factory=list)
    posts: int = 0
    bytes: int = 0  # the exports' protobuf bytes
    _mu: threading.Lock = field(default_factory=threading.Lock)

    def add(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        out = []
        for resource_spans in request.resource_spans:
            service = _attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    out.append(
                        Span(
                            service=service,
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            attributes=_attributes(s.attributes),
                            events={e.name: _attributes(e.attributes) for e in s.events},
                            error=s.status.message,
                            failed=s.status.code == s.status.STATUS_CODE_ERROR,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                        )
                    )
        with self._mu:
            self.spans.extend(out)
            self.posts += 1
            self.bytes += len(body)

    def trace_of(self, predicate) -> list[Span]:
        """Every span of the first trace holding a span that satisfies ``predicate``."""
        with self._mu:
            spans = list(self.spans)
        for span in spans:
            if predicate(span):
                return [s for s in spans if s.trace_id == span.trace_id]
        return []

    def wait_for(self, predicate, done, timeout: float = 30.0) -> list[Span]:
        """The trace of ``predicate`` once ``done(trace)`` holds (the components export in
        batches, each on its own schedule)."""
        deadline = time.monotonic() + timeout
        while True:
            trace = self.trace_of(predicate)
            if trace and done(trace):
                return trace
            if time.monotonic() > deadline:
                names = sorted((s.service, s.name) for s in trace)
                raise AssertionError(f"trace incomplete after {timeout} s: {names}")
            time.sleep(0.1)


def serve_receiver() -> tuple[Receiver, ThreadingHTTPServer, str]:
    """(the receiver, its server: ``shutdown()`` it, its endpoint URL) on a free loopback port."""
    receiver = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            receiver.add(body)
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return receiver, server, f"http://127.0.0.1:{server.server_address[1]}"
