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
    before = rates.fetch_rate
    rates.fetched(1 << 10, 1.0)  # too small a fetch
    assert rates.fetch_rate == before
    rates.fetched(100 << 20, 0.102)
    assert rates.fetch_rate > before
