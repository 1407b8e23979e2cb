"""PeerFetcher (prefill_node/peer_fetch.py) on its own, with a fake engine, transfer layer and
rates: only full blocks before the last prompt token are asked for, blocks cached here are not, a
fetch the rates say is slower than computing is skipped (and counted), the transfer layer's
adoption is counted and timed by its path, concurrent prompts with one prefix fetch it once, and
a fetch from a stalled peer gives up within its budget (the prompts compute; the peer is left
alone for a while).
Fetches between real nodes: tests/cluster/test_peer_fetch.py."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from splitserve.kvstore import ModelIdentity, hash_request_tokens
from splitserve.prefill_node import peer_fetch
from splitserve.prefill_node.peer_fetch import PeerFetcher
from splitserve.prefill_node.rates import MIN_FETCH_BLOCKS
from splitserve.runtime import counter_names as names

BS = 16
ROOT = ModelIdentity("m").root_hash


class FakeEngine:
    """What PeerFetcher uses of a ``NodeEngine`` here: its figures and ``count_cached`` (the
    first ``cached`` blocks of any prompt are cached)."""

    info = SimpleNamespace(block_size=BS, block_nbytes=1024)

    def __init__(self, cached: int = 0) -> None:
        self.cached = cached

    async def count_cached(self, block_hashes) -> int:
        return min(self.cached, len(block_hashes))


class FakeLayer:
    """The transfer layer's fetch: adopts every block asked for, after ``delay`` s."""

    def __init__(self, engine: FakeEngine, delay: float = 0.0) -> None:
        self.engine, self.delay = engine, delay
        self.asked: list[int] = []

    async def path_to(self, peer):
        return "tcp"

    async def fetch(self, peer, root, want, proof, timeout):
        self.asked.append(len(want))
        await asyncio.sleep(self.delay)
        self.engine.cached += len(want)
        return len(want)


class FakeRates:
    def __init__(self, worth: bool = True, block_compute_s: float | None = None) -> None:
        self.worth, self.block_compute_s = worth, block_compute_s
        self.timed: list[tuple[int, str]] = []

    def compute_seconds(self, blocks):
        return None if self.block_compute_s is None else blocks * self.block_compute_s

    def worth_fetching(self, blocks, path):
        return self.worth and blocks >= MIN_FETCH_BLOCKS  # as Rates: fewer are computed

    def fetched(self, nbytes, seconds, path=""):
        self.timed.append((nbytes, path))


def fetcher(engine: FakeEngine, rates: FakeRates, layer: FakeLayer | None) -> PeerFetcher:
    return PeerFetcher(engine, ROOT, rates, channels=None, counters=Counter(), layer=layer)


def test_only_full_blocks_before_the_last_token_are_asked_for_and_not_those_cached_here():
    async def main():
        engine = FakeEngine(cached=1)
        layer, rates = FakeLayer(engine), FakeRates()
        peers = fetcher(engine, rates, layer)
        assert await peers.fetch("p1", 10, list(range(BS)), None, None) == 0  # one block: computed
        prompt = list(range(4 * BS))  # 4 full blocks, the last one holding the last token
        assert await peers.fetch("p1", 10, prompt, None, None) == 2  # blocks 1 and 2
        assert layer.asked == [2]
        assert peers.counters[names.PREFIX_BLOCKS_FETCHED] == 2
        assert rates.timed == [(2 * 1024, "tcp")]

    asyncio.run(main())


def test_a_fetch_slower_than_computing_is_skipped_and_counted():
    async def main():
        engine = FakeEngine()
        layer = FakeLayer(engine)
        peers = fetcher(engine, FakeRates(worth=False), layer)
        assert await peers.fetch("p1", 10, list(range(5 * BS)), None, None) == 0
        assert layer.asked == []
        assert peers.counters[names.PREFIX_FETCH_SKIPPED_SLOWER] == 1

    asyncio.run(main())


def test_concurrent_prompts_with_one_prefix_fetch_it_once():
    async def main():
        engine = FakeEngine()
        layer = FakeLayer(engine, delay=0.05)
        peers = fetcher(engine, FakeRates(), layer)
        prompt = list(range(3 * BS + 1))
        got = await asyncio.gather(*(peers.fetch("p1", 3, prompt, None, None) for _ in range(3)))
        assert got == [3, 0, 0]  # the others wait, then find the blocks cached here
        assert layer.asked == [3]
        assert not peers._fetching

    asyncio.run(main())


def test_the_asked_hashes_are_the_prompts_chain_with_its_salt():
    async def main():
        engine = FakeEngine()
        seen = []

        class Recording(FakeLayer):
            async def fetch(self, peer, root, want, proof, timeout):
                seen.append((root, list(want), proof))
                return await super().fetch(peer, root, want, proof, timeout)

        peers = fetcher(engine, FakeRates(), Recording(engine))
        prompt = list(range(2 * BS + 5))
        assert await peers.fetch("p1", 2, prompt, "tenant", 1.0) == 2
        ((root, want, proof),) = seen
        assert root == ROOT and want == hash_request_tokens(prompt, BS, ROOT, "tenant")[:2]
        assert proof == dict(prompt_token_ids=prompt[: 2 * BS], cache_salt="tenant", first_block=0)

    asyncio.run(main())


class StalledLayer(FakeLayer):
    """A transfer layer whose fetches from ``stalled`` peers never end (a holder that stopped
    answering); it records each cancelled fetch (where the real one frees its reservation)."""

    def __init__(self, engine: FakeEngine, stalled: set[str]) -> None:
        super().__init__(engine)
        self.stalled, self.cancelled = stalled, 0

    async def fetch(self, peer, root, want, proof, timeout):
        if peer not in self.stalled:
            return await super().fetch(peer, root, want, proof, timeout)
        self.asked.append(len(want))
        try:
            await asyncio.sleep(60)  # (the tests end within seconds when the budget works)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        raise AssertionError("a stalled fetch ended")


def test_a_fetch_from_a_stalled_peer_gives_up_within_its_budget_and_the_peer_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(peer_fetch, "FETCH_MIN_S", 0.2)

    async def main():
        engine = FakeEngine()
        layer = StalledLayer(engine, {"stalled"})
        # Computing a block takes 1 ms: the budget is FETCH_MIN_S (0.2 s here).
        peers = fetcher(engine, FakeRates(block_compute_s=0.001), layer)
        assert peers.budget_s(3) == pytest.approx(0.2)
        prompt = list(range(3 * BS + 1))

        def fetch() -> asyncio.Task[int]:
            return asyncio.create_task(peers.fetch("stalled", 3, prompt, None, 30.0))

        t0 = time.monotonic()
        first = fetch()
        await asyncio.sleep(0.05)
        assert peers._fetching  # its fetch is in flight
        # Two prompts of the same prefix come now and wait for it (their own budgets, set
        # before they start, are long: only the first fetch's can end the wait).
        monkeypatch.setattr(peer_fetch, "FETCH_MIN_S", 30.0)
        waiting = [fetch(), fetch()]
        got = [await first, *[await w for w in waiting]]
        waited = time.monotonic() - t0
        assert got == [0, 0, 0]  # all three compute
        assert waited < 2.0, waited  # not the hour the holder would have taken
        assert layer.asked == [3] and layer.cancelled == 1  # one fetch, cancelled (freed)
        assert peers.counters[names.PREFIX_FETCH_TIMED_OUT] == 1
        # The two that waited for it did not try again themselves.
        assert peers.counters[names.PREFIX_FETCH_SKIPPED_PEER_SLOW] == 2
        assert not peers._fetching
        # The stalled peer is not asked again for a while; another peer is.
        assert await peers.fetch("stalled", 3, prompt, None, 30.0) == 0
        assert layer.asked == [3]
        assert peers.counters[names.PREFIX_FETCH_SKIPPED_PEER_SLOW] == 3
        assert await peers.fetch("other", 3, prompt, None, 30.0) == 3
        assert layer.asked == [3, 3]
        # Once the back-off has passed, the peer is asked again.
        peers._backoff["stalled"] = time.monotonic() - 1
        engine.cached = 0
        monkeypatch.setattr(peer_fetch, "FETCH_MIN_S", 0.2)
        assert await peers.fetch("stalled", 3, prompt, None, 30.0) == 0
        assert layer.asked == [3, 3, 3]
        assert peers.counters[names.PREFIX_FETCH_TIMED_OUT] == 2

    asyncio.run(asyncio.wait_for(main(), 20))


def test_the_fetch_budget_follows_the_compute_time_and_the_request_deadline_blames_no_peer():
    async def main():
        engine = FakeEngine()
        unknown = fetcher(engine, FakeRates(), FakeLayer(engine))
        assert unknown.budget_s(8) == peer_fetch.FETCH_TIMEOUT_S  # no rate yet: the cap
        slow = fetcher(engine, FakeRates(block_compute_s=0.5), FakeLayer(engine))
        assert slow.budget_s(2) == pytest.approx(peer_fetch.FETCH_BUDGET_X * 1.0)
        assert slow.budget_s(100) == peer_fetch.FETCH_TIMEOUT_S
        fast = fetcher(engine, FakeRates(block_compute_s=1e-4), FakeLayer(engine))
        assert fast.budget_s(2) == peer_fetch.FETCH_MIN_S
        # The request's own deadline ends the fetch first: it computes, and the peer is still
        # asked by the next request.
        layer = StalledLayer(engine, {"p1"})
        peers = fetcher(engine, FakeRates(block_compute_s=0.5), layer)
        prompt = list(range(3 * BS + 1))
        assert await peers.fetch("p1", 3, prompt, None, 0.05) == 0
        assert await peers.fetch("p1", 3, prompt, None, 0.0) == 0  # no time left: not tried
        assert layer.asked == [3] and layer.cancelled == 1
        assert peers.counters[names.PREFIX_FETCH_TIMED_OUT] == 1
        assert not peers._backoff
        assert peers.counters[names.PREFIX_FETCH_SKIPPED_PEER_SLOW] == 0

    asyncio.run(asyncio.wait_for(main(), 20))


def test_a_prompt_that_waited_on_a_stalled_fetch_fetches_from_its_own_holder_with_a_whole_budget(
    monkeypatch: pytest.MonkeyPatch,
):
    # A prompt of the same prefix whose hint names another holder waits for the first fetch
    # (from a stalled holder), then fetches from its own with a budget of its own: that holder is
    # not blamed for the time the first one took.
    # Both budgets are 1 s. The healthy holder takes 0.5 s: half a budget (room for a loaded
    # machine's stalls), but more than the ~0.02 s that would be left were the wait counted.
    monkeypatch.setattr(peer_fetch, "FETCH_MIN_S", 1.0)

    class SlowLayer(StalledLayer):
        async def fetch(self, peer, root, want, proof, timeout):
            if peer == "healthy":
                await asyncio.sleep(0.5)
            return await super().fetch(peer, root, want, proof, timeout)

    async def main():
        engine = FakeEngine()
        layer = SlowLayer(engine, {"stalled"})
        peers = fetcher(engine, FakeRates(block_compute_s=0.001), layer)
        prompt = list(range(3 * BS + 1))
        first = asyncio.create_task(peers.fetch("stalled", 3, prompt, None, 30.0))
        # It comes 0.02 s later: when the first fetch's budget ends, the second's would have
        # 0.02 s left, were its wait counted in it.
        await asyncio.sleep(0.02)
        second = asyncio.create_task(peers.fetch("healthy", 3, prompt, None, 30.0))
        assert await first == 0
        assert await second == 3
        assert set(peers._backoff) == {"stalled"}
        assert peers.counters[names.PREFIX_FETCH_TIMED_OUT] == 1
        assert peers.counters[names.PREFIX_FETCH_SKIPPED_PEER_SLOW] == 0

    asyncio.run(asyncio.wait_for(main(), 20))
