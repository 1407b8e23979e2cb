"""SamplingParams validation and normalisation, and check_stop: the parts of sampling that need
no logits."""

import dataclasses
import math

import pytest

from splitserve.models.sampler import SamplingParams, check_stop

# ------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "1.0"),
        ("top_k", -2),
        ("top_k", 2.0),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("min_p", math.inf),
        ("seed", 1.5),
        ("seed", False),
        ("seed", 2**64),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("presence_penalty", math.nan),
        ("frequency_penalty", -3.0),
        ("frequency_penalty", -math.inf),
        ("max_tokens", 0),
        ("max_tokens", True),
        ("max_tokens", 16.0),
        ("min_tokens", -1),
        ("min_tokens", 17),  # > max_tokens (16)
        ("min_tokens", True),
        ("ignore_eos", 1),
        ("logprobs", "yes"),
        ("stop_token_ids", (1, -5)),
        ("stop_token_ids", (True,)),
        ("stop_token_ids", 7),
        ("stop_token_ids", "12"),
    ],
)
def test_invalid_param_names_field_and_value(field, value):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    assert repr(value) in str(info.value)


def test_valid_edges_are_accepted_and_normalised():
    p = SamplingParams(
        temperature=0,
        top_k=0,
        top_p=1,
        min_p=1,
        seed=-(2**63),
        repetition_penalty=1e-3,
        presence_penalty=-2,
        frequency_penalty=2,
        max_tokens=3,
        min_tokens=3,
        stop_token_ids=[0, 7],
    )
    assert p.stop_token_ids == (0, 7) and isinstance(p.temperature, float)
    fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.init}
    assert hash(p) == hash(SamplingParams(**fields))
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # frozen


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"top_k": 1}, True),
        ({"temperature": 0.0, "top_k": 5}, True),
        ({}, False),
        ({"temperature": 1e-4}, False),
        ({"top_k": 2}, False),
    ],
)
def test_greedy_property(kwargs, greedy):
    assert SamplingParams(**kwargs).greedy is greedy


# ------------------------------------------------------------------------- check_stop


@pytest.mark.parametrize(
    ("kwargs", "token", "num_out", "expected"),
    [
        ({}, 2, 1, "stop"),  # eos
        ({"ignore_eos": True}, 2, 1, None),
        ({"stop_token_ids": (9, 11)}, 11, 1, "stop"),
        ({"stop_token_ids": (9,), "ignore_eos": True}, 9, 1, "stop"),
        ({"min_tokens": 3}, 2, 2, None),  # eos before min_tokens does not stop
        ({"min_tokens": 3}, 2, 3, "stop"),
        ({}, 5, 15, None),
        ({}, 5, 16, "length"),
        ({"max_tokens": 4}, 2, 4, "stop"),  # stop on the last allowed token beats length
        ({"max_tokens": 4, "ignore_eos": True}, 2, 4, "length"),
    ],
)
def test_check_stop(kwargs, token, num_out, expected):
    assert check_stop(SamplingParams(**kwargs), token, num_out, eos_token_id=2) == expected


def test_check_stop_without_eos_token():
    assert check_stop(SamplingParams(), 0, 1, eos_token_id=None) is None
