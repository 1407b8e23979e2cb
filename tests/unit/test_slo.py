"""``runtime.slo``: the one SLO syntax (router ``--slo``, the HTTP header, ``bench --slo``), the
numbers a client sends, and how a request's own bounds meet the router's default and its
deadline."""

from __future__ import annotations

import math

import pytest

from splitserve.runtime.slo import Slo, parse_bounds


def test_parse_reads_seconds_and_milliseconds(rng):
    ttft, tpot_ms = rng.uniform(0.1, 30), rng.randint(1, 999)
    assert Slo.parse(f"ttft={ttft!r},tpot={tpot_ms}ms") == (ttft, pytest.approx(tpot_ms / 1000))
    assert Slo.parse(f" TPOT = {tpot_ms}ms ") == (None, pytest.approx(tpot_ms / 1000))
    assert Slo.parse("ttft=2s") == Slo(2.0, None)
    assert Slo.parse(None) is None and Slo.parse("") is None and Slo.parse(" , ") is None


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("ttft", "KEY=SECONDS"),
        ("e2e=3", "KEY=SECONDS"),  # the router's SLO has no e2e (bench's has)
        ("ttft=fast", "not a number"),
        ("ttft=0", "positive"),
        ("tpot=-5ms", "positive"),
        ("ttft=nan", "positive"),
        ("ttft=inf", "positive"),
    ],
)
def test_parse_names_the_bad_part(text, says):
    with pytest.raises(ValueError, match=f"bad SLO '{text}'.*{says}"):
        Slo.parse(text)


def test_parse_bounds_takes_only_the_keys_given():
    assert parse_bounds("ttft=1,e2e=250ms", ("ttft", "tpot", "e2e")) == {"ttft": 1, "e2e": 0.25}
    with pytest.raises(ValueError, match="one of \\('ttft',\\)"):
        parse_bounds("tpot=1", ("ttft",))


def test_str_round_trips_through_parse(rng):
    for _ in range(20):
        slo = Slo(
            rng.choice([None, round(rng.uniform(0.01, 60), 3)]),
            round(rng.uniform(0.001, 1), 4),
        )
        assert Slo.parse(str(slo)) == slo
    assert str(Slo()) == "none"


def test_checked_takes_zero_as_unset_and_refuses_negative_or_non_finite(rng):
    ttft = rng.uniform(0.1, 10)
    assert Slo.checked(ttft, 0.0) == Slo(ttft, None)
    assert Slo.checked(0.0, ttft) == Slo(None, ttft)
    assert Slo.checked(0.0, 0.0) is None and Slo.checked(None, None) is None
    for bad in (-ttft, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"slo\.tpot is"):
            Slo.checked(ttft, bad)
        with pytest.raises(ValueError, match=r"slo\.ttft is"):
            Slo.checked(bad, None)


def test_within_keeps_own_bounds_and_fills_the_rest_from_the_default():
    default = Slo(5.0, 0.2)
    assert Slo(1.0, None).within(default) == Slo(1.0, 0.2)
    assert Slo(None, 0.05).within(default) == Slo(5.0, 0.05)
    assert Slo(9.0, 0.5).within(default) == Slo(9.0, 0.5)  # own bounds win, looser or not
    assert Slo(1.0, None).within(None) == Slo(1.0, None)
    assert Slo(None, None).within(Slo(None, 0.1)) == Slo(None, 0.1)


def test_capped_holds_ttft_to_the_deadline(rng):
    left = rng.uniform(1, 10)
    assert Slo(left + 1, 0.1).capped(left) == Slo(left, 0.1)
    assert Slo(left - 0.5, 0.1).capped(left) == Slo(left - 0.5, 0.1)
    assert Slo(None, 0.1).capped(left) == Slo(left, 0.1)  # a deadline bounds an unset TTFT too
