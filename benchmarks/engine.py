"""The in-process engine on a serving workload, and where a step's time goes.

    python benchmarks/engine.py --device cuda --make-8b /tmp/llama8b [--requests 256]
        [--prompt-range 128 1024] [--gen 128] [--repeats 2]
    python benchmarks/engine.py --device cpu --tiny --requests 8 --prompt-range 16 64 --gen 8
    python benchmarks/engine.py --device cuda --make-8b /tmp/llama8b --quantization fp8 \
        [--kv-cache-dtype fp8] [--kv-host-cache-mb 0]

The engine is built as a decode node builds it (``runtime.node.build_engine``: the real loader,
``--load-format dummy`` for the 8B shape, prefix caching on). Requests: the prompts of
``benchmarks/pipeline.py`` (random token ids, lengths uniform in ``--prompt-range``, seed 0),
``--gen`` tokens each (greedy, ignore_eos), all added at once, then stepped to the end.

Per run: output tok/s, steps, and a profile of the steps (``engine/step_profile.py``) split into
those that computed prompt tokens ("prefill", chunks mixed with decodes) and decode-only ones:
wall ms per step, the GPU time of the forward and sampling, the GPU's idle time between them
(wall - GPU: what overlapping the CPU's step work with the GPU can win back), and the CPU time of
schedule, input preparation, the forward's launch, sampling and the rest. A node records the
same profile with ``SPLITSERVE_STEP_PROFILE=FILE`` (docs/benchmarks.md, "A node's steps
against the engine's: step_compare.py", compares the two).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from step_kernels import CATEGORIES

from splitserve.engine.step_profile import PHASES, StepProfile
from splitserve.models.sampling_params import SamplingParams
from splitserve.runtime.config import NodeConfig
from splitserve.runtime.node import build_engine


class PhaseKernels:
    """``--kernel-profile``: torch.profiler over the steps that carry prompt tokens, then over
    the decode-only ones; per phase the kernels' GPU time by kind (step_kernels.CATEGORIES) and
    the CUDA runtime calls that block the stepping thread (syncs, allocations, pageable copies)."""

    def __init__(self) -> None:
        self.phases: dict[str, dict] = {}
        self._prof = None
        self._kind = None
        self._t0 = 0.0

    def enter(self, kind: str) -> None:
        if kind == self._kind:
            return
        self.close()
        from torch.profiler import ProfilerActivity, profile

        self._kind, self._t0 = kind, time.perf_counter()
        self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self._prof.start()

    def close(self) -> None:
        if self._prof is None:
            return
        from step_kernels import category

        torch.cuda.synchronize()
        wall = time.perf_counter() - self._t0
        self._prof.stop()
        cats: dict[str, float] = {}
        runtime: dict[str, list] = {}
        busy = 0.0
        for ev in self._prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                ms = ev.device_time / 1e3
                busy += ms
                cats[category(ev.name)] = cats.get(category(ev.name), 0.0) + ms
            elif ev.name.startswith("cuda") and ev.cpu_time_total > 0:
                entry = runtime.setdefault(ev.name, [0.0, 0])
                entry[0] += ev.cpu_time_total / 1e3
                entry[1] += 1
        top = sorted(runtime.items(), key=lambda kv: -kv[1][0])[:8]
        self.phases[self._kind] = {
            "wall_ms": wall * 1e3,
            "kernel_ms": busy,
            "kernels_ms": cats,
            "runtime_calls_ms": {k: [round(v[0], 2), v[1]] for k, v in top},
        }
        self._prof, self._kind = None, None


def run(
    engine,
    prompts,
    gen: int,
    tag: str,
    kernels: PhaseKernels | None = None,
    dump: str | None = None,
) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    profile = StepProfile(engine)
    if profile.cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    # A cache salt per run: no run finds an earlier run's prompts in the prefix cache.
    reqs = [engine.add_request(f"{tag}-{i}", p, params, tag) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        if kernels is not None:
            prompt_left = any(
                r.num_computed_tokens < len(r.prompt_token_ids)
                for r in (*engine.scheduler.running, *engine.scheduler.waiting)
            )
            kernels.enter("prefill" if prompt_left else "decode")
        profile.step()
    if kernels is not None:
        kernels.close()
    if profile.cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    produced = sum(len(r.output_token_ids) for r in reqs)
    assert produced == gen * len(prompts), (produced, gen * len(prompts))
    if dump:
        profile.dump(dump)  # every step's row: benchmarks/step_compare.py reads it
    return {
        "run": tag,
        "output_tok_s": produced / wall,
        "wall_s": wall,
        "steps": len(profile.rows),
        "profile": profile.table(),
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a checkpoint folder")
    src.add_argument("--make-8b", metavar="DIR", help="write the Llama-3-8B shape here (dummy)")
    src.add_argument("--tiny", action="store_true", help="the embedded random test model")
    src.add_argument("--make-70b", metavar="DIR", help="write the Llama-3-70B shape here (dummy)")
    ap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks of the engine (GPUs from --device's on; gloo ranks on the CPU)",
    )
    ap.add_argument(
        "--quantization",
        choices=["fp8"],
        default=None,
        help="the node's --quantization (fp8: the linear layers in FP8, quantized at load)",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="the node's --kv-cache-dtype (fp8: the KV cache in e4m3)",
    )
    ap.add_argument(
        "--kv-host-cache-mb",
        type=int,
        default=None,
        help="the node's --kv-host-cache-mb (default: the node's, a quarter of available memory; "
        "0: no host tier)",
    )
    ap.add_argument(
        "--kv-host-prepin",
        action="store_true",
        help="take the host tier's whole memory before the runs (a GPU node does at start)",
    )
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[128, 1024])
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--kernel-profile",
        action="store_true",
        help="one more run under torch.profiler: kernel time by kind, per phase (not timed)",
    )
    ap.add_argument(
        "--profile-json",
        metavar="PATH",
        help="write each run's step rows to PATH.rN.json (for benchmarks/step_compare.py)",
    )
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    load_format = "auto"
    if args.make_8b:
        from pipeline import make_8b

        model = make_8b(Path(args.make_8b))
        load_format = "dummy"
    elif args.make_70b:
        from shapes import llama3_70b_config

        from splitserve.models.tiny import build_byte_tokenizer

        model = Path(args.make_70b)
        model.mkdir(parents=True, exist_ok=True)
        llama3_70b_config(bos_token_id=256, eos_token_id=257).save_pretrained(model)
        build_byte_tokenizer().save_pretrained(model)
        load_format = "dummy"
    elif args.tiny:
        from splitserve.models.tiny import write_random_checkpoint

        model = write_random_checkpoint(Path(tempfile.mkdtemp()) / "tiny", with_tokenizer=False)
    else:
        model = Path(args.model)
    config = NodeConfig(
        model_path=str(model),
        device=args.device,
        load_format=load_format,
        kv_transfer="none",
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_host_cache_mb=args.kv_host_cache_mb,
    )
    engine, _ = build_engine(config, prefill_only=False)
    if args.kv_host_prepin and engine.host_tier is not None:
        seconds = engine.host_tier.reserve_memory()
        print(
            f"host tier: {engine.host_tier.stats().bytes_allocated / 2**30:.1f} GiB taken "
            f"in {seconds:.1f} s",
            flush=True,
        )
    lo, hi = args.prompt_range
    rng = random.Random(0)
    vocab = min(250, engine.runner.config.vocab_size)
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(args.requests)
    ]
    # Warm-up: every kernel variant and CUDA graph is compiled at start; this runs the sampler
    # and the Python paths once.
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.generate([p[:64] for p in prompts[:8]], warm)

    rows = []
    for rep in range(args.repeats):
        dump = f"{args.profile_json}.r{rep}.json" if args.profile_json else None
        row = run(engine, prompts, args.gen, f"r{rep}", dump=dump)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("\n| run | output tok/s | wall s | steps |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['output_tok_s']:,.0f} | {r['wall_s']:.2f} | {r['steps']} |")
    keys = [
        "count",
        "seqs",
        "wall_ms",
        "gpu_ms",
        "gpu_idle_ms",
        *(f"{p}_ms" for p in PHASES),
        "total_s",
    ]
    print("\n| run | steps | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for r in rows:
        for line in r["profile"]:
            cells = [
                "-"
                if line[k] is None
                else (f"{line[k]:.2f}" if isinstance(line[k], float) else str(line[k]))
                for k in keys
            ]
            print(f"| {r['run']} | {line['steps']} | " + " | ".join(cells) + " |")
    if args.kernel_profile and args.device.startswith("cuda"):
        kernels = PhaseKernels()
        run(engine, prompts, args.gen, "profiled", kernels)
        print(json.dumps(kernels.phases), flush=True)
        print(
            "\n| phase (profiled run) | wall ms | kernels ms | GPU busy | "
            + " | ".join(c for c, _ in CATEGORIES)
            + " | other |"
        )
        print("|---|---|---|---|" + "---|" * (len(CATEGORIES) + 1))
        for kind, ph in kernels.phases.items():
            cells = [f"{ph['kernels_ms'].get(c, 0.0):.1f}" for c, _ in (*CATEGORIES, ("other", 0))]
            print(
                f"| {kind} | {ph['wall_ms']:.0f} | {ph['kernel_ms']:.0f} | "
                f"{ph['kernel_ms'] / ph['wall_ms']:.1%} | " + " | ".join(cells) + " |"
            )
        for kind, ph in kernels.phases.items():
            print(f"{kind}: CUDA runtime calls (ms, count): {ph['runtime_calls_ms']}")
    engine.runner.close()  # a tensor-parallel engine's other ranks stop


if __name__ == "__main__":
    main()
