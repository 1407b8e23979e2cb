"""Start a local splitserve cluster (separate processes: Redis, prefill and decode nodes, router),
ask it a few chat questions through the SDK and through the OpenAI HTTP API, print the answers
with their usage figures, stop the cluster.

    python examples/quickstart.py [--model PATH] [--num-prefill 1] [--num-decode 1] [--device cpu]

Without --model it serves SmolLM2-135M-Instruct (converted from its GGUF file on the first run,
then cached); `--model tiny` serves the random test model instead (gibberish, but fast). The
components' logs go to a file (printed) unless -v.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import tempfile
import time
import urllib.request

from splitserve.client import AsyncClient, Client
from splitserve.launcher import ClusterSpec, LocalCluster
from splitserve.models.embedded import resolve_model_path

QUESTIONS = [
    "What is the capital of France?",
    "Name the three primary colors.",
    "Write one sentence about the ocean.",
]
GREEDY = dict(max_tokens=48, temperature=0.0, timeout=120)


def show(label: str, text: str, prompt: int, cached: int, completion: int, extra: str = "") -> None:
    print(f"{label}\n  {text.strip()!r}")
    figures = f"{prompt} prompt tokens ({cached} from the prefix cache), {completion} generated"
    print(f"  {figures}{extra}")


def ask_sdk(client: Client, question: str) -> None:
    r = client.chat([{"role": "user", "content": question}], **GREEDY)
    u = r.usage
    ttft = f", first token after {u.time_to_first_token_s * 1e3:.0f} ms"
    show(f"SDK  > {question}", r.text, u.prompt_tokens, u.cached_tokens, u.completion_tokens, ttft)


def ask_http(http: str, api_key: str | None, question: str) -> None:
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": GREEDY["max_tokens"],
        "temperature": 0.0,
    }
    request = urllib.request.Request(
        f"http://{http}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            # The key the cluster made for its HTTP API (as `splitserve up` does).
            **({"Authorization": f"Bearer {api_key}"} if api_key else {}),
        },
    )
    with urllib.request.urlopen(request, timeout=GREEDY["timeout"]) as reply:
        answer = json.load(reply)
    u = answer["usage"]
    cached = u.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    text = answer["choices"][0]["message"]["content"]
    show(f"HTTP > {question}", text, u["prompt_tokens"], cached, u["completion_tokens"])


async def concurrent(target: str, api_key: str | None, n: int) -> list:
    system = {"role": "system", "content": "You are a concise assistant. " * 8}
    async with AsyncClient(target, api_key=api_key) as client:
        return await asyncio.gather(
            *(
                client.chat([system, {"role": "user", "content": f"Count to {i + 2}."}], **GREEDY)
                for i in range(n)
            )
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct; tiny: random")
    ap.add_argument("--num-prefill", type=int, default=1)
    ap.add_argument("--num-decode", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("-v", "--verbose", action="store_true", help="components log to this terminal")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    t0 = time.perf_counter()
    model = resolve_model_path(args.model)
    log_file = None
    if not args.verbose:
        fd, log_file = tempfile.mkstemp(prefix="splitserve-", suffix=".log")
        os.close(fd)
        print(f"components log to {log_file} (-v: to this terminal)")
    spec = ClusterSpec(
        model_path=model,
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        port=0,  # the router binds a free port itself
        http_port=0,
        api_key_file="auto",
        device=args.device,
        log_file=log_file,
    )
    with LocalCluster(spec) as cluster:
        a = cluster.addresses
        print(
            f"cluster up in {time.perf_counter() - t0:.1f} s: model {model}\n  router {a.router}, "
            f"http {a.http}, prefill {', '.join(a.prefill)}, decode {', '.join(a.decode)}\n"
        )
        # up made an API key: both the SDK (gRPC) and the HTTP API present it.
        with Client(a.router, api_key=cluster.api_key) as client:
            for question in QUESTIONS:
                ask_sdk(client, question)
            print("SDK  > (streamed) Tell me a fun fact about cats.\n  ", end="")
            messages = [{"role": "user", "content": "Tell me a fun fact about cats."}]
            for chunk in client.chat_stream(messages, **GREEDY):
                print(chunk.text, end="", flush=True)
            print()
        for question in QUESTIONS[:2]:
            ask_http(a.http, cluster.api_key, question)
        results = asyncio.run(concurrent(a.router, cluster.api_key, 8))
        cached = sum(r.usage.cached_tokens for r in results)
        prompt = sum(r.usage.prompt_tokens for r in results)
        print(
            f"\n8 concurrent chats sharing a system prompt: {prompt} prompt tokens, {cached} "
            f"served from the prefix cache; e.g. {results[-1].text.strip()!r}"
        )
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
