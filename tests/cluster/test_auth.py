"""The cluster credential (runtime/auth.py) on real processes: with ``--auth-token-file``, the
nodes' internal services refuse calls without the token — UNAUTHENTICATED, before any parsing,
block or engine work — while health stays open; the router, holding the token, serves through
them token-exact with transformers, and its public service needs no token; the KV goes over
dist through the rendezvous' token gate."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.processes import node_stats, start_node, start_router
from support.reference import hf_greedy

from splitserve.client import Client
from splitserve.models.tiny import write_random_checkpoint
from splitserve.runtime.auth import metadata_for, read_token_file, write_token_file
from splitserve.transfer import Endpoint
from splitserve.v1 import common_pb2, nodes_pb2, nodes_pb2_grpc

UNAUTH = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    model = write_random_checkpoint(tmp / "m", seed=3, with_tokenizer=True, num_hidden_layers=2)
    token_file = tmp / "token"
    token = write_token_file(token_file)
    flags = ("--auth-token-file", str(token_file))
    prefill = start_node("prefill", model, tmp, *flags)
    decode = start_node("decode", model, tmp, *flags)
    router = start_router(model, tmp, [prefill.address], [decode.address], *flags)
    try:
        yield model, token, prefill, decode, router
    finally:
        for proc in (router, prefill, decode):
            proc.stop()


def stats(proc, token):
    with grpc.insecure_channel(proc.address) as channel:
        stub = nodes_pb2_grpc.NodeStatsServiceStub(channel)
        return stub.GetStats(nodes_pb2.GetStatsRequest(), timeout=10, metadata=metadata_for(token))


def refused(call) -> None:
    with pytest.raises(grpc.RpcError) as err:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, bytes):
            list(result)
    assert err.value.code() == UNAUTH, err.value
    assert "cluster token" in err.value.details()


def test_router_with_the_token_serves_token_exact(cluster):
    model, _, _, _, router = cluster
    prompt = [7, 1, 99, 42, 5, 18, 3] * 5
    with Client(router.address) as client:  # the public service: no token
        out = client.generate(prompt_token_ids=prompt, max_tokens=4, temperature=0.0)
    assert list(out.token_ids) == hf_greedy(model, prompt, 4)


def test_the_kv_goes_over_dist_through_the_gated_rendezvous(cluster):
    # No TLS: dist stays the CPU pair's path; with the token its store is behind the gate.
    model, token, _, decode, router = cluster
    prompt = [2, 7, 1, 8, 2, 8, 1, 8] * 6
    with Client(router.address) as client:
        out = client.generate(prompt_token_ids=prompt, max_tokens=3, temperature=0.0)
    assert list(out.token_ids) == hf_greedy(model, prompt, 3)
    reply = stats(decode, token)
    assert reply.counters.get("transfers_dist", 0) >= 1, dict(reply.counters)
    endpoint = Endpoint.from_bytes(reply.transfer_endpoint)
    assert endpoint.dist is not None and endpoint.dist.gated


@pytest.mark.parametrize("token", [None, "x" * 40])  # no token, a wrong one
def test_internal_calls_without_the_token_are_refused_before_any_work(cluster, token):
    _, real, prefill, decode, _ = cluster
    before_p, before_d = stats(prefill, real), stats(decode, real)
    md = metadata_for(token)
    with grpc.insecure_channel(prefill.address) as pc, grpc.insecure_channel(decode.address) as dc:
        p_stub = nodes_pb2_grpc.PrefillNodeServiceStub(pc)
        d_stub = nodes_pb2_grpc.DecodeNodeServiceStub(dc)
        sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=2)
        refused(lambda: nodes_pb2_grpc.NodeStatsServiceStub(dc).GetStats(
            nodes_pb2.GetStatsRequest(), timeout=10, metadata=md))  # fmt: skip
        refused(lambda: p_stub.Prefill(
            nodes_pb2.PrefillRequest(request_id="x", prompt_token_ids=[1] * 40,
                                     sampling=sampling, decode_address=decode.address),
            timeout=10, metadata=md))  # fmt: skip
        fetch = nodes_pb2.FetchBlocksRequest(block_hashes=[b"h" * 32])
        refused(lambda: p_stub.FetchBlocks(fetch, timeout=10, metadata=md))
        header = nodes_pb2.TransferHeader(request_id="forged", prompt_token_ids=[1] * 40)
        messages = [nodes_pb2.TransferKVRequest(header=header)]
        refused(lambda: d_stub.TransferKV(iter(messages), timeout=10, metadata=md))
        refused(lambda: d_stub.Release(
            nodes_pb2.ReleaseRequest(request_id="forged"), timeout=10, metadata=md))  # fmt: skip
        # Garbage bytes under a protected method: refused unread, no parse error.
        raw = pc.unary_unary("/splitserve.v1.PrefillNodeService/Prefill")
        refused(lambda: raw(b"\xff\x00garbage", timeout=10, metadata=md))
        health = health_pb2_grpc.HealthStub(dc).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
    after_p, after_d = stats(prefill, real), stats(decode, real)
    assert after_p.counters.get("prefills", 0) == before_p.counters.get("prefills", 0)
    assert after_d.counters.get("transfers", 0) == before_d.counters.get("transfers", 0)
    assert after_d.num_free_blocks == before_d.num_free_blocks


def test_token_files_are_checked(tmp_path):
    for text, message in (("short", "at least 16"), ("has a space in it ok", "no spaces")):
        path = tmp_path / "t"
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_token_file(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        read_token_file(str(tmp_path / "missing"))
    token = write_token_file(tmp_path / "new")
    assert read_token_file(str(tmp_path / "new")) == token
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o600


def test_a_node_refuses_to_start_with_a_bad_token_file(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad"
    bad.write_text("short")
    done = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "decode", "--auth-token-file", str(bad)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "at least 16" in done.stderr


def test_node_stats_helper_needs_the_token(cluster):
    _, token, prefill, _, _ = cluster
    with pytest.raises(grpc.RpcError):
        node_stats(prefill)
    assert stats(prefill, token).role == "prefill"


def test_a_node_registered_without_the_cluster_key_is_never_used(tmp_path):
    """With a token, registry entries are signed: the router discovers the real nodes from
    Redis and ignores one that anyone able to write to Redis registered (it would otherwise
    receive prompts, and the token with them)."""
    import asyncio

    from support.processes import start_redis, start_router_discovering

    from splitserve.kvstore import ModelIdentity
    from splitserve.kvstore.redis_index import NodeInfo, PrefixIndex

    model = write_random_checkpoint(
        tmp_path / "m", seed=6, with_tokenizer=True, num_hidden_layers=2
    )
    token_file = tmp_path / "token"
    write_token_file(token_file)
    redis = start_redis(tmp_path)
    flags = ("--auth-token-file", str(token_file), "--redis-url", redis.address)
    procs = [redis]
    try:
        procs += [start_node("prefill", model, tmp_path, *flags)]
        procs += [start_node("decode", model, tmp_path, *flags)]

        async def forge():
            root = ModelIdentity.for_checkpoint(str(model)).root_hash
            index = PrefixIndex(redis.address, root)  # no key: a stranger
            for _ in range(20):
                await index.heartbeat(NodeInfo("fake", "decode", "127.0.0.1:9", 10**6, 10**6, 0, 0))
                await asyncio.sleep(0.25)
            await index.close()

        router = start_router_discovering(model, tmp_path, redis.address, flags[0], flags[1])
        procs.append(router)
        forging = threading.Thread(target=asyncio.run, args=(forge(),))
        forging.start()
        with Client(router.address) as client:
            for i in range(6):
                prompt = [(5 * i + j) % 200 + 1 for j in range(20)]
                out = client.generate(prompt_token_ids=prompt, max_tokens=3, temperature=0.0)
                assert list(out.token_ids) == hf_greedy(model, prompt, 3)
        forging.join()
        log = router.log.read_text()
        assert "ignoring malformed registry entry 'fake'" in log and "127.0.0.1:9" not in log
    finally:
        for proc in reversed(procs):
            proc.stop()
