"""What quantization costs in accuracy: perplexity on a shipped public-domain text and greedy
agreement on chat questions, each variant against the unquantized model, through the engine's own
model code (paged KV, the same kernels and GEMMs a node runs).

    python benchmarks/accuracy.py --variants none,fp8,kv-fp8,fp8+kv-fp8   # CPU: float32
    python benchmarks/accuracy.py --device cuda --dtype bfloat16    # a GPU with FP8: _scaled_mm

The text is tests/unit/data/alice29.txt (Lewis Carroll, Alice's Adventures in Wonderland, public
domain; ~39k tokens with SmolLM2's tokenizer), cut into windows of --window tokens, each computed
from an empty cache; the perplexity is exp of the mean next-token negative log-likelihood over
every window's tokens but its first. The questions are examples/quickstart.py's (the main job's)
and benchmarks/real_model.py's, through the tokenizer's chat template, --max-new greedy tokens
each. Prints a table; --json writes the figures. --kv-scales runs each FP8-KV variant once per
per-tensor scale (row ``kv-fp8@0.75``): the spread between them is what the rounding alone moves.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from splitserve.engine.core import LLMEngine
from splitserve.kvstore import ModelIdentity
from splitserve.models.embedded import resolve_model_path
from splitserve.models.loader import load_model
from splitserve.models.runner import ModelRunner, RunnerConfig, SequenceInput
from splitserve.models.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "unit" / "data" / "alice29.txt"
# name → (--quantization, --kv-cache-dtype); the first variant run is the baseline of the others.
VARIANTS = {
    "none": (None, "auto"),
    "fp8": ("fp8", "auto"),
    "kv-fp8": (None, "fp8"),
    "fp8+kv-fp8": ("fp8", "fp8"),
}


def _module(path: Path):
    """A script's module loaded from its file (examples/ is on no import path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def questions() -> list[str]:
    """The main job's questions (examples/quickstart.py), then benchmarks/real_model.py's."""
    main_job = _module(ROOT / "examples" / "quickstart.py").QUESTIONS
    return list(dict.fromkeys([*main_job, *_module(ROOT / "benchmarks" / "real_model.py").PROMPTS]))


@torch.inference_mode()
def perplexity(runner: ModelRunner, tokens: list[int], window: int) -> tuple[float, int]:
    """exp(mean NLL) over ``tokens`` in windows of ``window``; and how many tokens were scored."""
    bs = runner.block_size
    blocks = list(range(1, -(-window // bs) + 1))
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, window):
        chunk = tokens[start : start + window]
        if len(chunk) < 2:
            break
        ids, pos, meta, _ = runner.prepare([SequenceInput(chunk, 0, blocks)])
        hidden = runner.model(ids, pos, runner.kv_pool, meta)
        logits = runner.model.compute_logits(hidden[:-1])
        target = torch.tensor(chunk[1:], device=logits.device)
        total += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(total / count), count


def build(path: str, device: str, dtype: str, variant: str, window: int):
    quantization, kv_cache_dtype = VARIANTS[variant]
    config, model = load_model(path, dtype=dtype, device=device, quantization=quantization)
    blocks = -(-window // 16) + 64
    runner_config = RunnerConfig(
        kv_cache_bytes=blocks * 16 * config.kv_bytes_per_token(model.embed_tokens.weight.dtype),
        use_cuda_graph=False,
        max_num_batched_tokens=max(window, 2048),
        kv_cache_dtype=kv_cache_dtype,
    )
    runner = ModelRunner(config, model, runner_config)
    identity = ModelIdentity.for_checkpoint(
        path, dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype
    )
    return runner, LLMEngine(runner, identity)


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy answers share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--variants", default="none,fp8", help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=50_000, help="of the text, at most")
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument(
        "--kv-scales",
        default=None,
        help="comma-separated per-tensor scales, e.g. 1,0.75,1.25: each variant with an FP8 KV "
        "cache is run once per scale (K's and V's set to it in every layer), for the spread that "
        "the choice of scale alone makes",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    if args.device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    path = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    tokens = tok(TEXT.read_text(encoding="utf-8"))["input_ids"][: args.max_tokens]
    chats = [
        tok(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )["input_ids"]
        for q in questions()
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_new, ignore_eos=True)
    rows, base_answers = [], None
    try:
        kv_scales = [float(x) for x in args.kv_scales.split(",")] if args.kv_scales else [None]
    except ValueError:
        ap.error(f"--kv-scales {args.kv_scales!r}: numbers separated by commas, e.g. 1,0.75")
    if not all(s is None or (math.isfinite(s) and s > 0) for s in kv_scales):
        ap.error(f"--kv-scales {args.kv_scales!r}: every scale must be a finite number > 0")
    runs = []
    for name in args.variants.split(","):
        if name not in VARIANTS:
            ap.error(f"unknown variant {name!r}; use {', '.join(VARIANTS)}")
        fp8_kv = VARIANTS[name][1] == "fp8"
        runs += [(name, scale) for scale in (kv_scales if fp8_kv else [None])]
    for name, kv_scale in runs:
        started = time.monotonic()
        runner, engine = build(path, args.device, dtype, name, args.window)
        if kv_scale is not None:
            for layer in runner.model.layers:
                layer.self_attn.kv_scales.fill_(kv_scale)
            name = f"{name}@{kv_scale:g}"
        ppl, scored = perplexity(runner, tokens, args.window)
        answers = [r.output_token_ids for r in engine.generate(chats, greedy)]
        if base_answers is None:
            base_answers = answers
        same = sum(a == b for a, b in zip(answers, base_answers, strict=True))
        shared = sum(agreement(a, b) for a, b in zip(answers, base_answers, strict=True))
        rows.append(
            dict(
                variant=name,
                perplexity=ppl,
                tokens=scored,
                identical_answers=same,
                answers=len(answers),
                shared_prefix=shared / sum(len(b) for b in base_answers),
                seconds=time.monotonic() - started,
            )
        )
        del runner, engine
    base = rows[0]["perplexity"]
    print(
        f"\n{Path(path).name} on {args.device} ({dtype}), {TEXT.name}: {rows[0]['tokens']} tokens "
        f"scored in windows of {args.window}; {len(base_answers or [])} chat questions, "
        f"{args.max_new} greedy tokens each\n"
    )
    print(f"{'variant':<16} {'perplexity':>10} {'vs ' + rows[0]['variant']:>9} "
          f"{'same answer':>12} {'shared tokens':>14} {'s':>6}")  # fmt: skip
    for r in rows:
        change = 100 * (r["perplexity"] / base - 1)
        print(
            f"{r['variant']:<16} {r['perplexity']:>10.3f} {change:>+8.2f}% "
            f"{r['identical_answers']:>5}/{r['answers']:<6} {100 * r['shared_prefix']:>13.1f}% "
            f"{r['seconds']:>6.0f}"
        )
    if args.json:
        figures = dict(model=path, device=args.device, dtype=dtype, window=args.window, rows=rows)
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
