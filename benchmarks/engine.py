"""The in-process engine on a serving workload, and where a step's time goes.

    python benchmarks/engine.py --device cuda --make-8b /tmp/llama8b [--requests 256]
        [--prompt-range 128 1024] [--gen 128] [--repeats 2] [--async-scheduling on off]
    python benchmarks/engine.py --device cpu --tiny --requests 8 --prompt-range 16 64 --gen 8

The engine is built as a decode node builds it (``runtime.node.build_engine``: the real loader,
``--load-format dummy`` for the 8B shape, prefix caching on). Requests: the prompts of
``benchmarks/pipeline.py`` (random token ids, lengths uniform in ``--prompt-range``, seed 0),
``--gen`` tokens each (greedy, ignore_eos), all added at once, then stepped to the end.

Per run: output tok/s, steps, and a profile of the steps split into those that computed prompt
tokens ("prefill", chunks mixed with decodes) and decode-only ones: wall ms per step, the GPU
time of the forward and sampling (CUDA events around them, so launch gaps inside a forward
count as busy), the GPU's idle time between them (wall - GPU: what overlapping the CPU's step
work with the GPU can win back), and the CPU time of schedule, input preparation, the forward's
launch, sampling and the rest (bookkeeping, stop checks). ``--async-scheduling on off`` runs
both modes on one engine, alternately.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from splitserve.models.sampling_params import SamplingParams
from splitserve.runtime.config import NodeConfig
from splitserve.runtime.node import build_engine

PHASES = ("schedule", "prepare", "launch", "sample", "other")


class StepProfile:
    """Wraps one engine's scheduler, runner and sampler to time every step's phases."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.cuda = engine.runner.device.type == "cuda"
        self.rows: list[dict] = []
        self._cur: dict = {}
        self._events: list[tuple] = []
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.runner, "prepare", "prepare")
        self._wrap(engine.runner, "execute", "execute", start_event=True)
        self._wrap(engine.sampler, "sample", "sample", end_event=True)

    def _wrap(self, obj, name: str, phase: str, start_event=False, end_event=False) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            if start_event and self.cuda:
                self._cur["ev0"] = torch.cuda.Event(enable_timing=True)
                self._cur["ev0"].record()
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._cur[phase] = self._cur.get(phase, 0.0) + time.perf_counter() - t0
                if end_event and self.cuda and "ev0" in self._cur:
                    ev1 = torch.cuda.Event(enable_timing=True)
                    ev1.record()
                    self._events.append((len(self.rows), self._cur.pop("ev0"), ev1))

        setattr(obj, name, timed)

    def step(self):
        engine = self.engine
        prefill = any(
            r.num_computed_tokens < len(r.prompt_token_ids)
            for r in (*engine.scheduler.running, *engine.scheduler.waiting)
        )
        self._cur = {}
        t0 = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - t0
        cur = self._cur
        row = {"wall": wall, "prefill": prefill, "gpu": 0.0}
        row["schedule"] = cur.get("schedule", 0.0)
        row["prepare"] = cur.get("prepare", 0.0)
        row["launch"] = cur.get("execute", 0.0) - row["prepare"]
        row["sample"] = cur.get("sample", 0.0)
        row["other"] = wall - sum(row[p] for p in PHASES[:-1])
        self.rows.append(row)
        return outputs

    def table(self) -> list[dict]:
        if self.cuda:
            torch.cuda.synchronize()
            for i, ev0, ev1 in self._events:
                self.rows[i]["gpu"] += ev0.elapsed_time(ev1) / 1e3
        out = []
        for kind in ("prefill", "decode"):
            rows = [r for r in self.rows if r["prefill"] == (kind == "prefill")]
            if not rows:
                continue
            n = len(rows)
            line = {"steps": kind, "count": n}
            for key in ("wall", "gpu"):
                line[f"{key}_ms"] = 1e3 * sum(r[key] for r in rows) / n
            line["gpu_idle_ms"] = line["wall_ms"] - line["gpu_ms"] if self.cuda else None
            for p in PHASES:
                line[f"{p}_ms"] = 1e3 * sum(r[p] for r in rows) / n
            line["total_s"] = sum(r["wall"] for r in rows)
            out.append(line)
        return out


def run(engine, prompts, gen: int, tag: str) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    profile = StepProfile(engine)
    if profile.cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    # A cache salt per run: no run finds an earlier run's prompts in the prefix cache.
    reqs = [engine.add_request(f"{tag}-{i}", p, params, tag) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        profile.step()
    if profile.cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    produced = sum(len(r.output_token_ids) for r in reqs)
    assert produced == gen * len(prompts), (produced, gen * len(prompts))
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
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[128, 1024])
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--async-scheduling",
        nargs="+",
        choices=("on", "off"),
        default=["on"],
        help="engine modes to run, in turn, per repeat",
    )
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    load_format = "auto"
    if args.make_8b:
        from pipeline import make_8b

        model = make_8b(Path(args.make_8b))
        load_format = "dummy"
    elif args.tiny:
        from splitserve.models.tiny import write_random_checkpoint

        model = write_random_checkpoint(Path(tempfile.mkdtemp()) / "tiny", with_tokenizer=False)
    else:
        model = Path(args.model)
    config = NodeConfig(
        model_path=str(model), device=args.device, load_format=load_format, kv_transfer="none"
    )
    engine, _ = build_engine(config, prefill_only=False)
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
        for mode in args.async_scheduling:
            engine.async_scheduling = mode == "on"
            tag = f"r{rep}-async-{mode}"
            row = run(engine, prompts, args.gen, tag)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| run | output tok/s | wall s | steps |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['output_tok_s']:,.0f} | {r['wall_s']:.2f} | {r['steps']} |")
    keys = ["count", "wall_ms", "gpu_ms", "gpu_idle_ms", *(f"{p}_ms" for p in PHASES), "total_s"]
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


if __name__ == "__main__":
    main()
