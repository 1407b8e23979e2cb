"""What a node tells a peer about itself, and the choice of transfer path for a pair.

A node's ``Endpoint`` travels as bytes (msgpack) in the services' handshake. The decode node
(the receiver) fills in what it offers: its exported KV pool (``ipc_handle``) and its rendezvous
address (``dist``); the prefill node (the sender) only describes itself. ``choose_path`` is a
pure function of the two endpoints.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Collection
from dataclasses import dataclass

import msgpack

IPC = "ipc"
DIST = "dist"
TCP = "tcp"
GRPC = "grpc"
PATHS = (IPC, DIST, TCP, GRPC)
RECEIVED_PATHS = (DIST, TCP)
"""Paths whose data the receiver takes in itself: ``KVReceiver.receive`` returns once it is in
the pool (ipc and grpc end with ``complete``)."""

BACKEND_FOR_DEVICE = {"cuda": "nccl", "cpu": "gloo"}
"""The torch.distributed backend the dist path uses for a pool on each device kind."""

_VERSION = 1


@dataclass(frozen=True, slots=True)
class DistAddress:
    """Where a receiver's rendezvous store listens, and the backend its pair groups run."""

    host: str
    port: int
    backend: str


@dataclass(frozen=True, slots=True)
class TcpAddress:
    """Where a receiver's tcp listener accepts chunks (``transfer.tcp_wire``)."""

    host: str
    port: int


@dataclass(frozen=True, slots=True)
class Endpoint:
    node_id: str
    hostname: str
    boot_id: str
    device: str  # "cuda" or "cpu": where the KV pool lives
    block_shape: tuple[int, ...]  # pool.shape[1:]: (layers, 2, block_size, kv_heads, head_dim)
    dtype: str  # e.g. "bfloat16"
    num_blocks: int = 0
    pid: int = 0  # the process (a CUDA IPC handle cannot be opened by its own process)
    device_uuid: str | None = None  # the GPU holding the pool
    visible_devices: tuple[str, ...] = ()  # UUIDs of the GPUs this process can open
    dist_backends: tuple[str, ...] = ()  # backends this process can run for its pool
    ipc_handle: bytes | None = None  # receiver only: its pool, exported (transfer.ipc.IpcHandle)
    dist: DistAddress | None = None  # receiver only: its rendezvous store
    tcp: TcpAddress | None = None  # receiver only: its tcp listener

    def same_host(self, other: Endpoint) -> bool:
        """Same kernel: a non-empty, equal boot id. NOTE: not the host name — containers of one
        host each have their own host name and share the kernel (and its boot id), and CUDA IPC
        works between them when they share a PID namespace and see each other's GPU
        (docs/deploy.md)."""
        return bool(self.boot_id) and self.boot_id == other.boot_id

    def to_bytes(self) -> bytes:
        fields = {
            "v": _VERSION,
            "node_id": self.node_id,
            "hostname": self.hostname,
            "boot_id": self.boot_id,
            "device": self.device,
            "block_shape": list(self.block_shape),
            "dtype": self.dtype,
            "num_blocks": self.num_blocks,
            "pid": self.pid,
            "device_uuid": self.device_uuid,
            "visible_devices": list(self.visible_devices),
            "dist_backends": list(self.dist_backends),
            "ipc_handle": self.ipc_handle,
            "dist": None
            if self.dist is None
            else [self.dist.host, self.dist.port, self.dist.backend],
            "tcp": None if self.tcp is None else [self.tcp.host, self.tcp.port],
        }
        return msgpack.packb(fields, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> Endpoint:
        try:
            f = msgpack.unpackb(data, raw=False)
            if f.get("v") != _VERSION:
                raise ValueError(f"unsupported endpoint version {f.get('v')!r}")
            dist = f["dist"]
            if dist is not None:
                dist = DistAddress(str(dist[0]), int(dist[1]), str(dist[2]))
            tcp = f.get("tcp")
            if tcp is not None:
                tcp = TcpAddress(str(tcp[0]), int(tcp[1]))
                if not 0 < tcp.port < 65536:
                    raise ValueError(f"bad tcp port {tcp.port}")
            return cls(
                node_id=str(f["node_id"]),
                hostname=str(f["hostname"]),
                boot_id=str(f["boot_id"]),
                device=str(f["device"]),
                block_shape=tuple(int(x) for x in f["block_shape"]),
                dtype=str(f["dtype"]),
                num_blocks=int(f["num_blocks"]),
                pid=int(f["pid"]),
                device_uuid=f["device_uuid"],
                visible_devices=tuple(f["visible_devices"]),
                dist_backends=tuple(f["dist_backends"]),
                ipc_handle=f["ipc_handle"],
                dist=dist,
                tcp=tcp,
            )
        except ValueError:
            raise
        except Exception as exc:  # msgpack raises several types on garbage
            raise ValueError(f"malformed endpoint: {exc!r}") from None


def choose_path(local: Endpoint, peer: Endpoint, allowed: Collection[str] = PATHS) -> str:
    """The path the sender ``local`` uses to ship KV blocks into the receiver ``peer``.

    - ``ipc`` when both pools are on CUDA, on the same host (kernel boot id) but in
      different processes, the peer offers its exported pool, and its GPU is visible to this
      process;
    - ``dist`` when the peer advertises a rendezvous address whose backend this process runs for
      its device kind (nccl on CUDA, gloo on CPU), both pools are on the same device kind, and
      (NCCL) the two pools are not on the same GPU;
    - ``tcp`` when the peer advertises a tcp listener (raw sockets from pinned memory: hosts
      without NCCL between them, CPU nodes without gloo, two nodes on one GPU without ipc);
    - ``grpc`` otherwise, and whenever the two pools' block layouts differ (the gRPC path then
      reports the mismatch as it always has).

    ``allowed`` restricts the choice (``grpc`` is always the fallback).
    """
    if (local.block_shape, local.dtype) != (peer.block_shape, peer.dtype):
        return GRPC
    both_cuda = local.device == peer.device == "cuda"
    same_host = local.same_host(peer)
    if (
        IPC in allowed
        and both_cuda
        and same_host
        and local.pid != peer.pid
        and peer.ipc_handle
        and peer.device_uuid is not None
        and peer.device_uuid in local.visible_devices
    ):
        return IPC
    if (
        DIST in allowed
        and peer.dist is not None
        and local.device == peer.device
        and peer.dist.backend == BACKEND_FOR_DEVICE.get(local.device)
        and peer.dist.backend in local.dist_backends
        and not (both_cuda and same_host and local.device_uuid == peer.device_uuid)
    ):
        return DIST
    if TCP in allowed and peer.tcp is not None:
        return TCP
    return GRPC


def why_not_ipc(local: Endpoint, peer: Endpoint) -> str | None:
    """Why ``choose_path`` cannot take ``ipc`` from ``local`` to ``peer`` (None: it can); for the
    log line a sender writes once per peer."""
    checks = (
        (local.device == peer.device == "cuda", "a pool is not on CUDA"),
        (local.same_host(peer), "another kernel (boot id): another host"),
        (local.pid != peer.pid, "the same process"),
        (bool(peer.ipc_handle), "the receiver offers no ipc (disabled, or its export failed)"),
        (
            peer.device_uuid is not None and peer.device_uuid in local.visible_devices,
            "the receiver's GPU is not visible to the sender (CUDA_VISIBLE_DEVICES, container "
            "devices)",
        ),
    )
    return next((why for ok, why in checks if not ok), None)


# ---------------------------------------------------------------------------- host identity


@functools.cache
def boot_id() -> str:
    """The kernel's boot id (changes on every boot; "" where there is none)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def hostname() -> str:
    return socket.gethostname()


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def device_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def visible_device_uuids() -> tuple[str, ...]:
    import torch

    if not torch.cuda.is_available():
        return ()
    return tuple(device_uuid(i) for i in range(torch.cuda.device_count()))


def local_device_index(uuid: str) -> int:
    """This process's index of the GPU with ``uuid`` (indices differ between processes with
    different ``CUDA_VISIBLE_DEVICES``); ``ValueError`` if it is not visible here."""
    for i, u in enumerate(visible_device_uuids()):
        if u == uuid:
            return i
    raise ValueError(f"GPU {uuid} is not visible to this process")


def available_backends(device: str) -> tuple[str, ...]:
    """The dist backend this process can run for a pool on ``device`` ("cuda"/"cpu")."""
    import torch.distributed as dist

    if not dist.is_available():
        return ()
    backend = BACKEND_FOR_DEVICE.get(device)
    if backend == "nccl" and dist.is_nccl_available():
        return ("nccl",)
    if backend == "gloo" and dist.is_gloo_available():
        return ("gloo",)
    return ()


def local_endpoint(
    node_id: str,
    kv_pool,
    *,
    ipc_handle: bytes | None = None,
    dist: DistAddress | None = None,
    tcp: TcpAddress | None = None,
) -> Endpoint:
    """This process's endpoint for its KV pool ``(num_blocks, layers, 2, block_size, kv_heads,
    head_dim)``."""
    kind = kv_pool.device.type
    if kind not in BACKEND_FOR_DEVICE:
        raise ValueError(f"unsupported pool device {kv_pool.device}")
    uuid = device_uuid(kv_pool.device.index or 0) if kind == "cuda" else None
    return Endpoint(
        node_id=node_id,
        hostname=hostname(),
        boot_id=boot_id(),
        device=kind,
        block_shape=tuple(kv_pool.shape[1:]),
        dtype=dtype_name(kv_pool.dtype),
        num_blocks=int(kv_pool.shape[0]),
        pid=os.getpid(),
        device_uuid=uuid,
        visible_devices=visible_device_uuids() if kind == "cuda" else (),
        dist_backends=available_backends(kind),
        ipc_handle=ipc_handle,
        dist=dist,
        tcp=tcp,
    )
