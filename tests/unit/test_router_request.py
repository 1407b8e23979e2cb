"""The router's request validation: bad requests name the field, good ones get defaults."""

from __future__ import annotations

import random

import pytest
from support.router_helpers import MODEL, TOKENIZER, request, request_message

from splitserve.router.request import InvalidRequest, parse_request
from splitserve.router.service import input_of
from splitserve.runtime.slo import Slo
from splitserve.v1 import router_pb2


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
        ({"prompt": "hi", "cache_salt": "s" * 257}, "cache_salt has 257 characters"),
        ({"prompt": "hi", "sampling": {"stop_token_ids": list(range(1025))}}, "at most 1024"),
        (
            {"prompt": "hello", "sampling": {"max_tokens": 10**9}},
            "maximum context length is 64 tokens; you requested 1000000005 .5 in the text, "
            "1000000000 in the completion.: set max_tokens to at most 59",
        ),
        ({"prompt_token_ids": [1] * 10, "sampling": {"max_tokens": 55}}, "at most 54"),
    ],
)
def test_bad_requests_are_rejected_with_a_message_naming_the_field(kwargs, named):
    with pytest.raises(InvalidRequest, match=named.replace("[", r"\[")):
        parse_request(request(**kwargs), MODEL)


def test_max_tokens_of_the_whole_context_means_as_many_as_fit():
    params = parse_request(request(prompt="hello", sampling={"max_tokens": 64}), MODEL)
    assert params.sampling.max_tokens == 64 - 5
    exact = parse_request(request(prompt="hello", sampling={"max_tokens": 59}), MODEL)
    assert exact.sampling.max_tokens == 59


def test_good_request_is_tokenized_with_defaults_filled_in():
    params = parse_request(request(prompt="hé", stop=["\n"]), MODEL)
    assert params.prompt_token_ids == tuple(TOKENIZER("hé").input_ids)
    assert params.sampling.max_tokens == 16 and params.sampling.temperature == 1.0
    assert params.request_id and params.stop == ("\n",)
    ids = [random.randrange(320) for _ in range(63)]
    assert parse_request(request(prompt_token_ids=ids), MODEL).prompt_token_ids == tuple(ids)


def test_the_requests_own_slo_is_read_and_zero_leaves_a_bound_unset(rng):
    ttft, tpot = rng.uniform(0.05, 30), rng.uniform(0.001, 1)
    both = request(prompt="hi", slo=router_pb2.Slo(ttft_s=ttft, tpot_s=tpot))
    assert both.slo == Slo(ttft, tpot)
    only_tpot = request(prompt="hi", slo=router_pb2.Slo(tpot_s=tpot))
    assert only_tpot.slo == Slo(None, tpot)
    assert request(prompt="hi").slo is None  # none sent
    empty = request_message(prompt="hi", slo=router_pb2.Slo())  # present, both 0: unbounded
    assert empty.HasField("slo") and input_of(empty).slo is None


@pytest.mark.parametrize(
    ("slo", "named"),
    [
        ({"ttft_s": -1.0}, "slo.ttft is -1.0"),
        ({"tpot_s": float("nan")}, "slo.tpot is nan"),
        ({"ttft_s": 2.0, "tpot_s": float("inf")}, "slo.tpot is inf"),
    ],
)
def test_a_bad_slo_is_rejected_with_a_message_naming_the_bound(slo, named):
    with pytest.raises(InvalidRequest, match=f"{named}: give a positive number.*0 to leave"):
        request(prompt="hi", slo=router_pb2.Slo(**slo))
