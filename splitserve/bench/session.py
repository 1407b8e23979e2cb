"""One ``splitserve bench`` run from its parsed options: the workload, the load, the target,
the scraper, then the result document (``report.result_document``)."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from typing import Any

from splitserve import credentials
from splitserve.runtime.slo import Slo

__all__ = ["config_of", "make_workload", "run_bench", "sent_slo"]

WORKLOADS = ("random", "shared-prefix", "conversation", "jsonl")


def make_workload(args: argparse.Namespace):
    """The endless request iterator the options describe."""
    from splitserve.bench import workloads as w

    kind, *rest = args.workload
    if kind not in WORKLOADS:
        raise ValueError(f"--workload {kind!r}: one of {', '.join(WORKLOADS)}")
    if (kind == "jsonl") != bool(rest) or len(rest) > 1:
        raise ValueError("--workload jsonl takes one FILE; the others take none")
    out = w.LengthDist.parse(args.output_len) if args.output_len else None
    out_or_default = out or w.LengthDist("fixed", 128)
    common = {"text": args.prompt_format == "text", "vocab": args.vocab, "seed": args.seed}
    if args.vocab < 1:
        raise ValueError("--vocab must be at least 1")
    if kind == "random":
        return w.random_prompts(w.LengthDist.parse(args.input_len), out_or_default, **common)
    if kind == "shared-prefix":
        return w.shared_prefix(
            args.num_prefixes,
            w.LengthDist.parse(args.prefix_len),
            args.questions_per_prefix,
            w.LengthDist.parse(args.question_len),
            out_or_default,
            **common,
        )
    if kind == "conversation":
        params = {"max_prompt_len": args.max_prompt_len}
        return w.conversation(args.conversations, out, **common, params=params)
    return w.jsonl(rest[0], out_or_default, seed=args.seed)


def config_of(args: argparse.Namespace, slo: dict[str, float]) -> dict[str, Any]:
    keys = (
        "input_len",
        "output_len",
        "prompt_format",
        "vocab",
        "num_prefixes",
        "prefix_len",
        "questions_per_prefix",
        "question_len",
        "conversations",
        "max_prompt_len",
        "seed",
        "request_rate",
        "burstiness",
        "max_concurrency",
        "num_requests",
        "duration",
        "warmup",
        "temperature",
        "ignore_eos",
        "cache_salt",
        "timeout",
        "send_slo",
        "client_id",
        "metrics_url",
        "scrape_interval",
    )
    config = {k: getattr(args, k) for k in keys}
    return {"workload": " ".join(args.workload), **config, "slo": slo}


def sent_slo(args: argparse.Namespace, slo: dict[str, float]) -> Slo | None:
    """With ``--send-slo``: the ``Slo`` every request carries (``--slo``'s ttft and tpot; its
    e2e stays the benchmark's own); else None."""
    if not args.send_slo:
        return None
    if "ttft" not in slo and "tpot" not in slo:
        raise ValueError("--send-slo sends --slo's ttft and tpot: give --slo with either")
    return Slo(slo.get("ttft"), slo.get("tpot"))


async def run_bench(args: argparse.Namespace, slo: dict[str, float]) -> dict[str, Any]:
    """One ``splitserve bench`` run: the target, the workload, the load with the scraper beside it,
    then the result document. Over 60 lines: the steps share the run's arguments and records."""
    from splitserve.bench.metrics import summarize, timeline
    from splitserve.bench.report import result_document
    from splitserve.bench.runner import Load, run_load
    from splitserve.bench.scrape import Scraper, summary
    from splitserve.bench.targets import make_target

    load = Load(
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_requests=args.num_requests,
        duration=args.duration,
        warmup=args.warmup,
        seed=args.seed,
    )
    load.check()
    requests = make_workload(args)
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    target = make_target(
        args.target,
        model=args.model,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        timeout=args.timeout,
        api_key=credentials.api_key(args) or os.environ.get("OPENAI_API_KEY"),
        cache_salt=args.cache_salt,
        slo=sent_slo(args, slo),
        client_id=args.client_id,
        **_tls_options(args),
    )
    async with target:
        await target.prepare()
        bar = _progress(args, load)
        scraper = Scraper(args.metrics_url or [], args.scrape_interval)
        try:
            async with scraper:
                records, duration = await run_load(
                    target,
                    requests,
                    load,
                    on_done=lambda r: bar.update(1) if bar is not None else None,
                    on_start=lambda: bar.reset() if bar is not None else None,
                )
        finally:
            if bar is not None:
                bar.close()
    plots: list[str] = []
    line = timeline(records, duration, args.scrape_interval)
    scraped = scraper.series(target.t0)
    if args.plots:
        from splitserve.bench.plots import write_plots

        plots = write_plots(args.plots, records, line, scraped)
    return result_document(
        target={"url": target.url, "kind": target.kind, "model": target.model},
        config=config_of(args, slo),
        results=summarize(records, duration, slo),
        timeline=line,
        server_metrics={
            "summary": summary(scraped),
            "series": {
                kind: {name: [[round(t, 3), v] for t, v in pts] for name, pts in named.items()}
                for kind, named in scraped.items()
            },
            "scrapes": scraper.scrapes,
            "scrape_errors": scraper.errors,
        },
        records=records,
        plots=plots,
        label=args.label,
        started_at=started_at,
    )


def _progress(args: argparse.Namespace, load):
    if args.no_progress:
        return None
    from tqdm import tqdm

    return tqdm(total=load.num_requests, desc="requests", unit="req", file=sys.stderr)


def _tls_options(args) -> dict:
    """The target's TLS: mTLS credentials for a gRPC target, the CA of an https:// one."""
    if args.target.startswith("https://"):
        return {"ssl_context": credentials.https_context(args)}
    if args.target.startswith("http://"):
        return {}
    return {"credentials": credentials.grpc_credentials(args)}
