"""Failures (runtime/failure.Failure) and their one mapping to gRPC (runtime/status.py):
every failure names a gRPC status, every status a node may send reads as a failure, and /metrics
counts an ending under the status name (not the failure's own name)."""

from __future__ import annotations

import time

import grpc

from splitserve.router.metrics import RouterMetrics
from splitserve.router.openai_api import HTTP_STATUS, ApiError
from splitserve.router.output import RequestObserver
from splitserve.runtime.failure import UNREACHABLE, Failure
from splitserve.runtime.status import from_grpc, to_grpc


def test_every_failure_is_a_grpc_status_and_back():
    for failure in Failure:
        assert from_grpc(to_grpc(failure)) is failure
    for code in grpc.StatusCode:
        if code is not grpc.StatusCode.OK:
            assert to_grpc(from_grpc(code)) is code
    assert from_grpc(grpc.StatusCode.OK) is Failure.UNKNOWN  # no error carries OK
    assert to_grpc(Failure.REFUSED) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert {to_grpc(f) for f in UNREACHABLE} == {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    }


def test_the_http_mapping():
    assert ApiError.of_failure(Failure.REFUSED, "full").status == 429
    assert ApiError.of_failure(Failure.INVALID, "bad").status == 400
    assert ApiError.of_failure(Failure.DEADLINE, "late").status == 504
    assert ApiError.of_failure(Failure.INTERNAL, "bug").status == 500  # not in the table
    assert ApiError.bad("x").failure is Failure.INVALID
    assert set(HTTP_STATUS) <= set(Failure)


def test_an_ending_is_counted_under_its_status_name():
    metrics = RouterMetrics()
    for failure in (Failure.INVALID, Failure.REFUSED, Failure.INVALID):
        observer = RequestObserver(metrics, time.monotonic())
        observer.failed(failure)
        observer.end()
    counted = {
        s.labels["code"]: s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name == "splitserve_requests_total"
    }
    assert counted == {"INVALID_ARGUMENT": 2.0, "RESOURCE_EXHAUSTED": 1.0}
