"""API keys and HTTPS on the router's HTTP front (``--api-key-file``, ``--http-tls-cert/-key``),
driven by the real ``openai`` client against a router, a prefill and a decode node as separate
processes: without a key, or with a wrong one, every route but /health is a 401 in OpenAI's
error JSON (unknown routes too); with any key of the file it answers; a key added to the file is
taken and a key removed from it refused without a restart; the same keys guard the gRPC API;
over HTTPS with a CA made by the openssl CLI (a client that does not trust that CA is refused in
the handshake); a router with mTLS serves an HTTPS + key front on a public address and refuses to
start one without; and
``splitserve bench`` and ``splitserve generate`` reach such a router with their TLS and key
options."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from support.pki import HAVE_OPENSSL, make_pki
from support.processes import start_cli, start_node, start_router

from splitserve.models.tiny import write_random_checkpoint

KEYS = ["k-" + "a" * 30, "k-" + "b" * 30]
needs_openssl = pytest.mark.skipif(not HAVE_OPENSSL, reason="test certificates need openssl")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    model = write_random_checkpoint(tmp / "tiny", seed=5, with_tokenizer=True)
    procs = [start_node("prefill", model, tmp), start_node("decode", model, tmp)]
    key_file = tmp / "api-keys"
    key_file.write_text(f"# the front's keys\n\n{KEYS[0]}\n  {KEYS[1]}  \n")
    yield model, tmp, procs, key_file
    for proc in procs:
        proc.stop()


def http_router(nodes, *flags: str, scheme: str = "http"):
    model, tmp, (prefill, decode), _ = nodes
    port_file = tmp / f"http-{time.monotonic_ns()}.port"
    router = start_router(
        model, tmp, [prefill.address], [decode.address],
        "--http-port", "0", "--http-port-file", str(port_file), *flags,
    )  # fmt: skip
    return router, f"{scheme}://127.0.0.1:{port_file.read_text().strip()}"


def _status(url: str, headers: dict | None = None, context=None) -> tuple[int, dict]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def keyed_router(nodes):
    router, url = http_router(nodes, "--api-key-file", str(nodes[3]))
    yield router, url
    router.stop()


@pytest.fixture(scope="module")
def keyed(keyed_router):
    return keyed_router[1]


def test_the_same_keys_guard_the_grpc_api(keyed_router):
    """One key for both doors: a gRPC call without a key of the file is UNAUTHENTICATED (the
    SDK's message says how to give one), with any of them it is served and the key is its
    client; the health service stays open."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from splitserve.client import Client, SplitserveError

    router, _ = keyed_router
    for key in (None, "", KEYS[0] + "x"):
        with Client(router.address, api_key=key) as client:
            with pytest.raises(SplitserveError) as refused:
                client.generate("Hello", max_tokens=2, timeout=30)
            assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization: Bearer <key>" in refused.value.message
    for key in KEYS:
        with Client(router.address, api_key=key) as client:
            out = client.generate("Hello", max_tokens=3, ignore_eos=True, temperature=0.0)
            assert out.usage.completion_tokens == 3
    with grpc.insecure_channel(router.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_without_a_valid_key_the_openai_client_gets_401(keyed):
    for key in ("none", KEYS[0][:-1] + "x", KEYS[0] + "x"):
        client = openai.OpenAI(base_url=keyed + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as refused:
            client.completions.create(model="tiny", prompt="Hello", max_tokens=4)
        assert refused.value.status_code == 401
        error = refused.value.body
        assert isinstance(error, dict), error
        assert set(error) == {"message", "type", "param", "code"}, error
        assert "Authorization: Bearer" in error["message"] and error["code"] == 401
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    # No header at all, and every route: unknown ones too (nothing is learnt without a key).
    for path in ("/v1/models", "/v1/nothing-here", "/metrics"):
        status, body = _status(keyed + path)
        assert status == 401 and body["error"]["type"] == "authentication_error", (path, body)
    status, body = _status(keyed + "/v1/models", {"Authorization": "Basic " + KEYS[0]})
    assert status == 401


def test_health_stays_open_and_every_key_of_the_file_works(keyed):
    assert _status(keyed + "/health") == (200, {"status": "ok"})
    for key in KEYS:
        client = openai.OpenAI(base_url=keyed + "/v1", api_key=key, max_retries=0)
        out = client.completions.create(
            model="tiny",
            prompt="Hello",
            max_tokens=4,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert out.usage is not None and out.usage.completion_tokens == 4
        chunks = list(
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=3,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        assert chunks and chunks[-1].choices[0].finish_reason == "length"
    status, _ = _status(keyed + "/v1/models", {"authorization": "bearer " + KEYS[1]})
    assert status == 200  # the scheme is case-insensitive, as RFC 7235 says


def test_keys_are_added_and_revoked_without_a_restart(nodes, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text(KEYS[0] + "\n")
    router, url = http_router(nodes, "--api-key-file", str(key_file))
    new = "k-" + "c" * 30
    try:
        assert _status(url + "/v1/models", {"Authorization": f"Bearer {KEYS[0]}"})[0] == 200
        key_file.write_text(new + "\n")  # KEYS[0] revoked, a new key added
        deadline = time.monotonic() + 10
        while _status(url + "/v1/models", {"Authorization": f"Bearer {new}"})[0] != 200:
            assert time.monotonic() < deadline, "the changed key file was not read again"
            time.sleep(0.2)
        assert _status(url + "/v1/models", {"Authorization": f"Bearer {KEYS[0]}"})[0] == 401
        key_file.write_text("# emptied by mistake\n")  # no key: the keys read before stay
        time.sleep(1.5)
        assert _status(url + "/v1/models", {"Authorization": f"Bearer {new}"})[0] == 200
    finally:
        router.stop()


@needs_openssl
def test_https_with_a_key_and_a_ca_made_by_openssl(nodes, tmp_path):
    pki = make_pki(tmp_path / "pki")
    router, url = http_router(
        nodes,
        "--api-key-file", str(nodes[3]),
        "--http-tls-cert", pki["cert"], "--http-tls-key", pki["key"],
        scheme="https",
    )  # fmt: skip
    try:
        trusted = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=pki["ca"]))
        client = openai.OpenAI(
            base_url=url + "/v1", api_key=KEYS[0], http_client=trusted, max_retries=0
        )
        out = client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
        assert out.usage is not None and out.usage.completion_tokens >= 1
        nokey = openai.OpenAI(
            base_url=url + "/v1", api_key="none", http_client=trusted, max_retries=0
        )
        with pytest.raises(openai.AuthenticationError):
            nokey.models.list()
        # A client that does not trust the CA never gets to send its key.
        stranger = openai.OpenAI(base_url=url + "/v1", api_key=KEYS[0], max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            stranger.models.list()
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP: no answer
            urllib.request.urlopen(url.replace("https", "http") + "/health", timeout=5)
        context = ssl.create_default_context(cafile=pki["ca"])
        assert _status(url + "/health", context=context)[0] == 200  # open over HTTPS too
        bench = _bench(url, "--tls-ca", pki["ca"], "--api-key-file", str(nodes[3]))
        assert bench.returncode == 0, bench.stderr[-2000:]
        assert _figure(bench.stdout, "completed requests") == "2", bench.stdout
        refused = _bench(url, "--tls-ca", pki["ca"])  # no key: every request a 401
        assert "HTTP 401" in refused.stdout + refused.stderr
    finally:
        router.stop()


@needs_openssl
def test_with_mtls_a_public_http_front_needs_https_and_a_key(nodes, tmp_path):
    model, _, _, key_file = nodes
    pki = make_pki(tmp_path / "pki")
    mtls = ["--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-ca", pki["ca"]]
    base = [sys.executable, "-m", "splitserve.cli", "router", "--model", str(model)]
    base += ["--decode", "127.0.0.1:1", "--http-port", "0", "--http-host", "0.0.0.0", *mtls]
    refused = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "--http-tls-cert" in refused.stderr and "--api-key-file" in refused.stderr
    half = subprocess.run(
        [*base, "--api-key-file", str(key_file)], capture_output=True, text=True, timeout=60
    )
    assert half.returncode == 2, half.stderr  # a key without HTTPS would cross in clear text
    bad = tmp_path / "bad-keys"
    bad.write_text("short\n")
    https = ["--http-tls-cert", pki["cert"], "--http-tls-key", pki["key"]]
    badkeys = subprocess.run(
        [*base, *https, "--api-key-file", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert badkeys.returncode == 2 and "line 1" in badkeys.stderr, badkeys.stderr

    # The whole cluster over mTLS, its HTTP front public with HTTPS and a key.
    def start(role, *extra):
        args = [role, "--model", str(model), *extra, *mtls]
        return start_cli(role, args, tmp_path, credentials=_grpc_credentials(pki))

    procs = [start("prefill"), start("decode")]
    port_file = tmp_path / "http.port"
    router_flags = ["--prefill", procs[0].address, "--decode", procs[1].address]
    router_flags += ["--http-port", "0", "--http-port-file", str(port_file)]
    router_flags += ["--http-host", "0.0.0.0", *https, "--api-key-file", str(key_file)]
    procs.append(start("router", *router_flags))
    try:
        url = f"https://127.0.0.1:{port_file.read_text().strip()}"
        trusted = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=pki["ca"]))
        client = openai.OpenAI(
            base_url=url + "/v1", api_key=KEYS[1], http_client=trusted, max_retries=0
        )
        assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices
        cli = [sys.executable, "-m", "splitserve.cli", "generate", "--target", procs[2].address]
        cli += ["--max-tokens", "3", "hello"]
        plain = subprocess.run(cli, capture_output=True, text=True, timeout=60)
        assert plain.returncode != 0  # the router takes mTLS clients only
        tls = ["--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-ca", pki["ca"]]
        keyless = subprocess.run([*cli, *tls], capture_output=True, text=True, timeout=60)
        assert keyless.returncode != 0 and "UNAUTHENTICATED" in keyless.stderr  # one key, 2 doors
        tls += ["--api-key-file", str(key_file)]
        gen = subprocess.run([*cli, *tls], capture_output=True, text=True, timeout=60)
        assert gen.returncode == 0 and "completion_tokens=3 " in gen.stderr, gen.stderr
        bench = _bench(f"grpc://{procs[2].address}", *tls)
        assert bench.returncode == 0, bench.stderr[-2000:]
        assert _figure(bench.stdout, "completed requests") == "2", bench.stdout
    finally:
        for proc in reversed(procs):
            proc.stop()


def _grpc_credentials(pki: dict[str, str]):
    import grpc

    read = {k: Path(v).read_bytes() for k, v in pki.items()}
    return grpc.ssl_channel_credentials(read["ca"], read["key"], read["cert"])


def _bench(url: str, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "splitserve.cli", "bench", "--target", url]
    cmd += ["--num-requests", "2", "--input-len", "16", "--output-len", "2", "--no-progress"]
    return subprocess.run([*cmd, *flags], capture_output=True, text=True, timeout=120)


def _figure(table: str, name: str) -> str:
    """The value of row ``name`` in ``splitserve bench``'s table."""
    row = next(line for line in table.splitlines() if line.strip().startswith(name))
    return row.strip()[len(name) :].split()[0]
