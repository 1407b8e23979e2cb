"""`splitserve bench`: the pure parts on hand-made inputs (workload shapes, arrival statistics,
percentiles, goodput, SSE parsing, scraped gauges) and the load loop against a fake target; the
HTTP target against a fake server and a run of the command on a cluster are in
tests/cluster/test_bench_command.py."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import statistics
import sys
import time

import pytest
from support.bench_schema import ROOT

from splitserve.bench import arrivals, metrics, report, runner, scrape, sse, targets, workloads
from splitserve.bench.metrics import RequestRecord
from splitserve.bench.workloads import BenchRequest, LengthDist

# ---------------------------------------------------------------- workloads


def take(it, n):
    return list(itertools.islice(it, n))


@pytest.mark.parametrize(
    ("spec", "kind", "a", "b"),
    [
        ("128", "fixed", 128, 0),
        ("uniform:4:9", "uniform", 4, 9),
        ("normal:50:5", "normal", 50, 5),
        ("lognormal:100:80", "lognormal", 100, 80),
        ("fixed:7", "fixed", 7, 0),
    ],
)
def test_length_specs_parse(spec, kind, a, b):
    assert LengthDist.parse(spec) == LengthDist(kind, a, b)


@pytest.mark.parametrize("spec", ["", "x", "uniform:5", "uniform:9:4", "normal:1:-1", "poisson:3"])
def test_bad_length_specs_say_what_is_allowed(spec):
    with pytest.raises(ValueError, match="bad length"):
        LengthDist.parse(spec)


def test_length_distributions_have_their_moments():
    for spec, mean, std in [("normal:200:20", 200, 20), ("lognormal:100:80", 100, 80)]:
        rng = random.Random(3)
        xs = [LengthDist.parse(spec).sample(rng) for _ in range(20000)]
        assert statistics.mean(xs) == pytest.approx(mean, rel=0.03)
        assert statistics.pstdev(xs) == pytest.approx(std, rel=0.08)
    rng = random.Random(0)
    xs = [LengthDist.parse("uniform:3:6").sample(rng) for _ in range(2000)]
    assert set(xs) == {3, 4, 5, 6}


def test_random_workload_is_seeded_and_in_range():
    make = lambda seed: workloads.random_prompts(  # noqa: E731
        LengthDist.parse("uniform:10:20"),
        LengthDist(kind="fixed", a=5),
        text=False,
        vocab=50,
        seed=seed,
    )
    a, b, c = take(make(1), 50), take(make(1), 50), take(make(2), 50)
    assert a == b and a != c
    assert all(10 <= r.prompt_len == len(r.prompt) <= 20 and r.max_tokens == 5 for r in a)
    assert all(0 <= t < 50 for r in a for t in r.prompt)
    text = take(
        workloads.random_prompts(
            LengthDist("fixed", 8), LengthDist("fixed", 3), text=True, vocab=50, seed=0
        ),
        3,
    )
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 8 for r in text)


def test_shared_prefix_workload_is_n_prefixes_times_m_questions():
    reqs = take(
        workloads.shared_prefix(
            3,
            LengthDist("fixed", 32),
            4,
            LengthDist("fixed", 8),
            LengthDist("fixed", 2),
            text=False,
            vocab=250,
            seed=0,
        ),
        24,
    )
    first, second = reqs[:12], reqs[12:]
    assert {r.prompt for r in first} == {r.prompt for r in second}  # each pass: every prompt once
    assert len({r.prompt for r in first}) == 12
    assert len({r.prompt[:32] for r in first}) == 3  # three prefixes, four questions each
    assert all(r.prompt_len == 40 for r in reqs)
    assert [r.prompt for r in first] != [r.prompt for r in second]  # in another order


def test_conversation_turns_extend_the_previous_turn():
    reqs = take(workloads.conversation(1, None, text=False, vocab=250, seed=4), 40)
    grew = sum(b.prompt[: len(a.prompt)] == a.prompt for a, b in itertools.pairwise(reqs))
    assert grew >= 20  # one conversation at a time: most turns extend the last
    for a, b in itertools.pairwise(reqs):
        if b.prompt[: len(a.prompt)] == a.prompt:  # history + question + answer (max_tokens)
            assert len(b.prompt) > len(a.prompt) + a.max_tokens
    assert max(r.prompt_len for r in reqs) <= workloads.CONVERSATION["max_prompt_len"]
    fixed = take(workloads.conversation(4, LengthDist("fixed", 9), text=True, vocab=9, seed=0), 5)
    assert all(r.max_tokens == 9 and isinstance(r.prompt, str) for r in fixed)


class _EchoTarget:
    """A server that answers each turn with tokens of its own choosing (a counter), after a
    short wait, and says it had the prompt's every earlier token cached."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.prompts: list[tuple[int, ...]] = []
        self.answers: list[list[int]] = []
        self._next = 10_000

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def send(self, req: BenchRequest, record: RequestRecord) -> RequestRecord:
        record.start = self.now()
        await asyncio.sleep(0.001)
        answer = list(range(self._next, self._next + req.max_tokens))
        self._next += req.max_tokens
        assert isinstance(record.answer, list)
        record.answer.extend(answer)
        record.token_times = [self.now()]
        record.output_tokens = len(answer)
        record.prompt_tokens = req.prompt_len
        record.cached_tokens = req.prompt_len // 2
        record.end = self.now()
        self.prompts.append(tuple(req.prompt))
        self.answers.append(answer)
        return record


def test_users_send_the_servers_real_answers_back_turn_by_turn():
    from splitserve.bench.session import per_turn

    target = _EchoTarget()
    load = runner.Load(num_requests=30, seed=3)
    params = {"turns": (3, 3)}

    def user(u):
        rng = random.Random(u)
        return workloads.ConversationUser(rng, LengthDist("fixed", 5), text=False, vocab=50,
                                          params=params)  # fmt: skip

    records, _ = asyncio.run(runner.run_users(target, user, 2, 0.0, load))
    assert len(records) == 30 and all(r.answer is None for r in records)  # not kept
    # Every answer the server gave comes back in a later prompt of the same conversation.
    answered = 0
    for prompt, answer in zip(target.prompts, target.answers, strict=True):
        later = [p for p in target.prompts if len(p) > len(prompt) and p[: len(prompt)] == prompt]
        if later:
            assert all(p[len(prompt) : len(prompt) + 5] == tuple(answer) for p in later[:1])
            answered += 1
    assert answered >= 15  # 3 turns each: two of every three turns are followed
    turns = per_turn(records)
    assert [t["turn"] for t in turns] == [0, 1, 2]
    assert sum(t["requests"] for t in turns) == 30
    for t in turns:
        assert t["computed_tokens"] + t["cached_tokens"] == t["prompt_tokens"] > 0
    # New in a turn: a first turn's whole prompt; later, what its prompt adds to the last one.
    assert turns[0]["new_tokens"] == turns[0]["prompt_tokens"]
    for r in records:
        if r.turn:
            assert 5 < r.new_tokens < r.prompt_len  # the answer fed back (5) and the question
    assert turns[1]["new_tokens"] < turns[1]["prompt_tokens"]


def test_per_turn_ttft_percentiles_are_the_turns_p50_and_p90():
    from splitserve.bench.session import per_turn

    records = []
    for i in range(11):  # turn 1's TTFTs: 0, 0.1, ..., 1.0 s
        r = RequestRecord(i, 10, 1, arrival=0.0, turn=1, new_tokens=2)
        r.start, r.token_times, r.end, r.output_tokens = 0.0, [i / 10], i / 10, 1
        records.append(r)
    (turn,) = per_turn(records)
    assert turn["ttft_p50_s"] == pytest.approx(0.5) and turn["ttft_p90_s"] == pytest.approx(0.9)
    assert turn["new_tokens"] == 22


def test_conversation_user_counts_what_each_turn_adds():
    rng = random.Random(0)
    user = workloads.ConversationUser(rng, LengthDist("fixed", 4), text=False, vocab=50,
                                      params={"turns": (3, 3)})  # fmt: skip
    first = user.next()
    assert user.new_tokens == first.prompt_len
    user.answered([1, 2, 3, 4])
    second = user.next()
    assert second.prompt[: first.prompt_len] == first.prompt
    assert user.new_tokens == second.prompt_len - first.prompt_len  # answer + new question
    user.failed()  # the question dropped: the next turn adds only its own question
    third = user.next()
    assert user.new_tokens == third.prompt_len - first.prompt_len - 4


def test_jsonl_workload(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a b c", "max_tokens": 4}\n\n{"prompt": [1, 2]}\n')
    reqs = take(workloads.jsonl(f, LengthDist("fixed", 7), seed=0), 3)
    assert reqs == [BenchRequest("a b c", 3, 4), BenchRequest((1, 2), 2, 7), reqs[0]]
    for bad in [
        '{"prompt": 3}',
        '{"text": "x"}',
        '{"prompt": [1, "x"]}',
        "{",
        '{"prompt": "a", "max_tokens": 0}',
    ]:
        f.write_text(bad + "\n")
        with pytest.raises(ValueError, match=r"p\.jsonl:1"):
            next(workloads.jsonl(f, LengthDist("fixed", 7), seed=0))


# ---------------------------------------------------------------- arrivals


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrival_gaps_have_rate_and_burstiness(burstiness):
    gaps = take(arrivals.intervals(20.0, burstiness, seed=7), 20000)
    mean = statistics.mean(gaps)
    assert mean == pytest.approx(1 / 20, rel=0.05)
    cv2 = (statistics.pstdev(gaps) / mean) ** 2  # gamma: 1 / shape
    assert cv2 == pytest.approx(1 / burstiness, rel=0.1)
    assert take(arrivals.intervals(20.0, burstiness, seed=7), 5) == gaps[:5]


def test_arrival_times_start_at_zero_and_infinite_rate_is_all_at_once():
    times = take(arrivals.arrival_times(10.0, 1.0, seed=0), 100)
    assert times[0] == 0 and all(b >= a for a, b in itertools.pairwise(times))
    assert take(arrivals.arrival_times(math.inf), 4) == [0.0] * 4
    with pytest.raises(ValueError):
        next(arrivals.intervals(0))


# ---------------------------------------------------------------- metrics


def rec(i, start, tokens, end, n=None, error=None, arrival=None):
    return RequestRecord(
        i,
        10,
        4,
        arrival if arrival is not None else start,
        start,
        end,
        list(tokens),
        n if n is not None else len(tokens),
        error=error,
    )


def test_percentiles_interpolate_like_numpy():
    xs = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert metrics.percentile(xs, 50) == 5.5
    assert metrics.percentile(xs, 90) == pytest.approx(9.1)
    assert metrics.percentile(xs, 99) == pytest.approx(9.91)
    assert metrics.percentile([3.0], 99) == 3.0 and metrics.percentile([], 50) is None
    assert metrics.distribution([2, 4]) == {"mean": 3, "p50": 3, "p90": 3.8, "p99": 3.98, "max": 4}


def test_request_figures():
    r = rec(0, 1.0, [1.5, 1.7, 2.0, 2.5], end=2.5)
    assert r.ttft == 0.5 and r.e2e == 1.5
    assert r.tpot == pytest.approx((2.5 - 1.5) / 3)
    assert r.itl == pytest.approx([0.2, 0.3, 0.5])
    one = rec(1, 0.0, [0.2], end=0.2)
    assert one.tpot is None and one.itl == []
    failed = rec(2, 0.0, [0.1], end=0.3, error="UNAVAILABLE")
    assert failed.ttft is None and failed.e2e is None and failed.itl == []


def test_slo_parsing():
    assert metrics.parse_slo("ttft=2, tpot=50ms,e2e=3s") == {"ttft": 2, "tpot": 0.05, "e2e": 3}
    assert metrics.parse_slo(None) == {}
    for bad in ["ttft", "itl=3", "ttft=x", "ttft=0"]:
        with pytest.raises(ValueError, match="bad SLO"):
            metrics.parse_slo(bad)


def test_slo_parsing_is_the_routers_syntax_plus_e2e():
    from splitserve.runtime.slo import Slo

    text = "ttft=1.5,tpot=40ms"
    parsed = metrics.parse_slo(text + ",e2e=9")
    assert (parsed["ttft"], parsed["tpot"]) == Slo.parse(text) and parsed["e2e"] == 9
    for bad in ["ttft=nan", "tpot=inf", "e2e=-1"]:
        with pytest.raises(ValueError, match="bad SLO"):
            metrics.parse_slo(bad)


def test_goodput_counts_requests_meeting_every_slo():
    records = [
        rec(0, 0.0, [0.5, 0.6, 0.7], end=0.7),  # ttft .5, tpot .1: good
        rec(1, 0.0, [2.5, 2.6], end=2.6),  # ttft 2.5: too slow
        rec(2, 0.0, [1.0, 1.5, 2.0], end=2.0),  # tpot .5: too slow
        rec(3, 0.0, [0.1], end=0.1),  # one token: no tpot, meets it
        rec(4, 0.0, [], end=0.1, error="HTTP 429"),
        rec(5, 0.0, [], end=0.1, error="HTTP 429"),
    ]
    slo = {"ttft": 2.0, "tpot": 0.2}
    records[4].detail = "busy"
    assert [metrics.meets_slo(r, slo) for r in records] == [True, False, False, True, False, False]
    assert metrics.goodput(records, slo, duration=4.0) == 0.5
    s = metrics.summarize(records, 4.0, slo)
    assert s["good_requests"] == 2 and s["goodput"] == 0.5 and s["slo_attainment"] == 2 / 6
    assert s["completed"] == 4 and s["failed"] == 0 and s["failures"] == {}
    assert s["refused"] == 2 and s["refusals"] == {"HTTP 429": 2}
    assert s["refusal_latency_s"]["max"] == 0.1
    assert s["failure_examples"] == {"HTTP 429": "busy"}
    assert s["output_tokens"] == 3 + 2 + 3 + 1 and s["output_throughput"] == 9 / 4
    assert s["input_tokens"] == 40 and s["request_throughput"] == 1.0
    assert s["total_token_throughput"] == 49 / 4
    assert s["ttft_s"]["max"] == 2.5 and s["e2e_s"]["p50"] == pytest.approx(1.35)
    assert metrics.summarize(records, 4.0)["goodput"] is None


def test_timeline_bins_tokens_in_flight_and_queue():
    records = [
        rec(0, 0.0, [0.2, 0.4, 0.6, 0.8], end=0.9),
        rec(1, 0.5, [0.7, 1.2], end=1.3, n=4, arrival=0.1),  # queued 0.1..0.5; 2 tokens/chunk
    ]
    line = metrics.timeline(records, 1.3, step=0.5)
    assert line["t_s"] == [0.5, 1.0, 1.5]
    assert line["output_tokens_per_s"] == [4.0, 8.0, 4.0]
    assert line["requests_per_s"] == [0.0, 2.0, 2.0]
    assert line["in_flight"] == pytest.approx([1.0, 1.8, 0.6])  # time-averaged over each bin
    assert line["queued"] == pytest.approx([0.8, 0.0, 0.0])
    assert metrics.occupancy([(0.0, 0.9), (0.5, 1.3), (0.5, 0.5)]) == (
        [0.0, 0.5, 0.9, 1.3],
        [1, 2, 1, 0],
    )


# ---------------------------------------------------------------- SSE and the HTTP target


def test_sse_parser_joins_pieces_and_lines():
    p = sse.SSEParser()
    stream = b': ping\r\ndata: {"a": 1}\r\n\r\nevent: x\ndata: li\ndata:ne2\n\ndata: [DONE]'
    out = [d for i in range(0, len(stream), 3) for d in p.feed(stream[i : i + 3])]
    assert out == ['{"a": 1}', "li\nne2"]
    assert list(p.close()) == ["[DONE]"]


def test_completion_events():
    ev = sse.parse_event
    chunk = lambda **c: json.dumps({"choices": [{"index": 0, **c}], "usage": None})  # noqa: E731
    assert ev(chunk(text="hi", finish_reason=None)).tokens == 1
    assert ev(chunk(text="", finish_reason=None)).tokens == 1  # a token of a partial character
    assert ev(chunk(text="", finish_reason="length")).tokens == 0  # only the finish reason
    assert ev(chunk(text="ab", token_ids=[4, 5], finish_reason="length")).tokens == 2
    assert ev(chunk(delta={"content": "x"})).tokens == 1  # chat-shaped
    usage = {"prompt_tokens": 3, "completion_tokens": 8}
    last = ev(json.dumps({"choices": [], "usage": usage}))
    assert last.tokens == 0 and last.usage == usage
    assert ev("[DONE]").done
    assert ev(json.dumps({"error": {"code": 503, "message": "m"}})).error == "stream error 503"


def test_targets_from_urls():
    assert isinstance(targets.make_target("grpc://h:1"), targets.GrpcTarget)
    assert targets.make_target("h:1").url == "h:1"
    assert targets.make_target("http://h:2/v1/").url == "http://h:2"
    with pytest.raises(ValueError, match="--target"):
        targets.make_target("h")


def _bench_args(*argv: str):
    import argparse

    from splitserve.bench.cli import add_command

    parser = argparse.ArgumentParser()
    add_command(parser.add_subparsers())
    return parser.parse_args(["bench", "--target", "h:1", *argv])


def test_send_slo_sends_the_ttft_and_tpot_bounds_only():
    from splitserve.bench.session import config_of, sent_slo
    from splitserve.runtime.slo import Slo

    args = _bench_args("--slo", "ttft=2,tpot=50ms,e2e=9", "--send-slo")
    slo = metrics.parse_slo(args.slo)
    assert sent_slo(args, slo) == Slo(2.0, 0.05)
    assert config_of(args, slo)["send_slo"] is True
    assert sent_slo(_bench_args("--slo", "ttft=2"), {"ttft": 2.0}) is None  # not asked
    with pytest.raises(ValueError, match=r"--send-slo .*give --slo"):
        sent_slo(_bench_args("--send-slo", "--slo", "e2e=3"), {"e2e": 3.0})


class _Stub:
    """The router's stub inside the SDK: records each request, answers one token."""

    def __init__(self):
        self.requests = []
        self.metadata = []

    def Generate(self, request, timeout=None, metadata=None):
        self.requests.append(request)
        self.metadata.append(metadata)
        return _Call()


class _Call:
    """A finished server stream of one message (async, and blocking for the SDK's Client)."""

    def __iter__(self):
        from splitserve.v1 import router_pb2

        last = router_pb2.GenerateResponse(token_ids=[7], finish_reason="length")
        last.usage.completion_tokens = 1
        return iter([last])

    async def __aiter__(self):
        for msg in self:
            yield msg

    def cancel(self):
        return False


def test_grpc_target_sends_the_slo_with_every_request(rng):
    from splitserve.runtime.slo import Slo

    slo = Slo(rng.uniform(0.5, 5), rng.choice([None, 0.05]))
    stub = _Stub()

    async def run(target_slo):
        async with targets.make_target("h:1", slo=target_slo) as target:
            for client in target._clients:
                client._stub = stub
            for i in range(3):
                record = await target.send(BenchRequest((1, 2, 3), 3, 1), RequestRecord(i, 3, 1, 0))
                assert record.ok and record.output_tokens == 1

    asyncio.run(run(slo))
    sent = [(r.slo.ttft_s, r.slo.tpot_s or None) for r in stub.requests]
    assert sent == [(slo.ttft_s, slo.tpot_s)] * 3
    stub.requests.clear()
    asyncio.run(run(None))
    assert not any(r.HasField("slo") for r in stub.requests)


def test_http_target_sends_the_slo_header():
    from splitserve.router.http import SLO_HEADER
    from splitserve.runtime.slo import Slo

    assert targets.SLO_HEADER == SLO_HEADER  # the one the router reads
    target = targets.make_target("http://h:2", slo=Slo(2.0, 0.05), api_key="k")
    assert target._headers() == {"Authorization": "Bearer k", SLO_HEADER: "ttft=2,tpot=0.05"}
    assert Slo.parse(target._headers()[SLO_HEADER]) == Slo(2.0, 0.05)
    assert SLO_HEADER not in targets.make_target("http://h:2")._headers()


def test_client_id_names_every_request_to_the_router(rng):
    from splitserve.bench.session import config_of
    from splitserve.client import Client
    from splitserve.router.front import CLIENT_KEY

    assert targets.CLIENT_HEADER == CLIENT_KEY  # the key the router reads, gRPC and HTTP
    name = f"tenant-{rng.randrange(10**6)}"
    stub = _Stub()

    async def run(client_id):
        async with targets.GrpcTarget("h:1", client_id=client_id) as target:
            for client in target._clients:
                client._stub = stub  # type: ignore[assignment]
            for i in range(3):
                record = await target.send(BenchRequest((1, 2), 2, 1), RequestRecord(i, 2, 1, 0))
                assert record.ok

    asyncio.run(run(name))
    assert stub.metadata == [((CLIENT_KEY, name),)] * 3
    stub.metadata.clear()
    asyncio.run(run(None))
    assert stub.metadata == [None] * 3  # no metadata at all: the router counts the caller's host
    with Client("h:1") as blocking:  # the SDK's blocking twin takes the same metadata=
        blocking._stub = stub  # type: ignore[assignment]
        result = blocking.generate(prompt_token_ids=[1], metadata=[(CLIENT_KEY, name)])
    assert result.token_ids == (7,)
    assert stub.metadata[-1] == ((CLIENT_KEY, name),)
    http = targets.HttpTarget("http://h:2", client_id=name, api_key="k")
    assert http._headers() == {"Authorization": "Bearer k", CLIENT_KEY: name}
    assert CLIENT_KEY not in targets.HttpTarget("http://h:2")._headers()
    args = _bench_args("--client-id", name)
    assert config_of(args, {})["client_id"] == name
    assert config_of(_bench_args(), {})["client_id"] is None
    for bad in ("caf\u00e9", "a\nb"):
        with pytest.raises(ValueError, match="--client-id"):
            targets.make_target("http://h:2", client_id=bad)


def test_refusals_of_a_sent_slo_count_as_refused():
    records = [rec(0, 0.0, [], end=0.01, error=e) for e in ("RESOURCE_EXHAUSTED", "HTTP 429")]
    s = metrics.summarize([*records, rec(2, 0.0, [0.1], end=0.1)], 1.0, {"ttft": 1.0})
    assert s["refused"] == 2 and s["failed"] == 0 and s["good_requests"] == 1


# ---------------------------------------------------------------- the load loop


class FakeTarget:
    """Answers each request after ``service`` s with ``max_tokens`` tokens; counts concurrency."""

    def __init__(self, service=0.02):
        self.service = service
        self.t0 = time.perf_counter()
        self.in_flight = self.peak = self.sent = 0

    def now(self):
        return time.perf_counter() - self.t0

    async def send(self, req, record):
        record.start = self.now()
        self.in_flight += 1
        self.sent += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(self.service)
        record.token_times = [self.now()]
        record.output_tokens = req.max_tokens
        self.in_flight -= 1
        record.end = self.now()
        return record


def requests():
    return workloads.random_prompts(
        LengthDist("fixed", 4), LengthDist("fixed", 2), text=False, vocab=10, seed=0
    )


def test_fixed_concurrency_with_warmup():
    t = FakeTarget()
    done = []
    load = runner.Load(max_concurrency=3, num_requests=12, warmup=2)
    records, duration = asyncio.run(runner.run_load(t, requests(), load, on_done=done.append))
    assert len(records) == 12 == len(done) and t.sent == 14 and t.peak == 3
    assert [r.index for r in records] == list(range(12))
    # Four rounds of three, each at least its 20 ms of service: a floor the clock cannot beat
    # (no ceiling: how much longer it takes is the machine's speed, not the runner's).
    assert duration >= 0.08


def test_rate_and_concurrency_queue_in_the_client():
    t = FakeTarget(service=0.02)
    load = runner.Load(request_rate=100, max_concurrency=1, duration=0.2, seed=1)
    records, _ = asyncio.run(runner.run_load(t, requests(), load))
    assert t.peak == 1 and 5 <= len(records) <= 60  # about 20 arrivals in 0.2 s
    assert all(r.arrival < 0.2 for r in records)
    assert max(r.start - r.arrival for r in records) > 0.04  # waited for the one slot


def test_load_options_are_checked():
    for bad in [runner.Load(duration=5), runner.Load(num_requests=0), runner.Load()]:
        with pytest.raises(ValueError):
            bad.check()


# ---------------------------------------------------------------- scrape, report


PROM = """# TYPE splitserve_decode_kv_usage gauge
splitserve_decode_kv_usage{role="decode"} 0.25
# TYPE splitserve_decode_kv_slot_utilization gauge
splitserve_decode_kv_slot_utilization{role="decode"} NaN
# TYPE splitserve_prefill_kv_slot_utilization gauge
splitserve_prefill_kv_slot_utilization{role="prefill"} 0.9
# TYPE splitserve_node_kv_usage gauge
splitserve_node_kv_usage{node="127.0.0.1:7",role="prefill"} 0.5
# TYPE splitserve_router_queue_length gauge
splitserve_router_queue_length 3.0
# TYPE splitserve_decode_running gauge
splitserve_decode_running{role="decode"} 2.0
"""


def test_scraped_series():
    assert scrape.series_of(PROM, "h:9") == {
        ("kv_usage", "decode h:9"): 0.25,  # its slot utilisation NaN (no block in use): skipped
        ("kv_slot_utilization", "prefill h:9"): 0.9,
        ("kv_usage", "prefill 127.0.0.1:7 (via router h:9)"): 0.5,
        ("queue_length", "router h:9"): 3.0,
    }
    series = {"kv_usage": {"d": [(0.0, 0.5), (1.0, 0.25)]}}
    assert scrape.summary(series) == {"kv_usage": {"d": {"samples": 2, "mean": 0.375, "max": 0.5}}}


def test_report_table_and_json(tmp_path):
    records = [rec(0, 0.0, [0.5, 0.6], end=0.6), rec(1, 0.0, [], end=0.1, error="UNAVAILABLE")]
    doc = report.result_document(
        target={"url": "h:1", "kind": "grpc", "model": None},
        config={"request_rate": math.inf},
        results=metrics.summarize(records, 1.0, {"ttft": 1.0}),
        timeline=metrics.timeline(records, 1.0),
        server_metrics={"summary": {"kv_usage": {"d": {"samples": 2, "mean": 0.1, "max": 0.2}}}},
        records=records,
    )
    assert doc["config"]["request_rate"] is None  # JSON has no infinity
    path = tmp_path / "r.json"
    report.write_json(str(path), doc)
    assert json.loads(path.read_text())["requests"][1]["error"] == "UNAVAILABLE"
    table = report.format_table(doc)
    for text in (
        "completed requests",
        "failed: UNAVAILABLE",
        "goodput",
        "TTFT",
        "500.00",
        "kv_usage",
    ):
        assert text in table


def test_plots_without_matplotlib_say_what_to_install(monkeypatch, capsys):
    from splitserve import cli

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli.main(["bench", "--target", "127.0.0.1:1", "--plots", "x"]) == 2
    assert "pip install splitserve[bench]" in capsys.readouterr().err


def test_every_option_is_documented():
    from splitserve import cli

    text = (ROOT / "docs" / "bench.md").read_text()
    parser = cli.build_parser()._subparsers._group_actions[0].choices["bench"]
    flags = [f for a in parser._actions for f in a.option_strings if f.startswith("--")]
    missing = [f for f in flags if f != "--help" and f"`{f}" not in text]
    assert len(flags) > 20 and not missing, f"options missing from docs/bench.md: {missing}"


def test_a_random_workload_found_in_the_cache_is_flagged():
    def table(workload, salt, cached):
        records = [rec(0, 0.0, [0.5, 0.6], end=0.6)]
        results = metrics.summarize(records, 1.0, {})
        results.update(input_tokens=1000, cached_tokens=cached)
        doc = report.result_document(
            target={"url": "h:1", "kind": "grpc", "model": None},
            config={"workload": workload, "cache_salt": salt},
            results=results,
            timeline=metrics.timeline(records, 1.0),
            server_metrics={},
            records=records,
        )
        return report.format_table(doc)

    assert "served 98% of the prompt tokens" in table("random", None, 980)
    assert "--cache-salt" in table("random", None, 980)
    assert "note:" not in table("random", None, 100)  # a little reuse is not a repeat
    assert "note:" not in table("random", "run-2", 980)  # salted: the server's own business
    assert "note:" not in table("shared-prefix", None, 980)  # sharing is the workload's point


def test_processes_share_one_workload_and_schedule(rng):
    """Three processes' shares of a load are the one-process load, request for request."""
    load = runner.Load(request_rate=2000, num_requests=30, warmup=2, seed=rng.randrange(100))

    def run(share):
        t = FakeTarget(service=0.001)
        sent = []
        orig = t.send

        async def send(req, record):
            if record.index >= 0:  # not a warm-up request
                sent.append((record.index, record.arrival, req.prompt))
            return await orig(req, record)

        t.send = send
        asyncio.run(runner.run_load(t, requests(), load, share=share))
        return sent

    whole = run(runner.Share())
    parts = [run(runner.Share(i, 3)) for i in range(3)]
    assert sorted(x for part in parts for x in part) == sorted(whole)
    assert all(index % 3 == i for i, part in enumerate(parts) for index, _, _ in part)
    assert [runner.Share(i, 3).concurrency(8) for i in range(3)] == [3, 3, 2]


def test_a_busy_or_late_load_generator_is_reported():
    from splitserve.bench.session import client_load

    on_time = [RequestRecord(i, 4, 2, arrival=i * 0.01, start=i * 0.01 + 0.001) for i in range(50)]
    fine = client_load(on_time, [0.3, 0.4], open_loop=True)
    assert fine["warnings"] == [] and fine["processes"] == 2
    late = [RequestRecord(i, 4, 2, arrival=i * 0.01, start=i * 0.01 + 0.2) for i in range(50)]
    slipped = client_load(late, [0.95], open_loop=True)
    assert len(slipped["warnings"]) == 2 and slipped["send_late_p99_s"] >= 0.19
    assert "--processes" in slipped["warnings"][0]
    assert client_load(late, [0.2], open_loop=False)["send_late_p99_s"] is None


def test_users_mode_takes_a_duration_and_refuses_what_it_cannot_honour():
    from splitserve.bench.session import _load

    def args(*more):
        return _bench_args("--workload", "conversation", "--think-time", "1", *more)

    assert _load(args("--duration", "10")).duration == 10
    with pytest.raises(ValueError, match="pace themselves"):
        _load(args("--duration", "10", "--request-rate", "5"))
    with pytest.raises(ValueError, match="--prompt-format text"):
        _load(args("--duration", "10", "--target", "http://localhost:1"))


def test_the_measured_run_collects_young_garbage_only_and_restores_the_collector():
    import gc
    import weakref

    class Cycle:
        pass

    async def run():
        assert gc.isenabled()
        async with runner.young_collections_only(every_s=0.01):
            assert not gc.isenabled() and gc.get_freeze_count() > 0
            a = Cycle()
            a.me = a  # garbage only a cyclic collection frees
            gone = weakref.ref(a)
            del a
            for _ in range(200):
                if gone() is None:
                    break
                await asyncio.sleep(0.01)
            assert gone() is None  # the periodic young collection took it
        assert gc.isenabled() and gc.get_freeze_count() == 0

    asyncio.run(run())


def test_the_open_loop_collects_young_garbage_in_the_gaps_of_its_schedule():
    """A young collection stops the event loop for some milliseconds: the open loop runs it
    where its next send is at least twice the last collection's time away, so it delays no
    send; with no such gap it still runs once overdue (YOUNG_GC_OVERDUE), so nothing piles up."""
    import time as clock

    collector = runner.YoungCollector(every_s=1.0)
    collector.took_s = 0.004
    collector.in_gap(1.0)
    assert collector.collections == 0  # not due yet (just made)
    collector.last -= 1.5  # due
    collector.in_gap(0.005)  # a gap shorter than twice the last collection: wait for a better
    assert collector.collections == 0
    collector.in_gap(0.05)
    assert collector.collections == collector.in_gaps == 1
    assert clock.perf_counter() - collector.last < 0.5 and collector.took_s < 0.5
    collector.last -= runner.YOUNG_GC_OVERDUE * collector.every_s  # overdue: collect anyway
    collector.in_gap(0.0)
    assert collector.collections == 2 and collector.in_gaps == 1


def test_a_paced_run_collects_in_its_gaps(monkeypatch):
    """run_load at 200 req/s for 1.5 s with collections due every 0.2 s: they ran, in the gaps
    between sends."""
    import contextlib
    import gc

    seen = {}

    class Target:
        t0 = 0.0

        def now(self):
            return time.perf_counter() - self.t0

        async def send(self, req, record):
            record.end = self.now()

    real = runner.young_collections_only

    @contextlib.asynccontextmanager
    async def spy(every_s=runner.YOUNG_GC_EVERY_S, timer=True):
        async with real(every_s=0.2, timer=timer) as collector:
            seen["collector"], seen["timer"] = collector, timer
            yield collector

    async def run():
        requests = iter([BenchRequest(prompt=(1, 2, 3, 4), prompt_len=4, max_tokens=2)] * 1000)
        load = runner.Load(request_rate=200.0, duration=1.5, seed=1)
        return await runner.run_load(Target(), requests, load)

    monkeypatch.setattr(runner, "young_collections_only", spy)
    records, _ = asyncio.run(run())
    collector = seen["collector"]
    assert seen["timer"] is False and len(records) > 100
    # (one overdue collection allowed: a loaded machine may stall the loop past 0.6 s once)
    assert collector.in_gaps >= 3 and collector.in_gaps >= collector.collections - 1
    assert gc.isenabled()
