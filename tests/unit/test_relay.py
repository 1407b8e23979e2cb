"""decode_node.relay: tokens that queued up while the event loop was busy go out in one message,
in order, the finish reason on the last; a failure queued behind tokens still sends them first;
the first token's facts give its message ``cached_tokens``."""

import asyncio
from collections import Counter

import grpc
import pytest

from splitserve.decode_node.relay import relay_tokens
from splitserve.engine.core import FirstFacts, StepOutput


class Aborted(Exception):
    pass


class Context:
    """What relay_tokens uses of a grpc.aio servicer context: ``abort`` ends the call."""

    def __init__(self) -> None:
        self.status = None

    async def abort(self, code, details):
        self.status = (code, details)
        raise Aborted(details)


def outputs(n: int, finish: str | None = "length", logprobs: bool = False) -> list[StepOutput]:
    return [
        StepOutput("r", 10 + i, -0.5 * i if logprobs else None, finish if i == n - 1 else None)
        for i in range(n)
    ]


async def relay(items, first_alone=False):
    queue: asyncio.Queue = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    context, counters, messages = Context(), Counter(), []
    try:
        async for message in relay_tokens(queue, context, "decoding", counters, first_alone):
            messages.append(message)
    except Aborted:
        pass
    return messages, context.status, counters


def test_queued_tokens_go_out_in_one_message():
    messages, status, counters = asyncio.run(relay(outputs(5, logprobs=True)))
    assert [list(m.token_ids) for m in messages] == [[10, 11, 12, 13, 14]]
    assert list(messages[0].logprobs) == pytest.approx([0, -0.5, -1.0, -1.5, -2.0])
    assert messages[0].finish_reason == "length"
    assert status is None and counters["requests_finished"] == 1


def test_the_first_token_alone_when_asked():
    messages, _, _ = asyncio.run(relay(outputs(4), first_alone=True))
    assert [list(m.token_ids) for m in messages] == [[10], [11, 12, 13]]
    assert [m.finish_reason for m in messages] == ["", "length"]
    assert not messages[0].logprobs


def test_tokens_arriving_one_by_one_go_out_one_by_one():
    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        got = []

        async def consume():
            async for message in relay_tokens(queue, Context(), "decoding", Counter()):
                got.append(list(message.token_ids))

        task = asyncio.ensure_future(consume())
        for out in outputs(3):
            queue.put_nowait(out)
            await asyncio.sleep(0.01)
        await task
        return got

    assert asyncio.run(main()) == [[10], [11], [12]]


def test_a_failure_behind_tokens_sends_the_tokens_then_ends_the_call():
    items = [*outputs(3, finish=None), RuntimeError("engine step failed")]
    messages, status, counters = asyncio.run(relay(items))
    assert [list(m.token_ids) for m in messages] == [[10, 11, 12]]
    assert status[0] == grpc.StatusCode.INTERNAL and "decoding failed" in status[1]
    assert counters["requests_finished"] == 0


def test_the_first_tokens_message_carries_its_cached_tokens():
    """Generate's first message says how much of the prompt was cached (the facts of a
    request's first token sampled on this engine); the messages after it say nothing."""
    first, *rest = outputs(4)
    items = [first._replace(facts=FirstFacts(num_cached_tokens=32)), *rest]
    messages, _, _ = asyncio.run(relay(items, first_alone=True))
    assert [(list(m.token_ids), m.cached_tokens) for m in messages] == [
        ([10], 32),
        ([11, 12, 13], 0),
    ]
    messages, _, _ = asyncio.run(relay(outputs(3)))  # a transferred request's: no facts here
    assert [m.cached_tokens for m in messages] == [0]


def test_an_engine_that_is_gone_ends_the_stream_unavailable():
    """An engine process that died fails every stream with a ConnectionError: UNAVAILABLE, the
    status the router resumes a stream on elsewhere (any other failure stays INTERNAL)."""
    items = [*outputs(2, finish=None), ConnectionError("the engine process is gone")]
    messages, status, _ = asyncio.run(relay(items))
    assert [list(m.token_ids) for m in messages] == [[10, 11]]
    assert status[0] == grpc.StatusCode.UNAVAILABLE and "the engine process is gone" in status[1]
    _, status, _ = asyncio.run(relay([ConnectionError("gone")]))
    assert status[0] == grpc.StatusCode.UNAVAILABLE


def test_a_stream_interval_sends_the_first_token_at_once_then_every_n():
    async def main(interval: int, n: int):
        queue: asyncio.Queue = asyncio.Queue()
        got = []

        async def consume():
            async for message in relay_tokens(
                queue, Context(), "decoding", Counter(), interval=interval
            ):
                got.append((list(message.token_ids), message.finish_reason))

        task = asyncio.ensure_future(consume())
        for out in outputs(n):  # one step's token at a time
            queue.put_nowait(out)
            await asyncio.sleep(0.01)
        await task
        return got

    # The first alone; then 3 at a time; the last (finished) one at once, however few.
    assert asyncio.run(main(3, 9)) == [
        ([10], ""),
        ([11, 12, 13], ""),
        ([14, 15, 16], ""),
        ([17, 18], "length"),
    ]
    assert asyncio.run(main(1, 3)) == [([10], ""), ([11], ""), ([12], "length")]


def test_a_stream_interval_still_ends_on_a_failure_after_its_tokens():
    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        context, got = Context(), []

        async def consume():
            with pytest.raises(Aborted):
                async for message in relay_tokens(
                    queue, context, "decoding", Counter(), interval=4
                ):
                    got.append(list(message.token_ids))

        task = asyncio.ensure_future(consume())
        for item in [*outputs(3, finish=None), RuntimeError("step failed")]:
            queue.put_nowait(item)
            await asyncio.sleep(0.01)
        await task
        return got, context.status

    got, status = asyncio.run(main())
    assert got == [[10], [11, 12]]
    assert status[0] == grpc.StatusCode.INTERNAL and "step failed" in status[1]
