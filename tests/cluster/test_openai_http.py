"""The OpenAI-compatible HTTP API, driven by the real ``openai`` package (sync and async, streamed
and not), curl and a raw socket, against a router, a prefill and a decode node as separate
processes: the same tokens as the gRPC SDK, usage and cached tokens, OpenAI's errors with their
HTTP codes, and a client that drops the connection frees every block in both pools."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.processes import node_stats, start_node, start_router

from splitserve.client import AsyncClient, Client, SplitserveError
from splitserve.models.tiny import write_random_checkpoint

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime."},
]
GREEDY = dict(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "tiny",
        seed=3,
        with_tokenizer=True,
        vocab_size=300,
        max_position_embeddings=1024,
    )


class Cluster:
    def __init__(self, router, prefill, decode, http: str, metrics: str = "") -> None:
        self.router, self.prefill, self.decode = router, prefill, decode
        self.http = http  # http://host:port
        self.metrics = metrics  # the router's /metrics URL
        self.nodes = [prefill, decode]

    def requests_ended(self) -> dict[str, float]:
        """The router's splitserve_requests_total, by code."""
        with urllib.request.urlopen(self.metrics, timeout=10) as r:
            text = r.read().decode()
        return {
            s.labels["code"]: s.value
            for family in text_string_to_metric_families(text)
            if family.name == "splitserve_requests"
            for s in family.samples
            if s.name == "splitserve_requests_total"
        }

    def free_blocks(self) -> list[int]:
        return [node_stats(n).num_free_blocks for n in self.nodes]

    def wait_idle(self, idle: list[int], timeout: float = 15.0) -> list[int]:
        deadline = time.monotonic() + timeout
        while (now := self.free_blocks()) != idle and time.monotonic() < deadline:
            time.sleep(0.2)
        return now


def http_router(model, tmp, prefill, decode, *flags):
    port_file = tmp / f"http-{time.monotonic_ns()}.port"
    router = start_router(
        model, tmp, [prefill.address], [decode.address],
        "--http-port", "0", "--http-port-file", str(port_file), *flags,
    )  # fmt: skip
    return router, f"http://127.0.0.1:{port_file.read_text().strip()}"


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    procs = []
    try:
        prefill = start_node("prefill", model_dir, tmp)
        procs.append(prefill)
        decode = start_node("decode", model_dir, tmp)
        procs.append(decode)
        router, http = http_router(model_dir, tmp, prefill, decode, "--metrics-port", "0")
        procs.append(router)
        metrics = f"http://127.0.0.1:{router.metrics_port}/metrics"
        yield Cluster(router, prefill, decode, http, metrics)
    finally:
        for proc in reversed(procs):
            proc.stop()


def oai(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.http + "/v1", api_key="none", max_retries=0)


def model_name(cluster) -> str:
    return oai(cluster).models.list().data[0].id


def post(cluster, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        cluster.http + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_and_health(cluster):
    models = oai(cluster).models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert oai(cluster).models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        oai(cluster).models.retrieve("gpt-4")
    with urllib.request.urlopen(cluster.http + "/health", timeout=10) as r:
        assert r.status == 200


def test_completions_give_the_sdk_tokens_streamed_or_not(cluster):
    client = oai(cluster)
    name = model_name(cluster)
    with Client(cluster.router.address) as sdk:
        want = sdk.generate("The paged KV cache", **GREEDY)
        want_ids = sdk.generate(prompt_token_ids=[5, 6, 7, 8, 9], **GREEDY)
    got = client.completions.create(
        model=name, prompt="The paged KV cache", extra_body={"return_token_ids": True}, **GREEDY
    )
    choice = got.choices[0]
    assert choice.model_extra["token_ids"] == list(want.token_ids)
    assert choice.text == want.text
    assert choice.finish_reason == want.finish_reason == "length"
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.completion_tokens == 8
    by_ids = client.completions.create(model=name, prompt=[5, 6, 7, 8, 9], **GREEDY)
    assert by_ids.choices[0].text == want_ids.text
    chunks = list(
        client.completions.create(
            model=name, prompt="The paged KV cache", stream=True,
            extra_body={"return_token_ids": True}, **GREEDY,
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == list(
        want.token_ids
    )
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_gives_the_sdk_tokens_sync_and_async(cluster):
    name = model_name(cluster)
    with Client(cluster.router.address) as sdk:
        want = sdk.chat(CHAT, **GREEDY)
    assert len(want.token_ids) == 8
    extra = {"extra_body": {"return_token_ids": True}}
    reply = oai(cluster).chat.completions.create(model=name, messages=CHAT, **GREEDY, **extra)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == want.text
    assert reply.choices[0].model_extra["token_ids"] == list(want.token_ids)
    assert reply.usage.prompt_tokens == want.usage.prompt_tokens

    async def run():
        aclient = openai.AsyncOpenAI(base_url=cluster.http + "/v1", api_key="none", max_retries=0)
        whole = await aclient.chat.completions.create(model=name, messages=CHAT, **GREEDY)
        stream = await aclient.chat.completions.create(
            model=name, messages=CHAT, stream=True,
            stream_options={"include_usage": True}, **GREEDY,
        )  # fmt: skip
        chunks = [c async for c in stream]
        await aclient.close()
        async with AsyncClient(cluster.router.address) as sdk_async:
            mine = await sdk_async.chat(CHAT, **GREEDY)
        return whole, chunks, mine

    whole, chunks, mine = asyncio.run(run())
    assert whole.choices[0].message.content == want.text == mine.text
    assert mine.token_ids == want.token_ids
    *body, last = chunks
    assert body[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in body) == want.text
    assert all(c.usage is None for c in body)
    # include_usage: a last chunk with no choices and the whole request's usage.
    assert last.choices == [] and last.usage.completion_tokens == 8
    assert last.usage.prompt_tokens == want.usage.prompt_tokens


def test_repeated_long_prompt_reports_cached_tokens(cluster):
    client = oai(cluster)
    prompt = list(range(3, 203))  # 200 tokens: 12 full blocks of 16
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens == 200
    assert again.usage.prompt_tokens_details.cached_tokens >= 192
    assert again.usage.prompt_tokens_details.cached_tokens > (
        first.usage.prompt_tokens_details.cached_tokens
    )

    # A tenant's salt from a trusted proxy's header wins over the body's: no cross-tenant hits.
    def cached(header: str | None, body_salt: str | None) -> int:
        headers = {"x-splitserve-cache-salt": header} if header else None
        extra = {"cache_salt": body_salt} if body_salt else None
        return client.completions.create(
            model="tiny", prompt=prompt, max_tokens=2, extra_headers=headers, extra_body=extra
        ).usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a", None) == 0  # another tenant's cache: cold
    assert cached("tenant-a", None) >= 192
    assert cached("tenant-b", "tenant-a") == 0  # the body cannot pick tenant a's cache
    assert cached(None, "tenant-c") == 0 and cached(None, "tenant-c") >= 192


def test_n_choices_and_prompt_lists(cluster):
    client = oai(cluster)
    got = client.completions.create(
        model="tiny", prompt=["Hello", "World"], n=2, max_tokens=4, temperature=1.0, seed=11
    )
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert got.usage.completion_tokens == 16
    with Client(cluster.router.address) as sdk:  # choice j of a prompt: seed + j
        for i, prompt in enumerate(["Hello", "World"]):
            for j in range(2):
                want = sdk.generate(prompt, max_tokens=4, temperature=1.0, seed=11 + j)
                assert got.choices[2 * i + j].text == want.text
    greedy = client.chat.completions.create(model="tiny", messages=CHAT, n=3, **GREEDY)
    assert len({c.message.content for c in greedy.choices}) == 1  # greedy: the same reply


BAD = [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", [1, 2], 400, "JSON object"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "does not exist"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "not a token"),
    ("/v1/completions", {"prompt": "x", "logprobs": 5}, 400, "top log-probabilities"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n must be"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": [0] * 2000}, 400, "tokens long"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/completions", {"prompt": [2**32]}, 400, "token ids"),
    ("/v1/completions", {"prompt": [1], "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "not valid JSON"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "best_of": True}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "echo": 0}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "return_token_ids": "false"}, 400, "return_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop": ["y" * 2000]}, 400, "characters"),
]


@pytest.mark.parametrize(("path", "body", "status", "words"), BAD)
def test_bad_input_gets_its_status_and_an_openai_error_then_a_good_request_works(
    cluster, path, body, status, words
):
    code, reply = post(cluster, path, body)
    assert code == status, reply
    error = reply["error"]
    assert words in error["message"] and error["type"] and error["code"] == status
    # ignore_eos: sampled at the default temperature 1, the random model may end at EOS first.
    good = {"prompt": "fine", "max_tokens": 2, "ignore_eos": True}
    code, ok = post(cluster, "/v1/completions", good)
    assert code == 200 and ok["usage"]["completion_tokens"] == 2


def test_unknown_route_and_oversized_body_are_openai_errors(cluster):
    code, reply = post(cluster, "/v1/embeddings", {"input": "x"})
    assert code == 404 and reply["error"]["type"] == "not_found_error"
    code, reply = post(cluster, "/v1/completions", {"prompt": "x" * (5 << 20)})
    assert code == 413 and "max-request-bytes" in reply["error"]["message"]


def test_openai_client_raises_its_own_error_classes(cluster):
    client = oai(cluster)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=-3)
    assert "max_tokens" in str(err.value)


def _raw_sse(cluster, body) -> list[bytes]:
    """The response of an HTTP/1.0 request on a plain socket, as a browser's EventSource reads
    it (no chunked encoding: the server closes at the end)."""
    host, port = cluster.http.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + data)
        raw = b"".join(iter(lambda: sock.recv(65536), b""))
    headers, _, payload = raw.partition(b"\r\n\r\n")
    assert b"200" in headers.split(b"\r\n")[0] and b"text/event-stream" in headers
    return payload.split(b"\n\n")


def test_sse_as_curl_and_a_raw_socket_read_it(cluster):
    body = {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "stream": True}
    events = [e for e in _raw_sse(cluster, body) if e]
    assert all(e.startswith(b"data: ") for e in events)
    assert events[-1] == b"data: [DONE]"
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
    with Client(cluster.router.address) as sdk:
        assert "".join(texts) == sdk.generate("Hello", max_tokens=5, temperature=0).text
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed: the raw-socket read above covered the SSE format")
    out = subprocess.run(
        ["curl", "-sN", cluster.http + "/v1/completions", "-H", "Content-Type: application/json",
         "-d", json.dumps(body)],
        capture_output=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    lines = [line for line in out.split(b"\n") if line]
    assert lines[-1] == b"data: [DONE]" and all(line.startswith(b"data: ") for line in lines)
    # The same text; how it is cut into events depends on timing (the decode node sends the
    # tokens that queued up meanwhile in one message).
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]) == "".join(
        texts
    )


@contextlib.contextmanager
def paused(proc):
    """``proc`` stopped (SIGSTOP) for the block: its requests make no progress meanwhile, so a
    test needs no bet on how long the tiny model takes to answer."""
    os.kill(proc.popen.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.popen.pid, signal.SIGCONT)


def until(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def test_client_that_disconnects_mid_stream_frees_every_block(cluster):
    idle = cluster.wait_idle(cluster.free_blocks())
    finished = node_stats(cluster.decode).counters.get("requests_finished", 0)
    client = oai(cluster)
    stream = client.completions.create(
        model="tiny", prompt=[9] * 70, max_tokens=600, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))  # its first token: it is under way
    cancelled = cluster.requests_ended().get("CANCELLED", 0)
    with paused(cluster.decode):  # it cannot end there before the router has cancelled it
        stream.close()  # drops the connection
        until(lambda: cluster.requests_ended().get("CANCELLED", 0) > cancelled, "router cancels")
    assert cluster.wait_idle(idle) == idle
    stats = node_stats(cluster.decode)
    assert stats.running == 0 and stats.counters.get("requests_finished", 0) == finished
    # And a non-streamed request whose client gives up waiting: the decode node is paused once
    # it runs the request, so the client's timeout fires first, whatever the machine's speed.
    slow = openai.OpenAI(base_url=cluster.http + "/v1", api_key="x", max_retries=0, timeout=1.0)
    cancelled = cluster.requests_ended().get("CANCELLED", 0)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(
            slow.completions.create,
            model="tiny", prompt=[9] * 70, max_tokens=900, extra_body={"ignore_eos": True},
        )  # fmt: skip
        until(lambda: answer.done() or node_stats(cluster.decode).running == 1, "it runs")
        with paused(cluster.decode):
            with pytest.raises(openai.APITimeoutError):
                answer.result(timeout=60)
            until(lambda: cluster.requests_ended().get("CANCELLED", 0) > cancelled, "cancelled")
    assert cluster.wait_idle(idle) == idle


def test_token_id_only_checkpoint_and_tokenizer_flag(cluster, model_dir, tmp_path):
    # The same checkpoint without its tokenizer files (same folder name: same model identity).
    bare = tmp_path / "bare" / model_dir.name
    shutil.copytree(model_dir, bare)
    for f in bare.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            f.unlink()
    router, http = http_router(bare, tmp_path, cluster.prefill, cluster.decode)
    try:
        with Client(router.address) as sdk, Client(cluster.router.address) as full:
            got = sdk.generate(prompt_token_ids=[5, 6, 7], **GREEDY)
            assert got.token_ids == full.generate(prompt_token_ids=[5, 6, 7], **GREEDY).token_ids
            assert got.text == ""  # no tokenizer: token ids only
        bare_cluster = Cluster(router, cluster.prefill, cluster.decode, http)
        code, reply = post(bare_cluster, "/v1/completions", {"prompt": "Hi"})
        assert code == 400 and "tokenizer" in reply["error"]["message"]
        assert "--tokenizer" in reply["error"]["message"]
        code, reply = post(bare_cluster, "/v1/chat/completions", {"messages": CHAT})
        assert code == 400 and "tokenizer" in reply["error"]["message"]
        code, reply = post(bare_cluster, "/v1/completions", {"prompt": [5, 6, 7], **GREEDY})
        assert code == 200 and reply["usage"]["completion_tokens"] == 8
    finally:
        router.stop()
    router, _ = http_router(bare, tmp_path, cluster.prefill, cluster.decode, "--tokenizer",
                            str(model_dir))  # fmt: skip
    try:
        with Client(router.address) as sdk, Client(cluster.router.address) as full:
            assert sdk.chat(CHAT, **GREEDY).text == full.chat(CHAT, **GREEDY).text
    finally:
        router.stop()


def test_every_ending_is_counted_by_its_code(cluster):
    """Refused requests count (by their code), and a deadline that expires is DEADLINE_EXCEEDED,
    not CANCELLED."""
    before = cluster.requests_ended()
    post(cluster, "/v1/completions", {"prompt": "x", "max_tokens": 0})  # refused by the checks
    post(cluster, "/v1/completions", b"{not json")  # refused by the HTTP front
    with Client(cluster.router.address) as sdk:
        with pytest.raises(SplitserveError) as err:
            sdk.generate(prompt_token_ids=[1, 2, 3], max_tokens=0)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        # The client's deadline passes mid-request and a stream is closed after its first token,
        # the decode node paused once it runs them: neither can end first, whatever the
        # machine's speed (the pauses are short of the router's stall detection, ~2 s).
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(
                sdk.generate,
                prompt_token_ids=[9] * 50, max_tokens=900, ignore_eos=True, timeout=0.5,
            )  # fmt: skip
            until(lambda: answer.done() or node_stats(cluster.decode).running == 1, "it runs")
            with paused(cluster.decode), pytest.raises(SplitserveError) as err:
                answer.result(timeout=60)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        cancelled = cluster.requests_ended().get("CANCELLED", 0)
        stream = sdk.stream(prompt_token_ids=[9] * 50, max_tokens=900, ignore_eos=True)
        next(iter(stream))
        with paused(cluster.decode):
            stream.close()  # cancelled
            until(lambda: cluster.requests_ended().get("CANCELLED", 0) > cancelled, "cancelled")
        sdk.generate(prompt_token_ids=[1, 2, 3], max_tokens=2)
    want = {"INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 1, "CANCELLED": 1, "OK": 1}
    deadline = time.monotonic() + 10
    while True:  # a cancelled stream is counted when the router sees it end
        after = cluster.requests_ended()
        got = {code: after.get(code, 0) - before.get(code, 0) for code in want}
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got == want


def test_pools_down_is_503_and_a_full_client_cap_is_429(cluster, model_dir, tmp_path):
    down = start_router(
        model_dir, tmp_path, ["127.0.0.1:1"], ["127.0.0.1:2"],
        "--http-port", "0", "--http-port-file", str(tmp_path / "down.port"),
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{(tmp_path / 'down.port').read_text().strip()}"
        dead = Cluster(down, None, None, url)
        code, reply = post(dead, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert code == 503 and reply["error"]["type"] == "service_unavailable_error"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url + "/health", timeout=10)
        assert err.value.code == 503
    finally:
        down.stop()
    capped, http = http_router(
        model_dir, tmp_path, cluster.prefill, cluster.decode, "--max-requests-per-client", "0"
    )
    try:
        code, reply = post(Cluster(capped, None, None, http), "/v1/completions", {"prompt": "x"})
        assert code == 429 and "max-requests-per-client" in reply["error"]["message"]
    finally:
        capped.stop()


def test_http_api_beside_mtls_listens_on_loopback_only_unless_https_and_keys():
    from splitserve.router.config import RouterConfig

    tls = dict(tls_cert="c.pem", tls_key="k.pem", tls_ca="ca.pem")
    base = dict(model_path="m", prefill_addresses=(), decode_addresses=(), host="0.0.0.0")
    with pytest.raises(ValueError, match="without HTTPS and API keys"):
        RouterConfig(**base, **tls, http_port=8080)
    guarded = dict(http_tls_cert="h.pem", http_tls_key="hk.pem", api_key_file="keys")
    assert RouterConfig(**base, **tls, **guarded, http_port=8080).http_host is None
    assert RouterConfig(**base, **tls, http_port=8080, http_host="127.0.0.1").http_port == 8080
    assert RouterConfig(**base, http_port=8080).http_host is None  # no TLS: any address
