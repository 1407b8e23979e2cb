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
