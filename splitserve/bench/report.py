"""The run's report: a table on stdout and a JSON document (schema in docs/bench.md)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from splitserve.bench.metrics import STATS, RequestRecord

__all__ = ["SCHEMA", "format_table", "request_rows", "result_document", "write_json"]

SCHEMA = "splitserve-bench/1"
LATENCIES = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E latency"))


def _r(x: float | None, digits: int = 6) -> float | None:
    return None if x is None else round(x, digits)


def request_rows(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """One row per measured request (times in seconds from the run's start)."""
    return [
        {
            "index": r.index,
            "arrival_s": _r(r.arrival),
            "start_s": _r(r.start),
            "end_s": _r(r.end),
            "ttft_s": _r(r.ttft),
            "tpot_s": _r(r.tpot),
            "e2e_s": _r(r.e2e),
            "prompt_len": r.prompt_len,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "max_tokens": r.max_tokens,
            "output_tokens": r.output_tokens,
            "error": r.error,
            "error_detail": r.detail,
            "turn": r.turn,
        }
        for r in records
    ]


def _finite(value: Any) -> Any:
    """JSON has no infinity: an infinite rate is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def result_document(
    *,
    target: dict[str, Any],
    config: dict[str, Any],
    results: dict[str, Any],
    timeline: dict[str, Any],
    server_metrics: dict[str, Any],
    records: Sequence[RequestRecord],
    plots: Sequence[str] = (),
    label: str | None = None,
    started_at: str = "",
    client: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``client``: what the load generator itself did (``session.client_load``)."""
    return _finite(
        {
            "schema": SCHEMA,
            "label": label,
            "started_at": started_at,
            "target": target,
            "config": config,
            "client": client or {},
            "results": results,
            "timeline": timeline,
            "server_metrics": server_metrics,
            "requests": request_rows(records),
            "plots": list(plots),
        }
    )


def write_json(path: str, document: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=1, allow_nan=False)
        f.write("\n")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.2f}"


def format_table(doc: dict[str, Any]) -> str:
    """The figures a person reads first, as a fixed-width table."""
    res, tgt = doc["results"], doc["target"]
    rows = [
        (
            "target",
            f"{tgt['url']} ({tgt['kind']}{', model ' + tgt['model'] if tgt['model'] else ''})",
        ),
        ("completed requests", f"{res['completed']}"),
        ("failed requests", f"{res['failed']}"),
    ]
    examples = res["failure_examples"]
    rows += [
        (f"  failed: {k}", f"{v}  ({(examples.get(k) or '')[:60]})" if examples.get(k) else f"{v}")
        for k, v in res["failures"].items()
    ]
    if res.get("refused"):
        latency = res["refusal_latency_s"]
        rows.append(
            (
                "refused requests",
                f"{res['refused']}  (answered in p50 {_ms(latency.get('p50'))} / max "
                f"{_ms(latency.get('max'))} ms)",
            )
        )
        rows += [(f"  refused: {k}", f"{v}") for k, v in res["refusals"].items()]
    rows += [
        ("duration (s)", f"{res['duration_s']:.2f}"),
        ("input tokens (cached)", f"{res['input_tokens']} ({res['cached_tokens']})"),
        ("output tokens", f"{res['output_tokens']}"),
        ("requests/s", f"{res['request_throughput']:.2f}"),
        ("output tok/s", f"{res['output_throughput']:.1f}"),
        ("total tok/s", f"{res['total_token_throughput']:.1f}"),
    ]
    if res["goodput"] is not None:
        slo = ", ".join(f"{k} <= {v * 1000:g} ms" for k, v in res["slo"].items())
        rows.append((f"goodput req/s ({slo})", f"{res['goodput']:.2f}"))
        rows.append(("SLO attainment", f"{res['slo_attainment']:.1%}"))
    width = max(len(k) for k, _ in rows) + 2
    lines = ["=" * 76, " splitserve bench", "=" * 76]
    lines += [f"{k:<{width}}{v}" for k, v in rows]
    lines.append("-" * 76)
    lines.append(f"{'latency (ms)':<14}" + "".join(f"{s:>9}" for s in STATS))
    for key, name in LATENCIES:
        lines.append(f"{name:<14}" + "".join(f"{_ms(res[key][s]):>9}" for s in STATS))
    kv = doc["server_metrics"].get("summary", {})
    for family in ("kv_usage", "kv_slot_utilization", "queue_length"):
        if family in kv:
            lines.append("-" * 76)
            lines.append(f"{family + ' (server)':<60} mean / max")
            for name, s in sorted(kv[family].items()):
                lines.append(f"  {name:<56}{s['mean']:7.3f} / {s['max']:.3f}")
    client = doc.get("client") or {}
    if client:
        late = client.get("send_late_p99_s")
        lines.append("-" * 76)
        lines.append(
            f"load generator: {client['processes']} process(es), busiest "
            f"{max(client['cpu_cores']):.2f} cores"
            + ("" if late is None else f", sends late p99 {_ms(late)} ms")
        )
    lines.append("=" * 76)
    lines += [f"warning: {w}" for w in client.get("warnings", ())]
    note = cache_note(doc)
    if note:
        lines.append(note)
    return "\n".join(lines)


# A random workload's prompts share no prefix: more of them served from the prefix cache than this
# means they were sent before (the same --seed against the same server).
CACHED_SHARE_NOTE = 0.5


def cache_note(doc: dict[str, Any]) -> str | None:
    """A warning when a random workload without a cache salt found most of its prompt tokens in
    the server's prefix cache: the run measured cache hits, not prefill."""
    config, res = doc["config"], doc["results"]
    if config.get("workload") != "random" or config.get("cache_salt"):
        return None
    cached, total = res.get("cached_tokens") or 0, res.get("input_tokens") or 0
    if not total or cached / total < CACHED_SHARE_NOTE:
        return None
    return (
        f"note: the server served {cached / total:.0%} of the prompt tokens from its prefix "
        "cache: these prompts were sent to it before (same --seed). To measure prefill, give "
        "each run its own --cache-salt (or another --seed)."
    )
