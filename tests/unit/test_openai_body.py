"""The HTTP API's JSON checks that need no model: a chat message must say what it says."""

from __future__ import annotations

import pytest
from support.router_helpers import MODEL

from splitserve.router.openai_api import ApiError, parse_body


def chat(*messages: dict) -> dict:
    return {"messages": list(messages), "max_tokens": 4}


@pytest.mark.parametrize(
    ("message", "says"),
    [
        ({"role": "user"}, "messages[1] has no content"),
        ({"role": "user", "content": None}, "messages[1].content is null"),
        ({"role": "system", "content": 7}, "messages[1].content must be a string"),
    ],
)
def test_a_chat_message_without_content_is_a_400_naming_it(message, says):
    with pytest.raises(ApiError) as err:
        parse_body(chat({"role": "user", "content": "hi"}, message), True, "m", MODEL, "", None)
    assert err.value.status == 400 and says in err.value.message


def test_an_assistant_turn_may_have_null_content():
    body = chat({"role": "user", "content": "hi"}, {"role": "assistant", "content": None})
    request = parse_body(body, True, "m", MODEL, "", None)
    assert [content for _, content in request.requests[0].messages] == ["hi", ""]


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"temperature": "0.5"}, 'temperature must be a number, got "0.5"'),
        ({"ignore_eos": 1}, "ignore_eos must be true or false"),
        ({"top_k": 2.0}, "top_k must be an integer, got 2.0"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"top_k": 3_000_000_000}, "top_k is out of range"),
        ({"temperature": 1e300}, "temperature must be a finite number"),  # inf on the wire
        ({"top_p": 0}, "top_p must be in (0, 1]"),
        ({"stop_token_ids": [2**33]}, "stop_token_ids must be a list of token ids"),
    ],
)
def test_a_sampling_field_of_the_wrong_type_or_range_is_a_400_naming_it(fields, says):
    with pytest.raises(ApiError) as err:
        parse_body({"prompt": "hi", **fields}, False, "m", MODEL, "", None)
    assert err.value.status == 400 and says in err.value.message


def test_sampling_values_are_those_the_nodes_receive():
    body = {"prompt": "hi", "temperature": 0.1, "top_k": 5, "seed": -1, "stop_token_ids": [7]}
    sampling = parse_body(body, False, "m", MODEL, "", None).requests[0].sampling
    assert sampling.temperature == pytest.approx(0.1, rel=1e-7) and sampling.temperature != 0.1
    assert (sampling.top_k, sampling.seed, sampling.stop_token_ids) == (5, 2**64 - 1, (7,))
    assert sampling.max_tokens == 16  # OpenAI's default for a completion
