"""The dist rendezvous behind its gate (transfer/dist/gate.py), between this process (a receiver
whose cluster has a token) and spawned senders: the store itself listens on loopback only; torch's
own store client, junk, a replayed answer, a silent connection and a sender with another token are
all refused (connection closed) while the pair built through the gate carries on and new senders
still join."""

from __future__ import annotations

import hmac
import secrets
import socket
import time
from pathlib import Path

import pytest
import torch
from support import transfer_common
from support.kv_pools import SenderProcess, fill_pool, make_pool
from support.transfer_common import RECEIVER_SEED, SENDER_SEED, SPEC, u8

from splitserve.transfer import DIST, GRPC, rendezvous_key
from splitserve.transfer.dist.gate import HELLO, MAC_LEN, NONCE_LEN
from splitserve.transfer.dist.group import default_host
from splitserve.transfer.dist.receiver import DistReceiver

TOKEN = secrets.token_urlsafe(24)
SOURCE = fill_pool(make_pool(**SPEC), SENDER_SEED)


@pytest.fixture(scope="module")
def gated():
    pool = fill_pool(make_pool(**SPEC), RECEIVER_SEED)
    key = rendezvous_key(TOKEN)
    rx = DistReceiver(pool, "decode-gated", host="127.0.0.1", connect_timeout=15.0,
                      rendezvous_key=key)  # fmt: skip
    sender = SenderProcess("prefill-0", SPEC, SENDER_SEED, 15.0, security={"token": TOKEN})
    try:
        sender.wait_ready()
        assert rx.address.gated
        assert sender.call("connect", rx.endpoint().to_bytes(), timeout=60) == DIST
        yield rx, pool, sender
    finally:
        sender.stop()
        rx.shutdown()


def ship(rx, sender, src, dst):
    res, _ = transfer_common.ship(rx, sender, src, dst, DIST, timeout=15.0)
    assert res.state == "done"
    return res


def listen_addresses(port: int) -> set[str]:
    """The local addresses (procfs hex) of the sockets listening on ``port``."""
    found = set()
    for table in ("tcp", "tcp6"):
        path = Path("/proc/net") / table
        rows = path.read_text().splitlines()[1:] if path.exists() else []
        for cols in (row.split() for row in rows):
            address, _, hex_port = cols[1].rpartition(":")
            if cols[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::ffff:127.0.0.1


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the listeners from procfs")
def test_the_store_listens_on_loopback_only(gated):
    rx, _, _ = gated
    host, port = rx.store_address
    assert host == "127.0.0.1" and port != rx.port
    assert listen_addresses(port) and listen_addresses(port) <= LOOPBACK
    outside = default_host()
    if not outside.startswith("127."):  # from another address of this host: nothing there
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((outside, port), timeout=5).close()
    # Without a token the store is torch's own: every interface (so the check above can fail).
    plain = DistReceiver(make_pool(**SPEC), "decode-plain", host="127.0.0.1")
    try:
        assert not plain.address.gated and not listen_addresses(plain.port) <= LOOPBACK
    finally:
        plain.shutdown()


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the gate closes ``sock`` within ``seconds`` (anything it sent first is read)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_strangers_are_refused_while_the_pair_carries_on(gated, rng):
    rx, pool, sender = gated
    port = rx.port
    ship(rx, sender, [1, 2, 3], [4, 5, 6])
    # A silent stranger holds a connection open: the gate drops it at its handshake timeout,
    # and a transfer goes through meanwhile.
    silent = socket.create_connection(("127.0.0.1", port), timeout=5)
    src, dst = (
        rng.sample(range(1, SPEC["num_blocks"]), 5),
        rng.sample(range(1, SPEC["num_blocks"]), 5),
    )
    ship(rx, sender, src, dst)
    assert torch.equal(u8(pool[dst]), u8(SOURCE[src]))
    # Junk, as a port scanner or a confused client sends.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as junk:
        junk.sendall(secrets.token_bytes(200))
        assert closed_within(junk, 10)
    # An answer computed for another connection's challenge (a replay): refused.
    key = rendezvous_key(TOKEN)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as first:
        nonce_first = HELLO.unpack(first.recv(HELLO.size, socket.MSG_WAITALL))[2]
        nonce_c = secrets.token_bytes(NONCE_LEN)
        answer = nonce_c + hmac.new(key, b"client" + nonce_first + nonce_c, "sha256").digest()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as replay:
            replay.recv(HELLO.size, socket.MSG_WAITALL)
            replay.sendall(answer)
            assert closed_within(replay, 10)
        first.sendall(answer)  # on its own connection the same answer opens the gate
        assert len(first.recv(MAC_LEN, socket.MSG_WAITALL)) == MAC_LEN
    # torch's own store client, straight at the advertised port: never gets in.
    from datetime import timedelta

    from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]

    with pytest.raises(Exception):  # noqa: B017 (torch raises DistNetworkError / RuntimeError)
        TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=3)).get("x")
    assert closed_within(silent, 10)
    silent.close()
    # A node holding another token: refused at the gate, its pair falls back to the byte path.
    other = SenderProcess("prefill-other", SPEC, SENDER_SEED, 10.0, security={"token": "x" * 24})
    newcomer = SenderProcess("prefill-1", SPEC, SENDER_SEED, 15.0, security={"token": TOKEN})
    try:
        other.wait_ready()
        assert other.call("connect", rx.endpoint().to_bytes(), timeout=60) == GRPC
        # The pair built before carries on, and a new sender of the cluster still joins.
        ship(rx, sender, [7, 8], [9, 10])
        newcomer.wait_ready()
        assert newcomer.call("connect", rx.endpoint().to_bytes(), timeout=60) == DIST
        ship(rx, newcomer, [11, 12, 13], [14, 15, 16])
        assert torch.equal(u8(pool[[9, 10, 14, 15, 16]]), u8(SOURCE[[7, 8, 11, 12, 13]]))
        assert sorted(rx.peers()) == ["prefill-0", "prefill-1"]
    finally:
        other.stop()
        newcomer.stop()


def test_a_sender_without_a_token_is_told_so_at_once(gated):
    rx, _, _ = gated
    plain = SenderProcess("prefill-plain", SPEC, SENDER_SEED, 60.0)
    try:
        plain.wait_ready()
        t0 = time.monotonic()
        assert plain.call("connect", rx.endpoint().to_bytes(), timeout=120) == GRPC
        # Refused by the endpoint's flag, not after its 60 s store timeout (a bound far from both).
        assert time.monotonic() - t0 < 30
    finally:
        plain.stop()


def test_a_tunnel_stays_open_past_the_handshake_timeout():
    # The pair's store client may be silent for the pair's life (NCCL uses the store at its
    # first operation, not at once): the gate's timeout covers the handshake only.
    from datetime import timedelta

    from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]

    from splitserve.transfer.dist.gate import Gate, open_tunnel
    from splitserve.transfer.dist.group import loopback_store

    key = rendezvous_key(TOKEN)
    store, store_port = loopback_store(10.0)
    gate = Gate("127.0.0.1", 0, key, store_port, handshake_timeout=0.3)
    try:
        local = open_tunnel("127.0.0.1", gate.port, key, 10.0)
        client = TCPStore("127.0.0.1", local, is_master=False, timeout=timedelta(seconds=10))
        client.set("before", b"1")
        time.sleep(1.0)  # over three handshake timeouts, silent
        client.set("after", b"2")
        assert store.get("before") == b"1" and client.get("after") == b"2"
    finally:
        gate.shutdown()
