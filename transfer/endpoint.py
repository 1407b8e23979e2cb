"""What a node tells a peer about itself: its ``Endpoint``, which travels as bytes (msgpack) in
the services' handshake.

The receiver fills in what each of its paths offers (``KVReceiver.offer``: its exported KV pool
``ipc_handle``, its rendezvous address ``dist``, its listener ``tcp``; a path added later, its own
bytes under its name in ``offers``); the sender only describes itself. Which path a pair takes is
``chooser.choose_path``, a pure function of the two endpoints.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgpack

if TYPE_CHECKING:
    import torch

# The paths' names, as tickets and the services' headers carry them.
IPC = "ipc"
DIST = "dist"
TCP = "tcp"
NIXL = "nixl"
GRPC = "grpc"

BACKEND_FOR_DEVICE = {"cuda": "nccl", "cpu": "gloo"}
"""The torch.distributed backend the dist path uses for a pool on each device kind."""

# The offers that have a field of their own (the first paths'); any other path's are bytes in
# ``offers``.
_OFFER_FIELDS = {IPC: "ipc_handle", DIST: "dist", TCP: "tcp"}

_VERSION = 1
MAX_TP = 64  # the largest tensor parallel size an endpoint may name
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class DistAddress:
    """Where a receiver's rendezvous store listens, and the backend its pair groups run."""

    host: str
    port: int
    backend: str
    gated: bool = False  # the store sits behind a gate that requires the cluster token (dist.gate)


@dataclass(frozen=True, slots=True)
class TcpAddress:
    """Where a receiver's tcp listener accepts chunks (``transfer.tcp.wire``)."""

    host: str
    port: int
    tls: bool = False  # the listener takes mutual TLS 1.3 connections only


@dataclass(frozen=True, slots=True)
class Endpoint:
    node_id: str
    hostname: str
    boot_id: str
    device: str  # "cuda" or "cpu": where the KV pool lives
    # (layers, 2, block_size, kv_heads, head_dim) of a whole block: every KV head of the model,
    # at any tensor parallel size (a rank's pool holds its share of the heads: ``tp``)
    block_shape: tuple[int, ...]
    dtype: str  # e.g. "bfloat16"
    num_blocks: int = 0
    pid: int = 0  # the process (a CUDA IPC handle cannot be opened by its own process)
    device_uuid: str | None = None  # the GPU holding the pool
    visible_devices: tuple[str, ...] = ()  # UUIDs of the GPUs this process can open
    dist_backends: tuple[str, ...] = ()  # backends this process can run for its pool
    ipc_handle: bytes | None = None  # receiver only: its pool, exported (transfer.ipc.IpcHandle)
    dist: DistAddress | None = None  # receiver only: its rendezvous store
    tcp: TcpAddress | None = None  # receiver only: its tcp listener
    # receiver only: what paths without a field above offer, as (path, bytes); none in the wire
    # format unless there are some, so endpoints without them keep their bytes
    offers: tuple[tuple[str, bytes], ...] = ()
    # the node's tensor parallel size: above 1 its blocks are spread over that many ranks'
    # pools, which only dist moves rank to rank (transfer.shards); in the wire format only then
    tp: int = 1

    def offered(self, path: str) -> object | None:
        """What this receiver offers for ``path`` (None: it does not offer that path)."""
        field = _OFFER_FIELDS.get(path)
        if field is not None:
            return getattr(self, field)
        return dict(self.offers).get(path)

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
            # A flag is written only when set, so endpoints without one keep their bytes.
            "dist": None
            if self.dist is None
            else [self.dist.host, self.dist.port, self.dist.backend, *([True] * self.dist.gated)],
            "tcp": None
            if self.tcp is None
            else [self.tcp.host, self.tcp.port, *([True] * self.tcp.tls)],
        }
        if self.offers:
            fields["offers"] = [list(offer) for offer in self.offers]
        if self.tp != 1:
            fields["tp"] = self.tp
        packed = msgpack.packb(fields, use_bin_type=True)
        assert packed is not None
        return packed

    @classmethod
    def from_bytes(cls, data: bytes) -> Endpoint:
        try:
            f = msgpack.unpackb(data, raw=False)
            if f.get("v") != _VERSION:
                raise ValueError(f"unsupported endpoint version {f.get('v')!r}")
            dist = f["dist"]
            if dist is not None:
                dist = DistAddress(str(dist[0]), int(dist[1]), str(dist[2]), _flag(dist, 3))
            tcp = f.get("tcp")
            if tcp is not None:
                tcp = TcpAddress(str(tcp[0]), int(tcp[1]), _flag(tcp, 2))
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
                offers=tuple((str(name), bytes(data)) for name, data in f.get("offers") or ()),
                tp=_tp(f.get("tp", 1)),
            )
        except ValueError:
            raise
        except Exception as exc:  # msgpack raises several types on garbage
            raise ValueError(f"malformed endpoint: {exc!r}") from None


def _tp(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_TP:
        raise ValueError(f"bad tensor parallel size {value!r} (1 to {MAX_TP})")
    return value


def _flag(fields: list, index: int) -> bool:
    """An address's optional flag at ``index`` (absent: False); ``ValueError`` if not a bool."""
    if len(fields) <= index:
        return False
    if not isinstance(fields[index], bool):
        raise ValueError(f"malformed address flag {fields[index]!r}")
    return fields[index]


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


def dtype_name(dtype: object) -> str:
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
    kv_pool: torch.Tensor,
    *,
    ipc_handle: bytes | None = None,
    dist: DistAddress | None = None,
    tcp: TcpAddress | None = None,
    offers: Mapping[str, object] | None = None,
    tp: int = 1,
    num_kv_heads: int | None = None,
) -> Endpoint:
    """This process's endpoint for its KV pool ``(num_blocks, layers, 2, block_size, kv_heads,
    head_dim)``; ``offers``: what a receiver's paths offer, by path name (``KVReceiver.offer``).
    ``tp`` / ``num_kv_heads``: rank 0 of a tensor-parallel engine (its pool holds its share of
    the model's ``num_kv_heads``; the endpoint names the whole block)."""
    left = dict(offers or {})
    ipc_handle = _offer(left, IPC, bytes, ipc_handle)
    dist = _offer(left, DIST, DistAddress, dist)
    tcp = _offer(left, TCP, TcpAddress, tcp)
    others: list[tuple[str, bytes]] = []
    for path, offer in sorted(left.items()):  # the paths without a field: bytes
        if not isinstance(offer, bytes):
            raise TypeError(f"the {path} path offers {type(offer).__name__}, not bytes")
        others.append((path, offer))
    kind = kv_pool.device.type
    if kind not in BACKEND_FOR_DEVICE:
        raise ValueError(f"unsupported pool device {kv_pool.device}")
    uuid = device_uuid(kv_pool.device.index or 0) if kind == "cuda" else None
    return Endpoint(
        node_id=node_id,
        hostname=hostname(),
        boot_id=boot_id(),
        device=kind,
        block_shape=whole_block_shape(kv_pool, num_kv_heads),
        dtype=dtype_name(kv_pool.dtype),
        num_blocks=int(kv_pool.shape[0]),
        pid=os.getpid(),
        device_uuid=uuid,
        visible_devices=visible_device_uuids() if kind == "cuda" else (),
        dist_backends=available_backends(kind),
        ipc_handle=ipc_handle,
        dist=dist,
        tcp=tcp,
        offers=tuple(others),
        tp=_tp(tp),
    )


def whole_block_shape(kv_pool: Any, num_kv_heads: int | None = None) -> tuple[int, ...]:
    """``kv_pool``'s block shape with every KV head of the model (``num_kv_heads``; None: the
    pool holds them all)."""
    shape = list(kv_pool.shape[1:])
    if num_kv_heads is not None:
        shape[3] = num_kv_heads
    return tuple(int(x) for x in shape)


def _offer(offers: dict[str, object], path: str, kind: type[_T], default: _T | None) -> _T | None:
    """``offers[path]`` (taken out), checked to be a ``kind``; ``default`` if absent."""
    offer = offers.pop(path, None)
    if offer is None:
        return default
    if not isinstance(offer, kind):
        raise TypeError(f"the {path} path offers {type(offer).__name__}, not {kind.__name__}")
    return offer
