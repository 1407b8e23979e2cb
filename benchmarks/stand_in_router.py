"""A stand-in router for measuring the load generator itself: a gRPC RouterService that streams
``max_tokens`` tokens 20 ms apart and refuses a share of requests at once (RESOURCE_EXHAUSTED),
with no model behind it, so what `splitserve bench` reports of its own lateness is its own.

    python benchmarks/stand_in_router.py --port 50111 --refuse 0.5 &
    splitserve bench --target 127.0.0.1:50111 --request-rate 256 --duration 15 --processes 4 \\
        --output-len 128 --input-len 1024 --no-progress --result-json r.json
    # r.json: client.send_late_p99_s, client.send_late_max_s, client.cpu_cores
"""

from __future__ import annotations

import argparse
import asyncio
import random

import grpc

from splitserve.v1 import common_pb2, router_pb2, router_pb2_grpc


class StandIn(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, refuse: float, gap_s: float) -> None:
        self.refuse, self.gap_s = refuse, gap_s

    async def Generate(self, request, context):
        if random.random() < self.refuse:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy: retry later")
        n = request.sampling.max_tokens or 16
        for i in range(n):
            await asyncio.sleep(self.gap_s)
            msg = router_pb2.GenerateResponse(token_ids=[7], request_id="stand-in")
            if i == n - 1:
                msg.finish_reason = "length"
                usage = common_pb2.Usage(prompt_tokens=10, cached_tokens=0, completion_tokens=n)
                msg.usage.CopyFrom(usage)
            yield msg


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=50111)
    ap.add_argument("--refuse", type=float, default=0.5, help="share refused at once (0.5)")
    ap.add_argument("--gap-s", type=float, default=0.02, help="between tokens (0.02)")
    args = ap.parse_args()
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServiceServicer_to_server(StandIn(args.refuse, args.gap_s), server)
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main())
