"""``splitserve bench --cache-salt``: every request carries the salt (here the HTTP body's
``cache_salt``, against a real aiohttp server; over gRPC it is the SDK's ``cache_salt`` argument),
and none does without it."""

import asyncio
import json

from splitserve.bench import targets
from splitserve.bench.metrics import RequestRecord
from splitserve.bench.workloads import BenchRequest


def test_every_http_request_carries_the_salt_and_none_without_it():
    from aiohttp import web

    bodies = []

    async def completions(request):
        bodies.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        piece = {"choices": [{"index": 0, "text": "t", "finish_reason": "length"}]}
        await resp.write(f"data: {json.dumps(piece)}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            for salt in ("run-a", None):
                async with targets.make_target(url, model="m", cache_salt=salt) as t:
                    for i in range(2):
                        record = RequestRecord(index=i, prompt_len=3, max_tokens=1, arrival=0.0)
                        done = await t.send(BenchRequest((1, 2, 3), 3, 1), record)
                        assert done.ok, (done.error, done.detail)
        finally:
            await runner.cleanup()

    asyncio.run(main())
    assert [b.get("cache_salt") for b in bodies] == ["run-a", "run-a", None, None]
