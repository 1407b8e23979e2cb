"""The figures of a run, from per-request records: pure functions over plain numbers.

Definitions (as vLLM's ``bench serve``): time to first token (TTFT) from sending a request to its
first token; inter-token latency (ITL) the gaps between consecutive token-bearing chunks of a
stream; time per output token (TPOT) ``(e2e - TTFT) / (output tokens - 1)`` per request with more
than one token; end-to-end latency (e2e) from sending to the last byte. Percentiles interpolate
linearly between closest ranks (numpy's default).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from splitserve.runtime.slo import parse_bounds

__all__ = [
    "SLO_KEYS",
    "RequestRecord",
    "distribution",
    "goodput",
    "meets_slo",
    "occupancy",
    "parse_slo",
    "percentile",
    "summarize",
    "timeline",
]

SLO_KEYS = ("ttft", "tpot", "e2e")  # what --slo may bound, in seconds
STATS = ("mean", "p50", "p90", "p99", "max")


@dataclass(slots=True)
class RequestRecord:
    """One measured request. Times are seconds from the benchmark's start."""

    index: int
    prompt_len: int  # as the workload made it (tokens, or words for text)
    max_tokens: int
    arrival: float  # when it was due (its arrival time)
    start: float = 0.0  # when it was sent (later than arrival when it waited for a slot)
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)  # each token-bearing chunk's arrival
    output_tokens: int = 0
    prompt_tokens: int | None = None  # as the server counted them (usage), when it said
    cached_tokens: int | None = None
    error: str | None = None  # None: completed; else the failure (gRPC code, "HTTP 429", ...)
    detail: str | None = None  # the failure's message, as the server (or the client) said it
    turn: int | None = None  # its turn in a conversation (users with --think-time), from 0
    new_tokens: int | None = None  # its prompt tokens no earlier turn of its user sent
    # The answer itself, collected only where a workload feeds it back (token ids, or text):
    # set to an empty list or string before sending, filled as it streams.
    answer: list[int] | str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.ok and self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.end - self.start if self.ok else None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or not self.token_times:
            return None
        return (self.end - self.token_times[0]) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_times)] if self.ok else []


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100), linear between closest ranks; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 and max (None each when there are no values)."""
    return {
        "mean": sum(values) / len(values) if values else None,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
    }


def parse_slo(text: str | None) -> dict[str, float]:
    """``ttft=2,tpot=0.05`` → {"ttft": 2.0, "tpot": 0.05}: seconds, or milliseconds with ``ms``
    (``ttft=500ms``). Keys: ttft, tpot, e2e (the router's ``--slo`` syntax, plus e2e)."""
    return parse_bounds(text, SLO_KEYS)


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Completed and within every bound. A one-token request has no TPOT: that bound holds."""
    if not record.ok:
        return False
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2e": record.e2e}
    return all((v := values[k]) is None or v <= bound for k, bound in slo.items())


def goodput(records: Iterable[RequestRecord], slo: dict[str, float], duration: float) -> float:
    """Requests that completed within every SLO, per second of the run."""
    good = sum(meets_slo(r, slo) for r in records)
    return good / duration if duration > 0 else 0.0


# A server that refuses a request for want of room (queue full, its wait would outlast its
# deadline) says so with these: counted apart from failures.
REFUSALS = frozenset({"RESOURCE_EXHAUSTED", "HTTP 429"})


def summarize(
    records: Sequence[RequestRecord], duration: float, slo: dict[str, float] | None = None
) -> dict:
    """The run's figures (the ``results`` object of the JSON file: docs/bench.md)."""
    done = [r for r in records if r.ok]
    refused = [r for r in records if r.error in REFUSALS]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in done)
    cached = sum(r.cached_tokens or 0 for r in done)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    slo = slo or {}
    good = sum(meets_slo(r, slo) for r in records) if slo else None
    return {
        "completed": len(done),
        "failed": len(records) - len(done) - len(refused),
        "failures": dict(
            Counter(r.error for r in records if not r.ok and r.error not in REFUSALS).most_common()
        ),
        "refused": len(refused),
        "refusals": dict(Counter(r.error for r in refused).most_common()),
        "refusal_latency_s": distribution([r.end - r.start for r in refused]),
        "failure_examples": {r.error: r.detail for r in reversed(records) if not r.ok},
        "duration_s": duration,
        "input_tokens": in_tokens,
        "cached_tokens": cached,
        "output_tokens": out_tokens,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        "ttft_s": distribution([r.ttft for r in done if r.ttft is not None]),
        "tpot_s": distribution([r.tpot for r in done if r.tpot is not None]),
        "itl_s": distribution([x for r in done for x in r.itl]),
        "e2e_s": distribution([r.e2e for r in done if r.e2e is not None]),
        "slo": slo,
        "good_requests": good,
        "goodput": per_s(good) if good is not None else None,
        "slo_attainment": good / len(records) if good is not None and records else None,
    }


def _spread(into: list[float], a: float, b: float, step: float) -> None:
    """Add the time the interval [a, b) spends in each bin, over the bin's length."""
    last = len(into) - 1
    for i in range(min(last, max(0, int(a / step))), min(last, max(0, int(b / step))) + 1):
        lo, hi = max(a, i * step), min(b, (i + 1) * step)
        if hi > lo:
            into[i] += (hi - lo) / step


def timeline(records: Sequence[RequestRecord], duration: float, step: float = 0.5) -> dict:
    """Per ``step``-second bin from 0 to ``duration`` (``t_s``: each bin's end): output tokens/s,
    completed requests/s, and the mean number of requests in flight (sent, not ended) and queued
    in this client (due, waiting for a --max-concurrency slot) over the bin."""
    bins = max(1, math.ceil(duration / step - 1e-9))
    tokens, completed = [0.0] * bins, [0.0] * bins
    in_flight, queued = [0.0] * bins, [0.0] * bins
    for r in records:
        if r.ok and r.token_times:
            share = r.output_tokens / len(r.token_times)  # tokens per chunk, spread evenly
            for t in r.token_times:
                tokens[min(bins - 1, max(0, int(t / step)))] += share
            completed[min(bins - 1, max(0, int(r.end / step)))] += 1
        _spread(in_flight, r.start, r.end, step)
        _spread(queued, r.arrival, r.start, step)
    return {
        "t_s": [step * (i + 1) for i in range(bins)],
        "output_tokens_per_s": [x / step for x in tokens],
        "requests_per_s": [x / step for x in completed],
        "in_flight": in_flight,
        "queued": queued,
    }


def occupancy(intervals: Iterable[tuple[float, float]]) -> tuple[list[float], list[int]]:
    """How many of the [a, b) intervals are open, as a step function: (times, counts), each
    count holding from its time to the next."""
    events = sorted(
        [(a, 1) for a, b in intervals if b > a] + [(b, -1) for a, b in intervals if b > a]
    )
    times, counts, n = [0.0], [0], 0
    for t, delta in events:
        n += delta
        if times[-1] == t:
            counts[-1] = n
        else:
            times.append(t)
            counts.append(n)
    return times, counts
