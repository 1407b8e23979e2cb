"""The ``splitserve`` command line."""

from __future__ import annotations

import argparse
import logging
import random
import sys

from splitserve import __version__


def _identity(args: argparse.Namespace):
    from kvstore import ModelIdentity

    return ModelIdentity(
        args.model, revision=args.revision, dtype=args.dtype, block_size=args.block_size
    )


def cmd_hash(args: argparse.Namespace) -> int:
    """Print the chained block hashes of a token list: the keys a prefix is cached under."""
    from kvstore import hash_request_tokens

    try:
        tokens = [int(t) for t in args.tokens.replace(",", " ").split()]
        identity = _identity(args)
        hashes = hash_request_tokens(tokens, identity.block_size, identity.root_hash, args.salt)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"root {identity.root_hash.hex()}  ({identity})")
    for i, block_hash in enumerate(hashes):
        print(
            f"block {i:4d}  tokens {i * identity.block_size}..{(i + 1) * identity.block_size - 1}"
            f"  {block_hash.hex()}"
        )
    tail = len(tokens) - len(hashes) * identity.block_size
    print(f"{len(hashes)} full blocks, {tail} tokens in the partial tail block (not hashed)")
    return 0


def cmd_kv_demo(args: argparse.Namespace) -> int:
    """Drive the real KV cache manager with chat-like traffic and report prefix-cache figures."""
    from kvstore import BlockPool, KVCacheManager, hash_request_tokens

    rng = random.Random(args.seed)
    identity = _identity(args)
    bs = identity.block_size
    pool = BlockPool(args.num_blocks, enable_events=True)
    mgr = KVCacheManager(pool, bs)
    system_prompts = [
        [rng.randrange(32_000) for _ in range(rng.randrange(64, 512))]
        for _ in range(args.system_prompts)
    ]
    running: list[tuple[str, int]] = []
    refused = stored = evicted = 0
    print(f"{'step':>5s} {'running':>8s} {'usage':>6s} {'cached blocks':>14s} {'hit rate':>9s}")
    for step in range(args.requests):
        prompt = rng.choice(system_prompts) + [
            rng.randrange(32_000) for _ in range(rng.randrange(1, 200))
        ]
        hashes = hash_request_tokens(prompt, bs, identity.root_hash)
        computed = mgr.get_computed_blocks(hashes, len(prompt))
        rid = f"req-{step}"
        if mgr.allocate_slots(rid, len(prompt), computed) is None:
            refused += 1
        else:
            mgr.cache_blocks(rid, hashes, len(prompt))
            running.append((rid, len(prompt) + rng.randrange(16, 256)))
        for rid, final_len in list(running):  # requests grow to their final length and finish
            if mgr.allocate_slots(rid, final_len) is None or rng.random() < 0.05:
                mgr.free(rid)
                running.remove((rid, final_len))
        for event in pool.take_events():
            if type(event).__name__ == "BlockStored":
                stored += len(event.block_hashes)
            else:
                evicted += len(event.block_hashes)
        if step % max(1, args.requests // 10) == 0 or step == args.requests - 1:
            print(
                f"{step:5d} {len(running):8d} {pool.get_usage():6.1%} "
                f"{pool.num_cached_blocks:14d} {mgr.stats.hit_rate:9.1%}"
            )
    s = mgr.stats
    print(
        f"\n{s.requests} lookups, {s.hit_tokens}/{s.queried_tokens} prompt tokens from cache "
        f"({s.hit_rate:.1%}); {refused} refused for lack of blocks; "
        f"{stored} blocks stored, {evicted} evicted (events a Redis index would receive)"
    )
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate text with the model runner in this process (the embedded tiny model by default)."""
    import time

    import torch
    from transformers import AutoTokenizer

    from kvstore import ModelIdentity
    from models.engine import LLMEngine
    from models.loader import load_model
    from models.runner import ModelRunner, RunnerConfig
    from models.sampler import SamplingParams
    from models.tiny import ensure_tiny_model

    path = args.model_path or ensure_tiny_model()
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
            seed=args.seed,
        )
        config, model = load_model(path, dtype=args.dtype, device=device)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rc = RunnerConfig(kv_cache_bytes=None if device == "cuda" else args.kv_cache_mb << 20)
    runner = ModelRunner(config, model, rc)
    identity = ModelIdentity(str(path), dtype=str(runner.dtype).removeprefix("torch."))
    engine = LLMEngine(runner, identity)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = args.prompt or ["The quick brown fox"]
    t0 = time.perf_counter()
    reqs = engine.generate([tokenizer(p).input_ids for p in prompts], params)
    elapsed = time.perf_counter() - t0
    for prompt, req in zip(prompts, reqs, strict=True):
        text = tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        print(
            f"{prompt!r} -> {text!r}  ({len(req.output_token_ids)} tokens, "
            f"{req.finish_reason}, {req.num_cached_tokens} prompt tokens from cache)"
        )
    total = sum(len(r.output_token_ids) for r in reqs)
    print(f"{total} tokens in {elapsed:.2f} s on {device} ({total / elapsed:.0f} tok/s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"splitserve {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default="splitserve/tiny-llama", help="model name or path")
        p.add_argument("--revision", default="main")
        p.add_argument("--dtype", default="float32")
        p.add_argument("--block-size", type=int, default=16)

    p = sub.add_parser("hash", help=cmd_hash.__doc__)
    model_args(p)
    p.add_argument("--salt", default=None, help="cache_salt (per tenant)")
    p.add_argument("tokens", help="token ids, separated by commas or spaces")
    p.set_defaults(func=cmd_hash)

    p = sub.add_parser("kv-demo", help=cmd_kv_demo.__doc__)
    model_args(p)
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_kv_demo)

    p = sub.add_parser("generate", help=cmd_generate.__doc__)
    p.add_argument("prompt", nargs="*", help="prompts (default: one example)")
    p.add_argument("--model-path", default=None, help="checkpoint folder (default: tiny model)")
    p.add_argument("--dtype", default=None, help="float32, float16, bfloat16 (default: ckpt's)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--kv-cache-mb", type=int, default=256, help="KV cache size on CPU")
    p.add_argument("--cpu", action="store_true", help="run on CPU even if a GPU is present")
    p.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
