"""StoreTier: full KV blocks in a store shared by every node, behind a node's host tier.

Where the host tier and the disk are one node's, the store is the cluster's: a block one node
computed can be read by any other, under the same name, its hash (which already carries the
model's identity and the request's ``cache_salt``, so two models or two tenants never meet).
The store is Mooncake Store (``mooncake://MASTER``): memory that other processes hold and a
master that knows where each object lives; ``up --kv-store embedded`` starts both beside Redis.

What the tier does, all of it off the engine thread (a thread of its own for each kind of call,
so a slow put never holds a read up, nor a read a probe):
- **put**: every block the host tier commits after computing it is put once (write-through: the
  blocks are there for other nodes as soon as they exist). The thread copies the block's bytes
  out first and reports the host slot free, then sends; a store that is slow or down costs puts,
  never slots (puts queued past ``max_queued`` are skipped and counted).
- **probe**: which hashes the store holds is not known locally (other nodes put them), so a
  waiting request's hashes are asked about (one batched existence call) when it is queued;
  the scheduler waits for the answer at most ``probe_wait_s`` before taking it as a miss.
- **get**: a hit is read into a host slot, checked (the same header as the disk tier's: magic,
  hash, length, CRC-32) and copied to the pool as host hits are; a value that fails the check is
  removed from the store (the node computes the block and puts it again). A read that has not
  come back within ``timeout_s`` is abandoned: the thread will not touch the slot after that (a
  lock and a flag per read), and the load goes on with what came in.

A store that cannot be reached, or fails ``FAILURES_TO_PAUSE`` calls in a row, is left alone for
``PAUSE_S`` (probes answer "none", puts are skipped): its tokens are computed, with one log line.
Every answer from the store is input: a value of the wrong length, header or checksum is
dropped (``read_failed``) and computed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Protocol
from urllib.parse import parse_qs, urlsplit

import torch

import splitserve.settings as settings
from splitserve.engine.kv_disk import HEADER, Done, block_header, header_mismatch
from splitserve.kernels.layout import host_bytes
from splitserve.kvstore.hashing import BlockHash

logger = logging.getLogger(__name__)

MAGIC = b"SSKVSTR1"  # (under the disk tier's HEADER)
KEY_PREFIX = "splitserve/kv/"
FAILURES_TO_PAUSE = 3  # calls failed in a row before the store is left alone for a while
PAUSE_S = 5.0
MAX_UNSENT_BYTES = 256 << 20  # puts copied out of their host slots and not sent yet, at most
MAX_GET_BATCH = 64  # gets sent in one call, and at most
MAX_GET_BATCH_BYTES = 64 << 20  # of values (the client stages them in its local buffer)
LOCAL_BUFFER_MB = 256  # the client's local buffer: a batch of gets and the puts under way
MAX_KNOWN = 1 << 20  # hashes remembered as in the store (LRU; about 100 MB at most)
DEFAULT_RPC_PORT = 50051  # mooncake_master's defaults
DEFAULT_METADATA_PORT = 8080


class StoreError(RuntimeError):
    """The store could not be reached or set up (the node runs without it)."""


class StoreClient(Protocol):
    """The few calls the tier makes; each may block (the tier's threads make them)."""

    def exists(self, keys: list[str]) -> list[bool]: ...

    def put(self, key: str, parts: Sequence[bytes | memoryview]) -> bool: ...

    def get_many(self, keys: list[str]) -> list[bytes | None]: ...

    def remove(self, key: str) -> None: ...

    def close(self) -> None: ...


def parse_store_url(url: str) -> tuple[str, str]:
    """``mooncake://HOST[:RPC_PORT][?metadata=URL]`` → (master address, metadata server URL).

    The metadata server defaults to the master's own HTTP one (``mooncake_master
    --enable_http_metadata_server``) on its default port."""
    parts = urlsplit(url)
    if parts.scheme != "mooncake" or not parts.hostname:
        raise ValueError(
            f"--kv-store {url!r}: expected mooncake://HOST[:PORT][?metadata=http://HOST:PORT/"
            "metadata] (Mooncake Store's master)"
        )
    try:
        port = parts.port or DEFAULT_RPC_PORT
    except ValueError as exc:
        raise ValueError(f"--kv-store {url!r}: {exc}") from None
    query = parse_qs(parts.query)
    unknown = set(query) - {"metadata"}
    if unknown:
        raise ValueError(f"--kv-store {url!r}: unknown option(s) {sorted(unknown)}")
    metadata = query.get("metadata", [f"http://{parts.hostname}:{DEFAULT_METADATA_PORT}/metadata"])
    return f"{parts.hostname}:{port}", metadata[-1]


def store_host(url: str) -> str:
    return urlsplit(url).hostname or ""


class MooncakeStore:
    """A Mooncake Store client that brings no memory of its own (the store's memory is held by
    ``mooncake_client`` processes, or by other nodes that mount a segment).

    It connects on its first call, not when made, and again at most every ``retry_s`` while the
    store cannot be reached: a node started before its store (compose, Kubernetes) or outliving
    a store's restart starts using it once it is there. Until then every call raises
    ``StoreError`` (the tier computes)."""

    def __init__(
        self,
        url: str,
        local_host: str = "127.0.0.1",
        buffer_mb: int = LOCAL_BUFFER_MB,
        retry_s: float = 10.0,
    ) -> None:
        self.master, self.metadata = parse_store_url(url)
        # NOTE: a master that is down costs one attempt (about 4 s), not twenty (90 s).
        settings.MC_STORE_CLIENT_SETUP_RETRIES.set_default("1")
        try:
            from mooncake.store import MooncakeDistributedStore  # pyright: ignore[reportMissingImports]
        except ImportError as exc:
            raise StoreError(
                f"--kv-store needs Mooncake Store: pip install 'splitserve[mooncake]' "
                f"(and Debian's libibverbs1): {exc}"
            ) from None
        self._make = MooncakeDistributedStore
        self.url, self.local_host, self.buffer_mb, self.retry_s = (
            url,
            local_host,
            buffer_mb,
            retry_s,
        )
        self._store = None
        self._lock = threading.Lock()
        self._next_try = 0.0

    def connect(self) -> None:
        """Connect now if not connected (``StoreError`` if the store cannot be reached)."""
        self._client()

    def _client(self):
        store = self._store
        if store is not None:
            return store
        with self._lock:
            if self._store is not None:
                return self._store
            if time.monotonic() < self._next_try:
                raise StoreError(f"Mooncake Store at {self.url}: not reached yet")
            store = self._make()
            rc = store.setup(
                self.local_host, self.metadata, 0, self.buffer_mb << 20, "tcp", "", self.master
            )
            if rc != 0:
                self._next_try = time.monotonic() + self.retry_s
                raise StoreError(
                    f"Mooncake Store at {self.url}: setup returned {rc} (is its master up?); "
                    f"tried again in {self.retry_s:.0f} s"
                )
            logger.info("KV store: connected to %s", self.url)
            self._store = store
            return store

    def exists(self, keys: list[str]) -> list[bool]:
        found = self._client().batch_is_exist(keys)
        if len(found) != len(keys):
            raise StoreError(f"existence answered {len(found)} of {len(keys)} keys")
        if any(x < 0 for x in found):
            raise StoreError(f"existence failed ({min(found)})")
        return [x == 1 for x in found]

    def put(self, key: str, parts: Sequence[bytes | memoryview]) -> bool:
        return self._client().put_parts(key, *parts) == 0

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return [value or None for value in self._client().get_batch(keys)]  # (missing: b"")

    def remove(self, key: str) -> None:
        # NOTE: forced: a get leases the object for a while, and an unforced remove fails then.
        rc = self._client().remove(key, force=True)
        if rc != 0:
            raise StoreError(f"remove returned {rc}")

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


class _Read:
    """One get: the thread fills ``dst`` only if the engine has not abandoned it meanwhile."""

    __slots__ = ("abandoned", "block_hash", "dst", "finished", "lock", "tag")

    def __init__(self, block_hash: BlockHash, dst: torch.Tensor, tag: object) -> None:
        self.block_hash, self.dst, self.tag = block_hash, dst, tag
        self.lock = threading.Lock()
        self.abandoned = self.finished = False


class Probe:
    """An existence question about a request's hashes; ``done`` once answered (or given up)."""

    __slots__ = ("asked_at", "done", "hashes")

    def __init__(self, hashes: list[BlockHash]) -> None:
        self.hashes = hashes
        self.done = False
        self.asked_at = time.monotonic()


class StoreTier:
    def __init__(
        self,
        client: StoreClient,
        block_bytes: int,
        timeout_s: float = 2.0,
        probe_wait_s: float = 0.05,
        max_queued: int = 1024,
    ) -> None:
        self.client = client
        self.block_bytes = block_bytes
        self.timeout_s = timeout_s
        self.probe_wait_s = probe_wait_s
        self.max_queued = max_queued
        self._known: OrderedDict[BlockHash, None] = OrderedDict()  # in the store, as far as we know
        self._known_lock = threading.Lock()  # (the threads add what they learn)
        self._puts: queue.SimpleQueue = queue.SimpleQueue()
        self._gets: queue.SimpleQueue = queue.SimpleQueue()
        self._probes: queue.SimpleQueue = queue.SimpleQueue()
        self._queued_puts = 0
        self._closed = False
        self._done: deque[Done] = deque()
        self._failures = 0
        self._paused_until = 0.0
        self._warned_at = 0.0
        self.put_ok = self.put_failed = self.put_skipped = 0
        self.read_ok = self.read_failed = self.read_timed_out = 0
        self.probed = self.probe_failed = 0
        self._threads = [
            threading.Thread(
                target=self._put_loop, args=(self._puts,), name="kv-store-put", daemon=True
            ),
            threading.Thread(
                target=self._run, args=(self._gets,), name="kv-store-get", daemon=True
            ),
            threading.Thread(
                target=self._run, args=(self._probes,), name="kv-store-probe", daemon=True
            ),
        ]
        for thread in self._threads:
            thread.start()

    # ---------------------------------------------------------------- engine thread

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._known

    def match(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading ``block_hashes`` are known to be in the store (not verified: a read
        checks)."""
        n = 0
        for block_hash in block_hashes:
            if block_hash not in self._known:
                break
            n += 1
        return n

    @property
    def paused(self) -> bool:
        return time.monotonic() < self._paused_until

    def probe(self, block_hashes: Sequence[BlockHash]) -> Probe:
        """Ask the store which of ``block_hashes`` it holds (answers land in ``match``)."""
        probe = Probe(list(block_hashes))
        if self.paused or not probe.hashes:
            probe.done = True
        else:
            self._probes.put(("probe", probe))
        return probe

    def waiting_on(self, probe: Probe) -> bool:
        """Whether a scheduler should still wait for ``probe``'s answer."""
        return not probe.done and time.monotonic() - probe.asked_at < self.probe_wait_s

    def write(self, block_hash: BlockHash, src: torch.Tensor, tag: object) -> bool:
        """Put ``src`` (a block in host memory, unchanged until ``completed`` lists this job:
        the thread's copy of it is made first). False: not queued (the store is paused or too
        far behind); the caller's slot is then free at once."""
        if self.paused or self._closed or self._queued_puts >= self.max_queued:
            self.put_skipped += 1
            return False
        self._queued_puts += 1
        self._puts.put(("put", block_hash, src, tag))
        return True

    def read(self, block_hash: BlockHash, dst: torch.Tensor, tag: object) -> _Read:
        """Get the block into ``dst`` (host memory no one else touches until ``completed`` lists
        this read or ``abandon`` returns True for it)."""
        job = _Read(block_hash, dst, tag)
        self._gets.put(("get", job))
        return job

    def abandon(self, job: _Read) -> bool:
        """Give up a read that took too long: True if the thread will never touch its ``dst``
        (it is counted as failed; ``completed`` will not list it)."""
        with job.lock:
            if job.finished:
                return False
            job.abandoned = True
        self.read_timed_out += 1
        return True

    def drop(self, block_hash: BlockHash) -> None:
        """Forget a block the store did not give back whole."""
        with self._known_lock:
            self._known.pop(block_hash, None)

    def completed(self) -> list[Done]:
        out = []
        while self._done:
            done = self._done.popleft()
            if done.kind == "write":
                self._queued_puts -= 1
            out.append(done)
        return out

    def counters(self) -> dict[str, int]:
        """Monotonic counts since start (read from any thread)."""
        return {
            "store_tier_put_blocks": self.put_ok,
            "store_tier_put_failed_blocks": self.put_failed,
            "store_tier_put_skipped_blocks": self.put_skipped,
            "store_tier_read_blocks": self.read_ok,
            "store_tier_read_failed_blocks": self.read_failed + self.read_timed_out,
            "store_tier_read_timed_out_blocks": self.read_timed_out,
            "store_tier_probed_blocks": self.probed,
            "store_tier_probe_failed": self.probe_failed,
        }

    def close(self) -> None:
        """Stop the threads (the puts queued are sent first, within ``timeout_s``) and close the
        client. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for q in (self._puts, self._gets, self._probes):
            q.put(None)
        deadline = time.monotonic() + self.timeout_s
        for thread in self._threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))
        if any(thread.is_alive() for thread in self._threads):
            # NOTE: never closed under a call still in it (that crashes the process): a store
            # that stopped answering keeps its client until the process ends.
            logger.warning("KV store: a call is still under way; the client is left open")
            return
        try:
            self.client.close()
        except Exception as exc:  # closing a store that went away
            logger.debug("closing the KV store: %s", exc)

    # ---------------------------------------------------------------- the threads

    @staticmethod
    def key(block_hash: BlockHash) -> str:
        return KEY_PREFIX + block_hash.hex()

    def _know(self, block_hashes: Sequence[BlockHash]) -> None:
        with self._known_lock:
            known = self._known
            for block_hash in block_hashes:
                known[block_hash] = None
                known.move_to_end(block_hash)
            while len(known) > MAX_KNOWN:
                known.popitem(last=False)

    def _run(self, jobs: queue.SimpleQueue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            kind = job[0]
            try:
                if kind == "get":
                    self._gets_from(job, jobs)
                else:
                    self._probe(job[1])
            except Exception as exc:  # a thread that dies would stall every later job
                logger.exception("KV store: %s failed unexpectedly: %s", kind, exc)

    def _call_failed(self, what: str, exc: BaseException | str) -> None:
        self._failures += 1
        now = time.monotonic()
        if self._failures >= FAILURES_TO_PAUSE:
            self._paused_until = now + PAUSE_S
            self._failures = 0
        if now - self._warned_at > 60:
            self._warned_at = now
            logger.warning(
                "KV store: %s failed (%s): those blocks are computed; after %d failures in a "
                "row the store is left alone for %.0f s",
                what,
                exc,
                FAILURES_TO_PAUSE,
                PAUSE_S,
            )

    def _put_loop(self, jobs: queue.SimpleQueue) -> None:
        """Copy out the bytes of every put queued (handing their slots back at once), send one,
        and again: a host slot is held until its block's copy, not through the round trips of
        the puts before it. Copies wait while ``MAX_UNSENT_BYTES`` are copied and not sent (the
        slots then stay held: the host tier skips new blocks before memory runs away)."""
        unsent: deque[tuple[BlockHash, bytes]] = deque()
        stopping = False
        while not (stopping and not unsent):
            while len(unsent) * self.block_bytes < MAX_UNSENT_BYTES and not stopping:
                try:
                    job = jobs.get(block=not unsent)
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                    break
                _, block_hash, src, tag = job
                try:
                    unsent.append((block_hash, src.view(torch.uint8).reshape(-1).numpy().tobytes()))
                except Exception as exc:  # (out of memory): this block is not put
                    self.put_failed += 1
                    logger.warning("KV store: a put's copy failed: %s", exc)
                finally:  # the slot is handed back whatever happened
                    self._done.append(Done("write", block_hash, True, tag))
            if unsent:
                try:
                    self._put(*unsent.popleft())
                except Exception as exc:  # a thread that dies would stall every later put
                    logger.exception("KV store: put failed unexpectedly: %s", exc)

    def _put(self, block_hash: BlockHash, payload: bytes) -> None:
        header = block_header(MAGIC, block_hash, payload)
        if self.paused:
            self.put_failed += 1
            return
        try:
            ok = self.client.put(self.key(block_hash), [header, payload])
        except Exception as exc:
            ok = False
            self._call_failed("put", exc)
        else:
            if not ok:
                self._call_failed("put", "refused (full?)")
            else:
                self._failures = 0
        if ok:
            self.put_ok += 1
            self._know([block_hash])
        else:
            self.put_failed += 1

    def _probe(self, probe: Probe) -> None:
        try:
            # (one no longer waited for is not asked: a backlog of probes does not grow)
            if not self.paused and time.monotonic() - probe.asked_at < self.probe_wait_s:
                found = self.client.exists([self.key(h) for h in probe.hashes])
                self._failures = 0
                self.probed += len(probe.hashes)
                self._know([h for h, there in zip(probe.hashes, found, strict=True) if there])
        except Exception as exc:
            self.probe_failed += 1
            self._call_failed("existence probe", exc)
        finally:
            probe.done = True

    def _gets_from(self, job: tuple, jobs: queue.SimpleQueue) -> None:
        """Read ``job``'s block and those of the gets queued behind it (MAX_GET_BATCH at most)
        in one call: one round trip for a load's blocks, not one each."""
        batch = [job[1]]
        most = max(1, min(MAX_GET_BATCH, MAX_GET_BATCH_BYTES // max(self.block_bytes, 1)))
        while len(batch) < most:
            try:
                more = jobs.get_nowait()
            except queue.Empty:
                break
            if more is None:
                jobs.put(None)  # (stop after this batch)
                break
            batch.append(more[1])
        batch = [read for read in batch if not read.abandoned]  # (given up: not fetched)
        if not batch:
            return
        values: list[bytes | None] = [None] * len(batch)
        if not self.paused:
            try:
                values = self.client.get_many([self.key(j.block_hash) for j in batch])
                if len(values) != len(batch):
                    raise StoreError(f"{len(values)} values for {len(batch)} keys")
                self._failures = 0
            except Exception as exc:
                values = [None] * len(batch)
                self._call_failed("get", exc)
        for read, value in zip(batch, values, strict=True):
            self._get(read, value)

    def _get(self, job: _Read, value: bytes | None) -> None:
        ok = value is not None and self._check(job.block_hash, value)
        if value is not None and not ok:  # removed, so the next put of the block replaces it
            try:
                self.client.remove(self.key(job.block_hash))
            except Exception as exc:
                self._call_failed("remove", exc)
        with job.lock:
            if job.abandoned:
                return
            if ok:
                assert value is not None
                out = host_bytes(job.dst)
                out[:] = memoryview(value)[HEADER.size :]
            job.finished = True
        if ok:
            self.read_ok += 1
        else:
            self.read_failed += 1
        self._done.append(Done("read", job.block_hash, ok, job.tag))

    def _check(self, block_hash: BlockHash, value: bytes) -> bool:
        if len(value) != HEADER.size + self.block_bytes:
            expected = HEADER.size + self.block_bytes
            return self._bad(block_hash, f"{len(value)} bytes, expected {expected}")
        view = memoryview(value)
        why = header_mismatch(MAGIC, block_hash, view[: HEADER.size], view[HEADER.size :])
        return True if why is None else self._bad(block_hash, why)

    def _bad(self, block_hash: BlockHash, why: str) -> bool:
        logger.warning("KV store: block %s: %s: computed instead", block_hash.hex()[:16], why)
        return False
