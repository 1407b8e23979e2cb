"""``splitserve calibrate`` (measure this engine's rates), ``splitserve layout`` (rank the layouts
of N GPUs for a workload and an SLO) and what ``up --num-prefill auto`` uses of them
(docs/deploy.md, "Choosing the layout")."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from splitserve.planner.layout import COLOCATED, Ranked, Workload, choose
from splitserve.runtime.slo import Slo, parse_bounds

WORKLOAD_SYNTAX = "rate=REQUESTS_PER_S,prompt=TOKENS,output=TOKENS (means)"


def parse_workload(text: str) -> Workload:
    """``rate=36,prompt=1152,output=128``: every key needed; ``ValueError`` saying the syntax."""
    try:
        fields = dict(part.split("=", 1) for part in text.split(",") if part.strip())
        values = {k.strip(): float(v) for k, v in fields.items()}
        if set(values) != {"rate", "prompt", "output"}:
            raise ValueError
        return Workload(values["rate"], values["prompt"], values["output"])
    except ValueError as exc:
        why = f": {exc}" if str(exc) else ""
        raise ValueError(f"--workload: give {WORKLOAD_SYNTAX}, got {text!r}{why}") from None


def parse_slo(text: str) -> Slo:
    """The router's ``--slo`` syntax; both targets needed for a layout."""
    bounds = parse_bounds(text, ("ttft", "tpot"))
    if set(bounds) != {"ttft", "tpot"}:
        raise ValueError(f"a layout needs both targets: --slo ttft=S,tpot=S, got {text!r}")
    return Slo(bounds["ttft"], bounds["tpot"])


def table(ranked: list[Ranked], work: Workload, slo: Slo) -> str:
    """The ranking as a table: each layout's capacity within the SLO and its figures at the
    workload's rate."""

    def ms(s: float) -> str:
        return "-" if math.isinf(s) else f"{s * 1000:.1f}"

    ttft_s, tpot_s = slo.both()
    lines = [
        f"layouts for {work.rate:g} req/s of {work.prompt_tokens:g} prompt + "
        f"{work.output_tokens:g} output tokens, SLO TTFT {ttft_s:g} s / TPOT "
        f"{tpot_s * 1000:g} ms (estimates, best first):",
        "| layout | GPUs | capacity req/s | at the rate: TTFT p90 ms | TPOT ms | meets |",
        "|---|---|---|---|---|---|",
    ]
    for r in ranked:
        e = r.at_rate
        lines.append(
            f"| {r.layout} | {r.layout.gpus} | {r.capacity:.1f} | {ms(e.ttft_p90_s)} | "
            f"{ms(e.tpot_s)} | {'yes' if e.meets(slo) else 'no'} |"
        )
    return "\n".join(lines)


def counts_of(best: Ranked) -> dict[str, int]:
    """``ClusterSpec`` fields for a chosen layout."""
    layout = best.layout
    if layout.kind == COLOCATED:
        return {"num_prefill": 0, "num_decode": layout.decode, "decode_tp": layout.decode_tp}
    return {
        "num_prefill": layout.prefill,
        "num_decode": layout.decode,
        "prefill_tp": layout.prefill_tp,
        "decode_tp": layout.decode_tp,
    }


def tp_sizes_of(rates) -> tuple[int, ...]:
    return tuple(sorted(n for n, _ in rates.tp_speedup))


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure this engine (prefill tokens/s, decode step times) for the layout search."""
    from splitserve.cli_tools import model_path
    from splitserve.planner.calibrate import calibrate
    from splitserve.runtime.config import NodeConfig

    try:
        batches = tuple(int(b) for b in args.batches.split(","))
        config = NodeConfig(
            model_path=model_path(args.model),
            device=args.device,
            dtype=args.dtype,
            kv_cache_mb=args.kv_cache_mb,
            max_num_seqs=args.max_num_seqs,
        )
        measured = calibrate(config, args.prompt_tokens, batches, args.steps)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = measured.to_json()
    if args.out:
        Path(args.out).write_text(text)
        print(f"rates written to {args.out}")
    print(text, end="")
    return 0


def cmd_layout(args: argparse.Namespace) -> int:
    """Rank the layouts of N GPUs (colocated or prefill:decode) for a workload and an SLO."""
    from splitserve.planner.calibrate import load_rates

    try:
        rates = load_rates(args.rates)
        work, slo = parse_workload(args.workload), parse_slo(args.slo)
        if args.gpus < 1:
            raise ValueError("--gpus: at least 1")
        ranked = choose(args.gpus, work, rates, slo, tp_sizes_of(rates))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(ranked, work, slo))
    return 0


def add_layout_inputs(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument(
        "--rates", required=required, help="a rates file of `splitserve calibrate` (JSON)"
    )
    p.add_argument("--workload", required=required, help=f"the expected load: {WORKLOAD_SYNTAX}")


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help=cmd_calibrate.__doc__)
    p.add_argument("--model", default=None, help="as the nodes' --model (default model: none)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default=None, help="float32, float16 or bfloat16")
    p.add_argument("--kv-cache-mb", type=int, default=1024, help="CPU KV cache (CUDA: sized)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length measured")
    p.add_argument("--batches", default="1,32,128,256", help="decode batch sizes measured")
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per batch size")
    p.add_argument("--out", default=None, help="write the rates there (JSON)")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("layout", help=cmd_layout.__doc__)
    add_layout_inputs(p, required=True)
    p.add_argument("--gpus", type=int, required=True, help="GPUs to lay out")
    p.add_argument("--slo", required=True, help="ttft=SECONDS,tpot=SECONDS")
    p.set_defaults(func=cmd_layout)


def auto_layout(args: argparse.Namespace, kwargs: dict, device: str) -> dict:
    """``up --num-prefill auto``: ``kwargs`` (``ClusterSpec``'s) with the counts and TP sizes of
    the best layout for ``--workload`` under ``--slo`` from ``--rates``, over the GPUs ``up``
    places nodes on (``--gpus``, else every visible one; on a CPU, ``--num-decode`` nodes). The
    ranking is printed. ``ValueError`` saying what is missing."""
    from splitserve.planner.calibrate import load_rates

    missing = [f for f, v in (("--rates", args.rates), ("--workload", args.workload)) if not v]
    if missing or not kwargs.get("slo"):
        missing += [] if kwargs.get("slo") else ["--slo"]
        raise ValueError(f"--num-prefill auto needs {', '.join(missing)} (docs/deploy.md)")
    rates = load_rates(args.rates)
    work, slo = parse_workload(args.workload), parse_slo(str(kwargs["slo"]))
    if device.startswith("cuda"):
        from splitserve.launcher import parse_gpus

        if kwargs.get("gpus"):
            units = len(parse_gpus(kwargs["gpus"]))
        else:
            import torch

            units = torch.cuda.device_count()
        what = "GPUs"
    else:
        units, what = int(kwargs.get("num_decode") or 1), "nodes (--num-decode, on a CPU)"
    if units < 1:
        raise ValueError("--num-prefill auto: no GPU to lay out")
    ranked = choose(units, work, rates, slo, tp_sizes_of(rates))
    print(f"--num-prefill auto over {units} {what}:", flush=True)
    print(table(ranked, work, slo), flush=True)
    best = ranked[0]
    if not best.at_rate.meets(slo):
        print(
            f"no layout meets the SLO at {work.rate:g} req/s; the one that holds the most: "
            f"{best.layout} ({best.capacity:.1f} req/s)",
            flush=True,
        )
    print(f"layout: {best.layout}", flush=True)
    return {**kwargs, **counts_of(best)}
