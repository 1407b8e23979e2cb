"""Server-sent events of a streamed OpenAI ``/v1/completions`` response, parsed (pure)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["SSEParser", "StreamEvent", "error_message", "parse_event"]


@dataclass(slots=True)
class StreamEvent:
    """One server-sent event of a streamed ``/v1/completions`` response, parsed."""

    done: bool = False  # data: [DONE]
    tokens: int = 0  # token-bearing chunks count 1 each, or len(token_ids) where they are given
    usage: dict = field(default_factory=dict)
    error: str | None = None
    detail: str | None = None  # the error's message
    text: str = ""  # the text its choices carry


def parse_event(data: str) -> StreamEvent:
    """A completion chunk's ``data``. A chunk with choices bears tokens, unless it carries only a
    finish reason (no text, no token ids); the last chunk has ``choices: []`` and ``usage``."""
    if data.strip() == "[DONE]":
        return StreamEvent(done=True)
    body = json.loads(data)
    if not isinstance(body, dict):
        raise ValueError(f"a stream event that is not an object: {data[:80]!r}")
    if "error" in body:
        err = body["error"]
        code = (err.get("code") or err.get("type")) if isinstance(err, dict) else err
        message = err.get("message") if isinstance(err, dict) else None
        return StreamEvent(error=f"stream error {code}", detail=message or str(err))
    event = StreamEvent(usage=body.get("usage") or {})
    for choice in body.get("choices") or ():
        ids = choice.get("token_ids")
        text = choice.get("text")
        if text is None:  # a chat chunk
            text = (choice.get("delta") or {}).get("content")
        event.text += text or ""
        if ids:
            event.tokens += len(ids)
        elif text or not choice.get("finish_reason"):
            event.tokens += 1
    return event


def error_message(body: bytes) -> str:
    """An error response's message: OpenAI's ``{"error": {"message"}}``, else the body's text."""
    try:
        err = json.loads(body).get("error")
        message = err.get("message") if isinstance(err, dict) else err
        if message:
            return str(message)[:500]
    except (ValueError, AttributeError):
        pass
    return body[:500].decode("utf-8", "replace")


class SSEParser:
    """Server-sent events from a byte stream in arbitrary pieces: ``feed`` yields the ``data``
    of each complete event (several ``data:`` lines joined with newlines; comments, ``event:``,
    ``id:`` and ``retry:`` fields skipped)."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, piece: bytes) -> Iterator[str]:
        self._buffer += piece
        *lines, self._buffer = self._buffer.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8")
            if not line:
                if self._data:
                    yield "\n".join(self._data)
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))

    def close(self) -> Iterator[str]:
        """The last event when the stream ended without a blank line after it."""
        if self._buffer:
            yield from self.feed(b"\n")
        if self._data:
            yield "\n".join(self._data)
            self._data = []
