"""Reading Prometheus /metrics pages (``fetch``, ``samples_of``; the bench's scraper reads with
them too), and the router's into ``policy.Figures``: its pressure gauges as they are, and TTFT/TPOT
as the 90th percentile of the requests between two scrapes (from the histograms' bucket counts, as
Prometheus' ``histogram_quantile`` over a rate does)."""

from __future__ import annotations

import math
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from splitserve.planner.policy import Figures, PoolFigures

TTFT = "splitserve_time_to_first_token_seconds"
TPOT = "splitserve_inter_token_latency_seconds"
QUANTILE = 0.9

Samples = dict[str, float]  # 'name{label="v",...}' (labels sorted) -> value
Buckets = dict[float, float]  # le -> cumulative count
Page = tuple[Samples, dict[str, Buckets]]  # one /metrics page, parsed


# What reading a page can raise: OSError for an endpoint that does not answer (or answers an HTTP
# error), the others for a page the parser rejects.
ERRORS = (OSError, ValueError, LookupError, TypeError)


def fetch(url: str, timeout_s: float) -> str:
    """The text of the page at ``url``; OSError (URLError, HTTPError, TimeoutError) when it does
    not come."""
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return reply.read().decode()


def samples_of(text: str) -> Iterator[Sample]:
    """Every sample of a /metrics page in order, histograms' buckets, sums and counts included."""
    for family in text_string_to_metric_families(text):
        yield from family.samples


def parse(text: str) -> Page:
    """The plain samples of a /metrics page, and each histogram's cumulative buckets."""
    samples: Samples = {}
    buckets: dict[str, Buckets] = {}
    for s in samples_of(text):
        if s.name.endswith("_bucket") and "le" in s.labels:
            le = math.inf if s.labels["le"] == "+Inf" else float(s.labels["le"])
            into = buckets.setdefault(s.name.removesuffix("_bucket"), {})
            into[le] = into.get(le, 0.0) + s.value  # summed over other labels
            continue
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
        samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples, buckets


def quantile(now: Buckets, before: Buckets | None, q: float = QUANTILE) -> float | None:
    """The q-quantile of what the histogram counted since ``before`` (None: nothing)."""
    delta = {le: c - (before or {}).get(le, 0.0) for le, c in now.items()}
    edges = sorted(delta)
    if not edges or delta[edges[-1]] <= 0:
        return None
    rank = q * delta[edges[-1]]
    lower, below = 0.0, 0.0
    for le in edges:
        if delta[le] >= rank:
            if math.isinf(le):
                return lower  # past the last finite bucket: its edge is all that is known
            inside = delta[le] - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = le, delta[le]
    return lower


def figures(
    samples: Samples,
    buckets: Mapping[str, Buckets],
    before: Mapping[str, Buckets] | None,
    at: float,
) -> Figures:
    """The policy's snapshot from one parsed scrape (and the previous one's histograms)."""

    def get(name: str, **labels: str) -> float:
        key = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        value = samples.get(f"{name}{{{key}}}" if key else name, 0.0)
        return 0.0 if math.isnan(value) else value

    def pool(role: str) -> PoolFigures:
        return PoolFigures(
            nodes=int(get("splitserve_router_nodes", role=role)),
            in_flight=int(get("splitserve_router_pool_in_flight", role=role)),
            slots=int(get("splitserve_router_pool_slots", role=role)),
            prompt_tokens=int(get("splitserve_router_pool_prompt_tokens", role=role)),
        )

    before = before or {}
    return Figures(
        at=at,
        queue_length=int(get("splitserve_router_queue_length")),
        queue_prompt_tokens=int(get("splitserve_router_queue_prompt_tokens")),
        oldest_wait_s=get("splitserve_router_queue_oldest_wait_seconds"),
        wait_p99_s=get("splitserve_router_queue_wait_recent_seconds", quantile="0.99"),
        prefill=pool("prefill"),
        decode=pool("decode"),
        kv_blocks_total=int(get("splitserve_router_decode_kv_blocks", state="total")),
        kv_blocks_charged=int(get("splitserve_router_decode_kv_blocks", state="charged")),
        prefill_tokens_per_s=get("splitserve_router_prefill_tokens_per_second"),
        ttft_s=quantile(buckets[TTFT], before.get(TTFT)) if TTFT in buckets else None,
        tpot_s=quantile(buckets[TPOT], before.get(TPOT)) if TPOT in buckets else None,
    )


# Several routers in front of the same pools (``up --num-routers``): each counts its own requests
# (summed over the routers), and each sees the same nodes (the most any of them sees).
SUMMED = (
    "splitserve_router_queue_length",
    "splitserve_router_queue_prompt_tokens",
    "splitserve_router_pool_in_flight",
    "splitserve_router_pool_prompt_tokens",
    'splitserve_router_decode_kv_blocks{state="charged"}',
)


def merge(pages: Sequence[Page]) -> Page:
    """One router's view from several routers' pages: their requests' counts and histograms
    summed; the figures of the nodes they share (sizes, rates), and the waits, at their most."""
    samples: Samples = {}
    buckets: dict[str, Buckets] = {}
    for page_samples, page_buckets in pages:
        for key, value in page_samples.items():
            if key not in samples:
                samples[key] = value
            elif key.startswith(SUMMED):
                samples[key] += value
            else:
                samples[key] = max(samples[key], value)
        for name, edges in page_buckets.items():
            into = buckets.setdefault(name, {})
            for le, count in edges.items():
                into[le] = into.get(le, 0.0) + count
    return samples, buckets


class Scraper:
    """Scrapes the /metrics of the routers (one URL, or several routers' comma-separated); each
    ``read`` gives the figures since the previous one."""

    def __init__(self, url: str | Sequence[str], timeout_s: float = 5.0) -> None:
        urls = url.split(",") if isinstance(url, str) else list(url)
        self.urls = [u.strip() for u in urls if u.strip()]
        self.url = ",".join(self.urls)
        self.timeout_s = timeout_s
        self._before: dict[str, Buckets] | None = None
        self.last_text = ""

    def read(self) -> Figures:
        """Raises OSError (URLError included) when a router does not answer."""
        texts = [fetch(url, self.timeout_s) for url in self.urls]
        return self.read_text(texts, time.monotonic())

    def read_text(self, text: str | Sequence[str], at: float) -> Figures:
        texts = [text] if isinstance(text, str) else list(text)
        self.last_text = "\n".join(texts)
        samples, buckets = merge([parse(t) for t in texts])
        out = figures(samples, buckets, self._before, at)
        self._before = buckets
        return out
