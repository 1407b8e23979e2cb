"""runtime/tracing.py on its own: off, it imports nothing of OpenTelemetry and every call is a
no-op (the call metadata stays the credential alone); on, a span continues the caller's trace
(``traceparent``), an outgoing call carries the current span's context, spans of stages timed
after the fact land at their times, a ratio of 0 records nothing but still passes the decision
on; asked for without its packages or with a ratio outside [0, 1], it says what to fix. The
spans through real processes are in tests/cluster/test_request_traces.py."""

from __future__ import annotations

import sys
import time

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from splitserve.runtime import auth, tracing

PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{PARENT_TRACE}-00f067aa0ba902b7-01"


@pytest.fixture
def traced(monkeypatch):
    """Tracing on (to an endpoint nothing listens at: the spans go to memory instead)."""
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)

    def on(ratio: float | None = None) -> InMemorySpanExporter:
        assert tracing.configure("splitserve-test", "http://127.0.0.1:9", ratio)
        memory = InMemorySpanExporter()
        tracing._provider.add_span_processor(SimpleSpanProcessor(memory))
        return memory

    yield on
    tracing.shutdown()


def test_off_every_call_is_a_no_op_and_nothing_is_sent(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert not tracing.configure("splitserve-router", None)
    assert not tracing.enabled()
    with tracing.span("request", carrier={"traceparent": PARENT}) as span:
        assert span is tracing.NO_SPAN and not span.is_recording()
    assert tracing.start("request").span is tracing.NO_SPAN
    assert tracing.outgoing() == () and tracing.carrier_of([("traceparent", PARENT)]) == {}
    auth.use_token("a-cluster-token-of-enough-chars")
    try:
        assert auth.call_metadata() == (
            ("authorization", "Bearer a-cluster-token-of-enough-chars"),
        )
    finally:
        auth.use_token(None)
    assert auth.call_metadata() is None


def test_a_span_continues_the_callers_trace_and_calls_carry_it_on(traced):
    memory = traced()
    carrier = tracing.carrier_of([("Traceparent", PARENT), ("x-other", "1")])
    assert carrier == {"traceparent": PARENT}
    with tracing.span("request", {"a": 1}, carrier=carrier, server=True) as span:
        assert span.is_recording()
        sent = dict(auth.call_metadata() or ())
        own = span.get_span_context()
        assert sent["traceparent"] == f"00-{PARENT_TRACE}-{own.span_id:016x}-01"
        now = time.monotonic()
        tracing.record("queue", now - 0.5, now - 0.2, {"b": 2})
        tracing.event("first_token", {"c": 3})
    spans = {s.name: s for s in memory.get_finished_spans()}
    request, queue = spans["request"], spans["queue"]
    assert f"{request.context.trace_id:032x}" == PARENT_TRACE
    assert request.parent is not None and request.parent.span_id == 0x00F067AA0BA902B7
    assert queue.parent is not None and queue.parent.span_id == request.context.span_id
    assert abs((queue.end_time - queue.start_time) / 1e9 - 0.3) < 0.01
    assert request.resource.attributes["service.name"] == "splitserve-test"
    assert [e.name for e in request.events] == ["first_token"]


def test_a_started_span_ends_once_with_its_error(traced):
    memory = traced()
    started = tracing.start("request")
    started.end("RESOURCE_EXHAUSTED: full")
    started.end()  # idempotent
    (span,) = memory.get_finished_spans()
    assert not span.status.is_ok and span.status.description == "RESOURCE_EXHAUSTED: full"


def test_a_ratio_of_zero_records_nothing_but_passes_the_decision_on(traced):
    memory = traced(0.0)
    with tracing.span("request") as span:
        assert not span.is_recording()
        (pair,) = tracing.outgoing()
        assert pair[0] == "traceparent"
        assert int(pair[1].rsplit("-", 1)[1], 16) & 1 == 0  # the sampled flag is off
    assert memory.get_finished_spans() == ()


def test_asked_for_without_its_packages_it_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    with pytest.raises(RuntimeError, match=r"pip install 'splitserve\[otel\]'"):
        tracing.configure("splitserve-router", "http://collector:4318")
    assert not tracing.enabled()
    with pytest.raises(RuntimeError, match=r"pip install 'splitserve\[otel\]'"):
        tracing.check_installed()  # what `splitserve up --otlp-endpoint` asks first


def test_a_ratio_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="--otlp-sample-ratio"):
        tracing.configure("splitserve-router", "http://collector:4318", 1.5)
    assert not tracing.enabled()


def test_up_refuses_a_bad_ratio_before_starting_anything():
    from splitserve.cluster_spec import ClusterSpec

    with pytest.raises(ValueError, match="--otlp-sample-ratio"):
        ClusterSpec(model_path="tiny", otlp_sample_ratio=-0.1)
