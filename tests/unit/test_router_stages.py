"""The router's request path, stage by stage, against scripted nodes (``router_fakes``: no
processes, no sockets): ``PrefillStage``, ``DirectStage``, ``DecodeStage`` / ``DecodeSession``,
``RequestFront`` over a ``Dispatcher``, alone and as ``router.assembly.build_front`` wires
them; then requests cancelled at random moments (seeded: a failure says how to repeat its
draws), after which every slot, queued token and KV ledger entry the router took is given back.

The same path over real gRPC servers on loopback: tests/cluster/test_router_unit.py."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import pytest
from router_fakes import FakeNodes, FakeRegistry, all_given_back
from support.router_helpers import MODEL, request

from splitserve.kvstore.redis_index import Held
from splitserve.router.assembly import build_front
from splitserve.router.config import RouterConfig
from splitserve.router.decode_stage import DecodeStage, DirectStage, FirstToken, Tried
from splitserve.router.dispatch import Dispatcher, DispatchPolicy, Stages
from splitserve.router.front import RequestFront
from splitserve.router.kv_budget import KVDemand
from splitserve.router.metrics import RouterMetrics
from splitserve.router.prefill_stage import PrefillStage
from splitserve.router.prefix import CachedPrefix
from splitserve.router.request import GenerateError, GenerateParams, parse_request
from splitserve.runtime.failure import Failure

BS = 16


def params(prompt: str = "abcd", **sampling) -> GenerateParams:
    sampling.setdefault("max_tokens", 16)
    return parse_request(request(prompt=prompt, sampling=sampling), MODEL)


def demand_of(p: GenerateParams) -> KVDemand:
    return KVDemand.of(p.prompt_token_ids, "", p.sampling.max_tokens, BS, 256)


def tried() -> Tried:
    return Tried(set(), set())


async def settle() -> None:
    """Let background work (releases, cancels) run."""
    for _ in range(20):
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)


def front_for(nodes: FakeNodes, num_prefill: int = 2, num_decode: int = 2, **options):
    registry = FakeRegistry(nodes, num_prefill, num_decode)
    prefill = tuple(n.address for n in registry.prefill.nodes)
    decode = tuple(n.address for n in registry.decode.nodes)
    config = RouterConfig("unused", prefill, decode, **options)
    return build_front(config, MODEL, registry), registry


async def collect(front, timeout: float | None = 10, **kwargs):
    steps = []
    async with contextlib.aclosing(front.run(request(**kwargs), "client", timeout)) as run:
        async for _, step in run:
            steps.append(step)
    return steps


# ------------------------------------------------------------------ PrefillStage


def test_prefill_stage_returns_the_first_token_and_gives_p_back():
    async def main():
        nodes = FakeNodes()
        registry = FakeRegistry(nodes)
        computed: list[int] = []
        stage = PrefillStage(registry, BS, on_computed=computed.append)
        decode = DecodeStage(registry)
        p, d = registry.prefill.nodes[0], registry.decode.nodes[0]
        prm = params("abcd")
        session = decode.claim(d, demand_of(prm), "r-1")
        first = await stage.attempt(prm, p, session, CachedPrefix(), tried(), time.monotonic() + 5)
        assert first == FirstToken(ord("d"), 0.0, "", 3, computed_tokens=1)
        assert computed == [len("abcd") - 3]
        assert nodes.prefill_calls == [("p0", "d0")] and "r-1" in nodes.held
        assert (p.in_flight, p.queued_tokens) == (0, 0)
        assert d.in_flight == 1  # the session's, until it is closed
        session.close(release_kv=True)
        session.close()  # idempotent
        await settle()
        assert nodes.released == ["r-1"] and not nodes.held
        assert not all_given_back(registry)

    asyncio.run(main())


def test_prefill_stage_classifies_refusals_and_failures():
    async def main():
        nodes = FakeNodes()
        registry = FakeRegistry(nodes)
        stage = PrefillStage(registry, BS)
        decode = DecodeStage(registry)
        p, d = registry.prefill.nodes[0], registry.decode.nodes[0]
        prm = params()
        deadline = time.monotonic() + 5

        async def attempt(t: Tried):
            session = decode.claim(d, demand_of(prm), "r")
            try:
                return await stage.attempt(prm, p, session, CachedPrefix(), t, deadline)
            finally:
                session.close()

        nodes.refuse_prefill = 1
        t = tried()
        result = await attempt(t)
        assert isinstance(result, GenerateError)
        assert result.code == Failure.REFUSED and t.busy == {p, d}

        nodes.fail_prefill, nodes.probe_ok = 1, True  # P answers health checks: D was at fault
        t = tried()
        result = await attempt(t)
        assert isinstance(result, GenerateError) and result.code == Failure.UNAVAILABLE
        assert t.unreachable == {d} and not d.is_up(time.monotonic()) and p.is_up(time.monotonic())

        registry.decode.mark_up(d)
        nodes.fail_prefill, nodes.probe_ok = 1, False  # P silent: P was at fault
        t = tried()
        result = await attempt(t)
        assert t.unreachable == {p} and not p.is_up(time.monotonic())
        assert not all_given_back(registry)

    asyncio.run(main())


def test_prefill_stage_names_a_peer_holding_a_longer_prefix():
    async def main():
        nodes = FakeNodes()
        registry = FakeRegistry(nodes, num_prefill=3)
        seen = []

        async def prefill(p, req):
            seen.append((req.peer_address, req.peer_blocks))
            return await FakeNodes.prefill(nodes, p, req)

        nodes.prefill = prefill  # type: ignore[method-assign]
        stage, decode = PrefillStage(registry, BS), DecodeStage(registry)
        p = registry.prefill.nodes[0]
        session = decode.claim(registry.decode.nodes[0], None, "r")
        cached = CachedPrefix({"p0": Held(1), "p1": Held(3), "p2": Held(2)})
        await stage.attempt(params(), p, session, cached, tried(), time.monotonic() + 5)
        session.close(release_kv=True)
        assert seen == [("p1", 3)]
        # A peer serves from its pool and its host tier, not from its disk; a chosen node
        # holding as many in any tier is sent to no peer.
        seen.clear()
        for held, hint in [
            ({"p0": Held(1), "p1": Held(1, host=5), "p2": Held(2)}, ("p1", 6)),
            ({"p0": Held(1), "p1": Held(1, disk=5), "p2": Held(2)}, ("p2", 2)),
            ({"p0": Held(0, disk=3), "p1": Held(3), "p2": Held(2)}, ("", 0)),
        ]:
            session = decode.claim(registry.decode.nodes[0], None, "r")
            cached = CachedPrefix(held)
            await stage.attempt(params(), p, session, cached, tried(), time.monotonic() + 5)
            session.close(release_kv=True)
            assert seen.pop() == hint

    asyncio.run(main())


# ------------------------------------------------------------------ DirectStage


def test_direct_stage_reads_d_first_token_and_leaves_the_stream_to_the_session():
    async def main():
        nodes = FakeNodes(max_delay_s=0.02)  # D still generating when the session closes
        registry = FakeRegistry(nodes)
        decode = DecodeStage(registry)
        d = registry.decode.nodes[1]
        session = decode.claim(d, None, "r-2")
        first = await DirectStage().attempt(params("xyz"), session, tried(), time.monotonic() + 5)
        assert first == FirstToken(ord("z"), 0.0, "", 5)
        call = session.stream(time.monotonic() + 5)  # the direct route's call, not a new decode
        reply = await call.read()
        assert list(reply.token_ids) == [ord("y")] and nodes.generate_calls == ["d1"]
        session.close()
        await settle()
        assert nodes.decode_cancelled == ["r-2"]  # D ends the request it prefilled
        assert not all_given_back(registry)

        nodes.refuse_generate = 1
        t = tried()
        session = decode.claim(d, None, "r-3")
        result = await DirectStage().attempt(params(), session, t, time.monotonic() + 5)
        session.close()
        assert isinstance(result, GenerateError) and t.busy == {d}
        await settle()
        assert not all_given_back(registry)

    asyncio.run(main())


def test_direct_stage_measures_d_prefill_rate_for_pricing_its_tiers():
    """D's prefill rate (tokens per busy second, as a prefill node's) is what the router prices
    a prefix in D's host tier or on its disk against; every attempt is counted once, refused
    ones with no tokens."""

    async def main():
        nodes = FakeNodes()
        registry = FakeRegistry(nodes)
        decode = DecodeStage(registry)
        d = registry.decode.nodes[0]
        assert d.prefill_tokens_per_s() is None
        for i in range(20):
            session = decode.claim(d, None, f"r-{i}")
            await DirectStage().attempt(params("x" * 40), session, tried(), time.monotonic() + 5)
            session.close()
        nodes.refuse_generate = 1
        session = decode.claim(d, None, "r-refused")
        await DirectStage().attempt(params("x" * 40), session, tried(), time.monotonic() + 5)
        session.close()
        await settle()
        assert d.rate.busy == 0
        rate = d.prefill_tokens_per_s()
        assert rate is not None and rate > 0

    asyncio.run(main())


# ------------------------------------------------------------------ DecodeStage


def test_a_request_ended_at_its_first_token_has_its_kv_released_on_d():
    async def main():
        nodes = FakeNodes(max_delay_s=0.02)
        registry = FakeRegistry(nodes)
        decode = DecodeStage(registry)
        nodes.held["r-9"] = [1, 2, 3]
        session = decode.claim(registry.decode.nodes[0], None, "r-9")
        session.close(release_kv=True)
        session.close(release_kv=True)  # idempotent: one Release
        await asyncio.sleep(0.1)
        assert not nodes.held and nodes.released == ["r-9"] and not nodes.relays
        assert not all_given_back(registry)

    asyncio.run(main())


def test_a_decode_d_no_longer_holds_fails_saying_why():
    async def main():
        nodes = FakeNodes()
        registry = FakeRegistry(nodes)
        decode = DecodeStage(registry)
        d = registry.decode.nodes[0]
        session = decode.claim(d, None, "unknown")
        with pytest.raises(GenerateError) as err:
            await session.stream(time.monotonic() + 5).read()
        assert err.value.code == Failure.INTERNAL  # NOT_FOUND: D lost the KV
        assert "no longer holds the request's KV" in err.value.message
        session.close()

        nodes.held["r"] = [7, 8]
        session = decode.claim(d, None, "r")
        call = session.stream(time.monotonic() + 5)  # the same Relay stream
        tokens = await call.read()
        assert (tokens.token_ids, tokens.finish_reason) == ([7, 8], "length")
        session.close()
        await settle()
        assert len(nodes.relays) == 1 and not all_given_back(registry)

    asyncio.run(main())


def test_a_session_charges_its_output_to_the_kv_ledger_and_gives_it_all_back():
    async def main():
        registry = FakeRegistry(FakeNodes())
        decode = DecodeStage(registry)
        d = registry.decode.nodes[0]
        prm = params("a" * 40)
        demand = KVDemand.of(prm.prompt_token_ids, "", 200, BS, 8)
        session = decode.claim(d, demand, "r")
        before = d.kv.used
        session.grow(100)
        assert d.kv.used > before
        session.close()
        assert d.kv.used == 0 and d.in_flight == 0

    asyncio.run(main())


# ------------------------------------------------------------------ RequestFront


class Served:
    """What the front tells admission at a request's end (``Admission.note_served``)."""

    def __init__(self) -> None:
        self.served: list[float] = []
        self.decoded: list[float] = []

    def check_arrival(self, *args) -> None:
        pass

    def note_served(self, seconds: float) -> None:
        self.served.append(seconds)

    def note_decoded(self, seconds: float) -> None:
        self.decoded.append(seconds)


def test_the_front_joins_the_stages_and_closes_the_session_whatever_ends_it():
    async def main():
        nodes = FakeNodes(max_delay_s=0.01)
        registry = FakeRegistry(nodes)
        prefill, decode = PrefillStage(registry, BS), DecodeStage(registry)
        metrics = RouterMetrics()
        stages = Stages(prefill, DirectStage(), decode)
        dispatch = Dispatcher(registry, metrics, stages, DispatchPolicy(block_size=BS))
        config = RouterConfig("unused", ("p",), ("d",))
        told = Served()
        front = RequestFront(config, MODEL, dispatch, metrics, told)  # pyright: ignore
        steps = await collect(front, prompt="abc")
        assert "".join(s.delta.text for s in steps) == "cba"
        assert [s.usage is None for s in steps] == [True] * (len(steps) - 1) + [False]
        assert steps[-1].usage is not None and steps[-1].usage.completion_tokens == 4
        assert len(told.served) == 1 and told.served[0] >= 0 and len(told.decoded) == 1
        assert not all_given_back(registry)

        run = front.run(request(prompt="abcdefghij", sampling={"max_tokens": 20}), "c", 5)
        await anext(run)  # the first token: the decode is started
        await anext(run)
        await run.aclose()  # the client left
        assert not all_given_back(registry)
        await asyncio.sleep(0.1)
        assert len(nodes.decode_cancelled) == 1 and not nodes.held
        assert len(told.served) == 1  # not served, and not cut off by its deadline

    asyncio.run(main())


def test_a_request_is_relayed_as_text_with_usage():
    async def main():
        nodes = FakeNodes()
        front, registry = front_for(nodes)
        steps = await collect(front, prompt="hello")
        assert "".join(s.delta.text for s in steps) == "olleh"
        assert steps[-1].delta.finish_reason == "stop"
        usage = steps[-1].usage
        assert usage is not None
        assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (5, 3, 6)
        assert not nodes.generate_calls and len(nodes.prefill_calls) == 1
        assert not all_given_back(registry)

    asyncio.run(main())


def test_the_kv_a_prefill_node_ships_is_counted_by_path_and_a_strange_path_is_bounded():
    async def main():
        nodes = FakeNodes()
        registry = FakeRegistry(nodes, 2, 2)
        config = RouterConfig(
            "unused",
            tuple(n.address for n in registry.prefill.nodes),
            tuple(n.address for n in registry.decode.nodes),
        )
        metrics = RouterMetrics()
        front = build_front(config, MODEL, registry, metrics=metrics)

        def value(name: str, path: str) -> float | None:
            return metrics.registry.get_sample_value(
                f"splitserve_router_{name}_total", {"path": path}
            )

        nodes.shipped = ("dist", 3, 3 * 4096)
        for prompt in ("hello", "world"):
            await collect(front, prompt=prompt)
        assert value("kv_transfers", "dist") == 2
        assert value("kv_shipped_blocks", "dist") == 6
        assert value("kv_shipped_bytes", "dist") == 6 * 4096
        # The label comes from another node: a path no transfer has is counted as "other".
        nodes.shipped = ("x" * 200, 1, 10)
        await collect(front, prompt="again")
        assert value("kv_shipped_bytes", "other") == 10
        assert value("kv_shipped_bytes", "x" * 200) is None
        # A request that ended at its first token shipped nothing and counts nowhere.
        await collect(front, prompt="z", sampling={"max_tokens": 1})
        assert value("kv_transfers", "dist") == 2 and value("kv_transfers", "other") == 1
        await settle()
        assert not all_given_back(registry)

    asyncio.run(main())


def test_the_routers_list_of_transfer_paths_is_the_transfer_layers():
    """The router names the paths itself (it imports no torch, the transfer layer does)."""
    from splitserve.router.dispatch import TRANSFER_PATHS
    from splitserve.transfer import PATHS

    assert frozenset(PATHS) == TRANSFER_PATHS


def test_a_stop_string_in_the_first_token_releases_d_blocks_at_once():
    async def main():
        nodes = FakeNodes()
        front, registry = front_for(nodes)
        steps = await collect(front, prompt="xyz", stop=["z"])
        assert steps[-1].delta.finish_reason == "stop" and not nodes.decode_cancelled
        await settle()
        assert len(nodes.released) == 1 and not nodes.held
        assert not all_given_back(registry)

    asyncio.run(main())


def test_direct_route_retries_a_busy_decode_node_and_counts_its_route():
    async def main():
        nodes = FakeNodes()
        front, registry = front_for(nodes, num_prefill=0)
        nodes.refuse_generate = 1
        steps = await collect(front, prompt="abc")
        assert "".join(s.delta.text for s in steps) == "cba"
        assert steps[-1].usage is not None and steps[-1].usage.cached_tokens == 5
        assert len(nodes.generate_calls) == 2 and len(set(nodes.generate_calls)) == 2
        assert not nodes.prefill_calls
        assert not all_given_back(registry)

    asyncio.run(main())


def test_the_front_refuses_bad_input_and_a_client_over_its_cap():
    async def main():
        nodes = FakeNodes(max_delay_s=0.05)
        front, registry = front_for(nodes, max_requests_per_client=1)
        with pytest.raises(GenerateError) as err:
            await collect(front, prompt="")
        assert err.value.code == Failure.INVALID
        first = front.run(request(prompt="long prompt"), "client")
        await anext(first)
        with pytest.raises(GenerateError) as err:
            await collect(front, prompt="abc")
        assert err.value.code == Failure.REFUSED
        await first.aclose()  # cancels it: everything given back at once
        assert not all_given_back(registry) and not front._in_flight
        await settle()
        await asyncio.sleep(0.1)
        assert not nodes.held

    asyncio.run(main())


def test_a_request_that_exhausts_its_attempts_fails_with_the_last_error():
    async def main():
        nodes = FakeNodes()
        front, registry = front_for(nodes, max_attempts=2)
        nodes.refuse_prefill = 5
        with pytest.raises(GenerateError) as err:
            await collect(front, prompt="abc")
        assert err.value.code == Failure.REFUSED
        assert len(nodes.prefill_calls) == 2
        assert not all_given_back(registry)

    asyncio.run(main())


# ------------------------------------------------------------------ cancelled at random moments


def test_requests_cancelled_at_random_moments_give_back_everything(rng: random.Random):
    # rng: this test's seed (tests/conftest.py): a failure's report says how to repeat its draws

    async def main():
        nodes = FakeNodes(random.Random(rng.random()), max_delay_s=0.004)
        front, registry = front_for(nodes, direct_prefill_tokens=4, max_queue=1000, max_attempts=3)
        for d in registry.decode.nodes:  # small enough that requests queue in admission
            d.capacity, d.kv.num_blocks = 3, 12
        completed: set[str] = set()

        async def one(i: int) -> None:
            prompt = bytes(rng.randrange(97, 123) for _ in range(rng.randrange(1, 34))).decode()
            rid = f"q{i}"
            stop = [prompt[-1]] if rng.random() < 0.2 else []  # the first token, sometimes
            if rng.random() < 0.1:
                nodes.refuse_prefill += 1
            if rng.random() < 0.05:
                nodes.refuse_generate += 1
            steps = await collect(
                front,
                prompt=prompt,
                request_id=rid,
                stop=stop,
                sampling={"max_tokens": rng.randrange(1, 30)},
            )
            assert steps[-1].delta.finish_reason
            completed.add(rid)

        loop = asyncio.get_running_loop()
        tasks = []
        for i in range(150):
            task = asyncio.create_task(one(i))
            if rng.random() < 0.7:
                loop.call_later(rng.uniform(0, 0.05), task.cancel)
            tasks.append(task)
            if rng.random() < 0.3:
                await asyncio.sleep(rng.uniform(0, 0.003))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [
            r
            for r in results
            if isinstance(r, BaseException)
            and not isinstance(r, asyncio.CancelledError)
            and not (isinstance(r, GenerateError) and r.code == Failure.REFUSED)
        ]
        assert not errors, errors[:3]
        cancelled = sum(isinstance(r, asyncio.CancelledError) for r in results)
        assert 0 < cancelled < len(results)
        await asyncio.sleep(0.2)  # background releases and cancels
        assert not all_given_back(registry), all_given_back(registry)
        assert not front._in_flight and len(front_admission(front)) == 0
        # A request that ended served left nothing on D either (a cancelled one may: D frees
        # what a Prefill shipped for a request that vanished at its transfer deadline).
        left = [rid for rid in nodes.held if rid.rpartition("-")[0] in completed]
        assert not left, left

    asyncio.run(main())


def front_admission(front):
    """The admission queue behind a front."""
    return front._admission


def test_first_token_finishing_the_request_on_p_opens_no_decode_and_releases_nothing():
    async def main():
        nodes = FakeNodes()
        front, registry = front_for(nodes)
        steps = await collect(front, prompt="xy", sampling={"max_tokens": 1})
        assert [s.delta.finish_reason for s in steps] == ["length"]
        assert steps[0].delta.token_ids == [ord("y")]
        await settle()
        assert not nodes.released and not nodes.held and not nodes.decode_cancelled
        assert not all_given_back(registry)

    asyncio.run(main())
