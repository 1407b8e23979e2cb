"""`splitserve bench` for real: the HTTP target against a fake aiohttp server on loopback, and
one smoke run of the command against a `splitserve up` cluster over gRPC and HTTP (the pure
parts are in tests/unit/test_bench.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.bench_schema import assert_documented

from splitserve.bench import metrics, targets
from splitserve.bench.metrics import RequestRecord
from splitserve.bench.workloads import BenchRequest


def rec(i, start, tokens, end, n=None, error=None, arrival=None):
    return RequestRecord(
        i,
        10,
        4,
        arrival if arrival is not None else start,
        start,
        end,
        list(tokens),
        n if n is not None else len(tokens),
        error=error,
    )


def test_http_target_against_a_fake_server():
    from aiohttp import web

    async def completions(request):
        body = await request.json()
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        assert body["model"] == "m1" and body["ignore_eos"] is True
        if body["max_tokens"] == 1:
            return web.json_response({"error": {"code": 429, "message": "busy"}}, status=429)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            piece = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(piece)}\n\n".encode())
        if body["max_tokens"] == 2:
            await resp.write(b'data: {"error": {"code": 500}}\n\n')
        usage = {
            "prompt_tokens": 7,
            "completion_tokens": body["max_tokens"],
            "prompt_tokens_details": {"cached_tokens": 3},
        }
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(request):
        return web.json_response({"data": [{"id": "m1"}, {"id": "m2"}]})

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/v1/models", models)
        server = web.AppRunner(app)
        await server.setup()
        site = web.TCPSite(server, "127.0.0.1", 0)
        await site.start()
        port = server.addresses[0][1]
        try:
            async with targets.make_target(f"http://127.0.0.1:{port}") as t:
                await t.prepare()
                assert t.model == "m1"
                out = []
                for n in (5, 1, 2):
                    out.append(await t.send(BenchRequest((1, 2), 2, n), rec(n, 0, [], 0)))
                return out
        finally:
            await server.cleanup()

    ok, refused, broken = asyncio.run(main())
    assert ok.ok and ok.output_tokens == 5 and len(ok.token_times) == 5
    assert ok.prompt_tokens == 7 and ok.cached_tokens == 3 and ok.ttft > 0
    assert refused.error == "HTTP 429" and refused.detail == "busy"
    assert broken.error == "stream error 500" and broken.output_tokens == 2


PNGS = {"latency_cdf.png", "throughput.png", "concurrency.png", "kv_usage.png"}


def _start_up(log):
    cmd = [
        sys.executable,
        "-m",
        "splitserve.cli",
        "up",
        "--model",
        "tiny",
        "--port",
        "0",
        "--http-port",
        "0",
        "--metrics-port",
        "0",
        "--num-prefill",
        "1",
        "--num-decode",
        "1",
    ]
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    lines = []
    while not (line := up.stdout.readline()).startswith("ready:"):
        assert line, f"splitserve up exited: {Path(log.name).read_text()[-2000:]}"
        lines.append(line.split())
    addresses = {w[0]: w[1] for w in lines}
    metrics_urls = [w[3] for w in lines if len(w) > 3 and w[2] == "metrics"]
    return up, addresses, metrics_urls


@pytest.mark.slow
def _bench_cmd(target: str, name: str, prompt_format: str, tmp_path: Path, metrics_urls):
    args = f"--num-requests 6 --max-concurrency 3 --input-len uniform:4:12 --output-len 8 \
        --prompt-format {prompt_format} --warmup 1 --seed 1 --slo ttft=60,tpot=10 --no-progress \
        --label {name} --result-json {tmp_path / name}.json --plots {tmp_path / name}"
    urls = [a for url in metrics_urls for a in ("--metrics-url", url)]
    cli = [sys.executable, "-m", "splitserve.cli", "bench", "--target", target]
    return [*cli, *args.split(), *urls]


def _check_run(name: str, out: str, tmp_path: Path) -> None:
    import matplotlib.image

    assert "output tok/s" in out and "TTFT" in out
    doc = json.loads((tmp_path / f"{name}.json").read_text())
    assert_documented(doc)
    res = doc["results"]
    assert res["completed"] == 6 and res["failed"] == 0 and res["failures"] == {}
    assert res["output_tokens"] == 48 and res["output_throughput"] > 0
    assert res["total_token_throughput"] > res["output_throughput"] > 0
    assert res["request_throughput"] > 0 and res["input_tokens"] > 0
    assert res["good_requests"] == 6 and res["goodput"] > 0
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        d = res[key]
        assert set(d) == set(metrics.STATS)
        assert 0 < d["p50"] <= d["p90"] <= d["p99"] <= d["max"] and d["mean"] > 0
    assert doc["target"]["kind"] == name and doc["label"] == name
    assert len(doc["requests"]) == 6 and all(r["output_tokens"] == 8 for r in doc["requests"])
    assert 0 < max(doc["timeline"]["in_flight"]) <= 3
    assert doc["server_metrics"]["scrapes"] >= 1
    assert "kv_usage" in doc["server_metrics"]["summary"]
    assert {Path(p).name for p in doc["plots"]} == PNGS
    for p in doc["plots"]:
        data = Path(p).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
        assert matplotlib.image.imread(p).shape[0] > 100
    if name == "http":
        assert doc["target"]["model"]  # from GET /v1/models
    client = doc["client"]
    assert client["processes"] == (2 if name == "grpc" else 1) == len(client["cpu_cores"])
    assert "load generator:" in out


@pytest.mark.slow
def test_bench_command_against_up_over_grpc_and_http(tmp_path):
    log = (tmp_path / "up.log").open("w")
    up, addresses, metrics_urls = _start_up(log)
    try:
        try:
            assert len(metrics_urls) == 3  # router, prefill, decode
            runs = {"grpc": f"grpc://{addresses['router']}", "http": f"http://{addresses['http']}"}
            formats = {"grpc": "ids", "http": "text"}
            # up made an API key for its HTTP API: the HTTP run presents it.
            # up made an API key for both APIs: each run presents it.
            keys = {name: ["--api-key-file", addresses["api-key"]] for name in runs}
            keys["grpc"] += ["--processes", "2"]  # the load spread over two processes
            procs = {
                name: subprocess.Popen(
                    _bench_cmd(target, name, formats[name], tmp_path, metrics_urls) + keys[name],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for name, target in runs.items()
            }
            outputs = {name: p.communicate(timeout=120) for name, p in procs.items()}
        finally:
            up.terminate()  # it stops while the results are checked
        for name, (out, err) in outputs.items():
            assert procs[name].returncode == 0, out + err
            _check_run(name, out, tmp_path)
    finally:
        try:
            up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()
