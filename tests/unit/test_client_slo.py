"""The SDK's ``slo=``: an ``Slo`` or the ``--slo`` syntax becomes ``GenerateRequest.slo`` on every
call (generate, stream, chat, both clients); a stub stands in for the router (the SDK against a
real loopback server: tests/cluster/test_client_unit.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from splitserve.client import AsyncClient, Client, Slo, SplitserveError, _build_request
from splitserve.v1 import common_pb2, router_pb2


def sent_slo(request: router_pb2.GenerateRequest) -> Slo | None:
    if not request.HasField("slo"):
        return None
    return Slo(request.slo.ttft_s or None, request.slo.tpot_s or None)


def test_build_request_takes_an_slo_or_its_text(rng):
    ttft, tpot = rng.uniform(0.1, 10), rng.uniform(0.001, 0.5)
    assert sent_slo(_build_request("hi", slo=Slo(ttft, tpot))) == Slo(ttft, tpot)
    assert sent_slo(_build_request("hi", slo=Slo(None, tpot))) == Slo(None, tpot)
    assert sent_slo(_build_request("hi", slo="ttft=1500ms")) == Slo(1.5, None)
    assert not _build_request("hi").HasField("slo")
    assert not _build_request("hi", slo="").HasField("slo")  # an empty text bounds nothing


def test_a_bad_slo_text_fails_before_sending():
    with pytest.raises(SplitserveError, match="bad SLO 'ttft=soon'") as caught:
        _build_request("hi", slo="ttft=soon")
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT


def _answer() -> list[router_pb2.GenerateResponse]:
    last = router_pb2.GenerateResponse(text="o", token_ids=[111], finish_reason="length")
    last.usage.CopyFrom(common_pb2.Usage(prompt_tokens=2, completion_tokens=1))
    return [last]


class _Call:
    """A finished server stream: iterable (sync and async) and cancellable."""

    def __init__(self) -> None:
        self._messages = _answer()

    def __iter__(self):
        return iter(self._messages)

    async def __aiter__(self):
        for m in self._messages:
            yield m

    def cancel(self) -> bool:
        return False


class FakeStub:
    def __init__(self) -> None:
        self.requests: list[router_pb2.GenerateRequest] = []

    def Generate(self, request, timeout=None, metadata=None):
        self.requests.append(request)
        return _Call()


def test_every_blocking_call_sends_the_slo():
    stub = FakeStub()
    with Client("127.0.0.1:1") as client:
        client._stub = stub  # type: ignore[assignment]
        assert client.generate("hi", max_tokens=1, slo="ttft=2,tpot=100ms").text == "o"
        list(client.stream("hi", slo=Slo(0.5, None)))
        client.chat([{"role": "user", "content": "hi"}], slo=Slo(None, 0.02))
        client.generate("hi")
    assert [sent_slo(r) for r in stub.requests] == [
        Slo(2.0, 0.1),
        Slo(0.5, None),
        Slo(None, 0.02),
        None,
    ]


def test_every_async_call_sends_the_slo():
    stub = FakeStub()

    async def calls() -> None:
        client = AsyncClient("127.0.0.1:1")
        client._stub = stub  # type: ignore[assignment]
        assert (await client.generate("hi", slo="tpot=30ms")).text == "o"
        async for _ in client.stream(prompt_token_ids=[1, 2], slo=Slo(3.0, 0.1)):
            pass
        await client.chat([{"role": "user", "content": "hi"}], slo="ttft=1")

    asyncio.run(calls())
    assert [sent_slo(r) for r in stub.requests] == [Slo(None, 0.03), Slo(3.0, 0.1), Slo(1.0, None)]
