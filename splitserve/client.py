"""The splitserve client SDK: a blocking ``Client`` and an asyncio ``AsyncClient``.

    from splitserve.client import Client

    with Client("localhost:8000") as client:
        result = client.generate("Hello", max_tokens=32, temperature=0)
        print(result.text, result.usage.completion_tokens)
        for chunk in client.stream("Once upon a time", max_tokens=64):
            print(chunk.text, end="", flush=True)
        reply = client.chat([{"role": "user", "content": "Hi"}], max_tokens=32)
        quick = client.generate("Hi", slo="ttft=500ms,tpot=50ms", timeout=10)

A router started with API keys (``--api-key-file``; ``splitserve up`` makes one) wants one with
every call: ``Client(target, api_key=KEY)``, or the ``SPLITSERVE_API_KEY`` environment variable.
Every failure raises ``SplitserveError`` with the gRPC status code and the server's message.
Breaking out of a stream (or closing it) cancels the request on the server, which frees its
KV blocks at once.

Over 300 lines on purpose: ``Client`` and ``AsyncClient`` mirror each other method for method,
each public signature spelled out, over the module's shared helpers; one file keeps them in step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc

import splitserve.settings as settings
from splitserve.runtime.protocol import usage_from_proto
from splitserve.runtime.slo import Slo
from splitserve.types import Collector, GenerateResult, SplitserveError, StreamChunk, Usage
from splitserve.v1 import common_pb2, router_pb2, router_pb2_grpc

__all__ = [
    "AsyncClient",
    "Client",
    "GenerateResult",
    "Slo",
    "SplitserveError",
    "StreamChunk",
    "Usage",
]


def _build_request(
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    max_tokens: int = 16,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    ignore_eos: bool = False,
    cache_salt: str | None = None,
    logprobs: bool = False,
    request_id: str | None = None,
    messages: Sequence[Mapping[str, str]] | None = None,
    slo: Slo | str | None = None,
) -> router_pb2.GenerateRequest:
    """The request message. Value checks are the server's (one source of truth); only what
    cannot be encoded at all fails here, with the same INVALID_ARGUMENT code."""
    if isinstance(stop, str):
        stop = [stop]
    if sum(x is not None for x in (prompt, prompt_token_ids, messages)) > 1:
        raise SplitserveError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "give one of prompt, prompt_token_ids and messages, not several",
        )
    try:
        sampling = common_pb2.SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
        )
        if seed is not None:
            sampling.seed = seed
        request = router_pb2.GenerateRequest(
            sampling=sampling,
            stop=stop or (),
            cache_salt=cache_salt or "",
            request_id=request_id or "",
        )
        if prompt_token_ids is not None:
            request.token_ids.ids.extend(prompt_token_ids)
        elif messages is not None:
            for m in messages:
                request.messages.messages.add(role=m["role"], content=m["content"])
            request.messages.SetInParent()  # an empty list is still a chat request
        else:
            request.text = prompt or ""
        if isinstance(slo, str):
            slo = Slo.parse(slo)
        if slo is not None:  # a bound left None goes as 0: unset, the router's --slo applies
            request.slo.ttft_s, request.slo.tpot_s = slo.ttft_s or 0.0, slo.tpot_s or 0.0
        return request
    except (TypeError, ValueError, KeyError) as exc:
        raise SplitserveError(grpc.StatusCode.INVALID_ARGUMENT, f"bad argument: {exc}") from None


def _chunk(msg: router_pb2.GenerateResponse) -> StreamChunk:
    """One reply message of the stream, as the SDK hands it out."""
    usage = usage_from_proto(msg.usage) if msg.HasField("usage") else None
    return StreamChunk(
        text=msg.text,
        token_ids=tuple(msg.token_ids),
        finish_reason=msg.finish_reason or None,
        usage=usage,
        logprobs=tuple(msg.logprobs),
        request_id=msg.request_id,
    )


def _result(chunks: Iterable[StreamChunk]) -> GenerateResult:
    """A whole stream's chunks joined into its result."""
    collector = Collector()
    for chunk in chunks:
        collector.add(chunk)
    return collector.result()


def _error(exc: grpc.RpcError) -> SplitserveError:
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    return SplitserveError(code, details or code.name)


@contextlib.contextmanager
def _generate_call(
    stub: router_pb2_grpc.RouterServiceStub,
    request: router_pb2.GenerateRequest,
    timeout: float | None,
    metadata: tuple[tuple[str, str], ...],
) -> Iterator[Any]:
    """The Generate call (sync or asyncio, as ``stub``'s channel): a gRPC failure inside raises
    ``SplitserveError``; leaving cancels the call (a no-op once finished; frees the server's
    blocks when abandoned)."""
    call = stub.Generate(request, timeout=timeout, metadata=metadata or None)
    try:
        yield call
    except grpc.RpcError as exc:
        raise _error(exc) from None
    finally:
        call.cancel()


API_KEY_ENV = settings.API_KEY.name  # the key a client sends when none is given


def _auth(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata that presents ``api_key`` (default: $SPLITSERVE_API_KEY; none: empty)."""
    key = api_key if api_key is not None else settings.API_KEY.get()
    return (("authorization", f"Bearer {key}"),) if key else ()


def _channel(
    kind: Any,
    target: str,
    options: Sequence[tuple[str, Any]],
    credentials: grpc.ChannelCredentials | None,
) -> Any:
    """A channel of ``kind`` (``grpc`` or ``grpc.aio``): TLS with ``credentials``, else plain."""
    if credentials is None:
        return kind.insecure_channel(target, options=list(options))
    return kind.secure_channel(target, credentials, options=list(options))


class Client:
    """Blocking client of a splitserve router. Thread-safe; close it (or use ``with``)."""

    def __init__(
        self,
        target: str,
        options: Sequence[tuple[str, Any]] = (),
        credentials: grpc.ChannelCredentials | None = None,
        api_key: str | None = None,
    ) -> None:
        """``credentials``: for a router serving TLS, e.g. ``grpc.ssl_channel_credentials(ca,
        key, cert)`` (mTLS: the router's CA, this client's key and certificate); ``api_key``:
        for a router with API keys (default: $SPLITSERVE_API_KEY)."""
        self.target = target
        self._auth = _auth(api_key)
        self._channel = _channel(grpc, target, options, credentials)
        self._stub = router_pb2_grpc.RouterServiceStub(self._channel)

    def generate(
        self,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool = False,
        cache_salt: str | None = None,
        timeout: float | None = None,
        *,
        logprobs: bool = False,
        request_id: str | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        slo: Slo | str | None = None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> GenerateResult:
        """Run one request to completion. Parameters as ``stream``."""
        return _result(self.stream(
            prompt, prompt_token_ids, max_tokens, temperature, top_p, top_k, seed, stop,
            ignore_eos, cache_salt, timeout, logprobs=logprobs, request_id=request_id,
            messages=messages, slo=slo, metadata=metadata,
        ))  # fmt: skip

    def stream(
        self,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool = False,
        cache_salt: str | None = None,
        timeout: float | None = None,
        *,
        logprobs: bool = False,
        request_id: str | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        slo: Slo | str | None = None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> Iterator[StreamChunk]:
        """Yield the completion as it is generated.

        Give ``prompt`` (text), ``prompt_token_ids`` or chat ``messages`` (``{"role": ...,
        "content": ...}``, rendered with the model's chat template). ``temperature=0`` is
        greedy; ``stop`` strings end the completion without being included; ``cache_salt`` keeps
        a tenant's prefix cache apart; ``timeout`` (seconds) bounds the whole request. ``slo``:
        this request's latency targets, an ``Slo`` or ``"ttft=2,tpot=100ms"`` (the router's
        ``--slo`` syntax; a bound left out takes the router's); a router that predicts a miss
        refuses the request at once (``RESOURCE_EXHAUSTED``) rather than serve it late.
        ``metadata``: gRPC metadata sent with the call, e.g. ``[("x-splitserve-client",
        "tenant-a")]`` names the client whose fair share and in-flight cap the request counts
        against.
        """
        request = _build_request(
            prompt, prompt_token_ids, max_tokens, temperature, top_p, top_k, seed, stop,
            ignore_eos, cache_salt, logprobs, request_id, messages, slo,
        )  # fmt: skip
        with _generate_call(self._stub, request, timeout, (*self._auth, *metadata)) as call:
            for msg in call:
                yield _chunk(msg)

    def chat(self, messages: Sequence[Mapping[str, str]], **kwargs: Any) -> GenerateResult:
        """The assistant's reply to ``messages`` (system/user/assistant turns); the other
        parameters as ``stream``."""
        return self.generate(messages=messages, **kwargs)

    def chat_stream(
        self, messages: Sequence[Mapping[str, str]], **kwargs: Any
    ) -> Iterator[StreamChunk]:
        """``chat``, streamed."""
        return self.stream(messages=messages, **kwargs)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client of a splitserve router; the same methods as ``Client``, awaited.

    The channel is created on first use, inside the running event loop.
    """

    def __init__(
        self,
        target: str,
        options: Sequence[tuple[str, Any]] = (),
        credentials: grpc.ChannelCredentials | None = None,
        api_key: str | None = None,
    ) -> None:
        self.target = target
        self._auth = _auth(api_key)  # as for Client
        self._options = list(options)
        self._credentials = credentials  # TLS, as for Client
        self._channel: grpc.aio.Channel | None = None
        self._stub: router_pb2_grpc.RouterServiceStub | None = None

    def _get_stub(self) -> router_pb2_grpc.RouterServiceStub:
        if self._stub is None:
            self._channel = _channel(grpc.aio, self.target, self._options, self._credentials)
            self._stub = router_pb2_grpc.RouterServiceStub(self._channel)
        return self._stub

    async def connect(self, timeout: float | None = None) -> None:
        """Open the connection now (else the first call opens it, and waits for it);
        ``TimeoutError`` when the router is not reached within ``timeout`` seconds."""
        self._get_stub()
        assert self._channel is not None
        await asyncio.wait_for(self._channel.channel_ready(), timeout)

    async def generate(
        self,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool = False,
        cache_salt: str | None = None,
        timeout: float | None = None,
        *,
        logprobs: bool = False,
        request_id: str | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        slo: Slo | str | None = None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> GenerateResult:
        """Run one request to completion. Parameters as ``Client.stream``."""
        return _result([chunk async for chunk in self.stream(
            prompt, prompt_token_ids, max_tokens, temperature, top_p, top_k, seed, stop,
            ignore_eos, cache_salt, timeout, logprobs=logprobs, request_id=request_id,
            messages=messages, slo=slo, metadata=metadata,
        )])  # fmt: skip

    async def stream(
        self,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool = False,
        cache_salt: str | None = None,
        timeout: float | None = None,
        *,
        logprobs: bool = False,
        request_id: str | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        slo: Slo | str | None = None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> AsyncIterator[StreamChunk]:
        """As ``Client.stream``; use ``async for``."""
        request = _build_request(
            prompt, prompt_token_ids, max_tokens, temperature, top_p, top_k, seed, stop,
            ignore_eos, cache_salt, logprobs, request_id, messages, slo,
        )  # fmt: skip
        with _generate_call(self._get_stub(), request, timeout, (*self._auth, *metadata)) as call:
            async for msg in call:
                yield _chunk(msg)

    async def chat(self, messages: Sequence[Mapping[str, str]], **kwargs: Any) -> GenerateResult:
        """As ``Client.chat``."""
        return await self.generate(messages=messages, **kwargs)

    def chat_stream(
        self, messages: Sequence[Mapping[str, str]], **kwargs: Any
    ) -> AsyncIterator[StreamChunk]:
        """As ``Client.chat_stream``; use ``async for``."""
        return self.stream(messages=messages, **kwargs)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
