"""The prefill node's fetch/compute rates follow what is measured (prefill_node.rates)."""

import pytest

from splitserve.prefill_node.rates import RATE_SAMPLE_MIN_TOKENS, Rates


def test_rates_follow_measurements():
    rates = Rates(block_nbytes=1 << 20, block_size=16, compute_rate=None)
    assert rates.worth_fetching(4)  # compute speed unknown
    rates.prefilled(RATE_SAMPLE_MIN_TOKENS - 1, 1.0)
    assert rates.compute_rate is None  # too small a prefill to say anything
    rates.prefilled(1000, 0.001)  # 1M tokens/s: computing beats any fetch
    assert rates.compute_rate == pytest.approx(1e6)
    assert not rates.worth_fetching(4)
    before = rates.fetch_rate()
    rates.fetched(1 << 10, 1.0)  # too small a fetch
    assert rates.fetch_rate() == before
    rates.fetched(100 << 20, 0.102)
    assert rates.fetch_rate() > before
    assert rates.fetch_rate("tcp") == 2e9  # each path's rate is its own


def test_a_faster_path_makes_fetching_worth_it():
    # A GPU-like prefill rate: 20k tokens/s; 64 blocks of 2 MiB (1,024 tokens, ~51 ms).
    rates = Rates(block_nbytes=2 << 20, block_size=16, compute_rate=20_000)
    assert not rates.worth_fetching(64, "grpc")  # ~0.54 s over the gRPC stream
    assert rates.worth_fetching(64, "ipc")  # ~3 ms
    for _ in range(12):  # measured far slower than the prior, again and again (an average)
        rates.fetched(128 << 20, 0.5, "ipc")
    assert not rates.worth_fetching(64, "ipc")
