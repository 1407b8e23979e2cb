"""Work a caller can cause is bounded: the router's public port refuses oversized requests
(RESOURCE_EXHAUSTED, configurable), long stop-id lists and salts are refused, tokenizing runs
off the router's event loop (other streams go on meanwhile), and the next request succeeds."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from support.processes import start_node, start_router

from splitserve.client import Client, SplitserveError
from splitserve.models.tiny import write_random_checkpoint


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits")
    model = write_random_checkpoint(tmp / "m", seed=9, with_tokenizer=True, num_hidden_layers=2)
    prefill = start_node("prefill", model, tmp)
    decode = start_node("decode", model, tmp)
    router = start_router(
        model, tmp, [prefill.address], [decode.address], "--max-request-bytes", "1000000"
    )
    try:
        yield router
    finally:
        for proc in (router, prefill, decode):
            proc.stop()


def test_an_oversized_request_is_refused_and_the_next_one_served(router):
    with Client(router.address) as client:
        with pytest.raises(SplitserveError) as err:
            client.generate(prompt="a " * 600_000, max_tokens=2)  # 1.2 MB
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        reply = client.generate(prompt_token_ids=[3, 4, 5], max_tokens=2, ignore_eos=True)
        assert len(reply.token_ids) == 2


def test_a_long_text_is_tokenized_while_other_requests_go_on(router):
    """A 0.9 MB text (tokenized, then refused as too long for the context) must not stall a
    short request sent meanwhile."""
    with Client(router.address) as client:
        client.generate(prompt_token_ids=[1, 2], max_tokens=1)  # warm
        done: dict[str, float] = {}

        def long_one():
            t0 = time.monotonic()
            with pytest.raises(SplitserveError) as err:
                client.generate(prompt="word " * 180_000, max_tokens=1)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            done["long"] = time.monotonic() - t0

        thread = threading.Thread(target=long_one)
        thread.start()
        time.sleep(0.05)
        t0 = time.monotonic()
        reply = client.generate(prompt_token_ids=[1, 2, 3], max_tokens=2, ignore_eos=True)
        assert len(reply.token_ids) == 2
        short = time.monotonic() - t0
        thread.join(60)
    assert "long" in done
    # The short request did not wait for the long one's tokenizing to end.
    assert short < done["long"] / 2, (short, done)
