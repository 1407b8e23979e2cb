"""The planner under load: `splitserve up --autoscale` from 1 prefill + 1 decode node, one
`splitserve bench` run at a rate past one pair's knee, and what scaling bought: SLO attainment,
TTFT and TPOT of the requests sent before the first added node was routable against those sent
once the pools had their final size, and a timeline plot (nodes per pool, wanted and routable,
against each request's TTFT).

    # one H200, the default model, bounds 3 and 3 (the issue's run)
    python benchmarks/autoscale.py --device cuda --max-prefill 3 --max-decode 3 \\
        --rate 40 --duration 180 --input-len 1024 --output-len 128 --slo ttft=1,tpot=0.05 \\
        --plot docs/img/autoscale_timeline.png
    # CPU smoke run: the tiny model, 2 sequence slots a decode node
    python benchmarks/autoscale.py --model tiny --max-decode 2 --max-prefill 2 --rate 20 \\
        --duration 40 --input-len 24 --output-len 32 --slo ttft=1,tpot=0.05 \\
        --up-args "--max-num-seqs 2 --interval 1 --cooldown 10"

Every figure lands in ``--out`` (bench.json: the bench's own results; timeline.json: the samples
of the router's and the planner's node counts, on the bench's clock).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from splitserve.planner.scrape import fetch, parse

ROLES = ("prefill", "decode")


def _gauges(url: str) -> dict[str, float]:
    return parse(fetch(url, 5))[0]


class Sampler(threading.Thread):
    """Every ``every`` s: routable and wanted nodes per pool, and the router's work in flight."""

    def __init__(self, router: str, planner: str, every: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.router, self.planner, self.every = router, planner, every
        self.rows: list[dict[str, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every):
            try:
                r, p = _gauges(self.router), _gauges(self.planner)
            except OSError:
                continue
            row = {"t": time.monotonic()}
            for role in ROLES:
                row[f"{role}_nodes"] = r.get(f'splitserve_router_nodes{{role="{role}"}}', 0.0)
                row[f"{role}_wanted"] = p.get(
                    f'splitserve_planner_wanted_nodes{{role="{role}"}}', 0.0
                )
            row["busy"] = r.get("splitserve_router_queue_length", 0.0) + r.get(
                'splitserve_router_pool_in_flight{role="decode"}', 0.0
            )
            self.rows.append(row)


def start_up(args: argparse.Namespace, out: Path) -> tuple[subprocess.Popen, str, str, str]:
    argv = [sys.executable, "-m", "splitserve.cli", "up", "--port", "0", "--autoscale"]
    argv += ["--api-key-file", "none"]
    argv += ["--device", args.device, "--max-prefill", str(args.max_prefill)]
    argv += ["--max-decode", str(args.max_decode), "--slo", args.slo]
    argv += ["--planner-metrics-port", "0", "--log-file", str(out / "up.log")]
    argv += ["--record", str(out / "planner.jsonl")]
    if args.model:
        argv += ["--model", args.model]
    argv += shlex.split(args.up_args)
    print("$", shlex.join(argv), flush=True)
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert up.stdout is not None
    urls: dict[str, str] = {}
    router = ""
    while not (line := up.stdout.readline()).startswith("ready:"):
        if not line:
            raise SystemExit(f"splitserve up exited: see {out / 'up.log'}")
        words = line.split()
        if words[:1] == ["router"] and "router" not in urls:
            router = words[1]  # the address the router bound (up --port 0)
        if "metrics" in words:
            urls[words[0]] = words[-1]
    return up, router, urls["router"], urls["planner"]


def phases(requests: list[dict], timeline: list[dict], slo: dict[str, float]) -> list[tuple]:
    """(phase, requests, attainment, TTFT p50, p99, TPOT p50) before and after scaling."""
    first = timeline[0]
    start_total = first["prefill_nodes"] + first["decode_nodes"]
    final_total = max(r["prefill_nodes"] + r["decode_nodes"] for r in timeline)
    grew = next(
        (r["t"] for r in timeline if r["prefill_nodes"] + r["decode_nodes"] > start_total), None
    )
    full = next(
        (r["t"] for r in timeline if r["prefill_nodes"] + r["decode_nodes"] >= final_total), None
    )
    out = []
    for name, lo, hi in (
        ("before scaling", -1e9, grew if grew is not None else 1e9),
        ("after scaling", (full + 5.0) if full is not None and grew is not None else 1e9, 1e9),
        ("all", -1e9, 1e9),
    ):
        rows = [q for q in requests if lo <= q["start_s"] < hi]
        ok = [
            q
            for q in rows
            if not q["error"]
            and (q["ttft_s"] or 0) <= slo.get("ttft", 1e9)
            and (q["tpot_s"] or 0) <= slo.get("tpot", 1e9)
        ]
        ttft = sorted(q["ttft_s"] for q in rows if q["ttft_s"] is not None)
        tpot = sorted(q["tpot_s"] for q in rows if q["tpot_s"] is not None)

        def pct(xs: list[float], p: float) -> float:
            return xs[min(int(p * len(xs)), len(xs) - 1)] if xs else float("nan")

        att = len(ok) / len(rows) if rows else float("nan")
        out.append((name, len(rows), att, pct(ttft, 0.5), pct(ttft, 0.99), pct(tpot, 0.5)))
    return out


def plot(path: str, requests: list[dict], timeline: list[dict], slo: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    t = [r["t"] for r in timeline]
    for role, color in (("prefill", "tab:blue"), ("decode", "tab:orange")):
        ax.step(t, [r[f"{role}_nodes"] for r in timeline], where="post", color=color,
                label=f"{role} routable")  # fmt: skip
        ax.step(t, [r[f"{role}_wanted"] for r in timeline], where="post", color=color,
                linestyle="--", label=f"{role} wanted")  # fmt: skip
    ax.set_ylabel("nodes")
    ax.legend(loc="upper left", fontsize=8)
    done = [q for q in requests if q["ttft_s"] is not None]
    bx.scatter([q["start_s"] for q in done], [q["ttft_s"] for q in done], s=3, label="TTFT")
    if "ttft" in slo:
        bx.axhline(slo["ttft"], color="red", linewidth=0.8, label="TTFT SLO")
    bx.set_yscale("log")
    bx.set_xlabel("seconds from the first request")
    bx.set_ylabel("TTFT (s)")
    bx.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--model", default=None, help="as `up --model` (default: its default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-prefill", type=int, default=3)
    p.add_argument("--max-decode", type=int, default=3)
    p.add_argument("--rate", type=float, required=True, help="requests/s, past one pair's knee")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of sending")
    p.add_argument("--input-len", default="1024")
    p.add_argument("--output-len", default="128")
    p.add_argument("--slo", default="ttft=1,tpot=0.05")
    p.add_argument("--tail", type=float, default=30.0, help="seconds sampled after the run")
    p.add_argument("--up-args", default="", help="more `splitserve up` flags")
    p.add_argument("--bench-args", default="", help="more `splitserve bench` flags")
    p.add_argument("--out", default=None, help="folder for the JSON files (default: a temp one)")
    p.add_argument("--plot", default=None, help="write the timeline PNG here")
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="autoscale-"))
    out.mkdir(parents=True, exist_ok=True)
    slo = {k: float(v) for k, v in (kv.split("=") for kv in args.slo.split(","))}
    up, target, router, planner = start_up(args, out)
    sampler = Sampler(router, planner)
    try:
        sampler.start()
        bench = [sys.executable, "-m", "splitserve.cli", "bench", "--target", target]
        bench += ["--request-rate", str(args.rate), "--duration", str(args.duration)]
        bench += ["--input-len", args.input_len, "--output-len", args.output_len]
        bench += ["--slo", args.slo, "--result-json", str(out / "bench.json"), "--no-progress"]
        bench += shlex.split(args.bench_args)
        print("$", shlex.join(bench), flush=True)
        subprocess.run(bench, check=True)
        time.sleep(args.tail)
    finally:
        sampler.stop.set()
        up.terminate()
        up.wait(timeout=120)
    doc = json.loads((out / "bench.json").read_text())
    requests = doc["requests"]
    # NOTE: the bench's clock starts at its first request; the first sample with work at the
    # router is taken as that moment (to the sampling interval).
    t0 = next((r["t"] for r in sampler.rows if r["busy"] > 0), sampler.rows[0]["t"])
    timeline = [{**r, "t": r["t"] - t0} for r in sampler.rows]
    (out / "timeline.json").write_text(json.dumps(timeline))
    print(f"\n{'phase':16s} {'requests':>8s} {'SLO met':>8s} {'TTFT p50':>9s} {'TTFT p99':>9s} "
          f"{'TPOT p50':>9s}")  # fmt: skip
    for name, n, att, t50, t99, tp50 in phases(requests, timeline, slo):
        print(f"{name:16s} {n:8d} {att:8.1%} {t50:9.3f} {t99:9.3f} {tp50:9.4f}")
    print("\nt (s)   prefill routable/wanted   decode routable/wanted   queued+decoding")
    last = None
    for r in timeline:
        now = tuple(int(r[f"{role}_{k}"]) for role in ROLES for k in ("nodes", "wanted"))
        if now != last:
            print(f"{r['t']:6.1f}   {now[0]:8d}/{now[1]:<8d}          {now[2]:8d}/{now[3]:<8d}"
                  f"         {int(r['busy'])}")  # fmt: skip
            last = now
    peak = {role: max(r[f"{role}_nodes"] for r in timeline) for role in ROLES}
    end = {role: timeline[-1][f"{role}_nodes"] for role in ROLES}
    print(f"nodes: peak {peak}, at the end {end}; results in {out}")
    if args.plot:
        plot(args.plot, requests, timeline, slo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
