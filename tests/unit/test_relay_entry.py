"""decode_node.relay_stream: a request's outputs on its router's Relay stream. Tokens that queued
up go out in one output, the first token alone; with a stream interval, every N after the first;
a failure behind tokens sends them first, then the error; the first token's facts give its
output ``cached_tokens``; an engine that is gone ends the request UNAVAILABLE (the router resumes
it elsewhere on that status only). The whole stream against a real node: tests/cluster/
test_relay_stream.py."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc

from splitserve.decode_node.relay_stream import _Live
from splitserve.engine.core import FirstFacts, StepOutput
from splitserve.v1 import nodes_pb2


class Stream:
    """What a request's entry uses of its RelayStream: the interval, counters, ``ready``."""

    def __init__(self, interval: int = 1) -> None:
        self.interval = interval
        self.counters: Counter[str] = Counter()
        self.readied = 0
        self.direct: list[tuple[int, int]] = []

    def ready(self, live: _Live) -> None:
        self.readied += 1

    def count_direct(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.direct.append((prompt_tokens, cached_tokens))


def out(token: int, finish: str | None = None, cached: int | None = None) -> StepOutput:
    facts = FirstFacts(cached) if cached is not None else None
    return StepOutput("r", token, None, finish, facts)


def taken(live: _Live) -> nodes_pb2.RelayOutput:
    message = nodes_pb2.RelayOutput()
    live.take(message)
    return message


def run(test) -> None:
    async def main():
        test()

    asyncio.run(main())


def test_queued_tokens_go_out_in_one_output_the_first_alone():
    def test():
        stream = Stream()
        live = _Live(stream, "r")  # type: ignore[arg-type]
        live.put_nowait(out(1, cached=5))
        first = taken(live)
        assert (list(first.token_ids), first.cached_tokens) == ([1], 5)
        for token in (2, 3, 4):
            live.put_nowait(out(token))
        live.put_nowait(out(5, finish="length"))
        rest = taken(live)
        assert (list(rest.token_ids), rest.finish_reason, rest.cached_tokens) == (
            [2, 3, 4, 5],
            "length",
            0,
        )
        assert live.done.done() and stream.counters["requests_finished"] == 1

    run(test)


def test_a_stream_interval_sends_the_first_at_once_then_every_n():
    def test():
        stream = Stream(interval=3)
        live = _Live(stream, "r")  # type: ignore[arg-type]
        live.put_nowait(out(1))
        assert stream.readied == 1  # the first token: at once
        taken(live)
        live.put_nowait(out(2))
        live.put_nowait(out(3))
        assert stream.readied == 1  # two of three: not yet
        live.put_nowait(out(4))
        assert stream.readied == 2 and list(taken(live).token_ids) == [2, 3, 4]
        live.put_nowait(out(5, finish="stop"))  # the last: at once
        assert stream.readied == 3 and taken(live).finish_reason == "stop"

    run(test)


def test_a_failure_behind_tokens_sends_them_then_the_error():
    def test():
        live = _Live(Stream(interval=4), "r")  # type: ignore[arg-type]
        live.put_nowait(out(1))
        taken(live)
        live.put_nowait(out(2))
        live.put_nowait(RuntimeError("the step failed"))
        live.put_nowait(out(3))  # nothing after the failure
        message = taken(live)
        assert list(message.token_ids) == [2]
        assert message.error_code == grpc.StatusCode.INTERNAL.value[0]
        assert "the step failed" in message.error_message and live.done.done()

    run(test)


def test_an_engine_that_is_gone_ends_the_request_unavailable():
    def test():
        live = _Live(Stream(), "r")  # type: ignore[arg-type]
        live.put_nowait(ConnectionError("engine process exited"))
        assert taken(live).error_code == grpc.StatusCode.UNAVAILABLE.value[0]

    run(test)


def test_a_direct_requests_first_token_counts_its_cached_prompt():
    def test():
        stream = Stream()
        live = _Live(stream, "r")  # type: ignore[arg-type]
        live.prompt_tokens = 40
        live.put_nowait(out(7, cached=32))
        assert stream.direct == [(40, 32)] and taken(live).cached_tokens == 32

    run(test)
