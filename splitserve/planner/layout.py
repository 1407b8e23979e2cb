"""Which layout serves a workload best under an SLO: colocated nodes, or a prefill:decode split,
and each pool's tensor parallel size (DistServe's placement search, with queueing estimates in
place of its simulator).

Pure functions of measured rates (``EngineRates``: what one engine does on one GPU), the workload
(``Workload``: arrival rate, prompt and output lengths) and the SLO (TTFT and TPOT targets):

- a **prefill pool** of ``p`` nodes is a queue whose server computes ``prefill_tokens_per_s``
  of prompt: a prompt of ``L_in`` tokens takes ``S = L_in / R`` (+ its KV transfer), arrivals
  are Poisson, so a node at load ``rho`` waits ``rho S / (2 (1 - rho))`` on average (M/D/1)
  and its 90th percentile TTFT is taken as ``S + 2.3 x`` that wait (an exponential tail);
- a **decode pool** of ``d`` nodes holds each request for ``L_out`` steps: by Little's law its
  batch is ``B = (lambda / d) L_out t(B)``, with the step time ``t(B) = a + b B`` measured on
  the engine; TPOT is ``t(B)``, and ``B`` must fit ``max_num_seqs``;
- a **colocated** node does both in mixed steps: its prefill work takes a share
  ``f = (lambda / n) L_in / R`` of the GPU, which stretches every decode step to
  ``t(B) / (1 - f)``; its TTFT is a prompt's wait for that share plus its own compute.

A layout's capacity is the highest arrival rate at which both targets hold (``max_rate``, by
bisection); ``choose`` ranks every layout of ``num_gpus`` by it. The estimates ignore batching
gains in prefill and the spread of prompt lengths: they rank layouts (tests/unit/test_layout.py
checks them against the two-GPU measurements of docs/benchmarks.md, "splitserve layout:
estimates against two GPUs") rather than predict a latency to the millisecond.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from splitserve.runtime.slo import Slo

TAIL = 2.3  # the 90th percentile of an exponential tail, in means (ln 10)
COLOCATED = "colocated"
DISAGGREGATED = "disaggregated"


@dataclass(frozen=True, slots=True)
class EngineRates:
    """What one engine on one GPU (TP 1) does, measured: prompt tokens/s when prefilling full
    batches, a decode step's time ``step_base_s + step_per_seq_s x batch``, the most sequences
    it runs at once, and how much faster a TP n engine is than TP 1 (``tp_speedup[n]``)."""

    prefill_tokens_per_s: float
    step_base_s: float
    step_per_seq_s: float
    max_num_seqs: int = 256
    transfer_s: float = 0.0  # one request's KV from a prefill to a decode node
    tp_speedup: tuple[tuple[int, float], ...] = ((1, 1.0),)

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.step_base_s <= 0 or self.step_per_seq_s < 0:
            raise ValueError("rates must be positive: prefill tokens/s and a decode step's time")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")

    def speedup(self, tp: int) -> float:
        table = dict(self.tp_speedup)
        if tp not in table:
            raise ValueError(f"no measured speed-up for tensor parallel size {tp}")
        return table[tp]

    def step_s(self, batch: float, tp: int = 1) -> float:
        return (self.step_base_s + self.step_per_seq_s * batch) / self.speedup(tp)


@dataclass(frozen=True, slots=True)
class Workload:
    rate: float  # requests/s arriving
    prompt_tokens: float  # mean
    output_tokens: float  # mean

    def __post_init__(self) -> None:
        if self.rate < 0 or self.prompt_tokens <= 0 or self.output_tokens < 1:
            raise ValueError("a workload needs a rate >= 0, prompts >= 1 token, outputs >= 1")


@dataclass(frozen=True, slots=True)
class Layout:
    """``colocated``: ``decode`` nodes of ``decode_tp`` GPUs each, no prefill pool;
    ``disaggregated``: ``prefill`` nodes of ``prefill_tp`` and ``decode`` nodes of
    ``decode_tp``."""

    kind: str
    prefill: int
    decode: int
    prefill_tp: int = 1
    decode_tp: int = 1

    @property
    def gpus(self) -> int:
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp

    def __str__(self) -> str:
        if self.kind == COLOCATED:
            return f"{self.decode} colocated x TP {self.decode_tp}"
        return (
            f"{self.prefill} prefill x TP {self.prefill_tp} + {self.decode} decode x TP "
            f"{self.decode_tp}"
        )


@dataclass(frozen=True, slots=True)
class Estimate:
    ttft_p90_s: float  # math.inf: the pool cannot keep up
    tpot_s: float
    decode_batch: float

    def meets(self, slo: Slo) -> bool:
        ttft_s, tpot_s = slo.both()
        return self.ttft_p90_s <= ttft_s and self.tpot_s <= tpot_s


def _queue_ttft(rho: float, service_s: float) -> float:
    """90th percentile of a prompt's time in an M/D/1 prefill queue (service + wait)."""
    if rho >= 1:
        return math.inf
    wait = rho * service_s / (2 * (1 - rho))
    return service_s + TAIL * wait


def _decode_batch(per_node_rate: float, output_tokens: float, base_s: float, per_seq_s: float):
    """The batch B with B = rate x L_out x (base + per_seq B): None when it diverges."""
    demand = per_node_rate * output_tokens
    denominator = 1 - demand * per_seq_s
    if denominator <= 0:
        return None
    return demand * base_s / denominator


def estimate(layout: Layout, work: Workload, rates: EngineRates) -> Estimate:
    """TTFT (90th percentile) and TPOT of ``layout`` serving ``work``."""
    tp_d = layout.decode_tp
    base = rates.step_s(0, tp_d)
    per_seq = rates.step_s(1, tp_d) - base
    if layout.kind == COLOCATED:
        n = layout.decode
        prefill_rate = rates.prefill_tokens_per_s * rates.speedup(tp_d)
        service = work.prompt_tokens / prefill_rate
        share = (work.rate / n) * service  # of each node's time, prefilling
        if share >= 1:
            return Estimate(math.inf, math.inf, math.inf)
        # Decode steps run in the time prefill leaves: stretched by 1 / (1 - share).
        stretch = 1 / (1 - share)
        batch = _decode_batch(work.rate / n, work.output_tokens, base * stretch, per_seq * stretch)
        if batch is None or batch > rates.max_num_seqs:
            return Estimate(math.inf, math.inf, math.inf)
        tpot = (base + per_seq * batch) * stretch
        # A prompt waits for the prefill share like a queue at that load, and its own compute
        # shares steps with the decoding batch.
        ttft = _queue_ttft(share, service) + tpot
        return Estimate(ttft, tpot, batch)
    if layout.prefill < 1 or layout.decode < 1:
        raise ValueError("a disaggregated layout needs a prefill and a decode node")
    prefill_rate = rates.prefill_tokens_per_s * rates.speedup(layout.prefill_tp)
    service = work.prompt_tokens / prefill_rate
    rho = (work.rate / layout.prefill) * service
    batch = _decode_batch(work.rate / layout.decode, work.output_tokens, base, per_seq)
    if batch is None or batch > rates.max_num_seqs:
        return Estimate(_queue_ttft(rho, service), math.inf, math.inf)
    tpot = base + per_seq * batch
    ttft = _queue_ttft(rho, service) + rates.transfer_s + tpot
    return Estimate(ttft, tpot, batch)


def max_rate(
    layout: Layout, work: Workload, rates: EngineRates, slo: Slo, ceiling: float = 1e5
) -> float:
    """The highest arrival rate (requests/s) at which ``layout`` meets ``slo`` for requests of
    ``work``'s lengths (0: not even one request a second... or none at all)."""

    def ok(rate: float) -> bool:
        at = Workload(rate, work.prompt_tokens, work.output_tokens)
        return estimate(layout, at, rates).meets(slo)

    if not ok(1e-6):
        return 0.0
    lo, hi = 1e-6, 1.0
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > ceiling:
            return ceiling
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def layouts(num_gpus: int, tp_sizes: tuple[int, ...] = (1,)) -> list[Layout]:
    """Every layout that uses all ``num_gpus``: colocated nodes of one TP size, or a prefill pool
    and a decode pool (each of one TP size, at least one node each)."""
    if num_gpus < 1:
        raise ValueError("give at least one GPU")
    out = [Layout(COLOCATED, 0, num_gpus // tp, 1, tp) for tp in tp_sizes if num_gpus % tp == 0]
    for tp_p in tp_sizes:
        for tp_d in tp_sizes:
            for p in range(1, num_gpus // tp_p + 1):
                left = num_gpus - p * tp_p
                if left >= tp_d and left % tp_d == 0:
                    out.append(Layout(DISAGGREGATED, p, left // tp_d, tp_p, tp_d))
    return out


@dataclass(frozen=True, slots=True)
class Ranked:
    layout: Layout
    capacity: float  # requests/s within the SLO
    at_rate: Estimate  # at the workload's own rate


def choose(
    num_gpus: int,
    work: Workload,
    rates: EngineRates,
    slo: Slo,
    tp_sizes: tuple[int, ...] = (1,),
) -> list[Ranked]:
    """Every layout of ``num_gpus``, best first: those that meet the SLO at ``work.rate`` before
    those that do not, then by capacity (the rate each holds within the SLO), then by fewer
    pools (colocated first: nothing to ship)."""
    ranked = [
        Ranked(layout, max_rate(layout, work, rates, slo), estimate(layout, work, rates))
        for layout in layouts(num_gpus, tp_sizes)
    ]
    ranked.sort(
        key=lambda r: (not r.at_rate.meets(slo), -round(r.capacity, 6), r.layout.kind != COLOCATED)
    )
    return ranked
