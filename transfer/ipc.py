"""Same-host CUDA path: the receiver's KV pool, mapped into the sender's process.

The receiver exports its pool once (``export_pool``): torch's CUDA IPC reduction of the tensor
(``torch.multiprocessing.reductions.reduce_tensor``, i.e. ``cudaIpcGetMemHandle`` of the
allocation that holds the pool, its offset, and torch's producer-side ref counter and event), as
plain fields serialized with msgpack so the handle can travel in a gRPC message. The sender maps
it (``open_pool``, once per peer, ``IpcWriter`` caches it) on the same physical GPU, found by
UUID, since device indices differ between processes with different ``CUDA_VISIBLE_DEVICES``, and
then writes shipped blocks straight into the receiver's reserved blocks: one ``index_select`` of
the source blocks and one ``index_copy_`` into the mapped pool, on a side stream that first waits
for the current stream, then a CUDA event synchronized before ``write`` returns. Only then may the
sender tell the receiver that the transfer is complete.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import msgpack
import torch

from splitserve.transfer.endpoint import device_uuid, dtype_name, local_device_index
from splitserve.transfer.reservation import block_nbytes, check_block_ids, check_source_ids

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
        return msgpack.packb(
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


class IpcWriter:
    """Sender side: peers' mapped pools (one per peer, cached) and block writes into them."""

    def __init__(self, kv_pool: torch.Tensor) -> None:
        if kv_pool.device.type != "cuda":
            raise ValueError(f"the ipc path needs a CUDA pool, got {kv_pool.device}")
        self.kv_pool = kv_pool
        self._peers: dict[str, torch.Tensor] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._mu = threading.Lock()

    def connect(self, peer_id: str, handle: IpcHandle | bytes) -> torch.Tensor:
        """Map ``peer_id``'s pool (cached: later calls return the same mapping)."""
        with self._mu:
            mapped = self._peers.get(peer_id)
            if mapped is not None:
                return mapped
        mapped = open_pool(handle)
        if mapped.dim() != 6 or tuple(mapped.shape[1:]) != tuple(self.kv_pool.shape[1:]):
            raise ValueError(
                f"peer pool blocks {tuple(mapped.shape[1:])} differ from ours "
                f"{tuple(self.kv_pool.shape[1:])}"
            )
        if mapped.dtype != self.kv_pool.dtype:
            raise ValueError(f"peer pool dtype {mapped.dtype} differs from ours")
        with self._mu:
            return self._peers.setdefault(peer_id, mapped)

    def connected(self, peer_id: str) -> bool:
        return peer_id in self._peers

    def close(self, peer_id: str) -> None:
        """Drop the mapping of ``peer_id``'s pool (when it leaves)."""
        with self._mu:
            self._peers.pop(peer_id, None)

    def close_all(self) -> None:
        with self._mu:
            self._peers.clear()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index or 0
        with self._mu:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(device=index)
            return stream

    def write(self, peer_id: str, src_block_ids, dst_block_ids) -> int:
        """Copy our blocks ``src_block_ids`` into the peer's blocks ``dst_block_ids`` (same
        length, pairwise) and return the bytes written, once the copy has finished on the GPU.
        ``ValueError`` (nothing written) on bad ids; ``KeyError`` if the peer is not connected."""
        dst_pool = self._peers[peer_id]
        src = check_source_ids(src_block_ids, self.kv_pool.shape[0])
        dst = check_block_ids(dst_block_ids, dst_pool.shape[0])
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source blocks for {len(dst)} destination blocks")
        if not src:
            return 0
        src_dev, dst_dev = self.kv_pool.device, dst_pool.device
        src_stream = self._stream(src_dev)
        with torch.cuda.device(src_dev):
            src_index = torch.tensor(src, dtype=torch.int64, device=src_dev)
            src_stream.wait_stream(torch.cuda.current_stream(src_dev))
            with torch.cuda.stream(src_stream):
                buffer = self.kv_pool.index_select(0, src_index)
                if dst_dev == src_dev:
                    dst_index = torch.tensor(dst, dtype=torch.int64, device=dst_dev)
                    dst_pool.index_copy_(0, dst_index, buffer)
                    done = torch.cuda.Event()
                    done.record(src_stream)
        if dst_dev != src_dev:
            # Pool on another GPU of this host: one peer copy, then the scatter over there.
            dst_stream = self._stream(dst_dev)
            with torch.cuda.device(dst_dev):
                dst_stream.wait_stream(src_stream)
                with torch.cuda.stream(dst_stream):
                    moved = buffer.to(dst_dev)
                    dst_index = torch.tensor(dst, dtype=torch.int64, device=dst_dev)
                    dst_pool.index_copy_(0, dst_index, moved)
                    done = torch.cuda.Event()
                    done.record(dst_stream)
        done.synchronize()
        return len(src) * block_nbytes(self.kv_pool)
