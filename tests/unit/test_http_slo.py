"""The HTTP API's latency targets and deadline: the ``x-splitserve-slo`` header and the body's
``slo`` become every choice's ``GenerateRequest.slo``; ``x-request-timeout`` becomes the
``time_remaining`` the shared request path gets. Pure parsing, then one handler call on a mocked
request (no socket)."""

from __future__ import annotations

import asyncio
import json
from unittest import mock

import pytest
from aiohttp import streams
from aiohttp.test_utils import make_mocked_request
from support.router_helpers import MODEL

from splitserve.router import http
from splitserve.router.openai_api import ApiError, parse_body, request_slo, request_timeout
from splitserve.router.output import Delta, Step
from splitserve.runtime.failure import Failure
from splitserve.runtime.protocol import Usage
from splitserve.runtime.slo import Slo


def body(**fields):
    return {"prompt": "hi", "max_tokens": 2, **fields}


def slo_of(request) -> Slo | None:
    return request.slo


def test_header_names():
    assert http.SLO_HEADER == "x-splitserve-slo"
    assert http.TIMEOUT_HEADER == "x-request-timeout"


def test_every_choice_carries_the_slo_and_the_body_wins_per_bound(rng):
    ttft, body_ttft, tpot_ms = rng.uniform(1, 9), rng.uniform(0.1, 0.9), rng.randint(5, 500)
    header = f"ttft={ttft!r},tpot={tpot_ms}ms"
    api = parse_body(body(n=3, slo={"ttft": body_ttft}), False, "m", MODEL, "", None, header)
    assert len(api.requests) == 3
    for r in api.requests:  # the body's ttft, the header's tpot
        assert slo_of(r) == (pytest.approx(body_ttft), pytest.approx(tpot_ms / 1000))
    only_header = parse_body(body(), False, "m", MODEL, "", None, header)
    assert slo_of(only_header.requests[0]) == (ttft, pytest.approx(tpot_ms / 1000))
    only_body = parse_body(body(slo={"tpot": 0.05, "ttft": None}), False, "m", MODEL, "", None)
    assert slo_of(only_body.requests[0]) == Slo(None, 0.05)


def test_chat_and_the_string_form_in_the_body():
    chat = {"messages": [{"role": "user", "content": "hi"}], "slo": "ttft=250ms"}
    api = parse_body(chat, True, "m", MODEL, "", None, "tpot=0.2")
    assert slo_of(api.requests[0]) == Slo(0.25, 0.2)


def test_no_slo_leaves_the_field_absent():
    api = parse_body(body(), False, "m", MODEL, "", None, None)
    assert api.requests[0].slo is None
    assert request_slo({"slo": {}}, "") is None  # an empty object bounds nothing


@pytest.mark.parametrize(
    ("fields", "header", "says"),
    [
        ({}, "ttft=soon", "x-splitserve-slo header: bad SLO 'ttft=soon'.*syntax is ttft=SECONDS"),
        ({}, "e2e=3", "x-splitserve-slo header: .*syntax is ttft=SECONDS"),
        ({"slo": {"ttft": -1}}, None, "slo.ttft is -1: give a positive number"),
        ({"slo": {"ttft": 0}}, None, "slo.ttft is 0: give a positive number"),
        ({"slo": {"tpot": "2"}}, None, 'slo.tpot is "2": .*"ttft": SECONDS'),
        ({"slo": {"tpot": True}}, None, "slo.tpot is true"),
        ({"slo": {"ttft": float("nan")}}, None, "slo.ttft is NaN"),
        ({"slo": {"ttft_s": 1}}, None, "slo.ttft_s is not a bound"),
        ({"slo": 2}, None, "slo must be an object"),
        ({"slo": "tpot=x"}, None, "slo: bad SLO 'tpot=x'.*syntax is ttft=SECONDS"),
    ],
)
def test_bad_slo_is_a_400_that_gives_the_syntax(fields, header, says):
    with pytest.raises(ApiError, match=says) as caught:
        parse_body(body(**fields), False, "m", MODEL, "", None, header)
    assert caught.value.status == 400 and caught.value.failure == Failure.INVALID


def test_request_timeout_header(rng):
    seconds = rng.uniform(0.01, 600)
    assert request_timeout(repr(seconds)) == seconds
    assert request_timeout(" 30 ") == 30.0
    assert request_timeout(None) is None and request_timeout("") is None
    for bad in ("0", "-2", "nan", "inf", "soon"):
        with pytest.raises(ApiError, match=f"x-request-timeout header is '{bad}'.*> 0") as caught:
            request_timeout(bad)
        assert caught.value.status == 400


# ---------------------------------------------------------------- through the handler


class FakeFront:
    """The shared request path, recording what each call got; answers one token."""

    model = MODEL

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.refused: list[Failure] = []

    async def run(self, request, client, time_remaining=None, trace=None):
        self.calls.append((request, client, time_remaining))
        yield None, Step(Delta("h", [104], [], "length"), Usage(1, 0, 1, 0.01))

    def count_refused(self, code: Failure) -> None:
        self.refused.append(code)


async def serve(front: FakeFront, payload: dict, headers: dict[str, str]):
    reader = streams.StreamReader(
        mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop()
    )
    reader.feed_data(json.dumps(payload).encode())
    reader.feed_eof()
    request = make_mocked_request(
        "POST",
        "/v1/completions",
        headers={"Content-Type": "application/json", **headers},
        payload=reader,
    )
    handler = http.HttpFront(front, "m", max_request_bytes=1 << 20)  # type: ignore[arg-type]
    return await handler.completions(request)


def test_the_handler_passes_the_deadline_and_the_slo_on(rng):
    front, timeout = FakeFront(), rng.uniform(5, 60)
    headers = {http.TIMEOUT_HEADER: repr(timeout), http.SLO_HEADER: "tpot=40ms"}
    response = asyncio.run(serve(front, body(n=2), headers))
    assert response.status == 200 and len(front.calls) == 2
    for request, _, time_remaining in front.calls:
        assert timeout - 1 < time_remaining <= timeout  # counted from the request's arrival
        assert slo_of(request) == Slo(None, 0.04)
    asyncio.run(serve(front, body(), {}))
    assert front.calls[-1][2] is None and front.calls[-1][0].slo is None


def test_the_handler_refuses_a_bad_timeout_before_any_work():
    front = FakeFront()
    response = asyncio.run(serve(front, body(), {http.TIMEOUT_HEADER: "-1"}))
    assert response.status == 400 and front.calls == []
    assert front.refused == [Failure.INVALID]
    assert b"x-request-timeout" in response.body  # type: ignore[attr-defined]
