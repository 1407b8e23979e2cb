"""The tcp KV path inside mutual TLS (transfer/security.py, tcp_*.py) between this process (the
receiver) and spawned senders: what a relay on the wire records holds the KV blocks' bytes without
TLS and none of them with it; the listener refuses plaintext, a TLS client without a certificate
and one of another CA, and leaves the reservation untouched; with TLS, dist (plaintext) is
offered and taken only where the network is trusted (--trust-kv-network), tcp otherwise; a node
whose key does not fit its certificate stops at start, saying so.
Certificates are made with the openssl CLI (skipped, saying so, where it is missing)."""

from __future__ import annotations

import dataclasses
import socket
import ssl
import subprocess
import sys

import pytest
import torch
from support import transfer_common
from support.kv_pools import SenderProcess, fill_pool, make_pool, security_of
from support.pki import HAVE_OPENSSL, make_pki, tls_triple
from support.transfer_common import RECEIVER_SEED, SENDER_SEED, SPEC, u8
from support.wiretap import Wiretap

from splitserve.transfer import DIST, GRPC, TCP, Endpoint, open_receiver
from splitserve.transfer.tcp.wire import WireError, checksum, pack_chunk, read_ack

pytestmark = pytest.mark.skipif(
    not HAVE_OPENSSL, reason="making test certificates needs the openssl CLI"
)

SOURCE = fill_pool(make_pool(**SPEC), SENDER_SEED)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The cluster's CA and another one (a stranger's)."""
    tmp = tmp_path_factory.mktemp("kv-tls")
    return make_pki(tmp / "cluster"), make_pki(tmp / "other", name="other-ca")


def receiver(security: dict | None, paths=(TCP,)):
    pool = fill_pool(make_pool(**SPEC), RECEIVER_SEED)
    rx = open_receiver(
        pool,
        "decode-tls",
        paths=paths,
        host="127.0.0.1",
        connect_timeout=15.0,
        security=security_of(security),
    )
    return rx, pool


def through(endpoint: Endpoint, tap: Wiretap) -> bytes:
    """The receiver's endpoint with its tcp listener's port replaced by the relay's."""
    assert endpoint.tcp is not None
    tapped = dataclasses.replace(endpoint, tcp=dataclasses.replace(endpoint.tcp, port=tap.port))
    return tapped.to_bytes()


def block_bytes(ids: list[int]) -> list[bytes]:
    return [bytes(u8(SOURCE[i]).reshape(-1).numpy()) for i in ids]


@pytest.mark.parametrize("tls", [True, False], ids=["mtls", "plaintext"])
def test_the_kv_bytes_on_the_wire_are_readable_only_without_tls(pki, tls, rng):
    security = {"tls": tls_triple(pki[0])} if tls else None
    rx, pool = receiver(security)
    tap = Wiretap(("127.0.0.1", rx.endpoint().tcp.port))
    sender = SenderProcess("prefill-tls", SPEC, SENDER_SEED, security=security)
    try:
        sender.wait_ready()
        assert sender.call("connect", through(rx.endpoint(), tap)) == TCP
        src = rng.sample(range(1, SPEC["num_blocks"]), 6)
        dst = rng.sample(range(1, SPEC["num_blocks"]), 6)
        res, nbytes = transfer_common.ship(rx, sender, src, dst, TCP)
        assert res.state == "done" and torch.equal(u8(pool[dst]), u8(SOURCE[src]))
        wire = tap.captured()
        assert tap.connections >= 1 and len(wire) >= nbytes  # everything went through the tap
        blocks = block_bytes(src)
        if not tls:  # the check can fail: in plaintext every block is there to read
            assert all(block in wire for block in blocks)
            return
        assert not any(block in wire for block in blocks)
        pieces = [block[k : k + 32] for block in blocks for k in range(0, len(block), 128)]
        assert not any(piece in wire for piece in pieces)  # nor any 32-byte piece of one
    finally:
        sender.stop()
        tap.close()
        rx.shutdown()


def closed_without_answer(sock: socket.socket) -> bool:
    sock.settimeout(15)
    try:
        return sock.recv(64) == b""
    except (ConnectionResetError, ssl.SSLError):
        return True


def test_a_sender_without_the_clusters_certificate_is_refused(pki):
    cluster, other = pki
    rx, pool = receiver({"tls": tls_triple(cluster)})
    before = pool.clone()
    port = rx.endpoint().tcp.port
    res = rx.reserve("prefill-ok", [4, 6], TCP)
    data = b"".join(block_bytes([1, 2]))
    chunk = pack_chunk(res.ticket.token, 0, 2, checksum(memoryview(data))) + data
    strangers = [
        SenderProcess("prefill-plain", SPEC, SENDER_SEED),
        SenderProcess("prefill-other", SPEC, SENDER_SEED, security={"tls": tls_triple(other)}),
    ]
    try:
        # Plaintext, even a well-formed chunk with the reservation's token: no TLS, no chunk.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(chunk)
            assert closed_without_answer(sock)
        # TLS that trusts the listener but shows no certificate, or one another CA signed.
        for client in (None, other):
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.load_verify_locations(cluster["ca"])
            if client is not None:
                ctx.load_cert_chain(client["cert"], client["key"])
            raw = socket.create_connection(("127.0.0.1", port), timeout=5)
            with raw, pytest.raises((OSError, WireError)):
                conn = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
                conn.sendall(chunk)
                read_ack(conn)  # the listener's alert, or the connection closed
        # Sender processes: plaintext, or another CA's certificate: the tcp path cannot be set
        # up (the pair would fall back to the byte path, inside the node's mTLS gRPC).
        for stranger in strangers:
            stranger.wait_ready()
            assert stranger.call("connect", rx.endpoint().to_bytes()) == GRPC
        assert res.state == "reserved" and torch.equal(u8(pool), u8(before))
        # The cluster's own sender still fills that very reservation.
        sender = SenderProcess(
            "prefill-ok", SPEC, SENDER_SEED, security={"tls": tls_triple(cluster)}
        )
        strangers.append(sender)
        sender.wait_ready()
        assert sender.call("connect", rx.endpoint().to_bytes()) == TCP
        sender.call("send", res.ticket.to_bytes(), [1, 2], 10.0)
        rx.finish(res)
        assert torch.equal(u8(pool[[4, 6]]), u8(SOURCE[[1, 2]]))
    finally:
        for stranger in strangers:
            stranger.stop()
        rx.shutdown()


@pytest.mark.parametrize(
    ("receiver_trusts", "sender_trusts", "path"),
    [(False, False, TCP), (True, False, TCP), (True, True, DIST)],
    ids=["untrusted", "only-the-receiver-trusts", "trusted"],
)
def test_with_tls_dist_is_taken_only_on_a_trusted_network(
    pki, receiver_trusts, sender_trusts, path
):
    tls = tls_triple(pki[0])
    rx, pool = receiver({"tls": tls, "trust": receiver_trusts}, paths=(DIST, TCP))
    endpoint = rx.endpoint()
    assert (endpoint.dist is not None) == receiver_trusts  # no store at all when not trusted
    assert endpoint.tcp is not None and endpoint.tcp.tls
    security = {"tls": tls, "trust": sender_trusts}
    sender = SenderProcess(
        "prefill-all", SPEC, SENDER_SEED, connect_timeout=15.0, security=security
    )
    try:
        sender.wait_ready()
        assert sender.call("connect", endpoint.to_bytes(), timeout=60) == path
        res, _ = transfer_common.ship(rx, sender, [3, 9], [12, 2], path, timeout=15.0)
        assert res.state == "done"
        assert torch.equal(u8(pool[[12, 2]]), u8(SOURCE[[3, 9]]))
    finally:
        sender.stop()
        rx.shutdown()


def test_a_key_that_does_not_fit_its_certificate_stops_the_node_at_once(pki):
    cluster, other = pki
    cmd = [sys.executable, "-m", "splitserve.cli", "decode", "--model", "tiny"]
    cmd += ["--tls-cert", cluster["cert"], "--tls-key", other["key"], "--tls-ca", cluster["ca"]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--tls-key" in done.stderr and "not a usable certificate and key" in done.stderr
