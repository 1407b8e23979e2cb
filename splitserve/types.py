"""What the client SDK hands back: results, stream chunks, usage, and the one error it raises.

Plain values (no gRPC stubs): ``splitserve.client`` makes them from the router's messages and
re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from splitserve.runtime.protocol import Usage


class SplitserveError(Exception):
    """A request failed. ``code`` is a ``grpc.StatusCode``; ``message`` says what went wrong."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """One piece of a streamed completion; the last one has ``finish_reason`` and ``usage``."""

    text: str  # complete UTF-8 characters only
    token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last chunk
    usage: Usage | None = None
    logprobs: tuple[float, ...] = ()
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class GenerateResult:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    logprobs: tuple[float, ...] = ()
    request_id: str = ""


class Collector:
    """Joins a stream's chunks into a ``GenerateResult``."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.last: StreamChunk | None = None

    def add(self, chunk: StreamChunk) -> None:
        self.text.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.last = chunk

    def result(self) -> GenerateResult:
        last = self.last
        if last is None or last.finish_reason is None or last.usage is None:
            raise SplitserveError(
                grpc.StatusCode.INTERNAL, "the server ended the stream without a finish reason"
            )
        return GenerateResult(
            text="".join(self.text),
            token_ids=tuple(self.token_ids),
            finish_reason=last.finish_reason,
            usage=last.usage,
            logprobs=tuple(self.logprobs),
            request_id=last.request_id,
        )
