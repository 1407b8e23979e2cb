"""The KV transfer layer (transfer/): path selection (also under TLS: dist only on a trusted
network), handshake bytes, a CPU pool's endpoint and the sender's fallback to grpc.
Reservations: test_transfer_reservations.py; the dist path over gloo with spawned senders:
test_transfer_dist.py."""

from __future__ import annotations

import dataclasses
from typing import cast

import msgpack
import pytest
import torch
from support.kv_pools import make_pool
from support.transfer_common import SPEC

from splitserve.transfer import (
    DIST,
    GRPC,
    IPC,
    NIXL,
    TCP,
    DistAddress,
    Endpoint,
    IpcHandle,
    KVSecurity,
    KVTls,
    TcpAddress,
    Ticket,
    choose_path,
    export_pool,
    local_endpoint,
    rendezvous_key,
    secured_paths,
)
from splitserve.transfer.chooser import why_not_preferred
from splitserve.transfer.nixl import NixlOffer, has_rdma

LAYOUT = (32, 2, 16, 8, 128)


def endpoint(**overrides) -> Endpoint:
    fields = dict(
        node_id="prefill-0",
        hostname="host-a",
        boot_id="boot-1",
        device="cuda",
        block_shape=LAYOUT,
        dtype="bfloat16",
        num_blocks=1000,
        pid=100,
        device_uuid="GPU-0",
        visible_devices=("GPU-0", "GPU-1"),
        dist_backends=("nccl",),
    )
    return Endpoint(**{**fields, **overrides})


def receiver_endpoint(**overrides) -> Endpoint:
    fields = dict(
        node_id="decode-0",
        pid=200,
        device_uuid="GPU-1",
        ipc_handle=b"handle",
        dist=DistAddress("10.0.0.2", 29500, "nccl"),
    )
    return endpoint(**{**fields, **overrides})


CASES = {
    "same host, CUDA, handle offered": ({}, {}, IPC),
    "same host name, other boot": ({}, {"boot_id": "boot-2"}, DIST),
    "another container of this host: other host name, same kernel": (
        {},
        {"hostname": "decode-container"},
        IPC,
    ),
    "same process": ({}, {"pid": 100}, DIST),
    "other host": ({}, {"hostname": "host-b", "boot_id": "boot-2"}, DIST),
    "no boot id": ({"boot_id": ""}, {"boot_id": ""}, DIST),
    "no handle offered": ({}, {"ipc_handle": None}, DIST),
    "peer GPU not visible here": ({"visible_devices": ("GPU-0",)}, {}, DIST),
    "same GPU, no handle: NCCL cannot pair one GPU": (
        {},
        {"ipc_handle": None, "device_uuid": "GPU-0"},
        GRPC,
    ),
    "CPU pools, same host": (
        {"device": "cpu", "device_uuid": None, "visible_devices": (), "dist_backends": ("gloo",)},
        {
            "device": "cpu",
            "device_uuid": None,
            "visible_devices": (),
            "ipc_handle": None,
            "dist": DistAddress("10.0.0.2", 29500, "gloo"),
        },
        DIST,
    ),
    "CPU pools, other hosts": (
        {"device": "cpu", "device_uuid": None, "dist_backends": ("gloo",)},
        {
            "hostname": "host-b",
            "boot_id": "boot-2",
            "device": "cpu",
            "device_uuid": None,
            "ipc_handle": None,
            "dist": DistAddress("10.0.0.2", 29500, "gloo"),
        },
        DIST,
    ),
    "CPU sender, CUDA receiver": (
        {"device": "cpu", "device_uuid": None, "dist_backends": ("gloo",)},
        {},
        GRPC,
    ),
    "no dist address": ({}, {"hostname": "host-b", "boot_id": "boot-2", "dist": None}, GRPC),
    "backend not available here": (
        {"dist_backends": ()},
        {"hostname": "host-b", "boot_id": "boot-2"},
        GRPC,
    ),
    "backend of the wrong device kind": (
        {"dist_backends": ("nccl", "gloo")},
        {"hostname": "host-b", "boot_id": "boot-2", "dist": DistAddress("10.0.0.2", 1, "gloo")},
        GRPC,
    ),
    "same GPU, no handle, a tcp listener: raw sockets rather than gRPC": (
        {},
        {"ipc_handle": None, "device_uuid": "GPU-0", "tcp": TcpAddress("10.0.0.2", 4000)},
        TCP,
    ),
    "other host, no dist, a tcp listener": (
        {},
        {"hostname": "host-b", "boot_id": "boot-2", "dist": None, "tcp": TcpAddress("h", 1)},
        TCP,
    ),
    "CPU sender, CUDA receiver with a tcp listener": (
        {"device": "cpu", "device_uuid": None, "dist_backends": ("gloo",)},
        {"tcp": TcpAddress("10.0.0.2", 4000)},
        TCP,
    ),
    "dist beats tcp": ({}, {"hostname": "h", "boot_id": "b", "tcp": TcpAddress("h", 1)}, DIST),
    "tcp listener, but layouts differ": (
        {},
        {"block_shape": (32, 2, 16, 8, 64), "tcp": TcpAddress("h", 1)},
        GRPC,
    ),
    "block layouts differ": ({}, {"block_shape": (32, 2, 16, 8, 64)}, GRPC),
    "dtypes differ": ({}, {"dtype": "float16"}, GRPC),
    # A tensor-parallel side's blocks span its ranks' pools: dist (rank to rank) or gRPC bytes.
    "a TP 2 receiver that offers ipc: dist": ({}, {"tp": 2}, DIST),
    "a TP 2 sender, an ipc receiver: dist": ({"tp": 2}, {}, DIST),
    "TP 2 to TP 4, no dist address, a tcp listener: gRPC bytes": (
        {"tp": 2},
        {"tp": 4, "dist": None, "tcp": TcpAddress("10.0.0.2", 4000)},
        GRPC,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_choose_path(case):
    local, peer, expected = CASES[case]
    assert choose_path(endpoint(**local), receiver_endpoint(**peer)) == expected


def test_choose_path_respects_allowed():
    local, peer = endpoint(), receiver_endpoint()
    assert choose_path(local, peer, allowed=(DIST, GRPC)) == DIST
    assert choose_path(local, peer, allowed=(IPC,)) == IPC
    assert choose_path(local, peer, allowed=(GRPC,)) == GRPC
    assert (
        choose_path(local, receiver_endpoint(hostname="host-b", boot_id="boot-2"), allowed=(IPC,))
        == GRPC
    )


# A stand-in for the node's TLS contexts (making real ones needs certificate files): the path
# choice looks only at whether there are any.
SOME_TLS = cast(KVTls, object())


def test_nixl_is_offered_only_where_an_unchecked_writer_is_acceptable():
    every = (IPC, NIXL, DIST, TCP, GRPC)
    assert secured_paths(every, KVSecurity()) == every  # no token, no TLS: an open cluster
    token = KVSecurity(rendezvous_key=b"k" * 32)  # dist's store checks the token; UCX cannot
    assert secured_paths(every, token) == (IPC, DIST, TCP, GRPC)
    assert secured_paths(every, KVSecurity(tls=SOME_TLS)) == (IPC, TCP, GRPC)
    trusted = KVSecurity(tls=SOME_TLS, rendezvous_key=b"k" * 32, trust_network=True)
    assert secured_paths(every, trusted) == every
    # A receiver that offers nixl is preferred over dist and tcp on one host, and between hosts
    # where both have RDMA (without, UCX falls back to TCP: slower than the tcp path).
    local = endpoint(device="cpu", dist_backends=("gloo",), boot_id="boot-a")
    offer = NixlOffer("a", b"meta", 4096, 100, 1024, "DRAM", 0, "bfloat16", rdma=True)
    peer = receiver_endpoint(
        device="cpu",
        boot_id="boot-a",
        ipc_handle=None,
        dist=DistAddress("10.0.0.2", 29500, "gloo"),
        offers=((NIXL, offer.to_bytes()),),
    )
    assert choose_path(local, peer) == NIXL
    without = dataclasses.replace(peer, offers=())
    assert choose_path(local, without) == DIST
    assert "not nixl: the receiver offers none" in (why_not_preferred(local, without, DIST) or "")
    remote = dataclasses.replace(peer, boot_id="boot-b")
    assert choose_path(local, remote) == (NIXL if has_rdma() else DIST)
    plain = dataclasses.replace(offer, rdma=False)
    no_rdma = dataclasses.replace(remote, offers=((NIXL, plain.to_bytes()),))
    assert choose_path(local, no_rdma) == DIST
    assert "not both with RDMA" in (why_not_preferred(local, no_rdma, DIST) or "")


def test_with_tls_dist_is_taken_only_where_the_kv_network_is_trusted():
    every = (IPC, DIST, TCP, GRPC)
    assert secured_paths(every, KVSecurity()) == every  # no TLS: as before, dist offered
    assert secured_paths(every, KVSecurity(trust_network=True)) == every
    assert secured_paths(every, KVSecurity(tls=SOME_TLS)) == (IPC, TCP, GRPC)
    assert secured_paths(every, KVSecurity(tls=SOME_TLS, trust_network=True)) == every
    # A pair on two hosts that both paths reach: the node's allowed paths decide.
    local = endpoint(device="cpu", dist_backends=("gloo",), boot_id="boot-a")
    peer = receiver_endpoint(
        device="cpu",
        boot_id="boot-b",
        ipc_handle=None,
        dist=DistAddress("10.0.0.2", 29500, "gloo"),
        tcp=TcpAddress("10.0.0.2", 40000, tls=True),
    )
    assert choose_path(local, peer, secured_paths(every, KVSecurity())) == DIST
    assert choose_path(local, peer, secured_paths(every, KVSecurity(tls=SOME_TLS))) == TCP
    # ipc stays allowed: it never leaves the host.
    assert (
        choose_path(endpoint(), receiver_endpoint(), secured_paths(every, KVSecurity(tls=SOME_TLS)))
        == IPC
    )


def test_the_addresses_flags_round_trip_and_old_bytes_stay_the_same():
    plain = receiver_endpoint(tcp=TcpAddress("10.1.2.3", 40000))
    flagged = receiver_endpoint(
        dist=DistAddress("10.0.0.2", 29500, "nccl", gated=True),
        tcp=TcpAddress("10.1.2.3", 40000, tls=True),
    )
    assert Endpoint.from_bytes(flagged.to_bytes()) == flagged
    assert Endpoint.from_bytes(plain.to_bytes()) == plain
    packed = msgpack.unpackb(plain.to_bytes(), raw=False)
    assert packed["tcp"] == ["10.1.2.3", 40000] and len(packed["dist"]) == 3  # as before
    packed["tcp"] = ["10.1.2.3", 40000, "yes"]
    with pytest.raises(ValueError, match="flag"):
        Endpoint.from_bytes(msgpack.packb(packed))


def test_a_tensor_parallel_size_round_trips_and_tp1_bytes_stay_the_same():
    tp1, tp4 = receiver_endpoint(), receiver_endpoint(tp=4)
    assert Endpoint.from_bytes(tp4.to_bytes()) == tp4
    assert "tp" not in msgpack.unpackb(tp1.to_bytes(), raw=False)  # as before
    for bad in (0, 65, "2", True):
        packed = msgpack.unpackb(tp4.to_bytes(), raw=False)
        packed["tp"] = bad
        with pytest.raises(ValueError, match="tensor parallel size"):
            Endpoint.from_bytes(msgpack.packb(packed))
    # Rank 0 of a TP 4 engine over 8 KV heads holds 2: its endpoint names the whole block.
    pool = torch.zeros(4, 2, 2, 16, 2, 8)
    ep = local_endpoint("n", pool, tp=4, num_kv_heads=8)
    assert (ep.tp, ep.block_shape) == (4, (2, 2, 16, 8, 8))


def test_the_rendezvous_key_is_derived_from_the_token_not_the_token():
    key = rendezvous_key("a-cluster-token-of-enough-length")
    assert len(key) == 32 and b"a-cluster-token" not in key
    assert key == rendezvous_key("a-cluster-token-of-enough-length")
    assert key != rendezvous_key("another-cluster-token-entirely")


def test_handshake_bytes_round_trip():
    ep = receiver_endpoint()
    assert Endpoint.from_bytes(ep.to_bytes()) == ep
    ep = receiver_endpoint(tcp=TcpAddress("10.1.2.3", 40000))
    assert Endpoint.from_bytes(ep.to_bytes()) == ep
    ticket = Ticket(DIST, "decode-0", "prefill-0", (5, 3, 9), gen=2, seq=17)
    assert Ticket.from_bytes(ticket.to_bytes()) == ticket
    ticket = Ticket(TCP, "decode-0", "prefill-0", (5, 3, 9), token=b"t" * 16)
    assert Ticket.from_bytes(ticket.to_bytes()) == ticket
    bad_port = receiver_endpoint(tcp=TcpAddress("h", 70000)).to_bytes()
    with pytest.raises(ValueError, match="tcp port"):
        Endpoint.from_bytes(bad_port)
    handle = IpcHandle(
        "GPU-1", (10, 2, 2, 16, 2, 8), (2048, 1024, 512, 16, 8, 1), 0, "bfloat16",
        b"\x01" * 64, 40960, 512, b"/torch_1_2", 3, b"\x02" * 64, True,
    )  # fmt: skip
    assert IpcHandle.from_bytes(handle.to_bytes()) == handle
    for parse in (Endpoint.from_bytes, Ticket.from_bytes, IpcHandle.from_bytes):
        with pytest.raises(ValueError):
            parse(b"\xc1garbage")


def test_local_endpoint_of_a_cpu_pool():
    pool = make_pool(**SPEC)
    ep = local_endpoint("n", pool)
    assert (ep.device, ep.device_uuid, ep.ipc_handle, ep.dist) == ("cpu", None, None, None)
    assert ep.block_shape == tuple(pool.shape[1:]) and ep.num_blocks == SPEC["num_blocks"]
    assert ep.dist_backends == ("gloo",)
    with pytest.raises(ValueError, match="CUDA"):
        export_pool(pool)


# ------------------------------------------------------------------------------- reservations


def test_the_reason_a_pair_is_not_on_ipc_is_named():
    from splitserve.transfer.ipc import why_not_ipc

    local = endpoint()
    assert why_not_ipc(local, receiver_endpoint()) is None
    assert "another kernel" in why_not_ipc(local, receiver_endpoint(boot_id="boot-2"))
    assert why_not_ipc(local, receiver_endpoint(hostname="elsewhere")) is None  # a container
    assert "not visible" in why_not_ipc(endpoint(visible_devices=("GPU-0",)), receiver_endpoint())
    assert "offers no ipc" in why_not_ipc(local, receiver_endpoint(ipc_handle=None))


def test_refused_connections_are_logged_once_per_interval_with_a_count(caplog):
    import logging

    from splitserve.transfer.security import RefusalLog

    log = RefusalLog(logging.getLogger("refusals-test"), "a listener", every_s=3600)
    with caplog.at_level(logging.WARNING, logger="refusals-test"):
        for n in range(5):
            log.refused(("10.0.0.9", 4000 + n), "junk")
    assert [r.getMessage() for r in caplog.records] == [
        "a listener: refused ('10.0.0.9', 4000) (junk)"
    ]
    log.every_s = 0  # the next line comes at once and counts the ones it held back
    with caplog.at_level(logging.WARNING, logger="refusals-test"):
        log.refused("peer", "bad token")
    assert caplog.records[-1].getMessage() == (
        "a listener: refused peer (bad token); 4 more refused since the last line"
    )


def test_without_nixl_or_with_a_failing_agent_the_node_offers_the_other_paths(monkeypatch):
    from splitserve.transfer import nixl, open_receiver, open_sender

    pool = make_pool(**SPEC)
    monkeypatch.setattr(nixl, "nixl_api", lambda: None)  # not installed
    rx = open_receiver(pool, "decode-x", paths=(NIXL, GRPC))
    assert NIXL not in rx.paths and rx.endpoint().offered(NIXL) is None
    assert NIXL not in open_sender(pool, "prefill-x", paths=(NIXL, GRPC)).paths

    class Broken:  # installed, but its agent cannot start (no UCX transport, say)
        def nixl_agent_config(self, **kw):
            return None

        def nixl_agent(self, *args):
            raise RuntimeError("no transport")

    monkeypatch.setattr(nixl, "nixl_api", lambda: Broken())
    rx = open_receiver(pool, "decode-y", paths=(NIXL, GRPC))
    assert NIXL not in rx.paths
