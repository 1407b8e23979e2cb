"""End-to-end model benchmark on one CUDA GPU: a Llama-3-8B-shaped model with random bf16 weights.

    python benchmarks/model.py [--hf] [--layers 32] [--batches 1 32 128] [--json]

1. parity: the same random weights in transformers and in splitserve (copied through the real
   weight-loading code); prefill logits of a 512-token prompt compared, and greedy continuations;
2. end to end: output tokens/s of ``LLMEngine.generate`` for batches of 512-token prompts and 128
   output tokens (``--hf`` also times transformers ``generate`` on the same machine);
3. decode step time (CUDA graph replay) against its memory floor: (weight bytes + KV bytes read)
   / copy bandwidth (4.13 TB/s measured on the H200; ``--copy-tbps``);
4. prefill model FLOP/s at 32 x 512 tokens against 790 TFLOP/s (measured bf16 matmul rate).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from shapes import llama3_8b_config

from splitserve.engine.core import LLMEngine
from splitserve.kvstore import ModelIdentity
from splitserve.models.loader import load_model, load_weights
from splitserve.models.runner import ModelRunner, RunnerConfig, SequenceInput
from splitserve.models.sampling_params import SamplingParams

ROWS: list[dict] = []


def emit(**row) -> None:
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def hf_model(layers: int):
    from transformers import AutoModelForCausalLM

    cfg = llama3_8b_config(layers)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    return cfg, model.eval()


def cuda_time(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--hf", action="store_true", help="also time transformers generate")
    ap.add_argument("--copy-tbps", type=float, default=4.13)
    ap.add_argument("--matmul-tflops", type=float, default=790.0)
    ap.add_argument("--profile", action="store_true", help="kernel time table of eager steps")
    return ap.parse_args()


def load(cfg, hf):
    """Our model with the weights of the transformers model ``hf``; emits the load time."""
    folder = Path(tempfile.mkdtemp())
    cfg.save_pretrained(folder)  # config.json only: weights come from the HF model below
    t0 = time.perf_counter()
    config, model = load_model(folder, dtype="bfloat16", device="cuda", load_format="dummy")
    load_weights(model, hf.state_dict().items(), source="transformers model")
    emit(what="load", s=round(time.perf_counter() - t0, 1))
    return config, model


def parity(args, config, model, hf, identity, greedy) -> tuple[float, float, int]:
    """1. Prefill logits and 16 greedy tokens against transformers, on a small KV pool."""
    small = ModelRunner(config, model, RunnerConfig(kv_cache_bytes=2 << 30, use_cuda_graph=False))
    prompt = [random.randrange(128000) for _ in range(args.prompt)]
    ids, pos, meta, _ = small.prepare([SequenceInput(prompt, 0, list(range(1, 33)))])
    with torch.inference_mode():
        ours = model.compute_logits(model(ids, pos, small.kv_pool, meta))
        ref = hf(torch.tensor([prompt], device="cuda")).logits[0].float()
    rel = ((ours - ref).norm() / ref.norm()).item()
    top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    ours_gen = LLMEngine(small, identity).generate([prompt], greedy)[0].output_token_ids
    ids_t = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        hf.generation_config.eos_token_id = None
        hf_gen = hf.generate(
            ids_t,
            attention_mask=torch.ones_like(ids_t),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    agree = next((i for i, (a, b) in enumerate(zip(ours_gen, hf_gen, strict=True)) if a != b), 16)
    emit(
        what="parity",
        prefill_logits_rel_err=rel,
        top1_agreement_all_positions=top1,
        greedy_tokens_agreeing=agree,
        ours=ours_gen,
        hf=hf_gen,
    )
    return rel, top1, agree


def hf_generate(args, hf) -> dict[int, float]:
    """2a. transformers generate on the same machine: output tokens/s by batch."""
    from transformers import GenerationConfig

    gc = GenerationConfig(
        max_new_tokens=args.gen,
        min_new_tokens=args.gen,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    warmup = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=0)
    hf_tps = {}
    for b in args.batches:
        x = torch.randint(0, 128000, (b, args.prompt), device="cuda")
        with torch.no_grad():
            head = x[:, :32]
            hf.generate(head, attention_mask=torch.ones_like(head), generation_config=warmup)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            hf.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)
            torch.cuda.synchronize()
        hf_tps[b] = b * args.gen / (time.perf_counter() - t0)
        emit(what="hf_generate", batch=b, out_tok_s=hf_tps[b])
    return hf_tps


def splitserve_generate(args, runner, identity, hf_tps) -> dict[int, float]:
    """2b. splitserve end to end: output tokens/s by batch."""
    params = SamplingParams(temperature=0.0, max_tokens=args.gen, ignore_eos=True)
    warm = LLMEngine(runner, identity, enable_prefix_caching=False)
    warm.generate([[1] * args.prompt] * 4, SamplingParams(temperature=0.0, max_tokens=4))
    e2e = {}
    for b in args.batches:
        engine = LLMEngine(runner, identity, enable_prefix_caching=False)
        prompts = [[random.randrange(128000) for _ in range(args.prompt)] for _ in range(b)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        e2e[b] = b * args.gen / (time.perf_counter() - t0)
        emit(
            what="splitserve_generate",
            batch=b,
            out_tok_s=e2e[b],
            vs_hf=e2e[b] / hf_tps[b] if b in hf_tps else None,
        )
    return e2e


def decode_seqs(b: int, ctx: int, per_seq: int) -> list[SequenceInput]:
    return [
        SequenceInput([7], ctx - 1, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)))
        for i in range(b)
    ]


def decode_steps(args, runner, config, weight_bytes, ctx: int) -> dict:
    """3. decode step vs its memory floor: (seconds, floor seconds) by batch."""
    per_seq = -(-ctx // runner.block_size)
    steps = {}
    for b in args.batches:
        seqs = decode_seqs(b, ctx, per_seq)
        t = cuda_time(lambda seqs=seqs: runner.execute(seqs), reps=20)
        kv_read = b * ctx * config.kv_bytes_per_token(torch.bfloat16)
        floor = (weight_bytes + kv_read) / (args.copy_tbps * 1e12)
        steps[b] = (t, floor)
        emit(
            what="decode_step",
            batch=b,
            context=ctx,
            ms=t * 1e3,
            floor_ms=floor * 1e3,
            ratio=t / floor,
            graph=runner.graphs is not None and runner.graphs.can_run(b),
        )
    return steps


def profile_decode(args, runner, ctx: int) -> None:
    """``--profile``: the kernel time table of an eager decode step, smallest and largest batch."""
    from torch.profiler import ProfilerActivity, profile

    per_seq = -(-ctx // runner.block_size)
    for b in (args.batches[0], args.batches[-1]):
        inputs = runner.prepare(decode_seqs(b, ctx, per_seq))[:3]
        with torch.inference_mode():
            runner.model(*inputs[:2], runner.kv_pool, inputs[2])
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                runner.model(*inputs[:2], runner.kv_pool, inputs[2])
                torch.cuda.synchronize()
        print(f"eager decode step, batch {b}:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))


def prefill_tflops(args, runner, config, weight_bytes) -> float:
    """4. prefill FLOP/s at 32 x prompt length."""
    nseq, plen = 32, args.prompt
    per_seq = -(-plen // runner.block_size)
    prompts = [[random.randrange(128000) for _ in range(plen)] for _ in range(nseq)]
    seqs = [
        SequenceInput(p, 0, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)))
        for i, p in enumerate(prompts)
    ]
    t_prefill = cuda_time(lambda: runner.execute(seqs), reps=5)
    matmul_params = weight_bytes // 2 - config.vocab_size * config.hidden_size  # no embedding
    tokens = nseq * plen
    attn = config.num_layers * nseq * 4 * plen * plen * config.q_size / 2
    flops = (
        2 * matmul_params * tokens
        - 2 * config.vocab_size * config.hidden_size * (tokens - nseq)
        + attn
    )  # logits only for the last token of each sequence
    tflops = flops / t_prefill / 1e12
    emit(
        what="prefill",
        tokens=tokens,
        ms=t_prefill * 1e3,
        tflops=tflops,
        fraction_of_matmul_peak=tflops / args.matmul_tflops,
    )
    return tflops


def print_summary(args, hf_tps, e2e, steps, ctx, tflops, parity_row) -> None:
    rel, top1, agree = parity_row
    print("\n| what | batch | value | reference |\n|---|---|---|---|")
    for b in args.batches:
        ref_s = f"HF {hf_tps[b]:.0f} tok/s ({e2e[b] / hf_tps[b]:.1f}x)" if b in hf_tps else "-"
        print(f"| end-to-end output tok/s | {b} | {e2e[b]:.0f} | {ref_s} |")
    for b in args.batches:
        t, floor = steps[b]
        print(
            f"| decode step ms (ctx {ctx}) | {b} | {t * 1e3:.2f} | floor {floor * 1e3:.2f} "
            f"({t / floor:.2f}x) |"
        )
    print(
        f"| prefill TFLOP/s (32x{args.prompt}) | - | {tflops:.0f} | "
        f"{tflops / args.matmul_tflops:.0%} of {args.matmul_tflops:.0f} |"
    )
    print(f"| prefill logits rel. err vs transformers | - | {rel:.2e} | top-1 agree {top1:.1%} |")
    print(f"| greedy tokens agreeing | - | {agree}/16 | |")


def main() -> None:
    args = parse_args()
    emit(what="env", torch=torch.__version__, gpu=torch.cuda.get_device_name(0))
    random.seed(0)
    cfg, hf = hf_model(args.layers)
    config, model = load(cfg, hf)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    identity = ModelIdentity("bench-8b", dtype="bfloat16")
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    parity_row = parity(args, config, model, hf, identity, greedy)
    hf_tps = hf_generate(args, hf) if args.hf else {}
    del hf  # the small runner of the parity check went with parity()
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    runner = ModelRunner(config, model, RunnerConfig(max_num_seqs=256))
    emit(what="runner_init", s=round(time.perf_counter() - t0, 1), kv_blocks=runner.num_blocks)
    e2e = splitserve_generate(args, runner, identity, hf_tps)
    ctx = args.prompt + args.gen // 2
    steps = decode_steps(args, runner, config, weight_bytes, ctx)
    if args.profile:
        profile_decode(args, runner, ctx)
    tflops = prefill_tflops(args, runner, config, weight_bytes)
    print_summary(args, hf_tps, e2e, steps, ctx, tflops, parity_row)


if __name__ == "__main__":
    main()
