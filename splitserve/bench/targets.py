"""Where requests go: a splitserve router over gRPC, or an OpenAI-compatible HTTP server.

``Target.send`` streams one request and fills a ``RequestRecord``: when it was sent, when each
token-bearing chunk came, when it ended, the token counts the server reported, or the failure:
the gRPC status code's name (``RESOURCE_EXHAUSTED``), ``HTTP <status>``, ``stream error <code>``
(an error event after an HTTP stream started), ``timeout``, or the exception's class name.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from splitserve.bench.metrics import RequestRecord
from splitserve.bench.sse import SSEParser, error_message, parse_event
from splitserve.bench.workloads import BenchRequest
from splitserve.runtime.slo import Slo

__all__ = ["CLIENT_HEADER", "SLO_HEADER", "GrpcTarget", "HttpTarget", "make_target"]

# A splitserve router reads a request's own SLO from this header (router.http.SLO_HEADER; the
# benchmark talks to any OpenAI-compatible server, so it loads no router code).
SLO_HEADER = "x-splitserve-slo"
# ... and the client (a tenant) a request counts against from this gRPC metadata key / HTTP header
# (router.front.CLIENT_KEY): its fair share of the pools and its in-flight cap.
CLIENT_HEADER = "x-splitserve-client"


def make_target(url: str, **options: Any) -> GrpcTarget | HttpTarget:
    """``http://host:port`` (or https) → HttpTarget; ``grpc://host:port`` or ``host:port`` →
    GrpcTarget."""
    if url.startswith(("http://", "https://")):
        return HttpTarget(url, **options)
    address = url.removeprefix("grpc://")
    if not address or "://" in address or ":" not in address:
        raise ValueError(f"bad --target {url!r}: give grpc://host:port, host:port or http://...")
    return GrpcTarget(address, **options)


class _Target:
    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        temperature: float = 0.0,
        ignore_eos: bool = True,
        timeout: float = 600.0,
        api_key: str | None = None,
        cache_salt: str | None = None,
        credentials: Any = None,
        ssl_context: Any = None,
        slo: Slo | None = None,
        client_id: str | None = None,
    ) -> None:
        if client_id is not None and not (client_id.isascii() and client_id.isprintable()):
            raise ValueError(f"--client-id {client_id!r}: give printable ASCII (a header value)")
        self.url = url
        self.client_id = client_id or None  # sent as CLIENT_HEADER with every request; None: no
        self.slo = slo  # sent with every request as its own SLO (--send-slo); None: none
        self.credentials = credentials  # gRPC: a router serving mTLS (grpc.ChannelCredentials)
        self.ssl_context = ssl_context  # https://: the CA to trust (ssl.SSLContext; None: system)
        self.cache_salt = cache_salt
        self.model = model
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.timeout = timeout
        self.api_key = api_key
        self.t0 = time.perf_counter()  # the benchmark's start: records count from it

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def send(self, req: BenchRequest, record: RequestRecord) -> RequestRecord:
        record.start = self.now()
        try:
            async with asyncio.timeout(self.timeout):
                await self._stream(req, record)
            if record.error is None and not record.token_times:
                record.error, record.detail = "no output", "the stream ended without a token"
        except TimeoutError:
            record.error, record.detail = "timeout", f"not done within {self.timeout:g} s"
        except Exception as exc:  # every failure is counted, by kind
            record.error = self._failure(exc)
            record.detail = (getattr(exc, "message", None) or str(exc) or repr(exc))[:500]
        record.end = self.now()
        return record

    def _failure(self, exc: Exception) -> str:
        return type(exc).__name__

    async def _stream(self, req: BenchRequest, record: RequestRecord) -> None:
        raise NotImplementedError

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        pass


GRPC_CONNECTIONS = 16  # requests go round robin over this many connections to the router


class GrpcTarget(_Target):
    """A splitserve router: ``RouterService.Generate`` through ``AsyncClient.stream``."""

    kind = "grpc"

    def __init__(self, address: str, **options: Any) -> None:
        super().__init__(address, **options)
        from splitserve.client import AsyncClient

        # NOTE: several connections, as many users would open: one HTTP/2 connection carrying
        # thousands of streams makes the transport's stream limits part of what is measured
        # (streams held back by the client, or reset at once, under overload).
        self._clients = [
            AsyncClient(
                address,
                options=[
                    ("grpc.max_receive_message_length", -1),
                    ("grpc.use_local_subchannel_pool", 1),  # a connection of its own
                ],
                credentials=self.credentials,
                api_key=self.api_key,
            )
            for _ in range(GRPC_CONNECTIONS)
        ]
        self._next = 0

    async def prepare(self) -> None:
        """Every connection open before the start: the first requests do not wait for one."""
        try:
            await asyncio.gather(*(c.connect(timeout=30) for c in self._clients))
        except TimeoutError:
            raise OSError(f"cannot reach {self.url} (30 s)") from None

    def _failure(self, exc: Exception) -> str:
        from splitserve.client import SplitserveError

        return exc.code.name if isinstance(exc, SplitserveError) else type(exc).__name__

    async def _stream(self, req: BenchRequest, record: RequestRecord) -> None:
        prompt = req.prompt if isinstance(req.prompt, str) else None
        ids = None if isinstance(req.prompt, str) else list(req.prompt)
        client = self._clients[self._next % len(self._clients)]
        self._next += 1
        stream = client.stream(
            prompt=prompt,
            prompt_token_ids=ids,
            max_tokens=req.max_tokens,
            temperature=self.temperature,
            ignore_eos=self.ignore_eos,
            cache_salt=self.cache_salt,
            timeout=self.timeout,
            slo=self.slo,
            metadata=[(CLIENT_HEADER, self.client_id)] if self.client_id else (),
        )
        async for chunk in stream:
            if chunk.token_ids:
                record.token_times.append(self.now())
                record.output_tokens += len(chunk.token_ids)
                if isinstance(record.answer, list):
                    record.answer.extend(chunk.token_ids)
                elif isinstance(record.answer, str):
                    record.answer += chunk.text
            if chunk.usage is not None:
                record.prompt_tokens = chunk.usage.prompt_tokens
                record.cached_tokens = chunk.usage.cached_tokens
                record.output_tokens = chunk.usage.completion_tokens

    async def close(self) -> None:
        for client in self._clients:
            await client.close()


class HttpTarget(_Target):
    """An OpenAI-compatible server: streamed ``POST /v1/completions`` with usage."""

    kind = "http"

    def __init__(self, url: str, **options: Any) -> None:
        base = url.rstrip("/").removesuffix("/v1")
        super().__init__(base, **options)
        self._session = None

    def _headers(self) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        if self.slo is not None:
            headers[SLO_HEADER] = str(self.slo)
        if self.client_id:
            headers[CLIENT_HEADER] = self.client_id
        return headers

    def _get_session(self):
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession(
                # limit 0: as many connections as requests
                connector=aiohttp.TCPConnector(limit=0, ssl=self.ssl_context or True),
                timeout=aiohttp.ClientTimeout(total=None),
                headers=self._headers(),
            )
        return self._session

    async def prepare(self) -> None:
        """Without --model: the first model ``GET /v1/models`` lists."""
        if self.model:
            return
        async with self._get_session().get(self.url + "/v1/models") as resp:
            if resp.status != 200:
                raise ValueError(f"GET {self.url}/v1/models answered HTTP {resp.status}")
            models = (await resp.json()).get("data") or []
        if not models:
            raise ValueError(f"{self.url}/v1/models lists no model; give --model")
        self.model = models[0]["id"]

    def body(self, req: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": req.prompt if isinstance(req.prompt, str) else list(req.prompt),
            "max_tokens": req.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM, SGLang and splitserve take it
        if self.cache_salt:
            body["cache_salt"] = self.cache_salt  # vLLM and splitserve take it
        return body

    async def _stream(self, req: BenchRequest, record: RequestRecord) -> None:
        session = self._get_session()
        async with session.post(self.url + "/v1/completions", json=self.body(req)) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}"
                record.detail = error_message(await resp.read())
                return
            parser = SSEParser()
            async for piece in resp.content.iter_any():
                for data in parser.feed(piece):
                    if self._event(data, record):
                        return
            for data in parser.close():
                if self._event(data, record):
                    return

    def _event(self, data: str, record: RequestRecord) -> bool:
        """Record one event; True when the stream is over."""
        event = parse_event(data)
        if event.error:
            record.error, record.detail = event.error, event.detail
            return True
        if event.tokens:
            record.token_times.append(self.now())
            record.output_tokens += event.tokens
            if isinstance(record.answer, str):
                record.answer += event.text
        if event.usage:
            u = event.usage
            record.prompt_tokens = u.get("prompt_tokens", record.prompt_tokens)
            record.output_tokens = u.get("completion_tokens", record.output_tokens)
            details = u.get("prompt_tokens_details") or {}
            record.cached_tokens = details.get("cached_tokens", record.cached_tokens)
        return event.done

    def _failure(self, exc: Exception) -> str:
        if isinstance(exc, json.JSONDecodeError | UnicodeDecodeError):
            return "bad stream"
        return type(exc).__name__

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
