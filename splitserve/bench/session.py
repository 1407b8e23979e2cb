"""One ``splitserve bench`` run from its parsed options: the workload, the load, the target,
the scraper, then the result document (``report.result_document``)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import sys
import time
from typing import Any

import splitserve.settings as settings
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
        "think_time",
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


def _load(args: argparse.Namespace):
    from splitserve.bench.runner import Load

    if users_mode(args):
        if args.workload[0] != "conversation":
            raise ValueError("--think-time is for --workload conversation")
        if args.think_time < 0:
            raise ValueError("--think-time must be 0 or more")
        if args.request_rate != float("inf") or args.max_concurrency is not None:
            raise ValueError(
                "with --think-time the --conversations users pace themselves: give no "
                "--request-rate or --max-concurrency"
            )
        if args.warmup:
            raise ValueError("--warmup is not taken with --think-time")
        if args.target.startswith(("http://", "https://")) and args.prompt_format != "text":
            raise ValueError(
                "--think-time over HTTP sends the answers back as text: add --prompt-format text"
            )
        if getattr(args, "processes", 1) > args.conversations:
            raise ValueError("--think-time: give at most --conversations processes")

    load = Load(
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_requests=args.num_requests,
        duration=args.duration,
        warmup=args.warmup,
        seed=args.seed,
    )
    load.check(paced_by_users=users_mode(args))
    return load


def _target(args: argparse.Namespace, slo: dict[str, float]):
    from splitserve.bench.targets import make_target

    return make_target(
        args.target,
        model=args.model,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        timeout=args.timeout,
        api_key=credentials.api_key(args)
        or settings.API_KEY.get()
        or settings.OPENAI_API_KEY.get(),
        cache_salt=args.cache_salt,
        slo=sent_slo(args, slo),
        client_id=args.client_id,
        **_tls_options(args),
    )


async def run_bench(args: argparse.Namespace, slo: dict[str, float]) -> dict[str, Any]:
    """One ``splitserve bench`` run: the target, the workload, the load (spread over
    ``--processes``) with the scraper beside it, then the result document. Over 60 lines: the
    steps share the run's arguments and records."""
    from splitserve.bench.metrics import summarize, timeline
    from splitserve.bench.report import result_document
    from splitserve.bench.runner import Share
    from splitserve.bench.scrape import Scraper, summary

    load = _load(args)
    requests = make_workload(args)
    processes = getattr(args, "processes", 1)
    if processes < 1:
        raise ValueError("--processes must be at least 1")
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    target = _target(args, slo)
    async with target, Workers(args, slo, processes) as workers:
        await target.prepare()
        t0 = await workers.start()  # once every process is ready: one start for all
        bar = _progress(args, load)
        scraper = Scraper(args.metrics_url or [], args.scrape_interval)
        cpu0 = time.process_time()
        try:
            async with scraper:
                records, duration = await _drive(
                    args,
                    target,
                    requests,
                    load,
                    Share(0, processes, t0),
                    on_done=lambda r: bar.update(1) if bar is not None else None,
                    on_start=lambda: bar.reset() if bar is not None else None,
                )
        finally:
            if bar is not None:
                bar.close()
        busy = [(time.process_time() - cpu0) / max(duration, 1e-9)]
        for more, cpu_s, their_duration in await workers.results():
            records += more
            busy.append(cpu_s / max(their_duration, 1e-9))
            duration = max(duration, their_duration)
    records.sort(key=lambda r: r.index)
    plots: list[str] = []
    line = timeline(records, duration, args.scrape_interval)
    scraped = scraper.series(target.t0)
    if args.plots:
        from splitserve.bench.plots import write_plots

        plots = write_plots(args.plots, records, line, scraped)
    return result_document(
        target={"url": target.url, "kind": target.kind, "model": target.model},
        config={**config_of(args, slo), "processes": processes},
        results={**summarize(records, duration, slo), "turns": per_turn(records)},
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
        client=client_load(records, busy, load.max_concurrency is None and not users_mode(args)),
    )


def users_mode(args: argparse.Namespace) -> bool:
    """Conversations whose users wait for each answer and send it back (``--think-time``)."""
    return getattr(args, "think_time", None) is not None


async def _drive(args, target, requests, load, share, on_done=lambda r: None, on_start=None):
    """This process's part of the load: requests at their arrival times (``run_load``), or
    with ``--think-time`` the conversation workload's users (``run_users``)."""
    from splitserve.bench import workloads as w
    from splitserve.bench.runner import run_load, run_users

    if not users_mode(args):
        return await run_load(
            target, requests, load, on_done=on_done, on_start=on_start or (lambda: None),
            share=share,
        )  # fmt: skip
    out = w.LengthDist.parse(args.output_len) if args.output_len else None
    params = {"max_prompt_len": args.max_prompt_len}
    text = args.prompt_format == "text"

    def make_user(u: int) -> w.ConversationUser:
        rng = random.Random(args.seed * 7919 + u)
        return w.ConversationUser(rng, out, text=text, vocab=args.vocab, params=params)

    if on_start is not None:
        on_start()
    return await run_users(
        target, make_user, args.conversations, args.think_time, load, on_done=on_done,
        share=share,
    )  # fmt: skip


def per_turn(records: list) -> list[dict[str, Any]]:
    """Per conversation turn (users with ``--think-time``): requests, TTFT p50/p90 of those that
    completed, prompt tokens, and of them those the server computed and those its cache served
    (``usage.cached_tokens``; a server that does not say counts them as computed), and those
    new in the turn (the question and the answer fed back: what no cache can hold)."""
    from splitserve.bench.metrics import percentile

    out = []
    for turn in sorted({r.turn for r in records if r.turn is not None}):
        rows = [r for r in records if r.turn == turn]
        done = [r for r in rows if r.ok]
        ttft = [r.ttft for r in done if r.ttft is not None]
        prompt = sum(r.prompt_tokens or r.prompt_len for r in done)
        served = sum(r.cached_tokens or 0 for r in done)
        new = sum(r.new_tokens or 0 for r in done)
        p50, p90 = percentile(ttft, 50), percentile(ttft, 90)
        out.append(
            {
                "turn": turn,
                "requests": len(rows),
                "completed": len(done),
                "ttft_p50_s": None if p50 is None else round(p50, 6),
                "ttft_p90_s": None if p90 is None else round(p90, 6),
                "prompt_tokens": prompt,
                "computed_tokens": prompt - served,
                "cached_tokens": served,
                "new_tokens": new,
            }
        )
    return out


# A load generator process busier than this (cores) may have delayed what it measured.
BUSY_CORES = 0.7
LATE_S = 0.05  # sends later than this behind their arrival time (p99): the schedule slipped


def client_load(records: list, busy: list[float], open_loop: bool) -> dict[str, Any]:
    """What the load generator itself did: each process's CPU (cores), how late its sends left
    against their arrival times (open loop only), and a warning where either says its figures
    may be the client's rather than the server's."""
    late = sorted(r.start - r.arrival for r in records) if open_loop and records else []
    p99 = late[min(len(late) - 1, int(0.99 * len(late)))] if late else None
    warnings = []
    if max(busy) > BUSY_CORES:
        warnings.append(
            f"a load generator process was busy {max(busy):.2f} cores (> {BUSY_CORES}): its "
            "timings may be its own, not the server's; spread the load with --processes N"
        )
    if p99 is not None and p99 > LATE_S:
        warnings.append(
            f"requests left p99 {p99 * 1000:.0f} ms after their arrival times (> "
            f"{LATE_S * 1000:.0f} ms): the load generator fell behind its schedule; use "
            "--processes N"
        )
    return {
        "processes": len(busy),
        "cpu_cores": [round(b, 3) for b in busy],
        "send_late_p99_s": None if p99 is None else round(p99, 6),
        "send_late_max_s": round(late[-1], 6) if late else None,
        "warnings": warnings,
    }


class Workers:
    """The load generator's other processes (``--processes N``: N - 1 of them, spawned), each
    sending its share of the same workload (``runner.Share``) from a common start."""

    def __init__(self, args: argparse.Namespace, slo: dict[str, float], processes: int) -> None:
        self._args, self._slo, self._n = args, slo, processes
        self._procs: list = []
        self._pipes: list = []

    async def __aenter__(self) -> Workers:
        if self._n == 1:
            return self
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # no fork of a process with an event loop
        args = argparse.Namespace(**{k: v for k, v in vars(self._args).items() if k != "func"})
        for i in range(1, self._n):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_worker, args=(args, self._slo, i, self._n, theirs), daemon=True
            )
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._pipes.append(ours)
        return self

    async def start(self) -> float | None:
        """Wait until every process is ready; the common start time (None: one process)."""
        if self._n == 1:
            return None
        for pipe in self._pipes:
            ready = await asyncio.to_thread(_receive, pipe, WORKER_START_S)
            if isinstance(ready, BaseException):
                raise ready
        t0 = time.perf_counter() + 0.2
        for pipe in self._pipes:
            pipe.send(t0)
        return t0

    async def results(self) -> list[tuple[list, float, float]]:
        """Each other process's (records, CPU seconds, duration)."""
        out = []
        for pipe in self._pipes:
            result = await asyncio.to_thread(_receive, pipe, None)
            if isinstance(result, BaseException):
                raise result
            out.append(result)
        return out

    async def __aexit__(self, *exc: object) -> None:
        for proc in self._procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()


WORKER_START_S = 120.0  # how long a load process may take to start and reach the target


def _receive(pipe, timeout: float | None):
    if timeout is not None and not pipe.poll(timeout):
        return OSError(f"a load generator process did not start within {timeout:g} s")
    try:
        return pipe.recv()
    except EOFError:
        return OSError("a load generator process ended early (see its error above)")


def _worker(args: argparse.Namespace, slo: dict[str, float], index: int, of: int, pipe) -> None:
    """One load generator process (``Workers``): its share of the load, results to ``pipe``."""
    try:
        asyncio.run(_work(args, slo, index, of, pipe))
    except BaseException as exc:  # the parent says what failed
        pipe.send(OSError(f"load generator process {index}: {exc!r}"))


async def _work(args: argparse.Namespace, slo: dict[str, float], index: int, of: int, pipe) -> None:
    from splitserve.bench.runner import Share

    load = _load(args)
    requests = make_workload(args)
    async with _target(args, slo) as target:
        await target.prepare()
        pipe.send("ready")
        t0 = await asyncio.to_thread(pipe.recv)
        cpu0 = time.process_time()
        records, duration = await _drive(args, target, requests, load, Share(index, of, t0))
        pipe.send((records, time.process_time() - cpu0, duration))


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
