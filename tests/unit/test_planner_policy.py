"""The planner's policy (splitserve.planner.policy.decide): which pool is short, hysteresis,
cooldowns, bounds; and a replay of two traces recorded from real `splitserve up --autoscale`
runs of the tiny model on the CPU (tests/unit/data/planner_trace_*.jsonl: every round's /metrics
figures, recorded with `--record`), one decode-bound and one prefill-bound step load."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest

from splitserve.planner.policy import (
    Bounds,
    Counts,
    Figures,
    PolicyConfig,
    PoolFigures,
    decide,
    decode_load,
)
from splitserve.runtime.slo import Slo

DATA = Path(__file__).parent / "data"
SLO = Slo(ttft_s=2.0, tpot_s=0.1)
WIDE = Bounds(min_prefill=1, max_prefill=4, min_decode=1, max_decode=4)
CFG = PolicyConfig(out_after_s=2.0, cooldown_s=30.0, settle_s=60.0)


def figures(at: float, *, p_nodes=1, d_nodes=1, d_in_flight=0, slots=8, queue=0, wait=0.0, **kw):
    return Figures(
        at=at,
        queue_length=queue,
        oldest_wait_s=wait,
        prefill=PoolFigures(
            nodes=p_nodes, in_flight=kw.pop("p_in_flight", 0), prompt_tokens=kw.pop("p_tokens", 0)
        ),
        decode=PoolFigures(nodes=d_nodes, in_flight=d_in_flight, slots=slots * d_nodes),
        **kw,
    )


def run(seq, current=Counts(1, 1), bounds=WIDE, config=CFG, state=None):  # noqa: B008
    """Decide over ``seq`` of figures, the actuator doing what is wanted at once; returns every
    decision."""
    out = []
    for f in seq:
        d = decide(f, current, bounds, SLO, state, config)
        out.append(d)
        current, state = d.wanted, d.state
    return out


def test_decode_short_on_slots_grows_decode_only_after_out_after():
    seq = [figures(t, d_in_flight=12, queue=5, wait=1.0) for t in (0.0, 1.0, 2.0)]
    d = run(seq)
    # Load 1.5 on one node, sized for 0.7: 3 nodes (+2, max_step).
    assert [x.wanted for x in d] == [Counts(1, 1), Counts(1, 1), Counts(1, 3)]
    assert "scale out: decode load 1.50" in d[-1].reasons["decode"]
    assert d[-1].reasons["prefill"].startswith("steady")  # the queue waits on decode, not prefill


def test_decode_short_on_kv_and_step_is_bounded():
    seq = [figures(t, d_in_flight=1, kv_blocks_total=100, kv_blocks_charged=99) for t in (0, 3)]
    assert run(seq, current=Counts(1, 2))[-1].wanted == Counts(1, 3)  # 0.99 sized for 0.7
    assert "decode load 0.99" in run(seq)[-1].reasons["decode"]
    seq = [figures(t, d_in_flight=16) for t in (0, 3)]  # load 2.0: 6 nodes for 0.7, +2 at most
    assert run(seq, current=Counts(1, 1))[-1].wanted == Counts(1, 3)
    assert run(seq, current=Counts(1, 1), bounds=replace(WIDE, max_decode=2))[-1].wanted == (1, 2)


def test_prefill_short_when_the_queue_waits_and_decode_has_room():
    seq = [figures(t, queue=10, wait=1.0, d_in_flight=2, p_in_flight=1) for t in (0, 1, 2)]
    d = run(seq)
    assert d[-1].wanted == Counts(2, 1)
    assert "while decode has room" in d[-1].reasons["prefill"]


def test_tpot_over_slo_on_an_idle_pool_scales_nothing():
    seq = [figures(t, d_in_flight=1, tpot_s=0.5, ttft_s=5.0) for t in range(10)]
    assert all(x.wanted == Counts(1, 1) for x in run(seq))


def test_tpot_over_slo_on_a_loaded_pool_grows_decode():
    seq = [figures(t, d_in_flight=5, tpot_s=0.5) for t in range(4)]  # load 0.62
    assert run(seq)[-1].wanted == Counts(1, 2)


def test_one_client_with_long_prompts_is_not_a_prefill_backlog():
    # One request at a time holds the prefill node (a backlog of 3 s at its rate), yet a second
    # node would not make it faster: no scale-out.
    seq = [figures(t, p_in_flight=1, p_tokens=3000, prefill_tokens_per_s=1000.0) for t in range(10)]
    assert all(x.wanted == Counts(1, 1) for x in run(seq))
    crowded = [replace(f, prefill=replace(f.prefill, in_flight=3)) for f in seq]
    assert run(crowded)[-1].wanted == Counts(3, 1)  # a 3 s backlog for a 1 s target: +2


def test_no_new_growth_until_the_asked_nodes_are_routable():
    short = [figures(t, d_in_flight=7, queue=5, wait=1.0) for t in range(0, 40, 2)]
    d = run(short)  # the router keeps seeing 1 decode node: the new ones are still starting
    grows = [x.wanted.decode for x in d]
    assert grows[:3] == [1, 2, 2] and set(grows) == {1, 2}
    assert "waiting for 2 to be routable" in d[-1].reasons["decode"]
    late = [figures(t, d_in_flight=7, queue=5, wait=1.0) for t in range(0, 70, 2)]
    assert run(late)[-1].wanted.decode == 3  # settle_s (60 s) passed: it asks again


def test_steady_load_between_the_thresholds_never_moves():
    # Decode load swings between 0.55 and 0.8 on 2 nodes: under out_util, above in_util with
    # one fewer; the queue empties and fills below the wait threshold.
    seq = [
        figures(t, d_nodes=2, d_in_flight=9 if t % 4 else 13, queue=t % 3, wait=0.2)
        for t in range(0, 600, 2)
    ]
    assert {x.wanted for x in run(seq, current=Counts(1, 2))} == {Counts(1, 2)}


def test_scale_in_needs_low_for_the_cooldown_and_the_cooldown_since_the_last_change():
    busy = [figures(t, d_in_flight=7, queue=4, wait=1.0) for t in (0, 2, 4)]
    idle = [figures(t, d_nodes=2) for t in range(6, 120, 2)]
    d = run(busy + idle)
    decode = [(f.at, x.wanted.decode) for f, x in zip(busy + idle, d, strict=True)]
    up = next(t for t, n in decode if n == 2)
    down = next(t for t, n in decode if t > up and n == 1)
    assert up == 2 and down - 6 >= CFG.cooldown_s  # idle from 6 s on, for 30 s
    # A blip of load restarts the low clock.
    blip = [figures(t, d_nodes=2) for t in range(6, 30, 2)] + [figures(30, d_nodes=2, queue=1)]
    blip += [figures(t, d_nodes=2) for t in range(32, 60, 2)]
    assert all(x.wanted.decode == 2 for x in run(blip, current=Counts(1, 2), state=d[3].state))


def test_never_below_min_nor_above_max():
    f = figures(0)
    assert decide(f, Counts(0, 0), WIDE, SLO).wanted == Counts(1, 1)
    assert decide(f, Counts(9, 9), WIDE, SLO).wanted == Counts(4, 4)
    seq = [figures(t, d_nodes=1) for t in range(0, 300, 5)]
    assert all(x.wanted == Counts(1, 1) for x in run(seq))


def _trace(name: str):
    lines = (DATA / name).read_text().splitlines()
    head = json.loads(lines[0])
    rows = []
    for line in lines[1:]:
        row = json.loads(line)
        f = row["figures"]
        f["prefill"], f["decode"] = PoolFigures(**f["prefill"]), PoolFigures(**f["decode"])
        rows.append((Figures(**f), Counts(**row["current"])))
    return head, rows


@pytest.mark.parametrize(
    ("name", "short", "other"),
    [
        ("planner_trace_decode.jsonl", "decode", "prefill"),
        ("planner_trace_prefill.jsonl", "prefill", "decode"),
    ],
)
def test_replay_of_a_recorded_step_load(name, short, other):
    head, rows = _trace(name)
    bounds = Bounds(**head["bounds"])
    cfg = PolicyConfig(out_after_s=head["interval_s"], cooldown_s=head["cooldown_s"])
    current, state = rows[0][1], None
    changes: dict[str, list[tuple[float, int]]] = {"prefill": [], "decode": []}
    for f, _recorded in rows:
        d = decide(f, current, bounds, SLO, state, cfg)
        for role in ("prefill", "decode"):
            have, want = getattr(current, role), getattr(d.wanted, role)
            if want > have:  # grown only where its own signal, read independently, is short
                if role == "decode":
                    assert decode_load(f) >= cfg.out_util, (f, d.reasons)
                else:
                    assert f.queue_length and decode_load(f) < cfg.out_util, (f, d.reasons)
            if want != have:
                changes[role].append((f.at, want - have))
        current, state = d.wanted, d.state
    assert not changes[other], f"{other} is never short in this trace: {changes[other]}"
    steps = changes[short]
    first_load = next(f.at for f, _ in rows if f.queue_length)
    assert steps[0][1] > 0 and steps[0][0] - first_load <= 5.0  # grows within 5 s of the step
    ups = [t for t, s in steps if s > 0]
    downs = [t for t, s in steps if s < 0]
    assert ups and downs and max(ups) < min(downs)  # up, then down: never back and forth
    assert getattr(current, short) == getattr(bounds, f"min_{short}")  # back to the minimum
    last_busy = max(f.at for f, _ in rows if f.queue_length or getattr(f, short).in_flight)
    assert min(downs) - last_busy >= cfg.cooldown_s  # low for a whole cooldown first
    for a, b in itertools.pairwise(downs):
        assert b - a >= cfg.cooldown_s
