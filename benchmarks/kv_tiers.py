"""The host KV tier in one engine: multi-turn conversations whose histories are many times the
KV pool, served with the tier and without it; a host hit's copy against the machine's pinned
host-to-device bandwidth; one long prompt's first token from the tier against computing it.

    python benchmarks/kv_tiers.py --device cuda --make-8b /tmp/llama8b --kv-cache-mb 2048 \\
        [--users 64 --turns 6 --doc 1024 --user-tokens 64 --gen 64] [--host-mb 32768]
    python benchmarks/kv_tiers.py --device cpu --tiny --kv-cache-mb 1 --users 8 --turns 3 \\
        --doc 128 --user-tokens 16 --gen 8 --host-mb 64 --long 256
    python benchmarks/kv_tiers.py --device cuda --make-8b /tmp/llama8b --kv-cache-mb 2048 \\
        --host-mb 8192 --long 4096 --store [--store-mb 4096]

The engine is built as a decode node builds it (``runtime.node.build_engine``; the 8B shape with
``--load-format dummy``), once with ``--kv-host-cache-mb`` ``--host-mb`` and once with 0, in that
order, each with a fresh pool. Conversations: ``--users`` users, each with a document of
``--doc`` random tokens of its own; every turn adds ``--user-tokens`` new tokens to the user's
history and asks for ``--gen`` tokens (greedy), and the answer the engine gave joins the history,
as a chat client sends it. A turn is every user's request at once (the batch loads the engine);
the next turn starts when all have answered. Per turn: prompt tokens, tokens computed (the rest
came from the pool or the tier), tokens new in that turn, TTFT p50/p90 (from the request's add
to its first token), the turn's wall time.

Not the cluster figure (``splitserve up`` + ``splitserve bench --workload conversation``): no
router, no gRPC, no Redis; the engine and its tiers only.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import tempfile
import time
from pathlib import Path

import torch

from splitserve.models.sampling_params import SamplingParams
from splitserve.runtime.config import NodeConfig
from splitserve.runtime.node import build_engine


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def sync(engine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()


def serve(engine, prompts: dict[str, list[int]], gen: int) -> tuple[dict, dict]:
    """Add every prompt at once and step to the end: (request → its request object, request →
    seconds from its add to its first token)."""
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    sync(engine)
    t0 = time.perf_counter()
    reqs = {rid: engine.add_request(rid, p, params) for rid, p in prompts.items()}
    first: dict[str, float] = {}
    while engine.has_unfinished():
        outputs = engine.step()
        for out in outputs:
            if out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
        if not outputs and not engine.last_num_scheduled:
            time.sleep(0.001)  # as a node's engine loop waits: a tier's copies are under way
    return reqs, first


def conversations(engine, args, tag: str) -> list[dict]:
    rng = random.Random(0)
    vocab = min(250, engine.runner.config.vocab_size)
    histories = {
        f"u{u}": [rng.randrange(vocab) for _ in range(args.doc)] for u in range(args.users)
    }
    rows = []
    for turn in range(args.turns):
        new = {}
        for user, history in histories.items():
            history += [rng.randrange(vocab) for _ in range(args.user_tokens)]
            new[user] = args.doc + args.user_tokens if turn == 0 else args.user_tokens
        sync(engine)
        t0 = time.perf_counter()
        reqs, first = serve(
            engine, {f"{tag}-{u}-t{turn}": list(h) for u, h in histories.items()}, args.gen
        )
        wall = time.perf_counter() - t0
        prompt = sum(len(r.prompt_token_ids) for r in reqs.values())
        computed = sum(len(r.prompt_token_ids) - r.num_cached_tokens for r in reqs.values())
        for user in histories:
            req = reqs[f"{tag}-{user}-t{turn}"]
            histories[user] = list(req.prompt_token_ids) + req.output_token_ids
            if turn:
                new[user] += args.gen  # the last answer is new to the prompt, its KV is not
        ttft = list(first.values())
        rows.append(
            {
                "run": tag,
                "turn": turn,
                "prompt_tokens": prompt,
                "computed_tokens": computed,
                "new_tokens": sum(new.values()),
                "ttft_p50_ms": pct(ttft, 0.5) * 1e3,
                "ttft_p90_ms": pct(ttft, 0.9) * 1e3,
                "wall_s": wall,
                "history_tokens": sum(len(h) for h in histories.values()),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def pinned_h2d_gbs(engine, mb: int = 1024) -> float:
    """The machine's pinned host-to-device copy bandwidth (GB/s), one large copy."""
    if engine.runner.device.type != "cuda":
        return float("nan")
    src = torch.empty(mb << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=engine.runner.device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, src.numel() / (time.perf_counter() - t0) / 1e9)
    return best


def long_prompt(engine, args) -> dict:
    """One ``--long``-token prompt's first token: computed, then (evicted from the pool by other
    prompts) from the tier. Also the tier's load bandwidth for those blocks."""
    rng = random.Random(1)
    vocab = min(250, engine.runner.config.vocab_size)
    prompt = [rng.randrange(vocab) for _ in range(args.long)]
    _, cold = serve(engine, {"long-cold": prompt}, 1)
    # Fill the pool with other prompts until the long one has left it.
    pool_tokens = (engine.pool.num_blocks - 1) * engine.block_size
    filler = {
        f"fill-{i}": [rng.randrange(vocab) for _ in range(min(args.long, 4096))]
        for i in range(pool_tokens // min(args.long, 4096) + 2)
    }
    serve(engine, filler, 1)
    loaded_before = engine.host_tier.loaded_blocks if engine.host_tier else 0
    reqs, warm = serve(engine, {"long-warm": prompt}, 1)
    loaded = (engine.host_tier.loaded_blocks if engine.host_tier else 0) - loaded_before
    return {
        "prompt_tokens": args.long,
        "cached_tokens": reqs["long-warm"].num_cached_tokens,
        "blocks_loaded": loaded,
        "ttft_computed_ms": cold["long-cold"] * 1e3,
        "ttft_from_tier_ms": warm["long-warm"] * 1e3,
    }


def load_bandwidth(engine, num_blocks: int) -> float:
    """GB/s of one load of ``num_blocks`` blocks the tier holds into free pool blocks."""
    tier = engine.host_tier
    hashes = tier.hashes()[:num_blocks]
    free = engine.pool.get_new_blocks(len(hashes))
    try:
        sync(engine)
        t0 = time.perf_counter()
        tier.load(hashes, free, "bandwidth")
        while not tier.loaded():
            pass
        sync(engine)
        seconds = time.perf_counter() - t0
    finally:
        engine.pool.free_blocks(free)
    return len(hashes) * tier.block_bytes / seconds / 1e9


def restart(args, model: Path, load_format: str, before: dict) -> dict:
    """A node started again on the disk folder the "on" engine filled: the long prompt's first
    token from its files, against the same prompt from the host tier before the restart."""
    engine = build(args, model, load_format, args.host_mb, args.disk_dir)
    rng = random.Random(1)  # the long prompt of long_prompt()
    vocab = min(250, engine.runner.config.vocab_size)
    prompt = [rng.randrange(vocab) for _ in range(args.long)]
    reqs, first = serve(engine, {"long-restart": prompt}, 1)
    out = {
        "disk_blocks_found": len(engine.host_tier.disk) if engine.host_tier.disk else 0,
        "cached_tokens": reqs["long-restart"].num_cached_tokens,
        "ttft_after_restart_ms": first["long-restart"] * 1e3,
        "ttft_before_restart_ms": before["ttft_from_tier_ms"],
    }
    engine.host_tier.close()
    engine.runner.close()
    return out


def store_hit(args, model: Path, load_format: str) -> dict:
    """The shared store: a Mooncake Store started here (master and memory on loopback, as ``up
    --kv-store embedded`` starts it); one engine computes the ``--long`` prompt and puts its
    blocks; a second engine, started afterwards with an empty pool and host tier (another node),
    serves the same prompt from the store; then a prompt of the same length that no one has
    computed, on that second engine (its first token computed)."""
    from splitserve.kv_store_service import start_store

    workdir = Path(tempfile.mkdtemp())
    store = start_store("127.0.0.1", args.store_mb, workdir, time.monotonic() + 60)
    try:
        rng = random.Random(2)
        first = build(args, model, load_format, args.host_mb, store_url=store.url)
        vocab = min(250, first.runner.config.vocab_size)
        prompt = [rng.randrange(vocab) for _ in range(args.long)]
        fresh = [rng.randrange(vocab) for _ in range(args.long)]
        _, computed_there = serve(first, {"long": prompt}, 1)
        tier = first.host_tier
        deadline = time.monotonic() + 120
        while tier.busy or tier.store.put_ok < args.long // first.block_size - 1:
            assert time.monotonic() < deadline, tier.store.counters()
            tier.reap()
            time.sleep(0.01)
        put = tier.store.counters()
        tier.close()
        first.runner.close()
        del first, tier
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        second = build(args, model, load_format, args.host_mb, store_url=store.url)
        reqs, hit = serve(second, {"long": prompt}, 1)
        _, cold = serve(second, {"fresh": fresh}, 1)
        out = {
            "prompt_tokens": args.long,
            "block_bytes": second.host_tier.block_bytes,
            "cached_tokens": reqs["long"].num_cached_tokens,
            "store_hit_blocks": second.host_tier.store_hit_blocks,
            "ttft_computed_first_engine_ms": computed_there["long"] * 1e3,
            "ttft_computed_ms": cold["fresh"] * 1e3,
            "ttft_from_store_ms": hit["long"] * 1e3,
            "put": put,
            "read": second.host_tier.store.counters(),
        }
        second.host_tier.close()
        second.runner.close()
        return out
    finally:
        store.stop()


def build(
    args,
    model: Path,
    load_format: str,
    host_mb: int,
    disk_dir: str | None = None,
    store_url: str | None = None,
):
    config = NodeConfig(
        model_path=str(model),
        device=args.device,
        load_format=load_format,
        kv_transfer="none",
        kv_cache_mb=args.kv_cache_mb,
        kv_host_cache_mb=host_mb,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_disk_cache_dir=disk_dir,
        kv_disk_cache_mb=args.disk_mb if disk_dir else None,
        kv_store=store_url,
    )
    engine, _ = build_engine(config, prefill_only=False)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.generate([[1] * 64 for _ in range(4)], warm)
    return engine


def main() -> None:
    # The engine's INFO lines say what the tiers took (pinned memory and how long it took).
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--make-8b", metavar="DIR", help="write the Llama-3-8B shape here (dummy)")
    src.add_argument("--tiny", action="store_true", help="the embedded random test model")
    ap.add_argument("--kv-cache-mb", type=int, required=True, help="the pool, small on purpose")
    ap.add_argument("--host-mb", type=int, default=32768, help="the host tier when on")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    ap.add_argument("--users", type=int, default=64)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--doc", type=int, default=1024)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--long", type=int, default=4096, help="the long prompt's tokens")
    ap.add_argument("--only", choices=["on", "off"], help="one of the two engines only")
    ap.add_argument(
        "--disk-dir",
        help="the 'on' engine also has a disk tier here; then a third engine, started on the same "
        "folder, serves the long prompt from it (a restart)",
    )
    ap.add_argument("--disk-mb", type=int, default=65536)
    ap.add_argument(
        "--store",
        action="store_true",
        help="only the shared store: the --long prompt from a Mooncake Store started here, on a "
        "second engine, against computing it (the mooncake extra)",
    )
    ap.add_argument("--store-mb", type=int, default=4096, help="the store's memory")
    args = ap.parse_args()
    if args.make_8b:
        from pipeline import make_8b

        model, load_format = make_8b(Path(args.make_8b)), "dummy"
    else:
        from splitserve.models.tiny import write_random_checkpoint

        model = write_random_checkpoint(Path(tempfile.mkdtemp()) / "tiny", with_tokenizer=False)
        load_format = "auto"

    if args.store:
        out = store_hit(args, model, load_format)
        print(json.dumps(out), flush=True)
        read_bytes = out["cached_tokens"] // 16 * out["block_bytes"]  # (block size 16)
        gbs = read_bytes / (out["ttft_from_store_ms"] / 1e3) / 1e9
        print(
            "\n| prompt tokens | from the store | TTFT computed ms | TTFT from the store ms | "
            "speed-up | store read GB/s (whole TTFT) |"
        )
        print("|---|---|---|---|---|---|")
        print(
            f"| {out['prompt_tokens']:,} | {out['cached_tokens']:,} tokens | "
            f"{out['ttft_computed_ms']:.0f} | {out['ttft_from_store_ms']:.0f} | "
            f"{out['ttft_computed_ms'] / out['ttft_from_store_ms']:.2f}x | {gbs:.2f} |"
        )
        return

    results = {}
    for name, host_mb in (("on", args.host_mb), ("off", 0)):
        if args.only and name != args.only:
            continue
        engine = build(args, model, load_format, host_mb, args.disk_dir if host_mb else None)
        pool_tokens = (engine.pool.num_blocks - 1) * engine.block_size
        rows = conversations(engine, args, name)
        extra = {"pool_tokens": pool_tokens, "long": long_prompt(engine, args)}
        if engine.host_tier is not None:
            extra["pinned_h2d_gbs"] = pinned_h2d_gbs(engine)
            extra["load_gbs"] = load_bandwidth(engine, min(256, engine.pool.num_free_blocks))
            extra["tier"] = engine.host_tier.stats()._asdict()
            extra["counters"] = engine.host_tier.counters()
            if args.disk_dir:
                deadline = time.monotonic() + 60
                while engine.host_tier._spilling and time.monotonic() < deadline:
                    engine.host_tier.reap()  # the disk's last writes
                    time.sleep(0.01)
            engine.host_tier.close()
        print(json.dumps(extra), flush=True)
        results[name] = (rows, extra)
        engine.runner.close()
        del engine
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()

    if args.disk_dir and "on" in results:
        after = restart(args, model, load_format, results["on"][1]["long"])
        print(json.dumps(after), flush=True)
        print(
            "\n| disk blocks found at start | long prompt cached tokens | TTFT before restart "
            "(host tier) ms | TTFT after restart (disk) ms |"
        )
        print("|---|---|---|---|")
        print(
            f"| {after['disk_blocks_found']:,} | {after['cached_tokens']:,} | "
            f"{after['ttft_before_restart_ms']:.0f} | {after['ttft_after_restart_ms']:.0f} |"
        )

    print(
        "\n| tier | turn | prompt tok | computed | new in turn | computed / new | TTFT p50 ms "
        "| TTFT p90 ms | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (rows, _) in results.items():
        for r in rows:
            print(
                f"| {name} | {r['turn']} | {r['prompt_tokens']:,} | {r['computed_tokens']:,} | "
                f"{r['new_tokens']:,} | {r['computed_tokens'] / r['new_tokens']:.2f} | "
                f"{r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | {r['wall_s']:.2f} |"
            )
    print(
        "\n| tier | pool tokens | histories at the end | long prompt TTFT computed / again ms "
        "| its cached tokens | load GB/s | pinned H2D GB/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (rows, extra) in results.items():
        lp = extra["long"]
        print(
            f"| {name} | {extra['pool_tokens']:,} | {rows[-1]['history_tokens']:,} | "
            f"{lp['ttft_computed_ms']:.0f} / {lp['ttft_from_tier_ms']:.0f} | "
            f"{lp['cached_tokens']:,} | {extra.get('load_gbs', float('nan')):.1f} | "
            f"{extra.get('pinned_h2d_gbs', float('nan')):.1f} |"
        )


if __name__ == "__main__":
    main()
