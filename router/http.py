"""The OpenAI-compatible HTTP API of the router process: ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``.

aiohttp serves it on the router's own event loop, beside grpc.aio: a request takes the same path
as a gRPC one (``router.front.RequestFront``), so limits, metrics and errors are shared. Streams
are server-sent events (``data: {...}`` lines, then ``data: [DONE]``); the response starts only
once the first token is there, so a request refused in admission or prefill still gets its HTTP
status (429, 503, ...). A client that goes away cancels its request in the pools (aiohttp cancels
the handler on disconnect), which frees its KV blocks. With ``--api-key-file`` every route but
``/health`` needs ``Authorization: Bearer <key>`` (``router.api_keys``; else 401); with
``--http-tls-cert/--http-tls-key`` it is served over HTTPS (``https_context``).

Over 300 lines: the OpenAI-compatible routes (completions, chat, models), their request checks,
their streaming replies and OpenAI's response objects; the request path below them is shared
with gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import ssl
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from splitserve.router.api_keys import ApiKeys
from splitserve.router.front import CLIENT_KEY, RequestFront
from splitserve.router.openai_api import (
    SLO_HEADER,
    TIMEOUT_HEADER,
    ApiError,
    ApiRequest,
    parse_body,
    request_timeout,
)
from splitserve.router.output import Delta, Step
from splitserve.router.request import GenerateError, GenerateInput, ModelInfo
from splitserve.runtime import tracing
from splitserve.runtime.failure import Failure

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Outputs = AsyncGenerator[tuple[int, Step], None]  # (choice index, step) of every choice

SALT_HEADER = "x-splitserve-cache-salt"  # a tenant's prefix cache, as the body's cache_salt
# Beside it, from router.openai_api (which checks their values): SLO_HEADER, "x-splitserve-slo"
# (the request's own SLO), and TIMEOUT_HEADER, "x-request-timeout" (the client's deadline, s).
_END = object()
ACCEPT_BACKLOG = 4096  # connections waiting to be accepted (the kernel caps it at somaxconn)
OPEN_PATHS = frozenset({"/health"})  # answered without an API key (probes carry none)
API_CLIENT = "splitserve.api_client"  # the request's key as a client (ApiKeys.client_of)
UNAUTHORIZED = (
    "a valid API key is required: send the header Authorization: Bearer <key>, with a key of "
    "the router's --api-key-file"
)


def https_context(cert: str, key: str) -> ssl.SSLContext:
    """The server context of the HTTPS front (TLS 1.2 or later); ``ValueError`` saying which
    file does not load."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(
            f"--http-tls-cert {cert} / --http-tls-key {key}: cannot load them ({exc}); give a "
            "PEM certificate (chain) and its private key"
        ) from None
    return context


def _error(exc: ApiError, retry_after_s: int | None = None) -> web.Response:
    """OpenAI's error JSON; a refusal for want of room says when to retry (Retry-After)."""
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return web.json_response(exc.body(), status=exc.status, headers=headers)


@web.middleware
async def _openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own refusals (unknown route, wrong method, a body over the size limit) in
    OpenAI's error JSON too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        return _error(ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}", kind))
    except (asyncio.CancelledError, ConnectionError):
        raise  # the client went away: nobody to answer
    except Exception:
        logger.exception("HTTP %s %s failed", request.method, request.path)
        return _error(ApiError(500, "internal error (logged by the router)", "server_error"))


def _require_key(keys: ApiKeys, count_refused: Callable[[], None]):
    @web.middleware
    async def require_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every route but the open ones needs a key of the file (unknown routes too: a caller
        without one learns nothing of what is served)."""
        if request.path not in OPEN_PATHS:
            client = keys.client_of(request.headers.get("Authorization"))
            if client is None:
                count_refused()
                error = ApiError(401, UNAUTHORIZED, "authentication_error")
                return web.json_response(
                    error.body(), status=401, headers={"WWW-Authenticate": "Bearer"}
                )
            request[API_CLIENT] = client
        return await handler(request)

    return require_key


class HttpFront:
    def __init__(
        self,
        front: RequestFront,
        model_name: str,
        max_request_bytes: int,
        ready: Callable[[], bool] = lambda: True,
        grace_s: float = 5.0,
        api_keys: ApiKeys | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._grace_s = grace_s
        self._tls = tls
        self._front = front
        self._model = front.model
        self.model_name = model_name
        self._ready = ready
        self._created = int(time.time())
        middlewares: list = [_openai_errors]
        if api_keys is not None:
            refused = functools.partial(front.count_refused, Failure.UNAUTHENTICATED)
            middlewares.insert(0, _require_key(api_keys, refused))  # outermost: runs first
        self.app = web.Application(client_max_size=max_request_bytes, middlewares=middlewares)
        self.app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/v1/models/{model}", self.model_card),
                web.get("/health", self.health),
            ]
        )
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Listen (``reuse_port``: sharing the port with other routers); returns the bound
        port."""
        # handler_cancellation: a client that disconnects cancels its handler, hence its request.
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=self._grace_s
        )
        await self._runner.setup()
        # A burst of clients connects at once (a benchmark opens hundreds of streams): a short
        # accept backlog (aiohttp's default is 128) drops SYNs, which the kernel retries 1 s later.
        site = web.TCPSite(
            self._runner,
            host,
            port,
            reuse_port=reuse_port,
            backlog=ACCEPT_BACKLOG,
            ssl_context=self._tls,
        )
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        scheme = "https" if self._tls is not None else "http"
        logger.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", scheme, host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # ------------------------------------------------------------------ simple routes

    async def health(self, request: web.Request) -> web.Response:
        if self._ready():
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "no usable prefill or decode node"}, status=503)

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "splitserve",
            "max_model_len": self._model.max_model_len,
        }

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model_card(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.model_name:
            message = f"model {name[:100]!r} does not exist; this server serves {self.model_name!r}"
            return _error(ApiError(404, message, "not_found_error", "model"))
        return web.json_response(self._card())

    # ------------------------------------------------------------------ generation

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        received = time.monotonic()
        try:
            timeout = request_timeout(request.headers.get(TIMEOUT_HEADER))
            try:
                body = await request.json(loads=json.loads)
            except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
                raise ApiError.bad(f"the request body is not valid JSON: {exc}") from None
            except web.HTTPRequestEntityTooLarge as exc:
                raise ApiError(
                    413, f"{exc.text} (the router's --max-request-bytes)", "invalid_request_error"
                ) from None
            api = parse_body(
                body,
                chat,
                self.model_name,
                self._model,
                request.headers.get(SALT_HEADER, ""),
                request.headers.get("x-request-id"),
                request.headers.get(SLO_HEADER),
            )
        except ApiError as exc:
            self._front.count_refused(exc.failure)
            return _error(exc)
        # With API keys the key is the client: a caller cannot dodge its cap by naming another.
        client = (
            request.get(API_CLIENT)
            or request.headers.get(CLIENT_KEY)
            or body.get("user")
            or request.remote
            or "-"
        )
        deadline = None if timeout is None else received + timeout
        trace = tracing.carrier_of(request.headers.items())  # (empty: tracing off)
        outputs = self._outputs(api, str(client)[:64], deadline, trace)
        try:
            async with contextlib.aclosing(outputs):
                if api.stream:
                    return await self._stream(request, api, outputs)
                return await self._whole(api, outputs)
        except GenerateError as exc:
            return _error(ApiError.of_failure(exc.code, exc.message), exc.retry_after_s)

    async def _outputs(
        self, api: ApiRequest, client: str, deadline: float | None, trace: Mapping[str, str]
    ) -> Outputs:
        """(choice index, step) of every choice as they come; ``GenerateError`` if any fails
        (the others are cancelled). ``deadline``: the client's (``time.monotonic()``; None:
        the router's --request-timeout-s alone)."""

        def run(request: GenerateInput):
            left = None if deadline is None else deadline - time.monotonic()
            return self._front.run(request, client, time_remaining=left, trace=trace)

        if len(api.requests) == 1:
            async with contextlib.aclosing(run(api.requests[0])) as steps:
                async for _, step in steps:
                    yield 0, step
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, request: GenerateInput) -> None:
            try:
                async with contextlib.aclosing(run(request)) as steps:
                    async for _, step in steps:
                        queue.put_nowait((index, step))
            except Exception as exc:  # GenerateError, or a bug: the request fails either way
                queue.put_nowait((index, exc))
            finally:
                queue.put_nowait((index, _END))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(api.requests)]
        try:
            live = len(tasks)
            while live:
                index, item = await queue.get()
                if item is _END:
                    live -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _head(self, api: ApiRequest) -> dict[str, Any]:
        """The fields every response object (a stream's: every chunk) to ``api`` starts with."""
        chat_kind = "chat.completion.chunk" if api.stream else "chat.completion"
        return {
            "id": ("chatcmpl-" if api.chat else "cmpl-") + api.request_id,
            "created": int(time.time()),
            "model": self.model_name,
            "object": chat_kind if api.chat else "text_completion",
        }

    async def _whole(self, api: ApiRequest, outputs: Outputs) -> web.Response:
        choices = [Choice() for _ in api.requests]
        async for index, step in outputs:
            choices[index].add(step)
        out = [self._choice(api, index, c.delta()) for index, c in enumerate(choices)]
        usage = usage_json([(i, c.usage) for i, c in enumerate(choices)], api.n)
        return web.json_response({**self._head(api), "choices": out, "usage": usage})

    async def _stream(
        self, request: web.Request, api: ApiRequest, outputs: Outputs
    ) -> web.StreamResponse:
        # The first step before the headers: a refusal still gets its own status.
        item = await anext(outputs, None)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        head = self._head(api)
        extra = {"usage": None} if api.include_usage else {}
        usages: list[tuple[int, Any]] = []
        started: set[int] = set()

        async def send(payload: dict[str, Any]) -> None:
            await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        try:
            while item is not None:
                index, step = item
                choice = self._choice(api, index, step.delta, first=index not in started)
                started.add(index)
                await send({**head, "choices": [choice], **extra})
                if step.usage is not None:
                    usages.append((index, step.usage))
                item = await anext(outputs, None)
            if api.include_usage:
                await send({**head, "choices": [], "usage": usage_json(usages, api.n)})
        except GenerateError as exc:  # after the headers: an error event ends the stream
            await send(ApiError.of_failure(exc.code, exc.message).body())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _choice(self, api: ApiRequest, index: int, delta: Delta, first: bool = False) -> dict:
        """A choice of a whole answer, or of a stream's chunk (``first``: the choice's first,
        whose chat delta names the role)."""
        choice: dict[str, Any] = {"index": index}
        if not api.chat:
            choice["text"] = delta.text
        elif not api.stream:
            choice["message"] = {"role": "assistant", "content": delta.text}
        else:
            choice["delta"] = {"content": delta.text}
            if first:
                choice["delta"]["role"] = "assistant"
        choice["logprobs"] = logprobs_json(self._model, api, delta.token_ids, delta.logprobs)
        choice["finish_reason"] = delta.finish_reason or None
        if api.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return choice


# ------------------------------------------------------------------ OpenAI's response objects


def logprobs_json(
    model: ModelInfo, api: ApiRequest, token_ids: list[int], logprobs: list[float]
) -> dict[str, Any] | None:
    """OpenAI's logprobs of a choice's tokens, in the shape of ``api``'s route (None: not asked
    for)."""
    if not api.logprobs:
        return None
    tokenizer = model.tokenizer
    tokens = [f"token_id:{t}" if tokenizer is None else tokenizer.decode([t]) for t in token_ids]
    if api.chat:
        return {
            "content": [
                {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
                for tok, lp in zip(tokens, logprobs, strict=False)
            ]
        }
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None}


def usage_json(usages: list[tuple[int, Any]], n: int) -> dict[str, Any]:
    """OpenAI's usage of a request: each prompt counted once, every choice's completion."""
    prompt = sum(u.prompt_tokens for i, u in usages if i % n == 0)
    cached = sum(u.cached_tokens for i, u in usages if i % n == 0)
    completion = sum(u.completion_tokens for _, u in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class Choice:
    """One choice's output, gathered for a non-streamed answer."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason = ""
        self.usage = None

    def add(self, step: Step) -> None:
        self.text.append(step.delta.text)
        self.token_ids.extend(step.delta.token_ids)
        self.logprobs.extend(step.delta.logprobs)
        self.finish_reason = step.delta.finish_reason or self.finish_reason
        if step.usage is not None:
            self.usage = step.usage

    def delta(self) -> Delta:
        return Delta("".join(self.text), self.token_ids, self.logprobs, self.finish_reason)
