"""``splitserve bench``: measure a serving deployment (docs/bench.md has every option)."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys

from splitserve.bench.workloads import CONVERSATION  # stdlib only: the CLI stays light

__all__ = ["add_command", "cmd_bench"]


def _error(message: str, status: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return status


def cmd_bench(args: argparse.Namespace) -> int:
    """Measure a serving deployment: a splitserve router (gRPC) or any OpenAI-compatible server."""
    from splitserve.bench.metrics import parse_slo
    from splitserve.bench.session import run_bench

    if args.plots:
        from splitserve.bench.plots import require_matplotlib

        try:
            require_matplotlib()
        except ImportError as exc:
            return _error(str(exc))
    if args.num_requests is None and args.duration is None:
        args.num_requests = 100
    try:
        slo = parse_slo(args.slo)
        doc = asyncio.run(run_bench(args, slo))
    except (ValueError, OSError) as exc:
        return _error(str(exc))
    except KeyboardInterrupt:
        return _error("interrupted", 130)
    from splitserve.bench.report import format_table, write_json

    print(format_table(doc), flush=True)
    if args.result_json:
        write_json(args.result_json, doc)
        print(f"results: {args.result_json}", flush=True)
    for path in doc["plots"]:
        print(f"plot: {path}", flush=True)
    return 0 if doc["results"]["completed"] else 1


def add_command(sub: argparse._SubParsersAction) -> None:
    """Register ``bench`` on the splitserve command line (over 60 lines: one call per option,
    each with its help)."""
    p = sub.add_parser(
        "bench",
        help=cmd_bench.__doc__,
        description=(cmd_bench.__doc__ or "") + " See docs/bench.md.",
    )
    t = p.add_argument_group("target")
    t.add_argument(
        "--target",
        required=True,
        help="grpc://host:port or host:port (a splitserve router), or http://host:port "
        "(any OpenAI-compatible server: POST /v1/completions, streamed)",
    )
    t.add_argument("--model", default=None, help="HTTP: the model name (default: GET /v1/models)")
    from splitserve.credentials import add_client_options

    add_client_options(t)  # --tls-cert/--tls-key/--tls-ca, --api-key, --api-key-file
    t.add_argument("--timeout", type=float, default=600.0, help="seconds per request (600)")
    t.add_argument("--label", default=None, help="a name for this run in the JSON file")
    t.add_argument(
        "--client-id",
        default=None,
        metavar="NAME",
        help="sent with every request as the x-splitserve-client gRPC metadata / HTTP header: "
        "the client (tenant) a splitserve router counts it against for fair queuing and its "
        "in-flight cap (default: none; the router then counts the caller's host)",
    )

    w = p.add_argument_group(
        "workload (lengths: N, uniform:LO:HI, normal:MEAN:STD, lognormal:MEAN:STD)"
    )
    w.add_argument(
        "--workload",
        nargs="+",
        default=["random"],
        metavar="KIND",
        help="random | shared-prefix | conversation | jsonl FILE",
    )
    w.add_argument("--input-len", default="1024", help="random: prompt length (1024)")
    w.add_argument(
        "--output-len",
        default=None,
        help="max_tokens of each request (default 128; conversation: each turn's answer "
        "length; jsonl: a line's max_tokens first)",
    )
    w.add_argument(
        "--prompt-format",
        choices=("ids", "text"),
        default="ids",
        help="token-id prompts (default) or text (random words)",
    )
    w.add_argument("--vocab", type=int, default=250, help="token ids are drawn from 0..N-1 (250)")
    w.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: system prompts (4)")
    w.add_argument("--prefix-len", default="512", help="shared-prefix: system prompt length (512)")
    w.add_argument(
        "--questions-per-prefix",
        type=int,
        default=16,
        help="shared-prefix: questions per system prompt (16)",
    )
    w.add_argument("--question-len", default="64", help="shared-prefix: question length (64)")
    w.add_argument(
        "--conversations",
        type=int,
        default=16,
        help="conversation: conversations under way at once (16)",
    )
    w.add_argument(
        "--think-time",
        type=float,
        default=None,
        help="conversation: each of the --conversations users waits for every answer, sends it "
        "back in the next turn's history (the server's real answers, as chat clients do) after "
        "thinking this many seconds on average (exponential; 0: at once); paced by the users, "
        "so no --request-rate. The report adds TTFT and computed vs cached prompt tokens per turn "
        "(default: open loop, made-up answers)",
    )
    w.add_argument(
        "--max-prompt-len",
        type=int,
        default=CONVERSATION["max_prompt_len"],
        help="conversation: the history is cut from the front to this length (4096)",
    )
    w.add_argument("--seed", type=int, default=0, help="seeds the workload and the arrivals (0)")
    w.add_argument("--temperature", type=float, default=0.0, help="(0: greedy)")
    w.add_argument(
        "--cache-salt",
        default=None,
        help="sent with every request: runs under different salts find nothing of each other's "
        "prompts in the prefix cache (splitserve; vLLM's cache_salt on HTTP)",
    )
    w.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate max_tokens whatever the model says (on)",
    )

    ld = p.add_argument_group("load")
    ld.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s (Poisson; inf: all at once)",
    )
    ld.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps: 1 Poisson (default), <1 burstier",
    )
    ld.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most C requests in flight (default: no limit)",
    )
    ld.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests measured (default 100 unless --duration)",
    )
    ld.add_argument("--duration", type=float, default=None, help="seconds of sending")
    ld.add_argument("--warmup", type=int, default=0, help="requests sent first, not counted")
    ld.add_argument(
        "--processes",
        type=int,
        default=1,
        help="spread the load over N processes (the same workload and arrival times, request i "
        "sent by process i mod N, results merged): one Python process receives ~7,000 "
        "messages/s at most; the report says when a process was busier than 0.7 cores or fell "
        "behind its schedule (1)",
    )
    ld.add_argument("--no-progress", action="store_true", help="no progress bar")

    r = p.add_argument_group("results")
    r.add_argument(
        "--slo", default=None, help="goodput bounds, e.g. ttft=2,tpot=0.05 (seconds; or 500ms)"
    )
    r.add_argument(
        "--send-slo",
        action="store_true",
        help="send --slo's ttft/tpot with every request as its own SLO (gRPC: the request's slo; "
        "HTTP: the x-splitserve-slo header): a splitserve router refuses at once what it "
        "predicts would miss them",
    )
    r.add_argument("--result-json", default=None, metavar="FILE", help="every figure as JSON")
    r.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots into DIR")
    r.add_argument(
        "--metrics-url",
        action="append",
        default=None,
        metavar="URL",
        help="a Prometheus /metrics to scrape (repeatable)",
    )
    r.add_argument(
        "--scrape-interval",
        type=float,
        default=0.5,
        help="seconds between scrapes and timeline bins (0.5)",
    )
    p.set_defaults(func=cmd_bench)
