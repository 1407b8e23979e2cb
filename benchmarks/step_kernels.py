"""Where one decode step's and one prefill step's GPU time goes, kernel by kernel, and how the
layer GEMMs run at the row counts of those steps (cuBLAS against the Triton tilings).

    python benchmarks/step_kernels.py --make-8b /tmp/llama8b [--decode-batch 240]
        [--context-range 128 1152] [--prefill-tokens 8192] [--gemm-rows 240 256 8192]
        [--gemm] [--attention-sweep [--sweep-registers 0 128] [--sweep-fp8-dots fp16 bf16]
                                    [--sweep-fp8-v pairs bytes]]
        [--quantization fp8] [--kv-cache-dtype fp8]
        [--out FILE.json]

The model is built as a node builds it (``runtime.node.build_engine``, ``--load-format dummy``
for the 8B shape, CUDA graphs as configured). A decode step: ``--decode-batch`` sequences with
contexts uniform in ``--context-range`` (the 256-prompt workload's contexts while it decodes),
through ``ModelRunner.execute`` and the sampler (greedy), as the engine runs it. A prefill
step: prompts of 128-1024 tokens filling ``--prefill-tokens`` (the engine's 8,192-token steps).
Each is profiled over 5 repetitions with torch.profiler; kernels are grouped by what they do
(GEMM, attention, norm, rotary, activation, cache write, sampling, copies, other) and the table
gives ms per step and the share of the step. ``--gemm`` times each layer GEMM shape at each of
``--gemm-rows`` with cuBLAS; ``--attention-sweep`` the decode attention kernel's tilings, in KV
bytes read per second and as a share of a device copy of as many bytes (the memory floor).
``--quantization fp8`` / ``--kv-cache-dtype fp8``: the node options of the same names.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from splitserve.models.runner import SequenceInput
from splitserve.runtime.config import NodeConfig
from splitserve.runtime.node import build_engine

CATEGORIES = (
    ("attention", ("decode_kernel", "decode_reduce", "prefill_kernel", "flash", "attention")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "splitk")),
    ("norm", ("rms_norm",)),
    ("rotary", ("rotary",)),
    ("activation", ("silu",)),
    ("fp8 quantize", ("quantize",)),
    ("cache write", ("reshape_and_cache",)),
    ("sampling", ("argmax", "reduce_kernel", "softmax", "topk", "sort")),
    ("copies", ("memcpy", "memset", "copy", "fill", "index", "gather", "cat")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def profile(fn, reps: int = 5) -> tuple[dict[str, float], list[tuple[str, float, int]], float]:
    """Per-category GPU ms per call, the top kernels, and the wall ms per call (CUDA events)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    cats: dict[str, float] = defaultdict(float)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.device_time  # microseconds
        cats[category(ev.name)] += us / 1e3 / reps
        kernels[ev.name][0] += us / 1e3 / reps
        kernels[ev.name][1] += 1
    top = sorted(((n, t, int(c) // reps) for n, (t, c) in kernels.items()), key=lambda r: -r[1])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return dict(cats), top[:12], start.elapsed_time(end) / reps


def block_ids_for(lengths: list[int], block_size: int, num_blocks: int) -> list[list[int]]:
    tables, nxt = [], 1
    for n in lengths:
        need = -(-n // block_size)
        if nxt + need > num_blocks:
            raise SystemExit(f"the KV pool holds {num_blocks} blocks: fewer sequences or tokens")
        tables.append(list(range(nxt, nxt + need)))
        nxt += need
    return tables


def decode_step(engine, batch: int, lo: int, hi: int):
    runner, rng = engine.runner, random.Random(1)
    ctx = [rng.randint(lo, hi) for _ in range(batch)]
    tables = block_ids_for(ctx, runner.block_size, runner.num_blocks)
    seqs = [
        SequenceInput([rng.randrange(1000)], c - 1, t) for c, t in zip(ctx, tables, strict=True)
    ]

    def step() -> None:
        logits = runner.execute(seqs)
        logits.argmax(dim=-1)  # the greedy sampler's one kernel

    kv_bytes = sum(ctx) * runner.config.kv_bytes_per_token(runner.dtype)
    return step, {"batch": batch, "mean_context": sum(ctx) / batch, "kv_read_gb": kv_bytes / 1e9}


def prefill_step(engine, tokens: int):
    runner, rng = engine.runner, random.Random(2)
    lengths, total = [], 0
    while total < tokens:
        n = min(rng.randint(128, 1024), tokens - total)
        lengths.append(n)
        total += n
    tables = block_ids_for(lengths, runner.block_size, runner.num_blocks)
    seqs = [
        SequenceInput([rng.randrange(1000) for _ in range(n)], 0, t)
        for n, t in zip(lengths, tables, strict=True)
    ]
    cfg = runner.config
    params = sum(p.numel() for p in runner.model.parameters()) - cfg.vocab_size * cfg.hidden_size
    if runner.model.lm_head is None:
        params += cfg.vocab_size * cfg.hidden_size  # tied: the head is the embedding
    head = cfg.vocab_size * cfg.hidden_size
    flops = 2 * (params - head) * tokens + 2 * head * len(lengths)
    flops += sum(4 * n * n / 2 * cfg.q_size for n in lengths) * cfg.num_layers  # causal attention

    def step() -> None:
        logits = runner.execute(seqs)
        logits.argmax(dim=-1)

    return step, {"tokens": tokens, "sequences": len(lengths), "model_tflop": flops / 1e12}


def gemm_shapes(engine) -> list[tuple[str, int, int]]:
    cfg = engine.runner.config
    return [
        ("qkv_proj", cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size),
        ("o_proj", cfg.hidden_size, cfg.q_size),
        ("gate_up_proj", 2 * cfg.intermediate_size, cfg.hidden_size),
        ("down_proj", cfg.hidden_size, cfg.intermediate_size),
        ("lm_head", cfg.vocab_size, cfg.hidden_size),
    ]


def cuda_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def gemm_table(engine, rows: list[int]) -> list[dict]:
    """cuBLAS (``F.linear``) at each layer GEMM shape and row count: 20 calls between two CUDA
    events (GPU-bound; one call between events would time its launch instead)."""
    out = []
    dtype = engine.runner.dtype
    for name, n, k in gemm_shapes(engine):
        w = torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            ms = cuda_ms(lambda x=x, w=w: [F.linear(x, w) for _ in range(20)], reps=5) / 20
            row = {"gemm": name, "M": m, "N": n, "K": k, "us": round(ms * 1e3, 1)}
            row["tflops"] = round(2 * m * n * k / ms / 1e9)
            row["weight_tb_s"] = round(n * k * dtype.itemsize / ms / 1e9, 2)
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def attention_sweep(
    engine, batch: int, lo: int, hi: int, grid: list[list[int]], dots: list[str], v_reads: list[str]
) -> list[dict]:
    """The decode attention kernel of one layer at the decode step's shapes, per tiling
    (`grid`: block_n, warps, stages, register caps (0 for none) and programs per SM, which set
    the splits per sequence) and, on an e4m3 cache, per dot dtype and way of reading V
    (`FP8_V_PAIRS`): 20 calls between two CUDA events (GPU-bound), KV bytes read per second."""
    from splitserve.kernels import decode_attention
    from splitserve.kernels.decode_attention import (
        DecodeConfig,
        choose_num_splits,
        paged_decode_attention,
    )
    from splitserve.kernels.layout import layer_kv_views

    runner, rng = engine.runner, random.Random(1)
    ctx = [rng.randint(lo, hi) for _ in range(batch)]
    tables = block_ids_for(ctx, runner.block_size, runner.num_blocks)
    seqs = [SequenceInput([1], c - 1, t) for c, t in zip(ctx, tables, strict=True)]
    _, _, meta, _ = runner.prepare(seqs)
    cfg = runner.config
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim, device="cuda", dtype=runner.dtype)
    k_cache, v_cache = layer_kv_views(runner.kv_pool, 0)
    # As in a CUDA graph: the table as wide as the longest sequence allowed.
    table = torch.zeros((batch, runner.max_blocks_per_seq), dtype=torch.int32, device="cuda")
    table[:, : meta.block_table.shape[1]] = meta.block_table
    kv_bytes = sum(ctx) * cfg.num_kv_heads * cfg.head_dim * 2 * runner.kv_pool.element_size()
    fp8 = runner.kv_pool.dtype == torch.float8_e4m3fn
    scales = torch.ones(2, device="cuda") if fp8 else None
    # The floor: a device copy of as many bytes, its rate counting what it reads and writes.
    src = torch.empty(int(kv_bytes), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = cuda_ms(lambda s=src, d=dst: [d.copy_(s) for _ in range(20)], reps=5) / 20
    copy_tb_s = 2 * kv_bytes / (copy_ms / 1e3) / 1e12
    print(json.dumps({"copy_us": copy_ms * 1e3, "copy_tb_s": copy_tb_s}), flush=True)
    del src, dst
    rows = []
    tilings = list(itertools.product(*grid))
    v_pairs_default = decode_attention.FP8_V_PAIRS
    v_reads = v_reads or ["pairs" if v_pairs_default else "bytes"]  # none given: this process's
    variants = itertools.product(dots if fp8 else ["-"], v_reads if fp8 else ["-"], tilings)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    max_context = table.shape[1] * runner.block_size  # the launcher's bound, as in the engine
    for dot, v_read, (block_n, warps, stages, regs, per_sm) in variants:
        config = DecodeConfig(
            block_n=block_n,
            num_warps=warps,
            num_stages=stages,
            programs_per_sm=per_sm,
            max_registers=regs or None,
        )
        splits = choose_num_splits(batch, cfg.num_kv_heads, max_context, sms, config)
        decode_attention.FP8_DOTS_IN_FP16 = dot != "bf16"
        decode_attention.FP8_V_PAIRS = v_read != "bytes"

        def call(c=config) -> None:
            paged_decode_attention(
                q, k_cache, v_cache, table, meta.seq_lens, 0.088, validate=False,
                config=c, kv_scales=scales,
            )  # fmt: skip

        try:
            ms = cuda_ms(lambda: [call() for _ in range(20)], reps=5) / 20
        except Exception as exc:  # a tiling that does not fit
            print(f"decode attention {config}: {type(exc).__name__}", flush=True)
            continue
        tb_s = kv_bytes / ms / 1e9
        row = {"block_n": block_n, "warps": warps, "stages": stages, "max_registers": regs}
        row |= {"programs_per_sm": per_sm, "splits": splits}
        row |= {"dots": dot, "v": v_read, "us": ms * 1e3, "tb_s": tb_s, "of_copy": tb_s / copy_tb_s}
        print(json.dumps(row), flush=True)
        rows.append(row)
    decode_attention.FP8_DOTS_IN_FP16 = True
    decode_attention.FP8_V_PAIRS = v_pairs_default
    return rows


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--make-8b", metavar="DIR", required=True)
    ap.add_argument("--decode-batch", type=int, default=240)
    ap.add_argument("--context-range", type=int, nargs=2, default=[192, 1088])
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--gemm-rows", type=int, nargs="+", default=[240, 256, 8192])
    ap.add_argument("--gemm", action="store_true", help="the cuBLAS table of the layer GEMMs")
    ap.add_argument("--attention-sweep", action="store_true")
    ap.add_argument("--sweep-block-n", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--sweep-warps", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--sweep-stages", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument(
        "--sweep-registers", type=int, nargs="+", default=[0], help="register caps, 0: none"
    )
    ap.add_argument(
        "--sweep-programs-per-sm", type=int, nargs="+", default=[4],
        help="DecodeConfig.programs_per_sm: more than the batch's programs fill splits each "
        "sequence (shorter programs, a shorter tail, and a reduce kernel)",
    )  # fmt: skip
    ap.add_argument(
        "--sweep-fp8-dots", nargs="+", default=["fp16"], choices=["fp16", "bf16"],
        help="an e4m3 cache: the dtype of the dots (float16 is the default path)",
    )  # fmt: skip
    ap.add_argument(
        "--sweep-fp8-v", nargs="+", default=[], choices=["pairs", "bytes"],
        help="an e4m3 cache: V read as int16 pairs of head dims or byte by byte "
        "(default: the process's, SPLITSERVE_DECODE_FP8_V)",
    )  # fmt: skip
    ap.add_argument("--no-graphs", action="store_true", help="decode steps eager")
    ap.add_argument("--quantization", default=None, help="fp8: FP8 weights (quantized at load)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="fp8: an e4m3 KV cache")
    ap.add_argument("--out", help="write every figure here as JSON")
    return ap.parse_args()


def print_table(title: str, cats: dict[str, float], top, wall_ms: float) -> None:
    gpu = sum(cats.values())
    print(f"\n{title}: wall {wall_ms:.2f} ms/step (CUDA events), kernels {gpu:.2f} ms/step")
    print("| kernels | ms/step | share |")
    print("|---|---|---|")
    for cat, ms in sorted(cats.items(), key=lambda kv: -kv[1]):
        print(f"| {cat} | {ms:.3f} | {ms / gpu:.1%} |")
    print("| top kernels | ms/step | launches/step |")
    print("|---|---|---|")
    for name, ms, count in top:
        print(f"| `{name[:90]}` | {ms:.3f} | {count} |")


def main() -> None:
    args = parse_args()
    from pipeline import make_8b

    folder = make_8b(Path(args.make_8b))
    config = NodeConfig(
        model_path=str(folder),
        device="cuda",
        load_format="dummy",
        kv_transfer="none",
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine, _ = build_engine(config, prefill_only=False)
    if args.no_graphs:
        engine.runner.graphs = None
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    with torch.inference_mode():
        step, info = decode_step(engine, args.decode_batch, *args.context_range)
        cats, top, wall = profile(step)
        result["decode"] = {**info, "kernels_ms": cats, "top": top, "wall_ms": wall}
        print_table(f"decode step {info}", cats, top, wall)
        step, info = prefill_step(engine, args.prefill_tokens)
        cats, top, wall = profile(step, reps=3)
        gemm_ms = cats.get("gemm", 0.0)
        info["tflops_wall"] = info["model_tflop"] / (wall / 1e3)
        result["prefill"] = {**info, "kernels_ms": cats, "top": top, "wall_ms": wall}
        print_table(f"prefill step {info}", cats, top, wall)
        print(f"prefill: {info['tflops_wall']:.0f} TFLOP/s over the step, GEMMs {gemm_ms:.1f} ms")
        if args.gemm:
            result["gemm"] = gemm_table(engine, args.gemm_rows)
            print("\n| GEMM | M | N | K | µs | TFLOP/s | weights TB/s |")
            print("|---|---|---|---|---|---|---|")
            for r in result["gemm"]:
                print(
                    f"| {r['gemm']} | {r['M']} | {r['N']} | {r['K']} | {r['us']} | "
                    f"{r['tflops']} | {r['weight_tb_s']} |"
                )
        if args.attention_sweep:
            result["attention"] = attention_sweep(
                engine,
                args.decode_batch,
                args.context_range[0],
                args.context_range[1],
                [
                    args.sweep_block_n,
                    args.sweep_warps,
                    args.sweep_stages,
                    args.sweep_registers,
                    args.sweep_programs_per_sm,
                ],
                args.sweep_fp8_dots,
                args.sweep_fp8_v,
            )
            print("\n| decode attention (one layer) | dots | V read | µs | KV TB/s | of copy |")
            print("|---|---|---|---|---|---|")
            for r in sorted(result["attention"], key=lambda r: r["us"])[:16]:
                regs = f", {r['max_registers']} registers" if r["max_registers"] else ""
                regs += f", {r['splits']} splits" if r["splits"] > 1 else ""
                print(
                    f"| block_n {r['block_n']}, {r['warps']} warps, {r['stages']} stages{regs} | "
                    f"{r['dots']} | {r['v']} | {r['us']:.1f} | {r['tb_s']:.2f} | "
                    f"{r['of_copy']:.0%} |"
                )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
