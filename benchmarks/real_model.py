"""The real default model through a local cluster against transformers, greedy, on one device.

    python benchmarks/real_model.py --device cuda --dtype bfloat16 --bench   # an H200
    python benchmarks/real_model.py --device cpu                            # fp32: token-exact

Starts `splitserve up`'s cluster (1 prefill + 1 decode node by default) of --model (default:
SmolLM2-135M-Instruct, converted from its GGUF file), sends every chat prompt greedily, runs
transformers' `generate` on the same converted checkpoint in the same dtype on the same device,
and prints per prompt where the first token differs (bf16 drifts: the kernels and cuBLAS round
differently from transformers' SDPA path; fp32 on CPU is expected to match everywhere). With
--bench it then runs `splitserve bench` against the same cluster and prints its table.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from splitserve.client import Client
from splitserve.launcher import ClusterSpec, LocalCluster
from splitserve.models.embedded import resolve_model_path

PROMPTS = [
    "What is the capital of France?",
    "Name the three primary colors.",
    "Write one sentence about the ocean.",
    "What is 12 plus 7?",
    "Give me a synonym for happy.",
    "Explain what a CPU does in two sentences.",
    "List three fruits that are red.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Write a haiku about autumn.",
    "What is the boiling point of water in Celsius?",
    "Tell me a fun fact about cats.",
]
# `splitserve bench`'s workload: (requests, concurrency, prompt lengths, output length)
BENCH_GPU = ("256", "64", "uniform:64:512", "64")
BENCH_CPU = ("16", "4", "uniform:32:128", "16")


def reference(model: str, device: str, dtype: str, prompts: list[list[int]], max_tokens: int):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device)
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            out = hf.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False
            )
            outs.append(out[0, len(ids) :].tolist())
    return hf, outs


def margin_at(hf, context: list[int], ours: int, theirs: int) -> float:
    """transformers' logit of its own choice less its logit of splitserve's, after ``context``
    (prompt and the common output prefix): small when the two tokens are a near tie."""
    import torch

    with torch.no_grad():
        x = torch.tensor([context], device=hf.device)
        logits = hf(x).logits[0, -1].float()
    return float(logits[theirs] - logits[ours])


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--num-prefill", type=int, default=1)
    ap.add_argument("--num-decode", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--bench", action="store_true", help="then run splitserve bench on it")
    args = ap.parse_args()
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    model = resolve_model_path(args.model)
    node_args = ["--dtype", dtype] + (["--kv-cache-mb", "512"] if args.device == "cpu" else [])
    spec = ClusterSpec(
        model_path=model,
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        port=0,  # the router binds a free port itself
        http_port=0,
        metrics_port=0,
        device=args.device,
        node_args=tuple(node_args),
        log_file=f"/tmp/splitserve-real-model-{int(time.time())}.log",
    )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    ids = [tok.apply_chat_template(m, add_generation_prompt=True, return_dict=False) for m in chats]
    print(f"model {model}, {dtype} on {args.device}; component logs in {spec.log_file}")
    with LocalCluster(spec) as cluster:
        a = cluster.addresses
        greedy = dict(max_tokens=args.max_tokens, temperature=0.0, timeout=600)
        t0 = time.perf_counter()
        with Client(a.router) as client, ThreadPoolExecutor(len(chats)) as pool:
            got = list(pool.map(lambda m: client.chat(m, **greedy), chats))
        served_s = time.perf_counter() - t0
        hf, want = reference(model, args.device, dtype, ids, args.max_tokens)
        exact = 0
        # in a half dtype, how long each run follows transformers in float32 (same device)
        fp32 = (
            want
            if dtype == "float32"
            else reference(model, args.device, "float32", ids, args.max_tokens)[1]
        )
        head = f"{'prompt':44s} {'tokens':>6s} {'first diff':>10s} {'margin':>6s} {'vs fp32':>7s}"
        print(f"\n{head}  splitserve's answer")
        for prompt, prompt_ids, r, w, f in zip(PROMPTS, ids, got, want, fp32, strict=True):
            ours = list(r.token_ids)
            diff = first_difference(ours, w)
            to_fp32 = [first_difference(x, f) for x in (ours, w)]
            vs = "/".join("-" if d is None else str(d) for d in to_fp32)
            exact += diff is None
            where, margin = "-", "-"
            if diff is not None and diff < min(len(ours), len(w)):
                where = str(diff)
                context = list(prompt_ids) + w[:diff]
                margin = f"{margin_at(hf, context, ours[diff], w[diff]):.3f}"
            elif diff is not None:
                where = f"{diff} (len)"
            row = f"{prompt[:44]:44s} {len(ours):6d} {where:>10s} {margin:>6s} {vs:>7s}"
            print(f"{row}  {r.text[:60]!r}")
            if diff is not None:
                print(f"{'':70s}  transformers: {tok.decode(w)[:60]!r}")
        print(
            "\nmargin: transformers' logit of its token less its logit of splitserve's at the "
            "first difference (a near tie when small); vs fp32: where splitserve / transformers "
            "in this dtype first differ from transformers in float32 on the same device"
        )
        print(
            f"\n{exact}/{len(PROMPTS)} token-exact with transformers ({dtype}); served "
            f"{sum(len(r.token_ids) for r in got)} tokens in {served_s:.1f} s"
        )
        if args.bench:
            metrics = a.metrics.get(a.decode[0])
            cmd = [sys.executable, "-m", "splitserve.cli", "bench", "--target", a.router]
            n, concurrency, input_len, output_len = BENCH_CPU if args.device == "cpu" else BENCH_GPU
            cmd += ["--num-requests", n, "--max-concurrency", concurrency]
            cmd += ["--input-len", input_len, "--output-len", output_len]
            cmd += ["--metrics-url", metrics] if metrics else []
            print("\n" + " ".join(cmd), flush=True)
            subprocess.run(cmd, check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
