"""``splitserve hash``, ``kv-demo`` and ``generate``: tools that run in this process (see cli)."""

from __future__ import annotations

import argparse
import random
import sys

from splitserve.runtime.config import CPU_KV_CACHE_MB, NodeConfig
from splitserve.runtime.options import add_options

IDENTITY_OPTIONS = (
    "model_path",
    "dtype",
    "block_size",
    "quantization",
    "kv_cache_dtype",
)  # what a node's model identity is of


def model_path(path: str | None) -> str:
    """The checkpoint folder a ``--model`` value stands for: the default model (nothing given),
    ``tiny``, a GGUF file or a folder holding one (converted once, cached), or a checkpoint
    folder as is (``models.embedded``)."""
    from splitserve.models.embedded import resolve_model_path

    return resolve_model_path(path)


def _identity(args: argparse.Namespace):
    """The model identity a node started with the same --model, --dtype, --block-size has."""
    from splitserve.kvstore import ModelIdentity

    return ModelIdentity.for_checkpoint(
        model_path(args.model_path),
        args.dtype,
        args.block_size,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def cmd_hash(args: argparse.Namespace) -> int:
    """Print the chained block hashes of a token list: the keys a prefix is cached under."""
    from splitserve.kvstore import hash_request_tokens

    try:
        tokens = [int(t) for t in args.tokens.replace(",", " ").split()]
        identity = _identity(args)
        hashes = hash_request_tokens(tokens, identity.block_size, identity.root_hash, args.salt)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    bs = identity.block_size
    print(f"root {identity.root_hash.hex()}  ({identity})")
    for i, block_hash in enumerate(hashes):
        print(f"block {i:4d}  tokens {i * bs}..{(i + 1) * bs - 1}  {block_hash.hex()}")
    tail = len(tokens) - len(hashes) * bs
    print(f"{len(hashes)} full blocks, {tail} tokens in the partial tail block (not hashed)")
    return 0


def cmd_kv_demo(args: argparse.Namespace) -> int:
    """Drive the real KV cache manager with chat-like traffic and report prefix-cache figures."""
    from splitserve.kvstore import BlockPool, BlockStored, KVCacheManager, hash_request_tokens

    try:
        identity = _identity(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
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
            if isinstance(event, BlockStored):
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
    """Generate text: through a running cluster with --target, else in this process."""
    if args.target:
        return _generate_remote(args)
    import time

    import torch
    from transformers import AutoTokenizer

    from splitserve.engine.core import LLMEngine
    from splitserve.kvstore import ModelIdentity
    from splitserve.models.loader import load_model
    from splitserve.models.runner import ModelRunner, RunnerConfig
    from splitserve.models.sampling_params import SamplingParams

    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    try:
        path = model_path(args.model_path)
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
            seed=args.seed,
        )
        identity = ModelIdentity.for_checkpoint(path, args.dtype, quantization=args.quantization)
        config, model = load_model(
            path, dtype=args.dtype, device=device, quantization=args.quantization
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    mb = args.kv_cache_mb if args.kv_cache_mb is not None or device == "cuda" else CPU_KV_CACHE_MB
    kv_bytes = None if mb is None else mb << 20
    runner = ModelRunner(
        config, model, RunnerConfig(block_size=identity.block_size, kv_cache_bytes=kv_bytes)
    )
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


def _generate_remote(args: argparse.Namespace) -> int:
    """Stream each prompt's completion from the router at --target; usage goes to stderr."""
    from splitserve.client import Client, SplitserveError

    prompts = args.prompt or ["The quick brown fox"]
    options = {
        k: getattr(args, k)
        for k in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")
    }
    from splitserve.credentials import api_key, grpc_credentials

    try:
        credentials = grpc_credentials(args)
        key = api_key(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with Client(args.target, credentials=credentials, api_key=key) as client:
        for prompt in prompts:
            try:
                last = None
                stream = client.stream(
                    prompt, **options, cache_salt=args.cache_salt, timeout=args.timeout
                )
                for chunk in stream:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    last = chunk
            except SplitserveError as exc:
                sys.stdout.write("\n")
                print(f"error: {exc}", file=sys.stderr)
                return 2 if exc.code.name == "INVALID_ARGUMENT" else 1
            sys.stdout.write("\n")
            if last is not None and last.usage is not None:
                u = last.usage
                print(
                    f"[{last.finish_reason}] prompt_tokens={u.prompt_tokens} "
                    f"cached_tokens={u.cached_tokens} completion_tokens={u.completion_tokens} "
                    f"time_to_first_token={u.time_to_first_token_s * 1000:.1f} ms",
                    file=sys.stderr,
                )
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """hash, kv-demo, generate and bench (splitserve.bench)."""
    from splitserve.bench.cli import add_command as add_bench

    p = sub.add_parser("hash", help=cmd_hash.__doc__)
    add_options(p, NodeConfig, IDENTITY_OPTIONS)
    p.add_argument("--salt", default=None, help="cache_salt (per tenant)")
    p.add_argument("tokens", help="token ids, separated by commas or spaces")
    p.set_defaults(func=cmd_hash)

    p = sub.add_parser("kv-demo", help=cmd_kv_demo.__doc__)
    add_options(p, NodeConfig, IDENTITY_OPTIONS)
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_kv_demo)

    p = sub.add_parser("generate", help=cmd_generate.__doc__)
    p.add_argument("prompt", nargs="*", help="prompts (default: one example)")
    p.add_argument(
        "--model-path",
        "--model",
        default=None,
        help="checkpoint folder, .gguf file or `tiny` (default: SmolLM2-135M-Instruct)",
    )
    add_options(p, NodeConfig, ("dtype", "quantization", "kv_cache_mb"))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--cpu", action="store_true", help="run on CPU even if a GPU is present")
    remote = p.add_argument_group("through a running cluster (--target)")
    remote.add_argument("--target", default=None, help="router host:port; streams via the SDK")
    remote.add_argument("--top-k", type=int, default=-1)
    remote.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    remote.add_argument("--ignore-eos", action="store_true")
    remote.add_argument("--cache-salt", default=None)
    remote.add_argument("--timeout", type=float, default=None, help="seconds per request")
    from splitserve.credentials import add_client_options

    add_client_options(remote, http=False)  # a guarded router: mTLS files, an API key
    p.set_defaults(func=cmd_generate)

    add_bench(sub)
