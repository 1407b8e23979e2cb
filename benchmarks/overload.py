"""Overload is a queue, not a collapse: one cluster, a rate sweep past its knee, and what each rate
cost the pools (``splitserve bench`` per rate, a fresh router per rate).

    python benchmarks/overload.py --device cuda --make-8b /tmp/llama8l --layers 8 \\
        --num-prefill 4 --gpu-memory-utilization 0.12 --rates 64 128 256 \\
        --slo ttft=2,tpot=0.1 --router-arg=--slo=ttft=2,tpot=0.1 --light-share 0.1
    python benchmarks/overload.py --rates 4 16 64 --duration 10 --slo ttft=2,tpot=0.5 \\
        --router-arg=--slo=ttft=2,tpot=0.5 --workload "--workload shared-prefix \\
        --num-prefixes 32 --prefix-len 256 --question-len 32 --output-len 16"  # CPU

Per rate: output tok/s, requests completed / refused (by reason, and how fast the refusals came:
the client's p99, the router's share within 50 ms) / failed, the share of the admitted requests
that completed in time (completed / (completed + failed): with short deadlines the failures are
timeouts after admission), TTFT p50 / p99, SLO attainment and goodput (requests/s within
``--slo``), the share of the prompt tokens computed that went to requests that did not complete
(the router's ``prefill_wasted_tokens`` / ``prefill_computed_tokens``), the prefill pool's
computed prompt tokens against the prompts of the requests served (the prefill nodes' own
counters, ``prompt_tokens - cached_tokens``), prefill attempts retried (the router's), transfers
that failed or waited on the decode node for blocks, the prefill nodes' peer prefix fetches
(blocks fetched, fetches past their budget, fetches skipped for a holder that just timed out),
and the load generator's busiest process and lateness. Each rate's workload goes under its own
cache salt, so no run finds another's prompts cached. ``--index on`` routes with the Redis prefix
index (the cluster always runs one; ``off`` gives the router static node lists and no index).

The router's own SLO: ``--router-arg=--slo=ttft=2,tpot=0.1`` (the ``=`` form: the value starts
with ``--``); ``--send-slo`` makes every request carry ``--slo`` instead. ``--light-share F`` runs
two tenants at once against each router: ``heavy`` at the rate and ``light`` at F times it (its
own seed and cache salt), started together; a row's request figures are then the heavy tenant's
(the token and router figures count both) and a second table gives each tenant's. A router of
``--before`` may lack the newer metrics: its rows show ``-`` there. ``--routers N`` starts N
routers per rate on one address (SO_REUSEPORT, the decode nodes leasing their capacity to them),
their metrics summed; the default, ``auto``, as many as ``splitserve up`` starts. JSON of every
run in ``--out``; ``--plot JSON`` draws the sweep from a finished run's ``sweep.json`` (no cluster).
Over 300 lines: the cluster, the runs, the rows and the tables of one experiment in one file.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import grpc

from splitserve.cluster_spec import ClusterSpec, auto_routers, router_count
from splitserve.launcher import LocalCluster, free_port
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

# The multi-tenant workload of the overload issue: 512 system prompts of 2,048 tokens, 8
# questions each of 128, 64 tokens out.
WORKLOAD = [
    "--workload", "shared-prefix", "--num-prefixes", "512", "--prefix-len", "2048",
    "--questions-per-prefix", "8", "--question-len", "128", "--output-len", "64",
]  # fmt: skip


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a checkpoint (default: the embedded model)")
    ap.add_argument("--make-8b", default=None, metavar="DIR", help="Llama-3-8B's shape (dummy)")
    ap.add_argument("--layers", type=int, default=32, help="with --make-8b: decoder layers")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-prefill", type=int, default=2)
    ap.add_argument("--num-decode", type=int, default=1)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--node-arg", action="append", default=[], help="a flag for every node")
    ap.add_argument("--router-arg", action="append", default=[],
                    help="a flag for each router but --before's: --router-arg=--slo=X")  # fmt: skip
    ap.add_argument("--rates", type=float, nargs="+", default=[32, 64, 128])
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
    ap.add_argument("--timeout", type=float, default=30.0, help="each request's deadline (s)")
    ap.add_argument("--slo", default="ttft=2,tpot=0.05", help="bench's --slo (goodput)")
    ap.add_argument("--send-slo", action="store_true", help="every request carries --slo")
    ap.add_argument("--routers", type=router_count, default="auto",
                    help="routers per rate on one address (SO_REUSEPORT; auto: as many as "
                    "`up --num-routers auto`; the --before router runs alone)")  # fmt: skip
    ap.add_argument("--bench-processes", type=int, default=4,
                    help="each bench's load over N processes (splitserve bench --processes): "
                    "one Python process receives ~7,000 messages/s at most")  # fmt: skip
    ap.add_argument("--light-share", type=float, default=0.0, metavar="F",
                    help="also a 'light' tenant at F times the rate (0: off)")  # fmt: skip
    ap.add_argument("--index", choices=("off", "on"), nargs="+", default=["off"])
    ap.add_argument("--workload", default=None,
                    help="splitserve bench's workload flags, one string (default: the "
                    "shared-prefix workload of the overload issue)")  # fmt: skip
    ap.add_argument("--out", default=None, help="folder for every run's files")
    ap.add_argument("--before", default=None, metavar="PYTHONPATH",
                    help="also run each rate through a router imported from here (an older "
                    "tree installed with pip --target), its rows labelled 'before'")  # fmt: skip
    ap.add_argument("--before-bare", action="store_true",
                    help="the 'before' router alone and without --router-arg (an older one "
                    "lacking them; default: as many and the same flags as the others)")  # fmt: skip
    ap.add_argument("--before-rates", type=float, nargs="+", default=None,
                    help="the rates of the 'before' rows (default: --rates)")  # fmt: skip
    ap.add_argument("--plot", default=None, metavar="JSON", help="plot a sweep.json and exit")
    return ap.parse_args()


def make_model(args) -> tuple[str, tuple[str, ...]]:
    if args.make_8b:
        from pipeline import make_8b

        return str(make_8b(Path(args.make_8b), args.layers)), ("--load-format", "dummy")
    if args.model:
        return args.model, ()
    from splitserve.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model()), ()


def counters(address: str) -> dict[str, float]:
    with grpc.insecure_channel(address) as channel:
        stub = nodes_pb2_grpc.NodeStatsServiceStub(channel)
        return dict(stub.GetStats(nodes_pb2.GetStatsRequest(), timeout=10).counters)


def scrape(url: str, keep: Path | None = None) -> dict[str, float]:
    """A router's ``splitserve_router_*`` samples; ``keep``: also write its whole text there."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    if keep is not None:
        keep.write_text(text)
    out = {}
    for line in text.splitlines():
        if line.startswith("splitserve_router_") and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def start_routers(
    cluster,
    model: str,
    index: str,
    out: Path,
    tag: str,
    extra: list[str],
    n: int,
    env=None,
    legacy: bool = False,
):
    """``n`` routers on one address (n > 1: SO_REUSEPORT): their processes, the address, and
    each one's /metrics base URL. Each binds its own free ports and writes them to files;
    `legacy` (an older router, without ``--metrics-port-file``): its /metrics port is picked
    here, which another process may take first."""
    addr = cluster.addresses
    nodes = ["--redis-url", addr.redis_url] if index == "on" else []
    nodes += ["--prefill", ",".join(addr.prefill)] if addr.prefill else []
    shared = [] if n == 1 else ["--reuse-port"]
    procs, files = [], []
    deadline = time.monotonic() + 120
    port = "0"  # router 0 binds a free port; the others (SO_REUSEPORT) join it
    for i in range(n):
        name = tag if n == 1 else f"{tag}-{i}"
        port_file, metrics_file = out / f"router-{name}.port", out / f"router-{name}.metrics-port"
        for stale in (port_file, metrics_file):  # a run before into the same --out left them
            stale.unlink(missing_ok=True)
        if legacy:
            metrics_file.write_text(str(free_port()))
            metrics = ["--metrics-port", metrics_file.read_text()]
        else:
            metrics = ["--metrics-port", "0", "--metrics-port-file", str(metrics_file)]
        cmd = [
            sys.executable, "-m", "splitserve.cli", "router", "--model", model,
            "--decode", ",".join(addr.decode), *nodes, "--port", port, "--port-file",
            str(port_file), *metrics, "--max-requests-per-client", "100000", *shared, *extra,
        ]  # fmt: skip
        log = (out / f"router-{name}.log").open("w")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        files.append((port_file, metrics_file))
        if i == 0:
            port = _wait_for(procs[0], port_file, deadline, f"router {tag}", out)
    urls = [
        f"http://127.0.0.1:{_wait_for(proc, metrics_file, deadline, f'router {tag}', out)}"
        for proc, (_, metrics_file) in zip(procs, files, strict=True)
    ]
    for proc, (port_file, _) in zip(procs, files, strict=True):
        _wait_for(proc, port_file, deadline, f"router {tag}", out)
    time.sleep(2.0)  # health checks and the nodes' GetStats (capacities) answered
    return procs, f"127.0.0.1:{port}", urls


def _wait_for(proc: subprocess.Popen, path: Path, deadline: float, what: str, out: Path) -> str:
    """The port a process wrote to `path` once it bound it (exits if it died or took too long)."""
    while not (path.exists() and path.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"{what} did not start: see {out}")
        time.sleep(0.2)
    return path.read_text().strip()


def scrape_all(urls: list[str], out: Path, tag: str) -> dict[str, float]:
    """Every router's samples, summed by name (counters and histogram buckets add up); each
    router's last /metrics text is kept in ``out`` (router-TAG-N.metrics.txt)."""
    total: dict[str, float] = {}
    for i, url in enumerate(urls):
        keep = out / f"router-{tag}-{i}.metrics.txt"
        for key, value in scrape(f"{url}/metrics", keep).items():
            total[key] = total.get(key, 0.0) + value
    return total


def bench_command(args, target: str, rate: float, salt: str, seed: int, result: Path) -> list[str]:
    workload = shlex.split(args.workload) if args.workload else WORKLOAD
    return [
        sys.executable, "-m", "splitserve.cli", "bench", "--target", target,
        *workload, "--request-rate", f"{rate:g}",
        "--duration", f"{args.duration:g}", "--timeout", f"{args.timeout:g}",
        "--slo", args.slo, "--seed", str(seed), "--cache-salt", salt, "--no-progress",
        "--result-json", str(result), *(["--send-slo"] if args.send_slo else []),
        "--processes", str(args.bench_processes),
    ]  # fmt: skip


def run_benches(commands: dict[str, list[str]], out: Path) -> None:
    """Start every bench at once, then wait for all (exit 1: none completed, still a result)."""
    with ExitStack() as stack:
        procs = []
        for name, cmd in commands.items():
            log = stack.enter_context((out / f"bench-{name}.log").open("w"))
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        for proc in procs:
            proc.wait()


def share(part: float | None, whole: float | None) -> float | None:
    return part / whole if part is not None and whole else None


def tenant(rate: float, r: dict) -> dict:
    """One tenant's figures from its bench results."""
    return {
        "rate": rate,
        "completed": r["completed"],
        "refused": r["refused"],
        "failed": r["failed"],
        "in_time": share(r["completed"], r["completed"] + r["failed"]),
        "slo_attainment": r["slo_attainment"],
        "goodput": r["goodput"],
        "ttft_p99_ms": None if r["ttft_s"]["p99"] is None else 1e3 * r["ttft_s"]["p99"],
    }


def one_rate(args, cluster, model: str, rate: float, index: str, out: Path, env=None) -> dict:
    """One rate through a fresh router (its counters start at 0): the row of the sweep."""
    label = index if env is None else f"{index}, before"
    tag = f"{index}-r{rate:g}" if env is None else f"{index}-before-r{rate:g}"
    # An older router may lack newer options: --before-bare starts it alone, without them.
    bare = env is not None and args.before_bare
    extra = [] if bare else args.router_arg
    n = 1 if bare else args.routers
    if n == 0:  # auto
        decode_gpus = args.num_decode  # one GPU each (this script runs TP 1)
        n = auto_routers(args.device, decode_gpus, os.cpu_count())
    if n > 1:
        label += f", {n} routers"
    routers, target, metrics = start_routers(
        cluster, model, index, out, tag, extra, n, env, legacy=bare
    )
    prefill, decode = cluster.addresses.prefill, cluster.addresses.decode
    benches = {"heavy": (rate, tag)}  # tenant: its rate, the name of its files and cache salt
    if args.light_share:
        benches["light"] = (rate * args.light_share, f"{tag}-light")
    commands = {}
    for seed, (name, (its_rate, its_tag)) in enumerate(benches.items(), start=1):
        cmd = bench_command(args, target, its_rate, its_tag, seed, out / f"bench-{its_tag}.json")
        commands[its_tag] = [*cmd, *(["--client-id", name] if args.light_share else [])]
    commands[tag] += [a for url in metrics for a in ("--metrics-url", f"{url}/metrics")]
    try:
        before = {a: counters(a) for a in (*prefill, *decode)}
        run_benches(commands, out)
        router_figures = scrape_all(metrics, out, tag)
        after = {a: counters(a) for a in (*prefill, *decode)}
    finally:
        for router in routers:
            router.terminate()
        for router in routers:
            router.wait(30)

    def delta(addresses, name):
        return sum(after[a].get(name, 0.0) - before[a].get(name, 0.0) for a in addresses)

    def router_figure(name: str) -> float | None:  # None: this router does not export it
        return router_figures.get(f"splitserve_router_{name}")

    docs = {
        name: json.loads((out / f"bench-{its_tag}.json").read_text())
        for name, (_, its_tag) in benches.items()
    }
    runs = {name: doc["results"] for name, doc in docs.items()}
    r = runs["heavy"]
    clients = [doc.get("client") or {} for doc in docs.values()]
    computed = delta(prefill, "prompt_tokens") - delta(prefill, "cached_tokens")
    refused_by = {
        k.split('reason="')[1].rstrip('"}'): v
        for k, v in router_figures.items()
        if k.startswith("splitserve_router_refused_total{") and v
    }
    lat = r["refusal_latency_s"]
    n_ref = router_figure("refusal_seconds_count") or 0.0
    ref_sum = router_figure("refusal_seconds_sum") or 0.0

    def refused_within(le: str) -> float | None:
        return share(router_figure(f'refusal_seconds_bucket{{le="{le}"}}'), n_ref)

    outcomes = {
        o: router_figure(f'slo_requests_total{{outcome="{o}"}}')
        for o in ("met", "missed", "failed")
    }
    return {
        "index": label,
        "rate": rate,
        "routers": n,
        "output_tok_s": r["output_throughput"],
        "completed": r["completed"],
        "refused": r["refused"],
        "refused_by_reason": refused_by,
        "refusal_p99_ms": None if lat["p99"] is None else 1e3 * lat["p99"],
        "refusal_max_ms": None if lat["max"] is None else 1e3 * lat["max"],
        "router_refusal_mean_ms": 1e3 * ref_sum / n_ref if n_ref else None,
        "router_refused_within_50ms": refused_within("0.05"),
        "router_refused_within_100ms": refused_within("0.1"),
        "failed": r["failed"],
        "failures": r["failures"],
        "in_time": share(r["completed"], r["completed"] + r["failed"]),
        "ttft_p50_ms": 1e3 * (r["ttft_s"]["p50"] or 0),
        "ttft_p99_ms": 1e3 * (r["ttft_s"]["p99"] or 0),
        "slo_attainment": r["slo_attainment"],
        "goodput": r["goodput"],
        "router_slo_requests": outcomes if any(v is not None for v in outcomes.values()) else None,
        "served_prompt_tokens": sum(x["input_tokens"] for x in runs.values()),
        "served_cached_tokens": sum(x["cached_tokens"] for x in runs.values()),
        "computed_prompt_tokens": computed,
        "router_computed_prompt_tokens": router_figure("prefill_computed_tokens_total"),
        "router_wasted_prompt_tokens": router_figure("prefill_wasted_tokens_total"),
        "wasted_share": share(
            router_figure("prefill_wasted_tokens_total"),
            router_figure("prefill_computed_tokens_total"),
        ),
        "prefill_retries": router_figures.get("splitserve_router_prefill_retries_total", 0.0),
        "prefill_transfers_failed": delta(prefill, "transfers_failed"),
        "decode_transfers_waited": delta(decode, "transfers_waited_for_blocks"),
        "decode_transfers_failed": delta(decode, "transfers_failed"),
        # Peer prefix fetches between the prefill nodes: blocks fetched, fetches past their
        # budget (computed instead), and those not tried because the holder had just timed out.
        "prefix_blocks_fetched": delta(prefill, "prefix_blocks_fetched"),
        "prefix_fetch_timed_out": delta(prefill, "prefix_fetch_timed_out"),
        "prefix_fetch_skipped_peer_slow": delta(prefill, "prefix_fetch_skipped_peer_slow"),
        "client_cpu_max": max((max(c.get("cpu_cores") or [0]) for c in clients), default=None),
        "client_late_p99_ms": max(
            (1e3 * c["send_late_p99_s"] for c in clients if c.get("send_late_p99_s") is not None),
            default=None,
        ),
        "client_warnings": [w for c in clients for w in c.get("warnings", ())],
        "tenants": {name: tenant(benches[name][0], x) for name, x in runs.items()}
        if args.light_share
        else None,
    }


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def num(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def table(rows: list[dict]) -> str:
    lines = [
        "| index | rate (req/s) | output tok/s | done / refused / failed | in time | refusals: "
        "by reason; client p99 ms; router <= 50 ms | TTFT p50 / p99 (ms) | SLO att. / goodput "
        "(req/s) | wasted prefill | computed / served prompt tokens (/ uncached) | prefill "
        "retries | transfers failed P / waited D | peer fetches: blocks / timed out / skipped "
        "| load generator: busiest (cores) / sends "
        "late p99 (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        uncached = max(r["served_prompt_tokens"] - r["served_cached_tokens"], 1)
        ref = "-"
        if r["refused"]:
            reasons = sorted(r["refused_by_reason"].items(), key=lambda kv: -kv[1])
            ref = ", ".join(f"{k} {v:.0f}" for k, v in reasons) or "?"
            ref += f"; {num(r['refusal_p99_ms'])}; {pct(r.get('router_refused_within_50ms'))}"
        computed = r["computed_prompt_tokens"]
        lines.append(
            f"| {r['index']} | {r['rate']:g} | {r['output_tok_s']:,.0f} | "
            f"{r['completed']} / {r['refused']} / {r['failed']} | {pct(r.get('in_time'))} | "
            f"{ref} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
            f"{pct(r['slo_attainment'])} / {num(r.get('goodput'), '.2f')} | "
            f"{pct(r.get('wasted_share'))} | "
            f"{computed / max(r['served_prompt_tokens'], 1):.3f} ({computed / uncached:.3f}) | "
            f"{r['prefill_retries']:.0f} | "
            f"{r['prefill_transfers_failed']:.0f} / {r['decode_transfers_waited']:.0f} | "
            f"{num(r.get('prefix_blocks_fetched'))} / {num(r.get('prefix_fetch_timed_out'))} / "
            f"{num(r.get('prefix_fetch_skipped_peer_slow'))} | "
            f"{num(r.get('client_cpu_max'), '.2f')} / {num(r.get('client_late_p99_ms'))}"
            f"{' (warned)' if r.get('client_warnings') else ''} |"
        )
    return "\n".join(lines)


def tenant_table(rows: list[dict]) -> str:
    lines = [
        "| index | rate (req/s) | tenant | its rate | done / refused / failed | in time | SLO att. "
        "| goodput (req/s) | TTFT p99 (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for name, t in (r.get("tenants") or {}).items():
            lines.append(
                f"| {r['index']} | {r['rate']:g} | {name} | {t['rate']:g} | {t['completed']} / "
                f"{t['refused']} / {t['failed']} | {pct(t['in_time'])} | "
                f"{pct(t['slo_attainment'])} | {num(t['goodput'], '.2f')} | "
                f"{num(t['ttft_p99_ms'])} |"
            )
    return "\n".join(lines)


def plot(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads(Path(path).read_text())["rows"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for index in sorted({r["index"] for r in rows}):
        rs = [r for r in rows if r["index"] == index]
        rates = [r["rate"] for r in rs]
        sent = [max(r["completed"] + r["refused"] + r["failed"], 1) for r in rs]

        def share(key, rs=rs, sent=sent):
            return [r[key] / n for r, n in zip(rs, sent, strict=True)]

        ax.plot(rates, [r["output_tok_s"] for r in rs], "o-", label=index)
        color = bx.plot(rates, share("completed"), "o-", label=f"served, {index}")[0].get_color()
        bx.plot(rates, share("refused"), "x--", color=color, label=f"refused, {index}")
        bx.plot(rates, share("failed"), "s:", color=color, label=f"failed, {index}")
    ax.set(xlabel="offered load (req/s)", ylabel="output tok/s", title="throughput vs load")
    bx.set(xlabel="offered load (req/s)", ylabel="share of the requests sent",
           title="served, refused, failed")  # fmt: skip
    for a in (ax, bx):
        a.set_xscale("log", base=2)
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    png = Path(path).with_suffix(".png")
    fig.savefig(png, dpi=110)
    print(png)


def main() -> None:
    args = parse_args()
    if args.plot:
        plot(args.plot)
        return
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="overload-"))
    out.mkdir(parents=True, exist_ok=True)
    model, node_args = make_model(args)
    spec = ClusterSpec(
        model_path=model,
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        port=0,  # the router binds a free port itself
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        node_args=(*node_args, *args.node_arg),
    )
    runs = [(index, rate, None) for index in args.index for rate in args.rates]
    if args.before:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (args.before, os.environ.get("PYTHONPATH")) if p
        )}  # fmt: skip
        check = [sys.executable, "-c", "import splitserve; print(splitserve.__file__)"]
        where = subprocess.run(check, env=env, capture_output=True, text=True, check=True)
        if not where.stdout.startswith(str(Path(args.before).resolve())):
            sys.exit(f"--before {args.before}: splitserve is imported from {where.stdout}")
        runs += [(args.index[0], rate, env) for rate in args.before_rates or args.rates]
    rows = []
    with LocalCluster(spec) as cluster:
        for index, rate, env in runs:
            row = one_rate(args, cluster, model, rate, index, out, env)
            print(json.dumps(row), flush=True)
            rows.append(row)
            (out / "sweep.json").write_text(json.dumps({"args": vars(args), "rows": rows}))
    print(f"\nruns in {out}\n")
    print(table(rows))
    if args.light_share:
        print("\n" + tenant_table(rows))


if __name__ == "__main__":
    main()
