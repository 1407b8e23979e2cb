"""Mutual TLS (runtime/tls.py) on real processes: a prefill node, a decode node and a router
started with --tls-cert/--tls-key/--tls-ca talk to each other over mTLS and serve a client that
presents a certificate of the same CA, token-exact with transformers; a plaintext client and a
client with another CA's certificate get nothing; the KV crosses over tcp inside TLS, not over
plaintext dist; `splitserve health` asks over mTLS when the
component's SPLITSERVE_TLS_* variables are set. Certificates are made here with the openssl CLI
(skipped, saying so, where it is missing)."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest
from support.pki import HAVE_OPENSSL, make_pki
from support.processes import start_cli
from support.reference import hf_greedy

from splitserve.client import Client, SplitserveError
from splitserve.models.tiny import write_random_checkpoint
from splitserve.transfer import Endpoint

pytestmark = pytest.mark.skipif(
    not HAVE_OPENSSL, reason="making test certificates needs the openssl CLI"
)


def credentials(pki) -> grpc.ChannelCredentials:
    read = {k: open(v, "rb").read() for k, v in pki.items()}  # noqa: SIM115
    return grpc.ssl_channel_credentials(read["ca"], read["key"], read["cert"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    pki = make_pki(tmp / "pki")
    model = write_random_checkpoint(tmp / "m", seed=7, with_tokenizer=True, num_hidden_layers=2)
    flags = ["--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-ca", pki["ca"]]
    creds = credentials(pki)

    def start(role, *extra):
        args = [role, "--model", str(model), *extra, *flags]
        return start_cli(role, args, tmp, credentials=creds)

    procs = [start("prefill", "--kv-cache-mb", "64"), start("decode", "--kv-cache-mb", "64")]
    procs.append(start("router", "--prefill", procs[0].address, "--decode", procs[1].address))
    try:
        yield model, pki, procs
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_the_cluster_serves_over_mtls_token_exact(cluster):
    model, pki, (_, _, router) = cluster
    prompt = [9, 4, 77, 12, 5] * 7
    with Client(router.address, credentials=credentials(pki)) as client:
        out = client.generate(prompt_token_ids=prompt, max_tokens=4, temperature=0.0)
    assert list(out.token_ids) == hf_greedy(model, prompt, 4)


def test_kv_crosses_over_tcp_inside_tls_not_plaintext_dist(cluster):
    # Both nodes offer every path (the default --kv-transfer); with --tls-* and no
    # --trust-kv-network the pair must take tcp (mutual TLS), never dist (plaintext gloo).
    model, pki, (_, decode, router) = cluster
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 9
    with Client(router.address, credentials=credentials(pki)) as client:
        out = client.generate(prompt_token_ids=prompt, max_tokens=3, temperature=0.0)
    assert list(out.token_ids) == hf_greedy(model, prompt, 3)
    from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

    with grpc.secure_channel(decode.address, credentials(pki)) as channel:
        stats = nodes_pb2_grpc.NodeStatsServiceStub(channel).GetStats(
            nodes_pb2.GetStatsRequest(), timeout=10
        )
    assert stats.counters.get("transfers_tcp", 0) >= 1, dict(stats.counters)
    assert stats.counters.get("transfers_dist", 0) == 0, dict(stats.counters)
    endpoint = Endpoint.from_bytes(stats.transfer_endpoint)
    assert endpoint.dist is None and endpoint.tcp is not None and endpoint.tcp.tls


def test_clients_without_a_certificate_of_the_ca_get_nothing(cluster, tmp_path):
    _, _, (_, decode, router) = cluster
    stranger = make_pki(tmp_path / "other", name="other-ca")
    for creds in (None, credentials(stranger)):
        with Client(router.address, credentials=creds) as client, pytest.raises(SplitserveError):
            client.generate(prompt_token_ids=[1, 2, 3], max_tokens=1, timeout=5)
    # Nor can anyone reach a node's internal services in plaintext.
    from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

    with grpc.insecure_channel(decode.address) as channel, pytest.raises(grpc.RpcError):
        nodes_pb2_grpc.NodeStatsServiceStub(channel).GetStats(
            nodes_pb2.GetStatsRequest(), timeout=5
        )


def test_health_checks_ask_over_mtls(cluster):
    _, pki, (_, decode, _) = cluster
    cmd = [sys.executable, "-m", "splitserve.cli", "health", "--address", decode.address]
    env = {
        **os.environ,
        "SPLITSERVE_TLS_CERT": pki["cert"],
        "SPLITSERVE_TLS_KEY": pki["key"],
        "SPLITSERVE_TLS_CA": pki["ca"],
    }
    assert subprocess.run(cmd, env=env, capture_output=True, timeout=60).returncode == 0
    plain = {k: v for k, v in env.items() if not k.startswith("SPLITSERVE_TLS_")}
    assert subprocess.run(cmd, env=plain, capture_output=True, timeout=60).returncode == 1
