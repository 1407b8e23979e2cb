"""A decode node's Relay stream (one per router): every request the router starts on it, their
tokens in one message per engine step, cancels and the stream's end freeing every block. The real
node service and engine behind a real gRPC server, in one process, so that the engine thread can
be held between two steps at will (a job that waits on an event: no bet on the machine's speed)."""

import asyncio

import grpc
from support.held_node import HeldNode as Node
from support.relay import Commands, relay_one, tokens_of

from splitserve.v1 import common_pb2, nodes_pb2


def generate(rid: str, prompt: list[int], max_tokens: int) -> nodes_pb2.RelayCommand:
    return nodes_pb2.RelayCommand(
        generate=nodes_pb2.GenerateOnNodeRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(
                max_tokens=max_tokens, ignore_eos=True, temperature=0.0
            ),
        )
    )


def test_one_stream_carries_every_request_in_one_message_per_step(tmp_path):
    node = Node(tmp_path)
    prompts = {f"r{i}": [3 + i, *range(10, 30 + 3 * i)] for i in range(6)}

    async def scenario():
        async with node.serving() as stub:
            alone = {}  # each prompt on a stream of its own: what the shared stream must give
            for rid, prompt in prompts.items():
                alone[rid] = tokens_of(await relay_one(stub, generate(rid + "-alone", prompt, 12)))
            await node.settled()
            steps_before = (await node.engine.figures()).counters["steps"]

            commands = Commands()
            call = stub.Relay(commands)
            for rid, prompt in prompts.items():
                commands.queue.put_nowait(generate(rid, prompt, 12))
            tokens = {rid: [] for rid in prompts}
            finished, batches, shared = set(), 0, 0
            async for batch in call:
                batches += 1
                shared += len({o.request_id for o in batch.outputs}) > 1
                for out in batch.outputs:
                    assert not out.error_code, out.error_message
                    tokens[out.request_id].extend(out.token_ids)
                    if out.finish_reason:
                        assert out.finish_reason == "length"
                        finished.add(out.request_id)
                if finished == set(prompts):
                    break
            steps = (await node.engine.figures()).counters["steps"] - steps_before
            commands.queue.put_nowait(None)
            call.cancel()
            assert tokens == alone  # token-exact with a stream of its own
            # A step's outputs never go out as more than one message (several steps' may share
            # one when the reader is slower than the engine).
            assert batches <= steps, (batches, steps)
            assert shared, "no message carried more than one request's tokens"
            await node.settled()

    asyncio.run(scenario())


def test_a_cancel_or_the_stream_ending_ends_its_requests_and_frees_their_blocks(tmp_path):
    node = Node(tmp_path)
    max_tokens = 64

    async def scenario():
        async with node.serving() as stub:
            commands = Commands()
            call = stub.Relay(commands)
            rids = [f"r{i}" for i in range(6)]
            for i, rid in enumerate(rids):
                commands.queue.put_nowait(generate(rid, list(range(5 + i, 40)), max_tokens))
            reader = aiter(call)
            got = {rid: 0 for rid in rids}
            while not all(got.values()):  # every request has its first token
                for out in (await anext(reader)).outputs:
                    got[out.request_id] += len(out.token_ids)
            # No step runs until the commands below are in: the cancels and the stream's end
            # reach the engine before any of these requests could have finished.
            gate, held = node.hold()
            commands.queue.put_nowait(nodes_pb2.RelayCommand(cancel="r0"))
            commands.queue.put_nowait(nodes_pb2.RelayCommand(cancel="r1"))
            ended = set()
            while not {"r0", "r1"} <= ended:
                for out in (await anext(reader)).outputs:
                    got[out.request_id] += len(out.token_ids)
                    if out.error_code:
                        assert out.error_code == grpc.StatusCode.CANCELLED.value[0]
                        ended.add(out.request_id)
            call.cancel()  # the router went: the other four end with the stream
            for _ in range(1200):  # until the node's handler has seen the stream end
                if not node.service.relay_streams:
                    break
                await asyncio.sleep(0.05)
            assert not node.service.relay_streams
            gate.set()
            await held
            await node.settled()
            assert all(n < max_tokens for n in got.values()), got
            # None ran to its end: each was ended by its cancel or by the stream's end. (Not
            # counted as requests_aborted: an abort marked while the engine is held may be
            # applied by the next step before its own job runs.)
            assert node.service.counters["requests_finished"] == 0

    asyncio.run(scenario())


def test_bad_commands_get_an_error_each_and_the_stream_goes_on(tmp_path):
    node = Node(tmp_path)

    async def scenario():
        async with node.serving() as stub:
            commands = Commands()
            call = stub.Relay(commands)
            vocab = node.engine.info.vocab_size
            nan_deadline = generate("nan", [5, 6], 2)
            nan_deadline.deadline_s = float("nan")
            for command in (
                generate("", [5, 6], 4),  # no id
                generate("big", [vocab + 1], 4),  # outside the vocabulary
                nodes_pb2.RelayCommand(decode=nodes_pb2.DecodeRequest(request_id="nothing")),
                nodes_pb2.RelayCommand(cancel="never-started"),
                nan_deadline,  # a deadline that is no number: the node's own bounds only
                generate("good", [5, 6, 7], 4),
            ):
                commands.queue.put_nowait(command)
            codes = {code.value[0]: code for code in grpc.StatusCode}
            errors, good, done = {}, [], False
            async for batch in call:
                for out in batch.outputs:
                    if out.error_code:
                        errors[out.request_id] = codes[out.error_code]
                        assert out.error_message
                    if out.request_id == "good":
                        good.extend(out.token_ids)
                        done = bool(out.finish_reason)
                if done:
                    break
            assert errors == {
                "": grpc.StatusCode.INVALID_ARGUMENT,
                "big": grpc.StatusCode.INVALID_ARGUMENT,
                "nothing": grpc.StatusCode.NOT_FOUND,
            }
            assert len(good) == 4 and "nan" not in errors
            commands.queue.put_nowait(None)
            call.cancel()
            await node.settled()

    asyncio.run(scenario())


def test_a_request_past_its_deadline_ends_on_the_node_with_deadline_exceeded(tmp_path):
    """The router sends each request's deadline: the node ends the request then, even while no
    step runs (the engine thread held), and its blocks are freed once it can."""
    node = Node(tmp_path)

    async def scenario():
        async with node.serving() as stub:
            commands = Commands()
            call = stub.Relay(commands)
            reader = aiter(call)
            gate, held = node.hold()  # no step runs: only the deadline can end the request
            command = generate("late", list(range(5, 30)), 64)
            command.deadline_s = 0.2
            commands.queue.put_nowait(command)
            out = next(o for o in (await anext(reader)).outputs if o.request_id == "late")
            assert out.error_code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            assert not out.token_ids and "deadline" in out.error_message
            gate.set()
            await held
            await node.settled()
            commands.queue.put_nowait(None)
            call.cancel()

    asyncio.run(scenario())
