"""DiskTier: full KV blocks in files named by their hash, behind a node's host tier.

Each block the host tier commits is written once to ``DIR/<model root>/<hash>.kv`` by a thread of
the tier's own (a header — magic, the block hash, the payload length, a CRC-32 of the payload —
then the block's bytes, one sequential write; written to a temporary name and renamed, so a file
under a block's name is whole or absent). The tier keeps at most ``capacity_bytes`` of them,
least recently used out first. A prompt whose prefix continues on disk past the host tier gets
those blocks read back into host slots (and from there copied to the pool as host hits are); a
file whose header or checksum does not match its name is deleted and its tokens computed.

A node started again with the same directory and model identity finds its files (``scan``), and
publishes them: its earlier prefixes are hits after a restart. Each node needs a directory of its
own: ``scan`` trims what it finds to this node's size and deletes unfinished writes (``up`` gives
every node ``<dir>/<role>-<index>``). A file that vanished anyway is simply a miss.

This object's index (which hashes are on disk, their order, the size) belongs to the engine
thread; the thread only moves bytes and reports each job's outcome (``completed``).
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict, deque
from pathlib import Path
from typing import NamedTuple

import torch

from splitserve.kernels.layout import host_bytes
from splitserve.kvstore.block_pool import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    append_event,
)
from splitserve.kvstore.hashing import BlockHash
from splitserve.kvstore.host_cache import DISK

logger = logging.getLogger(__name__)

MAGIC = b"SSKVBLK1"
HEADER = struct.Struct("<8s32sQI")  # magic, block hash, payload bytes, CRC-32 of the payload
SUFFIX = ".kv"


def block_header(magic: bytes, block_hash: BlockHash, payload: memoryview | bytes) -> bytes:
    """The header a block's bytes travel under out of this process (a file, the shared store)."""
    return HEADER.pack(magic, block_hash, len(payload), zlib.crc32(payload))


def header_mismatch(
    magic: bytes,
    block_hash: BlockHash,
    header: memoryview | bytes | bytearray,
    payload: memoryview | bytes,
) -> str | None:
    """Why ``header`` and ``payload`` are not block ``block_hash`` whole (None: they are)."""
    got_magic, name, size, crc = HEADER.unpack(header)
    if got_magic != magic or name != block_hash or size != len(payload):
        return "header does not match its name"
    if zlib.crc32(payload) != crc:
        return "checksum mismatch"
    return None


class Done(NamedTuple):
    """A finished job: ``kind`` write or read, its block, whether it worked, the caller's tag."""

    kind: str
    block_hash: BlockHash
    ok: bool
    tag: object


class DiskTier:
    def __init__(
        self,
        directory: str | Path,
        root_hash: bytes,
        capacity_bytes: int,
        block_bytes: int,
        enable_events: bool = False,
    ) -> None:
        self.dir = Path(directory) / root_hash.hex()[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.block_bytes = block_bytes
        self.file_bytes = HEADER.size + block_bytes
        self.capacity_blocks = capacity_bytes // self.file_bytes
        if self.capacity_blocks < 1:
            raise ValueError(
                f"a disk KV tier of {capacity_bytes >> 20} MiB holds no block of "
                f"{self.file_bytes} bytes: raise --kv-disk-cache-mb"
            )
        self.enable_events = enable_events
        self._files: OrderedDict[BlockHash, None] = OrderedDict()  # least recently used first
        self._events: list[KVCacheEvent] = []
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: deque[Done] = deque()
        self.written = self.read_ok = self.read_failed = self.write_failed = self.evicted = 0
        self._warned: set[str] = set()
        self.scan()
        self._thread = threading.Thread(target=self._run, name="kv-disk", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- index (engine thread)

    def scan(self) -> int:
        """Index the files an earlier life left here (oldest first); drop what cannot be ours."""
        found = []
        for path in self.dir.iterdir():
            name = path.name
            if name.endswith(SUFFIX) and len(name) == 64 + len(SUFFIX):
                try:
                    block_hash = bytes.fromhex(name[:64])
                    stat = path.stat()
                except (ValueError, OSError):
                    continue
                if stat.st_size == self.file_bytes:
                    found.append((stat.st_mtime, block_hash))
                    continue
            if ".tmp" in name or name.endswith(SUFFIX):  # torn or of another block size
                path.unlink(missing_ok=True)
        for _, block_hash in sorted(found):
            self._files[block_hash] = None
        self._evict_over(self.capacity_blocks)
        if found:
            logger.info("disk KV tier: %d blocks found in %s", len(self._files), self.dir)
        return len(self._files)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._files

    def __len__(self) -> int:
        return len(self._files)

    def hashes(self) -> list[BlockHash]:
        return list(self._files)

    def added(self, block_hash: BlockHash) -> None:
        """A write finished: the block is findable here (most recently used)."""
        self._files[block_hash] = None
        self._files.move_to_end(block_hash)
        self._event(BlockStored([block_hash], DISK))
        self._evict_over(self.capacity_blocks)

    def drop(self, block_hash: BlockHash) -> None:
        """Forget a block whose file is missing, torn or corrupt, and delete the file."""
        if block_hash in self._files:
            del self._files[block_hash]
            self._event(BlockRemoved([block_hash], DISK))
        self._jobs.put(("delete", block_hash, None, None))

    def touch(self, block_hash: BlockHash) -> None:
        if block_hash in self._files:
            self._files.move_to_end(block_hash)

    def _evict_over(self, limit: int) -> None:
        while len(self._files) > limit:
            block_hash, _ = self._files.popitem(last=False)
            self.evicted += 1
            self._event(BlockRemoved([block_hash], DISK))
            self._jobs.put(("delete", block_hash, None, None))

    def _event(self, event: KVCacheEvent) -> None:
        if self.enable_events:
            append_event(self._events, event)

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def counters(self) -> dict[str, int]:
        """Monotonic counts since start (read from any thread)."""
        return {
            "disk_tier_written_blocks": self.written,
            "disk_tier_write_failed_blocks": self.write_failed,
            "disk_tier_read_blocks": self.read_ok,
            "disk_tier_read_failed_blocks": self.read_failed,
            "disk_tier_evicted_blocks": self.evicted,
        }

    # ---------------------------------------------------------------- jobs

    def write(self, block_hash: BlockHash, src: torch.Tensor, tag: object) -> None:
        """Write ``src`` (a block's bytes in host memory, unchanged until ``completed`` lists
        this job) under ``block_hash``."""
        self._jobs.put(("write", block_hash, src, tag))

    def read(self, block_hash: BlockHash, dst: torch.Tensor, tag: object) -> None:
        """Read the block into ``dst`` (host memory no one else touches until ``completed``
        lists this job); checked against its name, length and checksum."""
        self._jobs.put(("read", block_hash, dst, tag))

    def completed(self) -> list[Done]:
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def close(self) -> None:
        self._jobs.put(None)

    def path(self, block_hash: BlockHash) -> Path:
        return self.dir / f"{block_hash.hex()}{SUFFIX}"

    # ---------------------------------------------------------------- the thread

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            kind, block_hash, tensor, tag = job
            if kind == "delete":
                try:
                    self.path(block_hash).unlink(missing_ok=True)
                except OSError as exc:
                    self._warn("delete", exc)
                continue
            try:
                ok = (self._write if kind == "write" else self._read)(block_hash, tensor)
            except Exception as exc:  # a full disk, a vanished file: degrade to computing
                self._warn(kind, exc)
                ok = False
            if kind == "write":
                self.written += ok
                self.write_failed += not ok
            else:
                self.read_ok += ok
                self.read_failed += not ok
            self._done.append(Done(kind, block_hash, ok, tag))

    # NOTE: one system call for the header and the payload each way (pwritev/preadv): each call
    # gives the GIL up and takes it back, and a busy engine thread can make that wait a switch
    # interval (5 ms) every time.

    def _write(self, block_hash: BlockHash, src: torch.Tensor) -> bool:
        payload = host_bytes(src)
        header = block_header(MAGIC, block_hash, payload)
        final = self.path(block_hash)
        tmp = final.with_name(f"{final.name}.tmp{threading.get_ident()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            try:
                written = os.pwritev(fd, [header, payload], 0)
            finally:
                os.close(fd)
            if written != HEADER.size + len(payload):
                raise OSError(f"short write ({written} of {HEADER.size + len(payload)} bytes)")
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return True

    def _read(self, block_hash: BlockHash, dst: torch.Tensor) -> bool:
        out = host_bytes(dst)
        header = bytearray(HEADER.size)
        fd = os.open(self.path(block_hash), os.O_RDONLY)
        try:
            got = os.preadv(fd, [header, out, bytearray(1)], 0)
        finally:
            os.close(fd)
        if got != HEADER.size + len(out):
            return self._bad(block_hash, "wrong length")
        why = header_mismatch(MAGIC, block_hash, header, out)
        return True if why is None else self._bad(block_hash, why)

    def _bad(self, block_hash: BlockHash, why: str) -> bool:
        logger.warning("disk KV tier: %s in %s: computed instead", why, self.path(block_hash))
        return False

    def _warn(self, kind: str, exc: Exception) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("disk KV tier: %s failed (%s): those blocks are computed", kind, exc)
