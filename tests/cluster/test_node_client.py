"""A Node.js client against a real CPU cluster (router, one prefill and one decode node of the
embedded model): tests/cluster/node/client.js knows only the .proto files, loaded at run time with
@grpc/proto-loader and served through @grpc/grpc-js (no generated code). Its unary Complete and
streamed Generate answers must hold the tokens the Python SDK gets for the same greedy requests,
and a bad request must reach it as INVALID_ARGUMENT. The npm packages (versions pinned in
tests/cluster/node/package.json and package-lock.json) are installed once into a cache
folder outside the repository; without node/npm, or when npm cannot install them (no network),
the tests skip.

Every component also serves gRPC reflection v1 (beside v1alpha), checked here on all three."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2
from support.processes import start_cli, start_router

from splitserve.client import Client, SplitserveError
from splitserve.models.tiny import default_cache_dir, ensure_tiny_model

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "tests" / "cluster" / "node"
PACKAGE_JSON = "tests/cluster/node/package.json"
NPM_FILES = ("package.json", "package-lock.json")
PROMPT_IDS = [1, 2, 3, 4, 5]  # what client.js sends
MAX_TOKENS = 8


def _npm_packages() -> Path:
    """The node_modules folder holding tests/cluster/node's pinned packages, installed on first use
    into ``$SPLITSERVE_NODE_CACHE`` (default ~/.cache/splitserve/node-client), one folder per
    digest of the package files (atomically: concurrent first uses are safe)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed (scripts/setup.sh installs them as root)")
    digest = hashlib.sha256(b"".join((NODE_DIR / f).read_bytes() for f in NPM_FILES))
    root = Path(os.environ.get("SPLITSERVE_NODE_CACHE") or default_cache_dir() / "node-client")
    target = root / digest.hexdigest()[:16]
    done = target / "node_modules" / ".splitserve-installed"
    if done.is_file():
        return done.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".install-", dir=root))
    try:
        for name in NPM_FILES:
            shutil.copy(NODE_DIR / name, tmp / name)
        cmd = ["npm", "install", "--no-audit", "--no-fund", "--ignore-scripts", "--no-save"]
        # One quick retry: offline, npm gives up in ~10 s rather than its default ~70 s.
        cmd += [
            "--fetch-retries=1",
            "--fetch-retry-mintimeout=1000",
            "--fetch-retry-maxtimeout=4000",
        ]
        try:
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            pytest.skip(
                "npm install of tests/cluster/node/package.json took over 120 s (no network?)"
            )
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            said = [line for line in lines if " code " in line or "request to" in line]
            reason = "; ".join(said[:2] or lines[-3:])
            pytest.skip(
                f"npm install of tests/cluster/node/package.json failed (no network?): {reason}"
            )
        (tmp / "node_modules" / ".splitserve-installed").touch()
        try:
            os.rename(tmp, target)
        except OSError:
            if not done.is_file():  # lost the race only if the other install is complete
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return done.parent


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Prefill and decode node started at once, then the router over them; ready once the
    router has answered a request that needed both.

    NOTE: the router starts after its nodes serve. Started beside them, its first health round
    found them not listening, and its channels then back off (up to 2 s) past the moment they
    serve: a request in that window failed UNAVAILABLE on a node that was up."""
    tmp = tmp_path_factory.mktemp("node-cluster")
    model = ensure_tiny_model()
    node_args = ["--model", str(model), "--kv-cache-mb", "64"]
    procs = []
    try:
        with ThreadPoolExecutor(2) as pool:
            starting = [pool.submit(start_cli, role, [role, *node_args], tmp) for role in ROLES]
            for future in starting:  # every one started is stopped, whichever failed
                with contextlib.suppress(Exception):
                    procs.append(future.result())
            prefill, decode = (future.result() for future in starting)
        router = start_router(model, tmp, [prefill.address], [decode.address])
        procs.append(router)
        _wait_routed(router.address)
        yield router, prefill, decode
    finally:
        for proc in procs:  # all at once: they drain in parallel
            proc.popen.terminate()
        for proc in procs:
            proc.stop()


ROLES = ("prefill", "decode")


def _wait_routed(address: str, timeout_s: float = 60.0) -> None:
    """Until the router has seen its nodes up (it probes them every second) and served one that
    needed both (two tokens: the second is the decode node's; a request ending at its first
    token never reaches it, and the decode node may start last)."""
    deadline = time.monotonic() + timeout_s
    with Client(address) as client:
        while True:
            try:
                client.generate(prompt_token_ids=[1], max_tokens=2, temperature=0, timeout=10)
                return
            except SplitserveError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


@pytest.fixture(scope="module")
def js(request):
    """What client.js printed for the router of ``cluster`` (the npm packages are installed,
    when not cached yet, while the cluster starts)."""
    with ThreadPoolExecutor(1) as pool:
        installing = pool.submit(_npm_packages)
        router = request.getfixturevalue("cluster")[0]
        node_modules = installing.result()
    env = {**os.environ, "NODE_PATH": str(node_modules)}
    cmd = ["node", str(NODE_DIR / "client.js"), router.address, str(ROOT / "proto")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"client.js failed:\n{proc.stderr[-3000:]}"
    assert "not found" not in proc.stderr, proc.stderr  # proto-loader warns of a bad path
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def sdk(cluster):
    """The Python SDK's answers to the requests client.js makes."""
    greedy = dict(max_tokens=MAX_TOKENS, temperature=0)
    with Client(cluster[0].address) as client:
        return {
            "token_ids": client.generate(prompt_token_ids=PROMPT_IDS, **greedy),
            "text": client.generate("Hello", **greedy),
            "chat": client.chat([{"role": "user", "content": "Hi"}], **greedy),
        }


@pytest.mark.parametrize("kind", ["token_ids", "text", "chat"])
def test_node_client_gets_the_sdks_tokens_unary_and_streamed(js, sdk, kind):
    expected = sdk[kind]
    assert 0 < len(expected.token_ids) <= MAX_TOKENS
    unary, stream = js[kind]["complete"], js[kind]["generate"]
    assert unary["token_ids"] == list(expected.token_ids)
    assert [t for msg in stream for t in msg["token_ids"]] == unary["token_ids"]
    assert unary["text"] == expected.text == "".join(msg["text"] for msg in stream)
    assert unary["finish_reason"] == stream[-1]["finish_reason"] == expected.finish_reason
    assert all(msg["finish_reason"] == "" for msg in stream[:-1])
    assert unary["usage"]["completion_tokens"] == len(expected.token_ids)
    assert stream[-1]["usage"]["completion_tokens"] == len(expected.token_ids)


def test_node_client_sees_invalid_argument(js):
    assert js["invalid"]["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0] == 3
    assert "max_tokens" in js["invalid"]["details"]


def _reflect_v1(address: str, *requests):
    """Reflection v1 asked raw: the v1 method path with v1alpha's messages (the same fields)."""
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        return list(call(iter(requests), timeout=10))


def test_every_component_serves_reflection_v1(cluster):
    router, prefill, decode = cluster
    listing = reflection_pb2.ServerReflectionRequest(list_services="")
    expected = {
        router: "splitserve.v1.RouterService",
        prefill: "splitserve.v1.PrefillNodeService",
        decode: "splitserve.v1.DecodeNodeService",
    }
    for proc, service in expected.items():
        (reply,) = _reflect_v1(proc.address, listing)
        names = {s.name for s in reply.list_services_response.service}
        assert {service, "grpc.reflection.v1.ServerReflection"} <= names, proc.address
        assert "grpc.reflection.v1alpha.ServerReflection" in names
    symbol = reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="splitserve.v1.RouterService"
    )
    (reply,) = _reflect_v1(router.address, symbol)
    protos = reply.file_descriptor_response.file_descriptor_proto
    assert any(b"splitserve/v1/router.proto" in raw for raw in protos)
