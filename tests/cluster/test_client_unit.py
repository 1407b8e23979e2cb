"""The client SDK against a fake Router servicer: real gRPC on loopback, scripted answers."""

from __future__ import annotations

import asyncio
import random
import threading

import grpc
import pytest

from splitserve.client import AsyncClient, Client, GenerateResult, SplitserveError, StreamChunk
from splitserve.v1 import common_pb2, router_pb2, router_pb2_grpc


class FakeRouter(router_pb2_grpc.RouterServiceServicer):
    """Answers the prompt's characters one chunk each (the 'token id' is the code point), or
    fails as the prompt says: "!invalid", "!slow" (sleeps), "!unavailable". Token ids in, "ids"
    out.
    """

    def __init__(self) -> None:
        self.requests: list[router_pb2.GenerateRequest] = []
        self.auth: list[str | None] = []  # each call's authorization metadata
        self.cancelled = threading.Event()

    async def Generate(self, request, context):
        self.requests.append(request)
        self.auth.append(dict(context.invocation_metadata()).get("authorization"))
        if request.text == "!invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "temperature must be >= 0")
        if request.text == "!unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no prefill node is reachable")
        text = (request.text or "ids")[: request.sampling.max_tokens]
        try:
            for i, char in enumerate(text):
                if request.text.startswith("!slow"):
                    await asyncio.sleep(0.05)
                last = i == len(text) - 1
                msg = router_pb2.GenerateResponse(
                    text=char, token_ids=[ord(char)], request_id="req-1"
                )
                if last:
                    msg.finish_reason = "length"
                    msg.usage.CopyFrom(
                        common_pb2.Usage(
                            prompt_tokens=len(request.text),
                            cached_tokens=2,
                            completion_tokens=len(text),
                            time_to_first_token_s=0.01,
                        )
                    )
                yield msg
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@pytest.fixture(scope="module")
def router():
    """(address, servicer) of a fake router served from a background thread's event loop."""
    fake = FakeRouter()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder = {}

    async def main():
        server = grpc.aio.server()
        router_pb2_grpc.add_RouterServiceServicer_to_server(fake, server)
        holder["port"] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        holder["stop"] = asyncio.Event()
        started.set()
        await holder["stop"].wait()
        await server.stop(0)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(10)
    yield f"127.0.0.1:{holder['port']}", fake
    loop.call_soon_threadsafe(holder["stop"].set)
    thread.join(10)


def random_word(n: int = 12) -> str:
    return "".join(random.choice("abcdefghé日") for _ in range(n))


def test_generate_returns_text_tokens_and_usage(router):
    address, fake = router
    prompt = random_word()
    with Client(address) as client:
        result = client.generate(prompt, max_tokens=5, temperature=0, stop=["x"], seed=7)
    assert isinstance(result, GenerateResult)
    assert result.text == prompt[:5] and result.token_ids == tuple(map(ord, prompt[:5]))
    assert result.finish_reason == "length"
    assert result.usage.prompt_tokens == len(prompt) and result.usage.cached_tokens == 2
    assert result.usage.completion_tokens == 5 and result.usage.time_to_first_token_s > 0
    with pytest.raises(AttributeError):
        result.text = "changed"  # frozen
    sent = fake.requests[-1]
    assert sent.text == prompt and list(sent.stop) == ["x"]
    assert sent.sampling.max_tokens == 5 and sent.sampling.temperature == 0
    assert sent.sampling.seed == 7 and sent.sampling.top_k == -1


def test_request_carries_every_parameter_and_leaves_seed_unset_by_default(router):
    address, fake = router
    ids = [random.randrange(1000) for _ in range(4)]
    with Client(address) as client:
        client.generate(
            prompt_token_ids=ids, top_p=0.5, top_k=3, ignore_eos=True, cache_salt="tenant"
        )
    sent = fake.requests[-1]
    assert list(sent.token_ids.ids) == ids and sent.WhichOneof("prompt") == "token_ids"
    assert sent.sampling.top_p == 0.5 and sent.sampling.top_k == 3 and sent.sampling.ignore_eos
    assert sent.sampling.max_tokens == 16 and sent.sampling.temperature == 1.0
    assert not sent.sampling.HasField("seed") and sent.cache_salt == "tenant"


def test_stream_yields_chunks_with_finish_and_usage_on_the_last(router):
    address, _ = router
    prompt = random_word()
    with Client(address) as client:
        chunks = list(client.stream(prompt, max_tokens=100))
    assert all(isinstance(c, StreamChunk) for c in chunks)
    assert "".join(c.text for c in chunks) == prompt
    assert [t for c in chunks for t in c.token_ids] == [ord(ch) for ch in prompt]
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12
    assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])


def test_errors_carry_the_grpc_code_and_message(router):
    address, _ = router
    with Client(address) as client:
        with pytest.raises(SplitserveError) as err:
            client.generate("!invalid")
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.message == "temperature must be >= 0"
        with pytest.raises(SplitserveError) as err:
            list(client.stream("!unavailable"))
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        # What cannot even be encoded fails the same way, before any call.
        with pytest.raises(SplitserveError) as err:
            client.generate(prompt_token_ids=[1, -2])
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(SplitserveError, match="one of prompt, prompt_token_ids") as err:
            client.generate("hi", prompt_token_ids=[1])
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(SplitserveError, match="not several") as err:
            client.chat([{"role": "user", "content": "hi"}], prompt="hi")
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(SplitserveError, match="bad argument") as err:
            client.chat([{"content": "no role"}])
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_timeout_is_deadline_exceeded(router):
    address, _ = router
    with Client(address) as client, pytest.raises(SplitserveError) as err:
        client.generate("!slow" + "z" * 20, max_tokens=25, timeout=0.2)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_leaving_a_stream_early_cancels_the_request(router):
    address, fake = router
    fake.cancelled.clear()
    with Client(address) as client:
        stream = client.stream("!slow" + "z" * 40, max_tokens=45)
        next(stream)
        stream.close()
        assert fake.cancelled.wait(5)


def test_unreachable_router_is_unavailable():
    from splitserve.launcher import free_port

    with Client(f"127.0.0.1:{free_port()}") as client, pytest.raises(SplitserveError) as err:
        client.generate("hi", timeout=5)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_async_client_generate_stream_errors_and_cancel(router):
    address, fake = router
    prompt = random_word()

    async def main():
        async with AsyncClient(address) as client:
            result = await client.generate(prompt, max_tokens=4)
            assert result.text == prompt[:4] and result.usage.completion_tokens == 4
            chunks = [c async for c in client.stream(prompt, max_tokens=100)]
            assert "".join(c.text for c in chunks) == prompt
            assert chunks[-1].finish_reason == "length"
            with pytest.raises(SplitserveError) as err:
                await client.generate("!invalid")
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(SplitserveError) as err:
                await client.generate("!slow" + "z" * 20, max_tokens=25, timeout=0.2)
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            fake.cancelled.clear()
            stream = client.stream("!slow" + "z" * 40, max_tokens=45)
            await anext(stream)
            await stream.aclose()
            assert await asyncio.to_thread(fake.cancelled.wait, 5)

    asyncio.run(main())


def test_an_api_key_goes_with_every_call_and_connect_opens_the_connection(router, monkeypatch):
    """``api_key=`` (else $SPLITSERVE_API_KEY) is the authorization metadata of every call;
    ``AsyncClient.connect`` opens the connection before the first call, and says when the router
    cannot be reached."""
    address, fake = router
    before = len(fake.auth)
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    with Client(address, api_key="k" * 20) as client:
        client.generate("hi", max_tokens=2)
    monkeypatch.setenv("SPLITSERVE_API_KEY", "e" * 20)
    with Client(address) as client:
        client.generate("hi", max_tokens=2)

    async def connected():
        async with AsyncClient(address, api_key="a" * 20) as client:
            await client.connect(timeout=10)
            await client.generate("hi", max_tokens=2)
        from splitserve.launcher import free_port

        async with AsyncClient(f"127.0.0.1:{free_port()}") as nowhere:
            with pytest.raises(TimeoutError):
                await nowhere.connect(timeout=0.5)

    asyncio.run(connected())
    assert fake.auth[before:] == [f"Bearer {'k' * 20}", f"Bearer {'e' * 20}", f"Bearer {'a' * 20}"]
