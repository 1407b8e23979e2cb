"""The KV transfer layer (transfer/): path selection, handshake bytes, a CPU pool's endpoint and
the sender's fallback to grpc. Reservations: test_transfer_reservations.py; the dist path over
gloo with spawned senders: test_transfer_dist.py."""

from __future__ import annotations

import pytest
from support.kv_pools import make_pool
from support.transfer_common import SPEC

from splitserve.transfer import (
    DIST,
    GRPC,
    IPC,
    TCP,
    DistAddress,
    Endpoint,
    IpcHandle,
    TcpAddress,
    Ticket,
    choose_path,
    export_pool,
    local_endpoint,
)

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
