"""The servers' own view during a run: gauges scraped from Prometheus ``/metrics`` endpoints.

Every ``interval`` seconds each URL is read (on a worker thread) and parsed, by
``planner.scrape``'s ``fetch`` and ``samples_of``; the gauges kept are the KV cache usage
(``splitserve_<role>_kv_usage`` from a node, ``splitserve_node_kv_usage{role,node}`` from a
router), the router's admission queue (``splitserve_router_queue_length``) and, where a node
exports it, ``splitserve_<role>_kv_slot_utilization`` (its NaN, no block in use, is skipped). A
failed scrape is counted, not fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
from urllib.parse import urlsplit

from splitserve.planner.scrape import ERRORS, fetch, samples_of

__all__ = ["KEPT", "Scraper", "series_of", "summary"]

# metric name → the family it belongs to in the report and the plots
KEPT = {
    re.compile(r"splitserve_(prefill|decode)_kv_usage"): "kv_usage",
    re.compile(r"splitserve_node_kv_usage"): "kv_usage",
    re.compile(r"splitserve_router_queue_length"): "queue_length",
    re.compile(r"splitserve_(\w+)_kv_slot_utilization"): "kv_slot_utilization",
}


def series_of(text: str, source: str) -> dict[tuple[str, str], float]:
    """The kept gauges of one scrape: ``{(family, series name): value}``. A series is named by
    the role (and node, as the router labels it) and ``source``, the endpoint's host:port."""
    out: dict[tuple[str, str], float] = {}
    for sample in samples_of(text):
        kind = next((k for pattern, k in KEPT.items() if pattern.fullmatch(sample.name)), None)
        if kind is None or not math.isfinite(sample.value):  # NaN: undefined (no block in use)
            continue
        labels = sample.labels
        if sample.name == "splitserve_router_queue_length":
            name = f"router {source}"
        elif "node" in labels:  # the router's view of a node
            name = f"{labels.get('role', '?')} {labels['node']} (via router {source})"
        else:
            role = labels.get("role") or sample.name.split("_")[1]
            name = f"{role} {source}"
        out[kind, name] = sample.value
    return out


class Scraper:
    """Scrapes ``urls`` in the background while a run lasts: ``async with Scraper(...)``.

    ``series(t0)``: ``{family: {series name: [(t, value), ...]}}``, t in seconds from ``t0`` (a
    ``time.perf_counter()``; samples taken before it, during a warmup, are left out)."""

    def __init__(self, urls: list[str], interval: float = 0.5):
        self.urls = urls
        self.interval = interval
        self._samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
        self.errors: dict[str, int] = {}
        self.scrapes = 0
        self._task: asyncio.Task | None = None

    async def _one(self, url: str) -> None:
        try:
            text = await asyncio.to_thread(fetch, url, max(self.interval * 4, 2.0))
            t = time.perf_counter()
            for key, value in series_of(text, urlsplit(url).netloc).items():
                self._samples.setdefault(key, []).append((t, value))
        except ERRORS:
            self.errors[url] = self.errors.get(url, 0) + 1  # counted, never fatal

    async def scrape_once(self) -> None:
        await asyncio.gather(*(self._one(url) for url in self.urls))
        self.scrapes += 1

    async def _loop(self) -> None:
        while True:
            started = asyncio.get_running_loop().time()
            await self.scrape_once()
            elapsed = asyncio.get_running_loop().time() - started
            await asyncio.sleep(max(0.0, self.interval - elapsed))

    async def __aenter__(self) -> Scraper:
        if self.urls:
            self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            await self.scrape_once()  # one last look: the state the run left behind

    def series(self, t0: float) -> dict[str, dict[str, list[tuple[float, float]]]]:
        out: dict[str, dict[str, list[tuple[float, float]]]] = {}
        for (kind, name), points in sorted(self._samples.items()):
            if kept := [(t - t0, v) for t, v in points if t >= t0]:
                out.setdefault(kind, {})[name] = kept
        return out


def summary(series: dict[str, dict[str, list[tuple[float, float]]]]) -> dict:
    """Per family and series: samples, mean and max."""
    return {
        kind: {
            name: {
                "samples": len(points),
                "mean": sum(v for _, v in points) / len(points),
                "max": max(v for _, v in points),
            }
            for name, points in named.items()
        }
        for kind, named in series.items()
    }
