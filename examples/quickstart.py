"""Start a local splitserve cluster (separate processes: Redis, prefill and decode nodes, router),
send a few requests through the SDK, print them with their usage figures, stop the cluster.

    python examples/quickstart.py [--model DIR] [--num-prefill 1] [--num-decode 1] [--device cpu]

Without --model it serves the embedded tiny random-weight model, so the text is gibberish: what
to look at is the pipeline (time to first token, prompt tokens served from the prefix cache).
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from splitserve.client import AsyncClient, Client
from splitserve.launcher import ClusterSpec, LocalCluster, free_port
from splitserve.models.tiny import ensure_tiny_model

SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 3


def show(label: str, result) -> None:
    u = result.usage
    print(f"{label:>14}: {result.text!r}")
    print(
        f"{'':>14}  {u.prompt_tokens} prompt tokens ({u.cached_tokens} from cache), "
        f"{u.completion_tokens} generated, first token after "
        f"{u.time_to_first_token_s * 1e3:.0f} ms, finish: {result.finish_reason}"
    )


async def concurrent(target: str, n: int) -> list:
    async with AsyncClient(target) as client:
        return await asyncio.gather(
            *(
                client.generate(prompt=f"{SYSTEM}Question {i}:", max_tokens=16, temperature=0.0)
                for i in range(n)
            )
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prefill", type=int, default=1)
    ap.add_argument("--num-decode", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    spec = ClusterSpec(
        model_path=args.model or str(ensure_tiny_model()),
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        port=free_port(),
        device=args.device,
    )
    with LocalCluster(spec) as cluster:
        addresses = cluster.addresses
        print(
            f"cluster up: router {addresses.router}, prefill {', '.join(addresses.prefill)}, "
            f"decode {', '.join(addresses.decode)}\n"
        )
        with Client(addresses.router) as client:
            show(
                "first",
                client.generate(
                    prompt=f"{SYSTEM}What is paged attention?", max_tokens=24, temperature=0.0
                ),
            )
            show(
                "shared prefix",
                client.generate(
                    prompt=f"{SYSTEM}What is a KV cache?", max_tokens=24, temperature=0.0
                ),
            )
            print(f"{'streamed':>14}: ", end="")
            for chunk in client.stream(prompt="Once upon a time", max_tokens=24, seed=1):
                print(chunk.text, end="", flush=True)
            print()
            # Chat messages, rendered with the checkpoint's chat template by the router.
            messages = [{"role": "user", "content": "What is a BlockPool?"}]
            show("chat", client.chat(messages, max_tokens=24, temperature=0.0, timeout=60))
        results = asyncio.run(concurrent(addresses.router, 8))
        cached = sum(r.usage.cached_tokens for r in results)
        prompt = sum(r.usage.prompt_tokens for r in results)
        print(f"\n8 concurrent requests: {prompt} prompt tokens, {cached} from the prefix cache")


if __name__ == "__main__":
    main()
