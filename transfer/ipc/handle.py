"""The ipc path's handle: a CUDA KV pool exported by the receiver and mapped into a sender's
process on the same host (``transfer.ipc`` is the path itself).

The receiver exports its pool once (``export_pool``): torch's CUDA IPC reduction of the tensor
(``torch.multiprocessing.reductions.reduce_tensor``, i.e. ``cudaIpcGetMemHandle`` of the
allocation that holds the pool, its offset, and torch's producer-side ref counter and event), as
plain fields serialized with msgpack so the handle can travel in a gRPC message. The sender maps
it (``open_pool``, once per peer, ``IpcSender`` caches it) on the same physical GPU, found by
UUID, since device indices differ between processes with different ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import torch

from splitserve.transfer.endpoint import device_uuid, dtype_name, local_device_index

_VERSION = 1


@dataclass(frozen=True, slots=True)
class IpcHandle:
    """An exported CUDA tensor: what ``rebuild_cuda_tensor`` needs, with the GPU named by UUID."""

    device_uuid: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # elements
    dtype: str
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool

    def to_bytes(self) -> bytes:
        packed = msgpack.packb(
            [
                _VERSION,
                self.device_uuid,
                list(self.shape),
                list(self.stride),
                self.storage_offset,
                self.dtype,
                self.storage_handle,
                self.storage_size_bytes,
                self.storage_offset_bytes,
                self.ref_counter_handle,
                self.ref_counter_offset,
                self.event_handle,
                self.event_sync_required,
            ],
            use_bin_type=True,
        )
        assert packed is not None
        return packed

    @classmethod
    def from_bytes(cls, data: bytes) -> IpcHandle:
        try:
            f = msgpack.unpackb(data, raw=False)
            if f[0] != _VERSION:
                raise ValueError(f"unsupported IPC handle version {f[0]!r}")
            return cls(
                device_uuid=str(f[1]),
                shape=tuple(int(x) for x in f[2]),
                stride=tuple(int(x) for x in f[3]),
                storage_offset=int(f[4]),
                dtype=str(f[5]),
                storage_handle=bytes(f[6]),
                storage_size_bytes=int(f[7]),
                storage_offset_bytes=int(f[8]),
                ref_counter_handle=bytes(f[9]),
                ref_counter_offset=int(f[10]),
                event_handle=None if f[11] is None else bytes(f[11]),
                event_sync_required=bool(f[12]),
            )
        except ValueError:
            raise
        except Exception as exc:
            raise ValueError(f"malformed IPC handle: {exc!r}") from None


def export_pool(kv_pool: torch.Tensor) -> IpcHandle:
    """Export a CUDA KV pool for same-host peers. Call once and keep the pool alive as long as
    peers may write (the pool lives as long as the node). Any number of peers may open it."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    if kv_pool.device.type != "cuda":
        raise ValueError(f"only a CUDA pool can be exported, got {kv_pool.device}")
    if not kv_pool.is_contiguous():
        raise ValueError("kv_pool must be contiguous")
    rebuild, args = reduce_tensor(kv_pool.detach())
    if rebuild is not rebuild_cuda_tensor or len(args) != 15:
        raise RuntimeError(
            f"unexpected CUDA tensor reduction in torch {torch.__version__}: "
            f"{getattr(rebuild, '__name__', rebuild)} with {len(args)} fields"
        )
    (
        _tensor_cls,
        size,
        stride,
        offset,
        _storage_cls,
        dtype,
        device,
        handle,
        storage_size_bytes,
        storage_offset_bytes,
        _requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    if handle is None:
        raise ValueError("the pool has no storage to export")
    return IpcHandle(
        device_uuid=device_uuid(int(device)),
        shape=tuple(size),
        stride=tuple(stride),
        storage_offset=int(offset),
        dtype=dtype_name(dtype),
        storage_handle=bytes(handle),
        storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes),
        ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=None if event_handle is None else bytes(event_handle),
        event_sync_required=bool(event_sync_required),
    )


def open_pool(handle: IpcHandle | bytes) -> torch.Tensor:
    """Map a peer's exported pool into this process (on this process's index of its GPU).
    torch caches the mapping of one allocation per process; keep the tensor as long as it is
    used, drop it to unmap."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if isinstance(handle, bytes | bytearray):
        handle = IpcHandle.from_bytes(bytes(handle))
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available in this process")
    index = local_device_index(handle.device_uuid)
    dtype = getattr(torch, handle.dtype)
    with torch.cuda.device(index):
        return rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(handle.shape),
            handle.stride,
            handle.storage_offset,
            torch.storage.TypedStorage,
            dtype,
            index,
            handle.storage_handle,
            handle.storage_size_bytes,
            handle.storage_offset_bytes,
            False,
            handle.ref_counter_handle,
            handle.ref_counter_offset,
            handle.event_handle,
            handle.event_sync_required,
        )
