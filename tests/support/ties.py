"""Comparing the tokens two computations of the same logits choose, where reduced precision may
break a near-tie either way: a seed that draws a random model with two logits equal to the third
digit must not fail a test of kernels that are right."""

from __future__ import annotations

import torch

TIE_SHARE = 0.1  # a top-two gap below this share of the row's standard deviation is a tie


def assert_same_choice(got: torch.Tensor, expected: torch.Tensor, tie: float = TIE_SHARE) -> None:
    """Each row of logits ``got`` chooses the token ``expected`` chooses, or one whose logit in
    ``expected`` is within ``tie`` x the row's standard deviation of the best (a near-tie)."""
    got, expected = got.float().reshape(-1, got.shape[-1]), expected.float()
    expected = expected.reshape(-1, expected.shape[-1])
    chosen, best = got.argmax(-1), expected.argmax(-1)
    rows = torch.arange(len(expected))
    gap = expected[rows, best] - expected[rows, chosen]
    allowed = tie * expected.std(dim=-1)
    bad = (chosen != best) & (gap > allowed)
    assert not bad.any(), [
        f"row {r}: chose {chosen[r].item()}, expected {best[r].item()} "
        f"({gap[r].item():.4g} apart; a tie is within {allowed[r].item():.4g})"
        for r in bad.nonzero().flatten().tolist()
    ]
