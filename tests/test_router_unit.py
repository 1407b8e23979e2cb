"""Router pieces without model nodes: detokenizer, stop strings, node choice, validation, and the
orchestration against fake prefill/decode servicers on loopback (real gRPC, fake model)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence

import grpc
import pytest

from splitserve.models.tiny import build_byte_tokenizer
from splitserve.router.detokenizer import IncrementalDetokenizer, StopStringMatcher
from splitserve.router.output import OutputAssembler
from splitserve.router.registry import MAX_IMBALANCE, NodePool, prompt_tokens_to_compute
from splitserve.router.request import InvalidRequest, ModelInfo, parse_request
from splitserve.router.server import start_router
from splitserve.runtime.config import RouterConfig
from splitserve.v1 import common_pb2, nodes_pb2, nodes_pb2_grpc, router_pb2, router_pb2_grpc

TOKENIZER = build_byte_tokenizer()
EOS = TOKENIZER.eos_token_id
SAMPLE_TEXT = "héllo wörld — 日本語 🚀 ok"


def byte_ids(text: str) -> list[int]:
    return list(text.encode())


def random_text(rng: random.Random, n: int) -> str:
    alphabet = "ab é日🚀\n"
    return "".join(rng.choice(alphabet) for _ in range(n))


# --- incremental detokenizer ------------------------------------------------------------------


def test_multibyte_characters_split_across_tokens_are_never_emitted_partially():
    detok = IncrementalDetokenizer(TOKENIZER)
    deltas = [detok.add([b]) for b in byte_ids(SAMPLE_TEXT)]
    deltas.append(detok.flush())
    assert "".join(deltas) == SAMPLE_TEXT
    assert all("\ufffd" not in d for d in deltas)
    # "é" is two tokens: nothing after its first byte, the whole character after its second.
    first = SAMPLE_TEXT.encode().index("é".encode())
    assert deltas[first] == "" and deltas[first + 1] == "é"


def test_detokenizer_matches_a_full_decode_for_random_batches():
    rng = random.Random()
    text = random_text(rng, 200)
    ids = [*byte_ids(text), EOS]
    detok = IncrementalDetokenizer(TOKENIZER)
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        out.append(detok.add(ids[i : i + n]))
        i += n
    out.append(detok.flush())
    assert "".join(out) == text  # EOS is a special token: no text
    assert all(not d.endswith("\ufffd") for d in out)


def test_flush_surfaces_an_incomplete_character_at_the_end():
    detok = IncrementalDetokenizer(TOKENIZER)
    assert detok.add([*byte_ids("ab"), "日".encode()[0]]) == "ab"
    assert detok.flush() == "\ufffd"


# --- stop strings -----------------------------------------------------------------------------


def run_assembler(ids: Sequence[int], stop: Sequence[str], batch: int = 1, finish="length"):
    out = OutputAssembler(TOKENIZER, stop)
    deltas = []
    for i in range(0, len(ids), batch):
        last = i + batch >= len(ids)
        deltas.append(out.add(ids[i : i + batch], finish_reason=finish if last else ""))
        if out.finished:
            break
    return out, deltas


def test_stop_string_across_token_boundaries_is_cut_and_stops_the_request():
    out, deltas = run_assembler(byte_ids("hello world, more"), ["o w"])
    assert "".join(d.text for d in deltas) == "hell"
    assert out.finish_reason == "stop" and deltas[-1].finish_reason == "stop"
    tokens = [t for d in deltas for t in d.token_ids]
    assert bytes(tokens) == b"hello w"  # up to the token that completed the stop string
    assert out.num_tokens == len(tokens)


def test_text_that_might_start_a_stop_string_is_held_back_until_ruled_out():
    out = OutputAssembler(TOKENIZER, ["wxyz", "bcd"])
    assert "".join(out.add([t]).text for t in byte_ids("abc wx")) == "abc "  # "wx" may go on
    assert out.add(byte_ids("q")).text == "wxq"
    assert out.add(byte_ids("wx"), finish_reason="length").text == "wx"  # released at finish
    assert out.finish_reason == "length"


def test_stop_string_with_a_multibyte_character_split_across_tokens():
    out, deltas = run_assembler(byte_ids("prix: 5€ net"), ["€"], batch=3)
    assert "".join(d.text for d in deltas) == "prix: 5"
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("trial", range(5))
def test_random_text_and_stop_strings_match_a_plain_search(trial):
    rng = random.Random()
    text = random_text(rng, 120)
    stops = [random_text(rng, rng.randint(1, 3)) for _ in range(rng.randint(1, 3))]
    out, deltas = run_assembler(byte_ids(text), stops, batch=rng.randint(1, 4))
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    got = "".join(d.text for d in deltas)
    if hits:
        assert got == text[: min(hits)] and out.finish_reason == "stop"
    else:
        assert got == text and out.finish_reason == "length"


def test_stop_matcher_without_stop_strings_holds_nothing_back():
    matcher = StopStringMatcher(())
    assert matcher.add("abc") == ("abc", False)


# --- node choice ------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pick_least_loaded_with_round_robin_among_ties():
    pool = NodePool("decode", ["a:1", "b:2", "c:3"], clock=FakeClock())
    a, b, c = pool.nodes
    picked = [pool.pick() for _ in range(6)]
    assert [n.address for n in picked] == ["a:1", "b:2", "c:3"] * 2
    pool.acquire(a)
    pool.acquire(b)
    assert pool.pick() is c
    pool.acquire(c)
    pool.acquire(c)
    assert {pool.pick(), pool.pick()} == {a, b}
    pool.release(a)
    assert pool.pick() is a
    assert pool.pick(exclude={a}) is b


def test_cache_aware_pick_on_decode_keeps_within_the_imbalance_guard():
    pool = NodePool("decode", ["a:1", "b:2"], clock=FakeClock())
    a, b = pool.nodes
    cached = {"a:1": 5}
    for _ in range(MAX_IMBALANCE):
        assert pool.pick(cached=cached) is a
        pool.acquire(a)
    assert pool.pick(cached=cached) is a  # at the guard's limit: still the node with the blocks
    pool.acquire(a)
    assert pool.pick(cached=cached) is b  # beyond it: the burst goes elsewhere


def test_prefill_pick_weighs_cached_prefix_against_queued_work():
    pool = NodePool("prefill", ["a:1", "b:2"], clock=FakeClock())
    a, b = pool.nodes
    cached = {"a:1": 18}  # a holds 288 of the prompt's 320 tokens: 32 to compute there
    order = []
    for _ in range(12):
        node = pool.pick(cached=cached, prompt_tokens=320)
        work = prompt_tokens_to_compute(320, cached.get(node.address, 0), 16)
        pool.acquire(node, work)
        order.append(node.address)
    # a takes requests until its queue (9 x 32 = 288 tokens) plus 32 reaches b's 320; then b.
    assert order[:9] == ["a:1"] * 9 and "b:2" in order[9:11]
    assert b.queued_tokens == 320 and a.queued_tokens == 32 * order.count("a:1")
    pool.release(b, 320)
    assert b.queued_tokens == 0
    # Without an index: the node with less queued work, whatever the request counts.
    assert pool.pick(prompt_tokens=100) is b
    assert prompt_tokens_to_compute(320, 20, 16) == 1  # the last token is always computed


def test_down_nodes_are_skipped_then_tried_again():
    clock = FakeClock()
    pool = NodePool("prefill", ["a:1", "b:2"], clock=clock, down_s=3.0)
    a, b = pool.nodes
    pool.acquire(b)  # b is busier, but a is down
    pool.mark_down(a, "UNAVAILABLE: connection refused")
    assert all(pool.pick() is b for _ in range(3))
    assert "a:1 (down: UNAVAILABLE" in pool.describe()
    clock.now += 3.0
    assert pool.pick() is a  # back after the down period
    pool.mark_down(a, "again")
    clock.now += 1.0
    pool.mark_down(b, "b too")
    assert pool.pick() is a  # all down: the oldest failure is tried rather than none
    assert pool.pick(exclude={a, b}) is None
    pool.mark_up(b)
    assert pool.pick() is b


# --- validation -------------------------------------------------------------------------------

MODEL = ModelInfo(tokenizer=TOKENIZER, vocab_size=320, max_model_len=64)


def request(**kwargs) -> router_pb2.GenerateRequest:
    sampling = kwargs.pop("sampling", {})
    if "prompt" in kwargs:
        kwargs["text"] = kwargs.pop("prompt")
    if "prompt_token_ids" in kwargs:
        kwargs["token_ids"] = router_pb2.TokenIds(ids=kwargs.pop("prompt_token_ids"))
    return router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(**sampling), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({}, "empty"),
        ({"prompt": "x" * 64}, "at most 63"),
        ({"prompt_token_ids": [1] * 64}, "token_ids"),
        ({"prompt": "hi", "sampling": {"max_tokens": 0}}, "max_tokens"),
        ({"prompt": "hi", "sampling": {"max_tokens": -3}}, "max_tokens"),
        ({"prompt": "hi", "sampling": {"temperature": -0.5}}, "temperature"),
        ({"prompt": "hi", "sampling": {"top_p": 0.0}}, "top_p"),
        ({"prompt": "hi", "sampling": {"top_k": -7}}, "top_k"),
        ({"prompt": "hi", "sampling": {"temperature": float("nan")}}, "temperature"),
        ({"prompt_token_ids": [5, 320, 7]}, "token_ids.ids[1] = 320"),
        ({"prompt": "hi", "stop": ["ok", ""]}, "stop[1]"),
    ],
)
def test_bad_requests_are_rejected_with_a_message_naming_the_field(kwargs, named):
    with pytest.raises(InvalidRequest, match=named.replace("[", r"\[")):
        parse_request(request(**kwargs), MODEL)


def test_good_request_is_tokenized_with_defaults_filled_in():
    params = parse_request(request(prompt="hé", stop=["\n"]), MODEL)
    assert params.prompt_token_ids == tuple(TOKENIZER("hé").input_ids)
    assert params.sampling.max_tokens == 16 and params.sampling.temperature == 1.0
    assert params.request_id and params.stop == ("\n",)
    ids = [random.randrange(320) for _ in range(63)]
    assert parse_request(request(prompt_token_ids=ids), MODEL).prompt_token_ids == tuple(ids)


# --- orchestration through the real router, fake nodes on loopback -----------------------------


class FakeCluster:
    """A fake 'model' answering the prompt's bytes in reverse, then EOS; shared state lets the
    fake prefill 'ship' into the fake decode node."""

    def __init__(self) -> None:
        self.transferred: dict[str, list[int]] = {}  # decode side: request id -> tokens to send
        self.prefill_calls: list[tuple[str, str]] = []  # (prefill address, decode address)
        self.refuse = 0  # the next n Prefill calls answer RESOURCE_EXHAUSTED
        self.decode_cancelled: list[str] = []
        self.decode_delay_s = 0.0
        self.live_decode: set[str] = set()


class FakePrefill(nodes_pb2_grpc.PrefillNodeServiceServicer):
    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster
        self.address = ""

    async def Prefill(self, request, context):
        c = self.cluster
        c.prefill_calls.append((self.address, request.decode_address))
        if request.decode_address not in c.live_decode:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode node unreachable")
        if c.refuse:
            c.refuse -= 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free blocks")
        answer = [*list(request.prompt_token_ids)[::-1], EOS]
        answer = answer[: request.sampling.max_tokens]
        finish = ""
        if len(answer) == 1:
            finish = "stop" if answer[0] == EOS else "length"
        else:
            c.transferred[request.request_id] = answer[1:]
        return nodes_pb2.PrefillResponse(
            first_token_id=answer[0], finish_reason=finish, cached_tokens=3
        )


class FakeDecode(nodes_pb2_grpc.DecodeNodeServiceServicer):
    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster

    async def Decode(self, request, context):
        tokens = self.cluster.transferred.pop(request.request_id, None)
        if tokens is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown request")
        try:
            for i in range(0, len(tokens), 2):
                await asyncio.sleep(self.cluster.decode_delay_s)
                last = i + 2 >= len(tokens)
                finish = ("stop" if tokens[-1] == EOS else "length") if last else ""
                yield nodes_pb2.DecodeResponse(token_ids=tokens[i : i + 2], finish_reason=finish)
        except asyncio.CancelledError:
            self.cluster.decode_cancelled.append(request.request_id)
            raise


async def start_fake_node(servicer, add) -> tuple[grpc.aio.Server, str]:
    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.aio.server()
    add(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def unused_address() -> str:
    from splitserve.launcher import free_port

    return f"127.0.0.1:{free_port()}"


async def with_cluster(test, num_prefill=2, num_decode=2, dead_prefill=0, dead_decode=0):
    cluster = FakeCluster()
    servers, prefill, decode = [], [], []
    for _ in range(num_prefill):
        servicer = FakePrefill(cluster)
        server, servicer.address = await start_fake_node(
            servicer, nodes_pb2_grpc.add_PrefillNodeServiceServicer_to_server
        )
        servers.append(server)
        prefill.append(servicer.address)
    for _ in range(num_decode):
        server, address = await start_fake_node(
            FakeDecode(cluster), nodes_pb2_grpc.add_DecodeNodeServiceServicer_to_server
        )
        servers.append(server)
        decode.append(address)
        cluster.live_decode.add(address)
    prefill += [unused_address() for _ in range(dead_prefill)]
    decode += [unused_address() for _ in range(dead_decode)]
    config = RouterConfig("unused", tuple(prefill), tuple(decode))
    router, registry = await start_router(config, MODEL)
    channel = grpc.aio.insecure_channel(router.address)
    try:
        await test(router_pb2_grpc.RouterServiceStub(channel), cluster, registry)
    finally:
        await channel.close()
        await router.stop(0)
        await registry.close()
        for server in servers:
            await server.stop(0)


async def collect(stub, **kwargs):
    return [msg async for msg in stub.Generate(request(**kwargs), timeout=10)]


def test_router_relays_prefill_then_decode_with_text_and_usage():
    async def test(stub, cluster, registry):
        prompt = "ab€"
        msgs = await collect(stub, prompt=prompt, sampling={"max_tokens": 100})
        tokens = [t for m in msgs for t in m.token_ids]
        assert tokens == [*byte_ids(prompt)[::-1], EOS]
        # "€" reversed is invalid UTF-8: it still comes through, as U+FFFD
        assert "".join(m.text for m in msgs) == TOKENIZER.decode(tokens, skip_special_tokens=True)
        last = msgs[-1]
        assert last.finish_reason == "stop" and all(not m.finish_reason for m in msgs[:-1])
        assert last.usage.prompt_tokens == len(prompt.encode())
        assert last.usage.completion_tokens == len(tokens) and last.usage.cached_tokens == 3
        assert last.usage.time_to_first_token_s > 0
        assert all(m.request_id == last.request_id for m in msgs)

    asyncio.run(with_cluster(test))


def test_requests_spread_over_nodes_and_finish_at_the_first_token_without_decode():
    async def test(stub, cluster, registry):
        for _ in range(4):
            await collect(stub, prompt="xy", sampling={"max_tokens": 4})
        assert len({p for p, _ in cluster.prefill_calls}) == 2
        assert len({d for _, d in cluster.prefill_calls}) == 2
        msgs = await collect(stub, prompt="xy", sampling={"max_tokens": 1})
        assert [m.finish_reason for m in msgs] == ["length"] and msgs[0].token_ids == [ord("y")]
        assert not cluster.transferred

    asyncio.run(with_cluster(test))


def test_stop_string_ends_the_stream_and_cancels_the_decode_call():
    async def test(stub, cluster, registry):
        cluster.decode_delay_s = 0.02
        msgs = await collect(stub, prompt="0123456789abcdef"[::-1], stop=["45"])
        assert "".join(m.text for m in msgs) == "0123"
        assert msgs[-1].finish_reason == "stop"
        await asyncio.sleep(0.2)
        assert len(cluster.decode_cancelled) == 1

    asyncio.run(with_cluster(test))


def test_client_cancel_reaches_the_decode_node():
    async def test(stub, cluster, registry):
        cluster.decode_delay_s = 0.05
        call = stub.Generate(request(prompt="z" * 40, sampling={"max_tokens": 40}))
        await call.read()
        call.cancel()
        for _ in range(50):
            if cluster.decode_cancelled:
                break
            await asyncio.sleep(0.02)
        assert len(cluster.decode_cancelled) == 1
        assert all(n.in_flight == 0 for n in registry.prefill.nodes + registry.decode.nodes)

    asyncio.run(with_cluster(test))


def test_full_nodes_are_retried_elsewhere():
    async def test(stub, cluster, registry):
        cluster.refuse = 2
        msgs = await collect(stub, prompt="ab")
        assert msgs[-1].finish_reason == "stop"
        assert len(cluster.prefill_calls) == 3
        cluster.refuse = 10
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, prompt="ab")
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    asyncio.run(with_cluster(test))


def test_dead_nodes_are_marked_down_and_avoided():
    async def test(stub, cluster, registry):
        for _ in range(6):  # a request meeting a dead node retries on a live one
            msgs = await collect(stub, prompt="ab")
            assert msgs[-1].finish_reason == "stop"
        now = time.monotonic()
        live_p, dead_p = registry.prefill.nodes
        live_d, dead_d = registry.decode.nodes
        assert live_p.is_up(now) and live_d.is_up(now)
        assert not dead_p.is_up(now) and not dead_d.is_up(now)
        calls = len(cluster.prefill_calls)
        for _ in range(4):  # while they are down, no attempt goes to them
            await collect(stub, prompt="ab")
        assert cluster.prefill_calls[calls:] == [(live_p.address, live_d.address)] * 4

    asyncio.run(with_cluster(test, num_prefill=1, num_decode=1, dead_prefill=1, dead_decode=1))


def test_no_reachable_node_is_unavailable_and_bad_input_touches_no_node():
    async def test(stub, cluster, registry):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, prompt="hi", sampling={"temperature": -1.0})
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "temperature" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, prompt="hi")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no prefill node is reachable" in err.value.details()

    asyncio.run(with_cluster(test, num_prefill=0, num_decode=1, dead_prefill=2))


def test_client_deadline_reaches_the_nodes():
    async def test(stub, cluster, registry):
        cluster.decode_delay_s = 0.1
        call = stub.Generate(request(prompt="q" * 30, sampling={"max_tokens": 30}), timeout=0.4)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            _ = [msg async for msg in call]
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(50):
            if cluster.decode_cancelled:
                break
            await asyncio.sleep(0.02)
        assert len(cluster.decode_cancelled) == 1
        msgs = await collect(stub, prompt="ok")  # the next request is served
        assert msgs[-1].finish_reason == "stop"

    asyncio.run(with_cluster(test, num_prefill=1, num_decode=1))


def test_health_checks_mark_dead_nodes_down_and_live_ones_up():
    async def test(stub, cluster, registry):
        live = registry.prefill.nodes[0]
        registry.prefill.mark_down(live, "pretend")
        await registry.check_all()
        now = time.monotonic()
        assert live.is_up(now) and registry.decode.nodes[0].is_up(now)
        assert not registry.prefill.nodes[1].is_up(now)
        assert "health check" in registry.prefill.nodes[1].last_error

    asyncio.run(with_cluster(test, num_prefill=1, num_decode=1, dead_prefill=1))
