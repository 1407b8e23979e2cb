"""Sampler: greedy, filtered and seeded draws, penalties, stop-token masking, logprobs.

Parameter validation and check_stop: tests/unit/test_sampler_params.py."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.models.sampler import Sampler, SamplingParams, apply_penalties, make_generator

SAMPLER = Sampler()


def _sample(logits, params, prompts=None, outputs=None, generators=None, eos=None):
    rows = logits.shape[0]
    if isinstance(params, SamplingParams):
        params = [params] * rows
    return SAMPLER.sample(
        logits,
        params,
        prompts if prompts is not None else [[]] * rows,
        outputs if outputs is not None else [[]] * rows,
        generators if generators is not None else [None] * rows,
        eos,
    )


def _fresh_seed():
    return int(torch.randint(0, 2**62, ()).item())


def _distinct_logits(rows, vocab, gap=0.05):
    """Random logits whose sorted values are >= ``gap`` apart in every row (no near-ties)."""
    steps = gap + torch.rand(rows, vocab)
    values = steps.cumsum(dim=1) * (4.0 / vocab)  # spread over roughly [0, 4 + ...]
    perm = torch.rand(rows, vocab).argsort(dim=1)
    return torch.empty(rows, vocab).scatter_(1, perm, values)


# ------------------------------------------------------------------------- greedy


def test_greedy_equals_argmax_and_leaves_logits_untouched():
    logits = torch.randn(64, 300)
    logits[0, 5] = logits[0, 200] = logits[0].max() + 1  # tie: the lowest index wins
    before = logits.clone()
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=0.8)] * 32
    out = _sample(logits, params, outputs=[[1, 2, 3]] * 64, eos=7)
    assert out.token_ids == logits.argmax(dim=1).tolist() and out.token_ids[0] == 5
    assert out.logprobs is None
    assert torch.equal(logits, before)


def test_tiny_temperature_equals_argmax():
    logits = _distinct_logits(500, 100)
    out = _sample(logits, SamplingParams(temperature=1e-4))
    assert out.token_ids == logits.argmax(dim=1).tolist()


# ------------------------------------------------------------------------- filters


def _assert_within(tokens, allowed, min_distinct=2):
    tokens = torch.tensor(tokens)
    assert allowed.gather(1, tokens.unsqueeze(1)).all()
    assert len(set(tokens.tolist())) >= min_distinct, "the draw should not be degenerate"


def test_top_k_never_emits_excluded_token():
    rows, vocab, k = 2000, 40, 5
    logits = _distinct_logits(rows, vocab)
    kth = logits.topk(k, dim=1).values[:, -1:]
    out = _sample(logits, SamplingParams(top_k=k))
    _assert_within(out.token_ids, logits >= kth, min_distinct=10)


def test_top_p_never_emits_excluded_token():
    rows, vocab, top_p = 2000, 30, 0.6
    logits = torch.randn(rows, vocab) * 2
    probs = logits.double().softmax(dim=1)
    sorted_probs, order = probs.sort(dim=1, descending=True)
    mass_before = sorted_probs.cumsum(dim=1) - sorted_probs
    # Allowed: the smallest nucleus reaching top_p, with slack for float32 rounding at the edge.
    allowed = torch.empty_like(probs, dtype=torch.bool).scatter_(
        1, order, mass_before < top_p + 1e-5
    )
    out = _sample(logits, SamplingParams(top_p=top_p))
    _assert_within(out.token_ids, allowed, min_distinct=10)


def test_min_p_never_emits_excluded_token():
    rows, vocab, min_p = 2000, 30, 0.2
    logits = torch.randn(rows, vocab) * 2
    probs = logits.double().softmax(dim=1)
    allowed = probs >= min_p * probs.amax(dim=1, keepdim=True) * (1 - 1e-5)
    out = _sample(logits, SamplingParams(min_p=min_p))
    _assert_within(out.token_ids, allowed, min_distinct=10)


@settings(max_examples=25, deadline=None)
@given(
    temperature=st.floats(0.05, 3.0),
    top_k=st.sampled_from([-1, 0, 1, 2, 7, 50]),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.9),
)
def test_combined_filters_keep_the_reference_support(temperature, top_k, top_p, min_p):
    """Temperature, then top-k, then top-p, then min-p, against a float64 reference."""
    rows, vocab = 300, 20
    logits = torch.randn(rows, vocab) * 2
    ref = logits.double() / temperature
    if 0 < top_k < vocab:
        ref = ref.masked_fill(ref < ref.topk(top_k, dim=1).values[:, -1:], -math.inf)
    sorted_probs, order = ref.softmax(dim=1).sort(dim=1, descending=True)
    in_nucleus = (sorted_probs.cumsum(dim=1) - sorted_probs) < top_p + 1e-5
    ref = ref.masked_fill(~torch.empty_like(in_nucleus).scatter_(1, order, in_nucleus), -math.inf)
    probs = ref.softmax(dim=1)
    allowed = probs >= min_p * probs.amax(dim=1, keepdim=True) * (1 - 1e-5)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    _assert_within(_sample(logits, params).token_ids, allowed, min_distinct=1)


# ------------------------------------------------------------------------- distribution


def _chi_square_p_value_df4(counts, expected):
    """Upper tail of chi-square with 4 degrees of freedom (5 categories): exp(-x/2)(1 + x/2)."""
    x = float(((counts - expected) ** 2 / expected).sum())
    return math.exp(-x / 2) * (1 + x / 2)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("seeded", [False, True])
def test_frequencies_match_softmax(temperature, seeded):
    draws = 4000 if seeded else 20000  # one generator per row is a Python loop
    row = torch.randn(5)
    logits = row.expand(draws, 5).contiguous()
    generators = None
    if seeded:
        first = _fresh_seed()
        generators = [torch.Generator().manual_seed(first + i) for i in range(draws)]
    out = _sample(logits, SamplingParams(temperature=temperature), generators=generators)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=5).double()
    expected = (row.double() / temperature).softmax(dim=0) * draws
    # A correct sampler fails this once in a million runs.
    assert _chi_square_p_value_df4(counts, expected) > 1e-6, (counts, expected)


# ------------------------------------------------------------------------- seeds


def test_same_seed_same_tokens_regardless_of_batch():
    vocab, steps = 500, 6
    seed_a, seed_b = _fresh_seed(), _fresh_seed()
    pa, pb = SamplingParams(seed=seed_a, top_p=0.95), SamplingParams(seed=seed_b, min_p=0.01)
    unseeded = SamplingParams(top_k=50)
    greedy = SamplingParams(temperature=0.0)
    logits_a, logits_b = torch.randn(steps, vocab), torch.randn(steps, vocab)

    # Run 1: [a, unseeded, b]. Run 2: [greedy, b, unseeded, unseeded, a] with other neighbours.
    gens1 = [make_generator(pa, "cpu"), None, make_generator(pb, "cpu")]
    gens2 = [None, make_generator(pb, "cpu"), None, None, make_generator(pa, "cpu")]
    tokens1, tokens2 = [], []
    for s in range(steps):
        batch1 = torch.stack([logits_a[s], torch.randn(vocab), logits_b[s]])
        out1 = _sample(batch1, [pa, unseeded, pb], generators=gens1)
        tokens1.append((out1.token_ids[0], out1.token_ids[2]))
        batch2 = torch.stack([torch.randn(vocab), logits_b[s], *torch.randn(2, vocab), logits_a[s]])
        out2 = _sample(batch2, [greedy, pb, unseeded, unseeded, pa], generators=gens2)
        tokens2.append((out2.token_ids[4], out2.token_ids[1]))
    assert tokens1 == tokens2

    # The same logits with another seed give another sequence (equal with chance ~1e-15).
    other = make_generator(SamplingParams(seed=seed_a + 1), "cpu")
    differ = [_sample(logits_a[s : s + 1], pa, generators=[other]).token_ids[0] for s in range(6)]
    assert differ != [t for t, _ in tokens1]


def test_make_generator():
    assert make_generator(SamplingParams(), "cpu") is None
    seed = _fresh_seed()
    g1, g2 = (make_generator(SamplingParams(seed=seed), "cpu") for _ in range(2))
    assert torch.equal(torch.rand(8, generator=g1), torch.rand(8, generator=g2))


# ------------------------------------------------------------------------- penalties


def test_penalties_hand_computed():
    logits = torch.tensor([[1.0, -1.0, 2.0, -2.0, 0.5, 3.0]]).repeat(3, 1)
    params = [
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(presence_penalty=-1.0),  # output only: the prompt token 4 is not touched
        SamplingParams(),
    ]
    prompts = [[1, 4]] * 3
    outputs = [[2, 3, 3]] * 3
    before = logits.clone()
    out = apply_penalties(logits, params, prompts, outputs)
    # Row 0: repetition over {1, 2, 3, 4} (negative x2, positive /2), then token 2 (count 1)
    # loses 0.5 + 0.25 and token 3 (count 2) loses 0.5 + 0.5.
    assert out[0].tolist() == [1.0, -2.0, 0.25, -5.0, 0.25, 3.0]
    assert out[1].tolist() == [1.0, -1.0, 3.0, -1.0, 0.5, 3.0]
    assert torch.equal(out[2], before[2]) and torch.equal(logits, before)
    assert apply_penalties(logits, [SamplingParams()] * 3, prompts, outputs) is logits


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    rep=st.floats(0.1, 3.0),
    presence=st.floats(-2.0, 2.0),
    frequency=st.floats(-2.0, 2.0),
)
def test_penalties_match_per_token_reference(data, rep, presence, frequency):
    vocab = 12
    tokens = st.lists(st.integers(0, vocab - 1), max_size=15)
    prompt, output = data.draw(tokens), data.draw(tokens)
    logits = torch.randn(1, vocab)
    params = SamplingParams(
        repetition_penalty=rep, presence_penalty=presence, frequency_penalty=frequency
    )
    expected = logits[0].tolist()
    for t in set(prompt) | set(output):
        expected[t] = expected[t] * rep if expected[t] < 0 else expected[t] / rep
    for t in set(output):
        expected[t] -= presence + frequency * output.count(t)
    out = apply_penalties(logits, [params], [prompt], [output])
    torch.testing.assert_close(out[0], torch.tensor(expected), rtol=1e-6, atol=1e-6)


def test_token_ids_outside_the_vocabulary_are_rejected():
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        apply_penalties(torch.randn(1, 8), [SamplingParams(presence_penalty=1.0)], [[]], [[8]])


# ------------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_tokens():
    eos, stop = 3, 6
    logits = torch.randn(4, 10)
    logits[:, eos] = 100.0
    logits[:, stop] = 90.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(stop, 99))
    outputs = [[], [1], [1, 1], [1, 1, 1]]
    out = _sample(logits, params, outputs=outputs, eos=eos)
    assert out.token_ids[2:] == [eos, eos]
    assert eos not in out.token_ids[:2] and stop not in out.token_ids[:2]

    # ignore_eos: eos is an ordinary token, stop tokens are still masked.
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(stop,), ignore_eos=True)
    assert _sample(logits[:1], params, outputs=[[]], eos=eos).token_ids == [eos]
    logits[:, eos] = 0.0
    assert _sample(logits[:1], params, outputs=[[]], eos=eos).token_ids != [stop]


def test_min_tokens_masks_eos_in_sampled_rows():
    eos = 0
    logits = torch.randn(2000, 8)
    logits[:, eos] += 2.0  # likely but masked
    before = logits.clone()
    out = _sample(logits, SamplingParams(min_tokens=5), outputs=[[1, 2]] * 2000, eos=eos)
    assert eos not in out.token_ids and torch.equal(logits, before)


# ------------------------------------------------------------------------- logprobs


def test_logprobs_are_log_softmax_of_penalised_logits_at_chosen_token():
    rows, vocab = 40, 50
    logits = torch.randn(rows, vocab)
    prompts = [torch.randint(0, vocab, (5,)).tolist() for _ in range(rows)]
    outputs = [torch.randint(0, vocab, (4,)).tolist() for _ in range(rows)]
    kinds = [
        SamplingParams(logprobs=True, repetition_penalty=1.3, temperature=0.5, top_k=10),
        SamplingParams(logprobs=True, frequency_penalty=0.7, temperature=0.0),
        SamplingParams(presence_penalty=1.0),  # no logprobs asked
        SamplingParams(logprobs=True, top_p=0.5, min_p=0.1, seed=1),
    ]
    params = [kinds[r % 4] for r in range(rows)]
    generators = [make_generator(p, "cpu") for p in params]
    out = _sample(logits, params, prompts, outputs, generators)
    reference = apply_penalties(logits, params, prompts, outputs).log_softmax(dim=1)
    for r, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        if params[r].logprobs:
            assert logprob == pytest.approx(reference[r, token].item(), abs=1e-5)
        else:
            assert logprob is None


def test_sample_rejects_mismatched_lengths():
    with pytest.raises(AssertionError):
        SAMPLER.sample(torch.randn(2, 5), [SamplingParams()], [[]], [[]], [None], None)


def test_a_near_tie_may_go_either_way_in_a_choice_check_and_nothing_else():
    """tests/support/ties.py, which the GPU tests compare reduced-precision logits with: a
    near-tie (top two within a tenth of the row's spread) may be chosen either way; a clear
    winner may not."""
    from support.ties import assert_same_choice

    expected = torch.tensor([[0.0, 3.0, 2.999, -1.0], [0.0, 3.0, 1.0, -1.0]])
    assert_same_choice(expected, expected)
    swapped = expected.clone()
    swapped[0, 2] = 3.001  # row 0 picks index 2: 0.001 from the best, a tie
    assert_same_choice(swapped, expected)
    wrong = expected.clone()
    wrong[1, 2] = 3.5  # row 1 picks index 2: 2.0 from the best, not a tie
    with pytest.raises(AssertionError, match="row 1: chose 2, expected 1"):
        assert_same_choice(wrong, expected)
