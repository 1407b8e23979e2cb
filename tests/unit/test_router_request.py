"""The router's request validation: bad requests name the field, good ones get defaults."""

from __future__ import annotations

import random

import pytest
from support.router_helpers import MODEL, TOKENIZER, request

from splitserve.router.request import InvalidRequest, parse_request


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
