"""Benchmark of the paged KV kernels on one CUDA GPU against torch SDPA on contiguous KV.

    python benchmarks/attention_kernels.py [--json] [--sweep {decode,prefill,splits} ...]
    python benchmarks/attention_kernels.py --wide-only

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128), bf16, block_size 16,
KV in a 2-layer block-major pool (strided per-layer views) with shuffled block tables.
Decode: KV bytes read per second, ratio to SDPA (enable_gqa) on the same KV laid out
contiguously; `decode wide`: the same through a block table 32,768 tokens wide, as a CUDA graph
holds it. Prefill (causal, one sequence, no cached prefix): TFLOP/s counting
4 * L^2 * heads * head_dim / 2, ratio to SDPA causal; `prefill mix`: one step of fresh prompts
of 128-1,024 tokens (8,192 in all, as in the engine benchmark's prompt steps) against SDPA called
once per prompt (the same work, graphed). Our kernels are timed as CUDA graph
replays (the launchers' table checks need a host sync and are skipped during capture, as in a
serving step); `eager` also shows a plain call including those checks, `eag-nv` one with
validate=False (launch overhead only). `default` rows use the
launchers' own choices (split count, prefill tiling by length). Times are medians of
triton.testing.do_bench, which flushes L2 before each run. Every shape also checks our output
against SDPA's (relative L2 error).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import kernels_report as report
import torch
import torch.nn.functional as F
import triton
from kernels_setup import (
    DTYPE,
    HKV,
    HQ,
    SCALE,
    D,
    bench,
    graphed,
    paged_copy,
    paged_mix,
    rel_err,
)

from splitserve.kernels.decode_attention import DecodeConfig, paged_decode_attention
from splitserve.kernels.prefill_attention import PrefillConfig, paged_prefill_attention

DECODE_SHAPES = [(1, 32768), (16, 4096), (64, 4096), (256, 1024), (64, 16384)]
# `decode wide`: a block table as wide as a CUDA graph's (the longest context allowed,
# WIDE_TOKENS), the rest of each row the null block, with the launcher's own split count.
WIDE_SHAPES = [(1, 1024), (1, 4096), (8, 2048), (16, 1024), (64, 1024)]
WIDE_TOKENS = 32768
PREFILL_LENS = [2048, 8192]
# A prompt step of the engine benchmark's workload (W): fresh prompts of 128-1,024 tokens, as
# many as fit the step's 8,192 tokens (seeded, so every run and variant sees the same mix).
MIX_RANGE, MIX_TOKENS, MIX_SEED = (128, 1024), 8192, 0
# Measured 2026-11-29 on the same H200 (/work/shared/anchors): SDPA, contiguous KV.
ANCHOR_DECODE_TBPS = {
    (1, 32768): 2.31,
    (16, 4096): 2.89,
    (64, 4096): 3.84,
    (256, 1024): 3.63,
    (64, 16384): 4.34,
}
ANCHOR_PREFILL_TFLOPS = {2048: 302.0, 8192: 549.0}
DECODE_VARIANTS = {
    "n128": DecodeConfig(block_n=128),
    "n32_s4": DecodeConfig(block_n=32, num_stages=4),
    "n64_s2": DecodeConfig(block_n=64, num_stages=2),
    "n64_s4": DecodeConfig(block_n=64, num_stages=4),
}
PREFILL_VARIANTS = {
    "m128_n128_w8_s3": PrefillConfig(128, 128, 8, 3),
    "m64_n64_w4_s3": PrefillConfig(64, 64, 4, 3),
    "m256_n64_w8_s3": PrefillConfig(256, 64, 8, 3),
    "m256_n64_w8_s4": PrefillConfig(256, 64, 8, 4),
    "m256_n128_w8_s2": PrefillConfig(256, 128, 8, 2),
    "m256_n64_w16_s3": PrefillConfig(256, 64, 16, 3),
    "m128_n64_w4_s4": PrefillConfig(128, 64, 4, 4),
    # Triton 3.6 compiles 3 and 4 stages of this kernel alike: two K/V buffers and a wait for
    # every copy in flight at the top of each key step (no prefetch past the PV dot); 5 stages
    # give three buffers and a real prefetch (docs/kernels.md; measured:
    # docs/benchmarks-history.md, "V read as 16-bit pairs and a 5-stage prefill tile, measured:
    # one H100 (2026-12-05, night)").
    "m256_n64_w8_s5": PrefillConfig(256, 64, 8, 5),
    "m256_n64_w16_s5": PrefillConfig(256, 64, 16, 5),
    "m128_n128_w8_s5": PrefillConfig(128, 128, 8, 5),
    "m128_n64_w8_s5": PrefillConfig(128, 64, 8, 5),
    "m64_n64_w4_s5": PrefillConfig(64, 64, 4, 5),
}
# `--sweep splits` times explicit split counts with the default tiling on these shapes.
SPLIT_SWEEP_SHAPES = [*DECODE_SHAPES, (4, 8192), (8, 2048), (32, 2048), (2, 131072), (128, 512)]
SPLIT_SWEEP = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64]


def run_decode(variants: dict[str, DecodeConfig | None], eager: bool, emit) -> None:
    for batch, ctx in DECODE_SHAPES:
        pool, kc, vc, table, seq_lens, k, v = paged_copy(batch, ctx)
        q = torch.randn(batch, HQ, D, dtype=DTYPE, device="cuda")
        kv_bytes = 2 * batch * ctx * HKV * D * DTYPE.itemsize
        want = F.scaled_dot_product_attention(q[:, :, None], k, v, scale=SCALE, enable_gqa=True)[
            :, :, 0
        ]
        sdpa_ms = bench(
            lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                q[:, :, None], k, v, scale=SCALE, enable_gqa=True
            )
        )
        del k, v
        sdpa = kv_bytes / sdpa_ms / 1e9
        for name, config in variants.items():
            out = torch.empty_like(q)

            def call(config=config, out=out, q=q, kc=kc, vc=vc, table=table, seq_lens=seq_lens):
                kwargs = {} if config is None else {"config": config}
                paged_decode_attention(q, kc, vc, table, seq_lens, SCALE, out=out, **kwargs)

            call()
            err = rel_err(out, want)
            ms = bench(graphed(call))
            eager_ms = bench(call) if eager and config is None else float("nan")

            def call_nv(out=out, q=q, kc=kc, vc=vc, table=table, seq_lens=seq_lens):
                paged_decode_attention(q, kc, vc, table, seq_lens, SCALE, out=out, validate=False)

            eager_nv_ms = bench(call_nv) if eager and config is None else float("nan")
            tbps = kv_bytes / ms / 1e9
            emit(
                kind="decode",
                variant=name,
                batch=batch,
                ctx=ctx,
                ms=ms,
                TBps=tbps,
                sdpa_TBps=sdpa,
                ratio=tbps / sdpa,
                anchor_ratio=tbps / ANCHOR_DECODE_TBPS[(batch, ctx)],
                eager_TBps=kv_bytes / eager_ms / 1e9,
                eager_novalidate_TBps=kv_bytes / eager_nv_ms / 1e9,
                rel_err=err,
            )
        del pool, kc, vc
        torch.cuda.empty_cache()


def run_decode_wide(emit) -> None:
    """Decode through a table as wide as a CUDA graph's: the splits the launcher picks from
    that width must still spread each short context over several programs."""
    for batch, ctx in WIDE_SHAPES:
        pool, kc, vc, table, seq_lens, k, v = paged_copy(batch, ctx)
        wide = torch.zeros((batch, WIDE_TOKENS // kc.shape[1]), dtype=table.dtype, device="cuda")
        wide[:, : table.shape[1]] = table
        q = torch.randn(batch, HQ, D, dtype=DTYPE, device="cuda")
        want = F.scaled_dot_product_attention(q[:, :, None], k, v, scale=SCALE, enable_gqa=True)
        del k, v
        out = torch.empty_like(q)

        def call(out=out, q=q, kc=kc, vc=vc, wide=wide, seq_lens=seq_lens):
            paged_decode_attention(q, kc, vc, wide, seq_lens, SCALE, out=out)

        call()
        ms = bench(graphed(call))
        kv_bytes = 2 * batch * ctx * HKV * D * DTYPE.itemsize
        emit(
            kind="decode_wide",
            batch=batch,
            ctx=ctx,
            table_tokens=WIDE_TOKENS,
            ms=ms,
            TBps=kv_bytes / ms / 1e9,
            rel_err=rel_err(out, want[:, :, 0]),
        )
        del pool, kc, vc
        torch.cuda.empty_cache()


def run_split_sweep(emit) -> None:
    for batch, ctx in SPLIT_SWEEP_SHAPES:
        pool, kc, vc, table, seq_lens, _, _ = paged_copy(batch, ctx, contiguous=False)
        q = torch.randn(batch, HQ, D, dtype=DTYPE, device="cuda")
        out = torch.empty_like(q)
        kv_bytes = 2 * batch * ctx * HKV * D * DTYPE.itemsize
        for splits in SPLIT_SWEEP:

            def call(splits=splits, out=out, q=q, kc=kc, vc=vc, table=table, seq_lens=seq_lens):
                paged_decode_attention(
                    q, kc, vc, table, seq_lens, SCALE, out=out, num_splits=splits
                )

            call()
            ms = bench(graphed(call))
            emit(
                kind="splits", batch=batch, ctx=ctx, splits=splits, ms=ms, TBps=kv_bytes / ms / 1e9
            )
        del pool, kc, vc
        torch.cuda.empty_cache()


def prefill_call(q, kc, vc, table, cu, seq_lens, length, config, out):
    """Our prefill of one sequence of ``length`` tokens into ``out`` (for timing)."""

    def call():
        paged_prefill_attention(
            q, kc, vc, table, cu, seq_lens, SCALE, out=out, max_query_len=length, config=config
        )

    return call


def sdpa_prefill_out(q, k, v):
    """SDPA causal of one sequence's queries ([L, Hq, D]) over its contiguous K/V."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k, v, is_causal=True, scale=SCALE, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def time_prefill(call, out, want, flops: float, sdpa_tflops: float) -> dict:
    """One tiling's row: its graphed median time, TFLOP/s, ratio to SDPA and error against
    ``want``; or the error of a tiling that does not fit this GPU (shared memory)."""
    try:
        call()
    except Exception as ex:
        return {"error": repr(ex)[:200]}
    ms = bench(graphed(call))
    tflops = flops / ms / 1e9
    return {"ms": ms, "TFLOPs": tflops, "sdpa_TFLOPs": sdpa_tflops,
            "ratio": tflops / sdpa_tflops, "rel_err": rel_err(out, want)}  # fmt: skip


def sdpa_prefill(q, k, v):
    """SDPA causal on the contiguous copy: its output ([L, Hq, D]) and its median ms."""
    return sdpa_prefill_out(q, k, v), bench(lambda: sdpa_prefill_out(q, k, v))


def run_prefill(variants: dict[str, PrefillConfig | None], emit) -> None:
    for length in PREFILL_LENS:
        pool, kc, vc, table, seq_lens, k, v = paged_copy(1, length)
        q = torch.randn(length, HQ, D, dtype=DTYPE, device="cuda")
        cu = torch.tensor([0, length], dtype=torch.int32, device="cuda")
        flops = 4 * length * length * HQ * D / 2
        want, sdpa_ms = sdpa_prefill(q, k, v)
        sdpa = flops / sdpa_ms / 1e9
        for name, config in variants.items():
            out = torch.empty_like(q)
            call = prefill_call(q, kc, vc, table, cu, seq_lens, length, config, out)
            row = time_prefill(call, out, want, flops, sdpa)
            if "TFLOPs" in row:
                row["anchor_ratio"] = row["TFLOPs"] / ANCHOR_PREFILL_TFLOPS[length]
            emit(kind="prefill", variant=name, L=length, **row)
        del pool, kc, vc, k, v
        torch.cuda.empty_cache()


def mix_lengths() -> list[int]:
    """Prompt lengths drawn from MIX_RANGE until the next would pass MIX_TOKENS."""
    gen = torch.Generator().manual_seed(MIX_SEED)
    lengths: list[int] = []
    while True:
        n = int(torch.randint(MIX_RANGE[0], MIX_RANGE[1] + 1, (1,), generator=gen))
        if sum(lengths) + n > MIX_TOKENS:
            return lengths
        lengths.append(n)


def run_prefill_mix(variants: dict[str, PrefillConfig | None], emit) -> None:
    lengths = mix_lengths()
    pool, kc, vc, table, seq_lens, contiguous = paged_mix(lengths)
    total = sum(lengths)
    q = torch.randn(total, HQ, D, dtype=DTYPE, device="cuda")
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    flops = sum(4 * n * n * HQ * D / 2 for n in lengths)
    pieces = [
        (q[a:b], k, v)
        for (a, b), (k, v) in zip(itertools.pairwise(bounds), contiguous, strict=True)
    ]
    want = torch.cat([sdpa_prefill_out(*piece) for piece in pieces])

    def sdpa_all():
        for piece in pieces:
            sdpa_prefill_out(*piece)

    sdpa_all()
    sdpa = flops / bench(graphed(sdpa_all)) / 1e9
    for name, config in variants.items():
        out = torch.empty_like(q)
        call = prefill_call(q, kc, vc, table, cu, seq_lens, max(lengths), config, out)
        row = time_prefill(call, out, want, flops, sdpa)
        emit(kind="prefill_mix", variant=name, L=total, prompts=len(lengths), **row)
    del pool, kc, vc, contiguous
    torch.cuda.empty_cache()


def run_once() -> None:
    pool, kc, vc, table, seq_lens, _, _ = paged_copy(64, 4096, contiguous=False)
    q = torch.randn(64, HQ, D, dtype=DTYPE, device="cuda")
    paged_decode_attention(q, kc, vc, table, seq_lens, SCALE)
    del pool, kc, vc
    _pool, kc, vc, table, seq_lens, _, _ = paged_copy(1, 8192, contiguous=False)
    q = torch.randn(8192, HQ, D, dtype=DTYPE, device="cuda")
    cu = torch.tensor([0, 8192], dtype=torch.int32, device="cuda")
    paged_prefill_attention(q, kc, vc, table, cu, seq_lens, SCALE)
    torch.cuda.synchronize()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="also print one JSON line per row")
    parser.add_argument(
        "--sweep",
        nargs="*",
        default=[],
        choices=["decode", "prefill", "splits"],
        help="also time the tiling variants / explicit split counts",
    )
    parser.add_argument(
        "--wide-only",
        action="store_true",
        help="time only the decode rows through a CUDA graph's full-width table",
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="run decode (64, 4096) and prefill 8192 once each, untimed "
        "(for a profiler: ncu --clock-control none ... --once)",
    )
    return parser.parse_args()


def measure(sweeps: list[str], emit, wide_only: bool = False) -> None:
    """Emit the env row, then every row of the default runs and the requested sweeps (only the
    wide-table decode rows with `wide_only`)."""
    props = torch.cuda.get_device_properties(0)
    emit(
        kind="env",
        gpu=props.name,
        sms=props.multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
    )
    if wide_only:
        run_decode_wide(emit)
        return
    decode = {"default": None}
    prefill = {"default": None}
    if "decode" in sweeps:
        decode.update(DECODE_VARIANTS)
    if "prefill" in sweeps:
        prefill.update(PREFILL_VARIANTS)
    run_decode(decode, eager=True, emit=emit)
    run_prefill(prefill, emit)
    run_prefill_mix(prefill, emit)
    run_decode_wide(emit)
    if "splits" in sweeps:
        run_split_sweep(emit)


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention_kernels.py needs a CUDA GPU")
    if args.once:
        run_once()
        return
    rows: list[dict] = []

    def emit(**row):
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)

    measure(args.sweep, emit, args.wide_only)
    report.print_env(rows[0])
    report.print_decode(rows)
    report.print_decode_wide(rows)
    report.print_prefill(rows)
    report.print_prefill_mix(rows)
    report.print_split_sweep(rows, SPLIT_SWEEP_SHAPES, SPLIT_SWEEP)


if __name__ == "__main__":
    main()
