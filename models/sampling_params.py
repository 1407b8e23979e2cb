"""What a request asks of sampling (``SamplingParams``) and when it stops (``check_stop``).

Plain Python (no torch): the router validates requests with the very class the nodes sample
with, so both agree on what is valid, and the router process never loads torch.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


def _real(name: str, value: object, ok: Callable[[float], bool], valid: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or not ok(float(value))
    ):
        raise ValueError(f"SamplingParams.{name} must be {valid}, got {value!r}")
    return float(value)


def _int(name: str, value: object, ok: Callable[[int], bool], valid: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not ok(int(value)):
        raise ValueError(f"SamplingParams.{name} must be {valid}, got {value!r}")
    return int(value)


MAX_STOP_TOKEN_IDS = 1024  # per request: each is masked while short of min_tokens


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the tokens of one request. Validated on construction (``ValueError``).

    Penalties follow HF (``repetition_penalty`` over prompt and output tokens: positive logits
    divided, negative multiplied) and OpenAI (``presence_penalty``/``frequency_penalty`` over
    output tokens only: ``logit -= presence * (count > 0) + frequency * count``), applied in that
    order. ``logprobs`` asks for the log-probability of each chosen token under the logits after
    penalties and stop-token masking but BEFORE temperature/top-k/top-p/min-p (vLLM's default).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    # stop_token_ids as a set: check_stop looks a token up in it every step.
    stop_set: frozenset[int] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # NOTE: numbers are normalised to plain float/int (numpy scalars arrive from clients);
        # min_tokens comes after max_tokens because its range depends on it.
        checks = (
            ("temperature", _real, lambda v: v >= 0, "a finite number >= 0 (0 means greedy)"),
            ("top_k", _int, lambda v: v >= -1, "-1 or 0 (disabled) or an int >= 1"),
            ("top_p", _real, lambda v: 0 < v <= 1, "in (0, 1]"),
            ("min_p", _real, lambda v: 0 <= v <= 1, "in [0, 1]"),
            ("seed", _int, lambda v: -(2**63) <= v < 2**64, "None or an int in [-2**63, 2**64)"),
            ("repetition_penalty", _real, lambda v: v > 0, "a finite number > 0 (1 is off)"),
            ("presence_penalty", _real, lambda v: -2 <= v <= 2, "in [-2, 2]"),
            ("frequency_penalty", _real, lambda v: -2 <= v <= 2, "in [-2, 2]"),
            ("max_tokens", _int, lambda v: v >= 1, "an int >= 1"),
            ("min_tokens", _int, lambda v: 0 <= v <= self.max_tokens,
             f"an int in [0, max_tokens={self.max_tokens}]"),
        )  # fmt: skip
        for name, check, ok, valid in checks:
            value = getattr(self, name)
            if not (name == "seed" and value is None):
                object.__setattr__(self, name, check(name, value, ok, valid))
        for name in ("ignore_eos", "logprobs"):
            if not isinstance(value := getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name} must be true or false, got {value!r}")
        ids = self.stop_token_ids
        if (
            isinstance(ids, str | bytes)
            or not isinstance(ids, Sequence)
            or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids)
            or any(t < 0 for t in ids)
        ):
            raise ValueError(
                f"SamplingParams.stop_token_ids must be a list of ints >= 0, got {ids!r}"
            )
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"SamplingParams.stop_token_ids has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        object.__setattr__(self, "stop_set", frozenset(self.stop_token_ids))

    @property
    def needs_previous_tokens(self) -> bool:
        """Sampling reads the request's own earlier tokens (repetition, presence or frequency
        penalty): a step cannot be sampled before the one before it is read back."""
        return (
            self.repetition_penalty != 1
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
        )

    @property
    def greedy(self) -> bool:
        """True when the argmax is the only possible token (temperature 0 or top_k 1)."""
        return self.temperature == 0 or self.top_k == 1


def check_stop(
    params: SamplingParams, token_id: int, num_output_tokens: int, eos_token_id: int | None
) -> str | None:
    """Why the request finishes after ``token_id``: "stop", "length" or None (go on).

    ``num_output_tokens`` counts ``token_id``. "stop" (eos unless ``ignore_eos``, or one of
    ``stop_token_ids``) counts only once ``num_output_tokens >= min_tokens`` and wins over
    "length" when both hold: the model did end its answer on the last allowed token.
    """
    if num_output_tokens >= params.min_tokens and (
        (token_id == eos_token_id and not params.ignore_eos) or token_id in params.stop_set
    ):
        return "stop"
    if num_output_tokens >= params.max_tokens:
        return "length"
    return None
