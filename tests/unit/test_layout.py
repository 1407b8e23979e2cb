"""The layout search (splitserve/planner/layout.py): queueing estimates of colocated and
disaggregated layouts from one engine's measured rates, checked against what two GPUs measured.

The rates are the engine's alone, measured on one H200 with the Llama-3-8B shape
(docs/benchmarks.md, "splitserve layout: estimates against two GPUs"): a prefill step at ~590
TFLOP/s of model FLOPs (16.06 GFLOP a token: ~36,700 prompt tokens/s), decode steps of 5.24 ms
at batch 1 and 13.9 ms at ~240 requests (base 5.2 ms + 36 us a sequence). The layouts' figures
they are checked against were measured separately, on two H200s serving Poisson arrivals of
256-2,048-token prompts (mean 1,152), 128 out (the same section; the tensor-parallelism issue's
table):

| layout | rate | goodput (TTFT 1 s, TPOT 50 ms) | TTFT p50 / p99 | TPOT mean |
|---|---|---|---|---|
| 2 colocated | 36 | 34.0 | 104 / 240 ms | 14.6 ms |
| 1 prefill + 1 decode | 24 | 22.7 | 135 / 585 ms | 7.1 ms |
| 1 prefill + 1 decode | 36 | 18.2 | 915 / 1,644 ms | 7.4 ms |
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.planner.layout import (
    COLOCATED,
    DISAGGREGATED,
    EngineRates,
    Layout,
    Workload,
    choose,
    estimate,
    layouts,
    max_rate,
)
from splitserve.runtime.slo import Slo

H200_8B = EngineRates(
    prefill_tokens_per_s=36_700, step_base_s=0.0052, step_per_seq_s=0.000036, transfer_s=0.005
)
COLOC = Layout(COLOCATED, 0, 2)
SPLIT = Layout(DISAGGREGATED, 1, 1)
SLO = Slo(ttft_s=1.0, tpot_s=0.05)


def work(rate: float) -> Workload:
    return Workload(rate, prompt_tokens=1152, output_tokens=128)


def test_the_estimates_land_near_what_two_gpus_measured():
    coloc = estimate(COLOC, work(36), H200_8B)
    assert coloc.tpot_s == pytest.approx(0.0146, rel=0.25)
    assert 0.104 * 0.5 < coloc.ttft_p90_s < 0.240  # between half the p50 and the p99
    split = estimate(SPLIT, work(24), H200_8B)
    assert split.tpot_s == pytest.approx(0.0071, rel=0.3)
    assert 0.135 < split.ttft_p90_s < 0.585
    # At 36 req/s one prefill GPU cannot keep up (it measured TTFT 0.9-1.6 s, growing).
    assert math.isinf(estimate(SPLIT, work(36), H200_8B).ttft_p90_s)


def test_at_the_measured_slo_colocated_wins_and_at_24_both_meet_it():
    best = choose(2, work(36), H200_8B, SLO)
    assert best[0].layout == COLOC and best[0].at_rate.meets(SLO)
    assert not estimate(SPLIT, work(36), H200_8B).meets(SLO)
    assert estimate(SPLIT, work(24), H200_8B).meets(SLO)
    assert estimate(COLOC, work(24), H200_8B).meets(SLO)


def test_a_tight_tpot_target_turns_the_choice_to_disaggregation():
    # (Not measured: what DistServe found, in this model's terms.) Prefill work stretches a
    # colocated node's decode steps; a decode-only pool keeps them short.
    tight = Slo(ttft_s=1.0, tpot_s=0.010)
    best = choose(2, work(28), H200_8B, tight)
    assert best[0].layout == SPLIT and best[0].at_rate.meets(tight)
    assert not estimate(COLOC, work(28), H200_8B).meets(tight)
    assert max_rate(SPLIT, work(28), H200_8B, tight) > max_rate(COLOC, work(28), H200_8B, tight)


def test_layouts_use_every_gpu_and_each_tp_size_that_fits():
    found = {str(x) for x in layouts(4, (1, 2))}
    assert found == {
        "4 colocated x TP 1",
        "2 colocated x TP 2",
        "1 prefill x TP 1 + 3 decode x TP 1",
        "2 prefill x TP 1 + 2 decode x TP 1",
        "3 prefill x TP 1 + 1 decode x TP 1",
        "2 prefill x TP 1 + 1 decode x TP 2",
        "1 prefill x TP 2 + 2 decode x TP 1",
        "1 prefill x TP 2 + 1 decode x TP 2",
    }
    assert all(x.gpus == 4 for x in layouts(4, (1, 2)))
    with pytest.raises(ValueError, match="speed-up for tensor parallel size 2"):
        choose(2, work(10), H200_8B, SLO, tp_sizes=(1, 2))


def test_bad_rates_and_workloads_are_refused():
    with pytest.raises(ValueError, match="positive"):
        EngineRates(prefill_tokens_per_s=0, step_base_s=0.005, step_per_seq_s=0.0)
    with pytest.raises(ValueError, match="workload"):
        Workload(-1, 100, 10)
    with pytest.raises(ValueError, match="at least one GPU"):
        layouts(0)


@settings(max_examples=60, deadline=None)
@given(
    rate=st.floats(1, 200),
    prompt=st.floats(16, 8192),
    out=st.floats(1, 1024),
    ttft=st.floats(0.05, 10),
    tpot=st.floats(0.006, 0.5),
)
def test_capacity_is_the_edge_of_meeting_the_slo_and_more_gpus_never_lower_the_best(
    rate, prompt, out, ttft, tpot
):
    slo, w = Slo(ttft, tpot), Workload(rate, prompt, out)
    for layout in (COLOC, SPLIT):
        cap = max_rate(layout, w, H200_8B, slo)
        if cap > 0.01:
            assert estimate(layout, Workload(cap * 0.99, prompt, out), H200_8B).meets(slo)
            assert not estimate(layout, Workload(cap * 1.01 + 0.01, prompt, out), H200_8B).meets(
                slo
            )
    best = [choose(g, w, H200_8B, slo)[0].capacity for g in (1, 2, 4)]
    assert best == sorted(best)


# ----------------------------------------------------------------- the commands' parts


def test_workloads_slos_and_rates_files_are_read_or_refused_with_the_syntax(tmp_path):
    import json
    from argparse import Namespace

    from splitserve.planner.calibrate import fit_line, load_rates
    from splitserve.planner.layout_cli import auto_layout, counts_of, parse_slo, parse_workload

    assert parse_workload("rate=36, prompt=1152,output=128") == Workload(36, 1152, 128)
    for bad in ("rate=36", "rate=x,prompt=1,output=1", "36,1152,128", "rate=1,prompt=0,output=1"):
        with pytest.raises(ValueError, match="--workload: give rate="):
            parse_workload(bad)
    assert parse_slo("ttft=1,tpot=50ms") == Slo(1.0, 0.05)
    with pytest.raises(ValueError, match="both targets"):
        parse_slo("ttft=1")
    good = tmp_path / "rates.json"
    good.write_text(json.dumps({
        "prefill_tokens_per_s": 36700, "step_base_s": 0.0052, "step_per_seq_s": 3.6e-5,
        "tp_speedup": [[1, 1.0], [2, 1.44]], "measured": {"device": "cuda:0"},
    }))  # fmt: skip
    rates = load_rates(good)
    assert rates.speedup(2) == 1.44 and rates.max_num_seqs == 256
    for text in ("{", '{"prefill_tokens_per_s": 1}', '{"prefill_tokens_per_s": -1, '
                 '"step_base_s": 1, "step_per_seq_s": 0}'):  # fmt: skip
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError, match=r"bad\.json: not a rates file"):
            load_rates(tmp_path / "bad.json")
    assert fit_line([(1, 2.5), (33, 18.5), (129, 66.5)]) == pytest.approx((2.0, 0.5))
    assert fit_line([(8, 3.0)]) == (3.0, 0.0)
    assert fit_line([(1, 5.0), (64, 4.0)])[1] == 0.0  # a step never gets quicker with more

    # up --num-prefill auto on a CPU: --num-decode nodes to split, the best layout's counts.
    args = Namespace(rates=str(good), workload="rate=28,prompt=1152,output=128")
    tight = auto_layout(
        args, {"num_prefill": -1, "num_decode": 2, "slo": "ttft=1,tpot=10ms"}, "cpu"
    )
    assert (tight["num_prefill"], tight["num_decode"]) == (1, 1)
    loose = auto_layout(
        args, {"num_prefill": -1, "num_decode": 2, "slo": "ttft=1,tpot=50ms"}, "cpu"
    )
    assert (loose["num_prefill"], loose["num_decode"], loose["decode_tp"]) == (0, 2, 1)
    assert counts_of(choose(2, work(36), H200_8B, SLO)[0]) == {
        "num_prefill": 0, "num_decode": 2, "decode_tp": 1
    }  # fmt: skip
    from splitserve.cluster_spec import AUTO_PREFILL, prefill_count

    assert [prefill_count(v) for v in ("auto", " AUTO", "3", 2)] == [AUTO_PREFILL, -1, 3, 2]
    with pytest.raises(ValueError, match="a number or auto"):
        prefill_count("some")
    with pytest.raises(ValueError, match="needs --rates, --workload, --slo"):
        auto_layout(Namespace(rates=None, workload=None), {"num_prefill": -1}, "cpu")
