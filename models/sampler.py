"""Token sampler of the model runner: penalties, stop-token masking, greedy/top-k/top-p/min-p draws.

Plain torch on ``[B, V]`` float32 logits (CPU or CUDA). Python loops run per row at most (to
build index lists and to draw seeded rows from their own generators), never per vocabulary entry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import chain
from typing import NamedTuple

import torch
from torch import Tensor

from splitserve.models.sampling_params import SamplingParams, check_stop

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "check_stop",
    "make_generator",
    "skip_draws",
    "to_device",
]


class SamplerOutput(NamedTuple):
    """One token per row; ``logprobs`` is None unless some row asked (then None for the rest)."""

    token_ids: list[int]
    logprobs: list[float | None] | None


def to_device(values: Sequence, device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    """A small host list on ``device`` without waiting for the device: a plain copy of pageable
    memory to a GPU waits for everything queued before it (it would wait for the forward just
    launched), so the list goes through pinned memory with a non-blocking copy."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class PendingSample:
    """The tokens of a launched ``Sampler.launch``: on a GPU still being computed. ``token_ids``
    (a ``[B]`` long tensor on the device) can feed the next forward at once; ``result()`` waits
    for this step's tokens only (a CUDA event after their copy to pinned memory), not for work
    queued after them."""

    def __init__(self, token_ids: Tensor, logprob_rows: list[int], logprobs: Tensor | None):
        self.token_ids = token_ids
        self._rows = logprob_rows
        self._event = None
        if token_ids.is_cuda:
            host_ids = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            host_ids.copy_(token_ids, non_blocking=True)
            if logprobs is not None:
                host_lp = torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True)
                logprobs = host_lp.copy_(logprobs, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            token_ids = host_ids
        self._host_ids, self._host_lp = token_ids, logprobs

    def result(self) -> SamplerOutput:
        if self._event is not None:
            self._event.synchronize()
        token_ids = self._host_ids.tolist()
        if self._host_lp is None:
            return SamplerOutput(token_ids, None)
        logprobs: list[float | None] = [None] * len(token_ids)
        for r, value in zip(self._rows, self._host_lp.tolist(), strict=True):
            logprobs[r] = value
        return SamplerOutput(token_ids, logprobs)


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The request's own RNG, created once per request and passed to every ``sample`` call.

    None when ``params.seed`` is None (the row then draws from the global RNG).
    """
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def _token_counts(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> Tensor:
    """``[len(token_lists), V]`` float32 occurrence counts (one scatter_add over all rows)."""
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.float32, device=device)
    flat = list(chain.from_iterable(token_lists))
    if not flat:
        return counts
    if min(flat) < 0 or max(flat) >= vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size}), got {min(flat)}..{max(flat)}")
    lengths = to_device([len(t) for t in token_lists], device)
    rows = torch.repeat_interleave(
        torch.arange(len(token_lists), device=device), lengths, output_size=len(flat)
    )
    flat_index = rows * vocab_size + to_device(flat, device, torch.long)
    counts.view(-1).scatter_add_(0, flat_index, torch.ones_like(flat_index, dtype=torch.float32))
    return counts


def apply_penalties(
    logits: Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
) -> Tensor:
    """Repetition, then presence and frequency penalties (see :class:`SamplingParams`).

    Returns ``logits`` itself when no row has a penalty, else a new tensor in which rows without
    penalties are bit-identical to the input. Never writes to ``logits``.
    """
    idx = [i for i, p in enumerate(params) if p.needs_previous_tokens]
    if not idx:
        return logits
    device, vocab_size = logits.device, logits.shape[1]
    row_params = [params[i] for i in idx]
    idx_t = to_device(idx, device, torch.long)
    rows = logits.index_select(0, idx_t)
    out_counts = _token_counts([output_token_ids[i] for i in idx], vocab_size, device)
    rep = [p.repetition_penalty for p in row_params]
    if any(r != 1 for r in rep):
        seen = _token_counts([prompt_token_ids[i] for i in idx], vocab_size, device) > 0
        seen |= out_counts > 0
        rep_t = to_device(rep, device, torch.float32).unsqueeze(1)
        penalised = torch.where(rows < 0, rows * rep_t, rows / rep_t)
        rows = torch.where(seen, penalised, rows)
    presence = to_device([p.presence_penalty for p in row_params], device, torch.float32)
    frequency = to_device([p.frequency_penalty for p in row_params], device, torch.float32)
    rows = rows - (frequency.unsqueeze(1) * out_counts + presence.unsqueeze(1) * (out_counts > 0))
    out = logits.clone()
    out.index_copy_(0, idx_t, rows)
    return out


def _mask_stop_tokens(
    logits: Tensor,
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_id: int | None,
    owned: bool,
) -> Tensor:
    """Set eos (unless ignore_eos) and stop tokens to -inf in rows still short of min_tokens."""
    rows: list[int] = []
    cols: list[int] = []
    vocab_size = logits.shape[1]
    for i, p in enumerate(params):
        if len(output_token_ids[i]) >= p.min_tokens:
            continue
        ids = p.stop_token_ids
        if eos_token_id is not None and not p.ignore_eos:
            ids = (*ids, eos_token_id)
        ids = [t for t in ids if t < vocab_size]  # a token past the logits can't be drawn anyway
        rows += [i] * len(ids)
        cols += ids
    if not rows:
        return logits
    if not owned:
        logits = logits.clone()
    logits[
        to_device(rows, logits.device, torch.long), to_device(cols, logits.device, torch.long)
    ] = -math.inf
    return logits


def _top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask (to -inf) tokens outside the top ``top_k[r]`` and outside the nucleus ``top_p[r]``.

    Ties with the k-th logit are all kept. The nucleus is the shortest prefix (by probability,
    descending) whose mass reaches ``top_p``; it always holds the most likely token.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -math.inf)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # NOTE: top_p == 1 must keep everything, but a float32 cumsum can pass 1 before the tail.
    top_p = torch.where(top_p >= 1, 2.0, top_p)
    sorted_logits.masked_fill_(mass_before >= top_p.unsqueeze(1), -math.inf)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _draw(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> Tensor:
    """Temperature, top-k, top-p, min-p, then one token per row (none of the rows is greedy)."""
    device, (num_rows, vocab_size) = logits.device, logits.shape
    temperature = to_device([p.temperature for p in params], device, torch.float32)
    logits = logits / temperature.unsqueeze(1)
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab_size for k in top_k) or any(p < 1 for p in top_p):
        logits = _top_k_top_p(
            logits, to_device(top_k, device, torch.long), to_device(top_p, device, torch.float32)
        )
    probs = logits.softmax(dim=-1)
    min_p = [p.min_p for p in params]
    if any(m > 0 for m in min_p):
        min_p_t = to_device(min_p, device, torch.float32).unsqueeze(1)
        threshold = min_p_t * probs.amax(dim=-1, keepdim=True)
        probs = logits.masked_fill(probs < threshold, -math.inf).softmax(dim=-1)
    # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) draws i with probability p_i.
    noise = torch.empty_like(probs)
    seeded = [r for r, g in enumerate(generators) if g is not None]
    if len(seeded) < num_rows:
        noise.exponential_()
    for r in seeded:
        # NOTE: a fresh [V] draw per row, so a seeded row's tokens don't depend on the batch.
        noise[r] = torch.empty(vocab_size, device=device).exponential_(generator=generators[r])
    # An Exp(1) draw can round to 0; clamping keeps masked tokens (p = 0) at 0 instead of NaN.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)


def skip_draws(generator: torch.Generator, vocab_size: int, device, steps: int = 1) -> None:
    """Advance a request's generator past ``steps`` sampled (non-greedy) tokens, exactly as
    ``_draw`` consumes it: a request continued on another node then draws what it would have
    drawn in one process."""
    for _ in range(steps):
        torch.empty(vocab_size, device=device).exponential_(generator=generator)


class Sampler:
    """Picks the next token of each row of a batch. Stateless; one instance per model runner."""

    def sample(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        eos_token_id: int | None,
    ) -> SamplerOutput:
        """One token per row of ``logits`` (``[B, V]`` float32, left unchanged).

        Every sequence argument has B entries; ``generators[r]`` is ``make_generator(params[r])``
        of row r's request, on the logits' device. Order: penalties, masking of eos/stop tokens
        while ``len(output_token_ids[r]) < min_tokens``, then greedy rows take the argmax (lowest
        index on ties, as ``torch.argmax``; a row without penalties or masking sees the logits
        untouched, so it matches HF greedy generate) and the others go through temperature, top-k,
        top-p, min-p and a random draw. A seeded row's tokens depend only on its own logits and
        generator, not on the rest of the batch.
        """
        return self.launch(
            logits, params, prompt_token_ids, output_token_ids, generators, eos_token_id
        ).result()

    def launch(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        eos_token_id: int | None,
    ) -> PendingSample:
        """``sample`` without waiting for the device: the draws are queued behind the forward and
        the tokens come from ``PendingSample.result()``."""
        assert logits.dim() == 2 and logits.dtype == torch.float32, (logits.shape, logits.dtype)
        num_rows, device = logits.shape[0], logits.device
        assert (
            len(params) == len(prompt_token_ids) == len(output_token_ids) == len(generators)
        ) and len(params) == num_rows, "every per-row argument needs one entry per logits row"
        processed = apply_penalties(logits, params, prompt_token_ids, output_token_ids)
        processed = _mask_stop_tokens(
            processed, params, output_token_ids, eos_token_id, owned=processed is not logits
        )

        greedy = [r for r, p in enumerate(params) if p.greedy]
        if len(greedy) == num_rows:
            token_ids = processed.argmax(dim=-1)
        else:
            token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
            if greedy:
                greedy_t = to_device(greedy, device, torch.long)
                token_ids.index_copy_(
                    0, greedy_t, processed.index_select(0, greedy_t).argmax(dim=-1)
                )
            drawn = [r for r, p in enumerate(params) if not p.greedy]
            drawn_t = to_device(drawn, device, torch.long)
            draws = _draw(
                processed.index_select(0, drawn_t),
                [params[r] for r in drawn],
                [generators[r] for r in drawn],
            )
            token_ids.index_copy_(0, drawn_t, draws)

        wants_logprobs = [r for r, p in enumerate(params) if p.logprobs]
        if not wants_logprobs:
            return PendingSample(token_ids, [], None)
        rows_t = to_device(wants_logprobs, device, torch.long)
        chosen = token_ids.index_select(0, rows_t).unsqueeze(1)
        values = processed.index_select(0, rows_t).log_softmax(dim=-1).gather(1, chosen).squeeze(1)
        return PendingSample(token_ids, wants_logprobs, values)
