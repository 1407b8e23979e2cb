"""The nixl path: one-sided WRITEs into the receiver's registered pool through NIXL (the transfer
library vLLM's NixlConnector, SGLang's PD, Dynamo and llm-d use), over whatever its UCX backend
finds: RDMA, shared memory or TCP between hosts, cuda_ipc on one host.

The receiver registers its pool once with a NIXL agent and offers the agent's metadata, the
pool's address and block layout in its endpoint (push mode: the decode node's pre-allocated
blocks are the WRITE target, as NIXL's push mode and SGLang do). The sender registers its own
pool, adds the receiver's agent once per peer (``connect``), and fills a reservation with one
transfer request: a descriptor per run of consecutive blocks on each side. ``send`` returns once
NIXL says the request is done; only then may the sender tell the receiver it finished, and the
receiver takes its word (``finish``), as on the ipc path. The writer is the sender's agent, so a
reservation cancelled before the sender finished is freed only after ``NIXL_FREE_GRACE_S``.

NIXL is optional (``pip install 'splitserve[nixl]'``: the ``nixl-cu13`` wheel, which bundles
UCX; ``nixl-cu12`` works too): without it, or when its agent cannot start, the path is not
offered and pairs take the others (the node logs why). UCX neither encrypts nor checks who
writes: nixl is offered only without TLS and without a cluster token, or under
``--trust-kv-network`` (``chooser.secured_paths``).
UCX settings (``UCX_TLS``, ``UCX_NET_DEVICES``) choose its transports: docs/transfer.md.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch

from splitserve.transfer.base import (
    BlockIds,
    KVSender,
    PathOptions,
    SenderWritesReceiver,
    TransferPath,
    as_endpoint,
    own_ticket,
)
from splitserve.transfer.endpoint import NIXL, Endpoint, dtype_name
from splitserve.transfer.errors import NotConnected, PeerLost, TransferError, TransferTimeout
from splitserve.transfer.reservation import (
    Ticket,
    block_nbytes,
    check_block_ids,
    check_source_ids,
)

logger = logging.getLogger(__name__)

# A cancelled reservation's blocks may still be a queued WRITE's target: freed after this, longer
# than a sender ever waits for a WRITE (NIXL_SEND_LIMIT_S), after which it drops the peer's agent.
NIXL_FREE_GRACE_S = 40.0
NIXL_SEND_LIMIT_S = 30.0
POLL_S = 0.0002  # between two looks at a transfer request's state
_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")  # the meta package, then a backend


def nixl_api() -> Any | None:
    """NIXL's Python API module (None: not installed here)."""
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def available() -> bool:
    return nixl_api() is not None


def _mem_type(pool: torch.Tensor) -> tuple[str, int]:
    if pool.device.type == "cuda":
        return "VRAM", pool.device.index or 0
    return "DRAM", 0


@dataclass(frozen=True, slots=True)
class NixlOffer:
    """What a receiver offers senders: its agent's metadata and where its pool lies."""

    agent: str
    metadata: bytes
    base: int  # the pool's address
    num_blocks: int
    block_bytes: int
    mem: str  # DRAM or VRAM
    device: int
    dtype: str
    rdma: bool = False  # the receiver's host has an RDMA device (has_rdma)

    def to_bytes(self) -> bytes:
        packed = msgpack.packb(
            [1, self.agent, self.metadata, self.base, self.num_blocks, self.block_bytes,
             self.mem, self.device, self.dtype, self.rdma],
            use_bin_type=True,
        )  # fmt: skip
        assert packed is not None
        return packed

    @classmethod
    def from_bytes(cls, data: bytes) -> NixlOffer:
        try:
            version, agent, meta, base, n, size, mem, device, dtype, rdma = msgpack.unpackb(data)
        except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
            raise ValueError(f"malformed nixl offer: {exc}") from None
        if version != 1 or mem not in ("DRAM", "VRAM"):
            raise ValueError(f"unsupported nixl offer version {version!r} / memory {mem!r}")
        if not (isinstance(agent, str) and isinstance(meta, bytes) and isinstance(dtype, str)):
            raise ValueError("malformed nixl offer: agent, metadata or dtype of the wrong type")
        ints = (base, n, size, device)
        if not all(type(v) is int and 0 <= v < 1 << 63 for v in ints) or n < 2 or size < 1:
            raise ValueError("malformed nixl offer: an address, count or size out of range")
        return cls(agent, meta, base, n, size, mem, device, dtype, bool(rdma))


class _Agent:
    """A NIXL agent with this pool registered (one per receiver or sender side)."""

    def __init__(self, pool: torch.Tensor, role: str) -> None:
        api = nixl_api()
        if api is None:
            raise RuntimeError("NIXL is not installed (pip install 'splitserve[nixl]')")
        self.pool = pool
        self.name = f"splitserve-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        config = api.nixl_agent_config(backends=["UCX"])
        self.agent = api.nixl_agent(self.name, config)
        self.mem, self.device = _mem_type(pool)
        self.block_bytes = block_nbytes(pool)
        self.base = pool.data_ptr()
        region = [(self.base, pool.numel() * pool.element_size(), self.device, "")]
        self.registered = self.agent.register_memory(region, self.mem)
        self._closed = False
        # NOTE: without NIXL's listen thread the agent is made with no locking of its own
        # (NIXL_THREAD_SYNC_NONE), and sends run on several threads: every call to it holds this.
        self.mu = threading.Lock()

    def descs(self, base: int, runs: list[tuple[int, int]], device: int, mem: str) -> Any:
        """Transfer descriptors of runs ``(first block, count)`` of a pool at ``base``."""
        size = self.block_bytes
        with self.mu:
            return self.agent.get_xfer_descs(
                [(base + first * size, count * size, device) for first, count in runs], mem
            )

    def close(self) -> None:
        with self.mu:
            if self._closed:
                return
            self._closed = True
            try:
                self.agent.deregister_memory(self.registered)
            except Exception as exc:  # at shutdown: nothing more to do with it
                logger.debug("nixl: deregistering the pool failed: %s", exc)


class NixlReceiver(SenderWritesReceiver):
    """Registers the pool; the sender writes the reserved blocks itself."""

    path_name = NIXL
    free_grace_s = NIXL_FREE_GRACE_S

    def __init__(self, kv_pool: torch.Tensor, node_id: str) -> None:
        self.kv_pool, self.node_id = kv_pool, node_id
        self._agent = _Agent(kv_pool, "rx")
        self._offer = NixlOffer(
            agent=self._agent.name,
            metadata=self._agent.agent.get_agent_metadata(),
            base=self._agent.base,
            num_blocks=kv_pool.shape[0],
            block_bytes=self._agent.block_bytes,
            mem=self._agent.mem,
            device=self._agent.device,
            dtype=dtype_name(kv_pool.dtype),
            rdma=has_rdma(),
        ).to_bytes()

    @classmethod
    def open(cls, kv_pool: torch.Tensor, node_id: str, options: PathOptions) -> NixlReceiver | None:
        if not available():
            logger.info("transfer: not offering nixl: NIXL is not installed")
            return None
        try:
            return cls(kv_pool, node_id)
        except Exception as exc:
            logger.warning("transfer: not offering nixl, its agent did not start: %s", exc)
            return None

    @property
    def paths(self) -> tuple[str, ...]:
        return (NIXL,)

    def offer(self) -> dict[str, object]:
        return {NIXL: self._offer}

    def shutdown(self) -> None:
        self._agent.close()


class NixlSender(KVSender):
    """Peers' agents (added once per peer) and WRITE requests into their pools."""

    def __init__(self, kv_pool: torch.Tensor, node_id: str) -> None:
        self.kv_pool, self.node_id = kv_pool, node_id
        self._agent = _Agent(kv_pool, "tx")
        self._peers: dict[str, tuple[str, NixlOffer]] = {}  # node id → (agent name, offer)
        self._mu = self._agent.mu  # one lock: the peer table and the agent change together

    @classmethod
    def open(cls, kv_pool: torch.Tensor, node_id: str, options: PathOptions) -> NixlSender | None:
        if not available():
            return None
        try:
            return cls(kv_pool, node_id)
        except Exception as exc:
            logger.warning("transfer: not sending over nixl, its agent did not start: %s", exc)
            return None

    @property
    def paths(self) -> tuple[str, ...]:
        return (NIXL,)

    def connect(self, peer: Endpoint | bytes) -> str:
        """Add the peer's agent (once: later calls reuse it)."""
        peer = as_endpoint(peer)
        raw = peer.offered(NIXL)
        if not isinstance(raw, bytes | bytearray):
            raise NotConnected(f"{peer.node_id!r} offers no nixl")
        offer = NixlOffer.from_bytes(bytes(raw))
        if (offer.block_bytes, offer.dtype) != (
            self._agent.block_bytes,
            dtype_name(self.kv_pool.dtype),
        ):
            raise ValueError(
                f"peer blocks of {offer.block_bytes} bytes {offer.dtype} differ from ours"
            )
        with self._mu:
            known = self._peers.get(peer.node_id)
            if known is not None and known[1] == offer:
                return NIXL
            if known is not None:  # the peer restarted: its old agent is gone
                self._remove(peer.node_id)
            try:
                name = self._agent.agent.add_remote_agent(offer.metadata)
            except Exception as exc:
                raise NotConnected(f"nixl: adding {peer.node_id!r}'s agent failed: {exc}") from exc
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._peers[peer.node_id] = (name, offer)
        return NIXL

    def path(self, peer_id: str) -> str | None:
        return NIXL if peer_id in self._peers else None

    def close(self, peer_id: str) -> None:
        with self._mu:
            self._remove(peer_id)

    def _remove(self, peer_id: str) -> None:
        """(under ``_mu``) Forget the peer and drop its agent (closes its UCX endpoints)."""
        known = self._peers.pop(peer_id, None)
        if known is not None:
            try:
                self._agent.agent.remove_remote_agent(known[0])
            except Exception as exc:
                logger.debug("nixl: removing %s's agent failed: %s", peer_id, exc)

    def close_all(self) -> None:
        """Drop every peer (the agent and its registration last as long as this process)."""
        with self._mu:
            for peer_id in list(self._peers):
                self._remove(peer_id)

    def send(self, ticket: Ticket | bytes, src_block_ids: BlockIds, *, timeout: float) -> int:
        """WRITE our blocks into the peer's reserved ones; returns the bytes moved once NIXL says
        the request is done. ``TransferTimeout`` after ``timeout`` s (UCX has no deadline of its
        own: a stopped peer leaves a request in progress for ever), ``PeerLost`` when the peer's
        agent went."""
        ticket = own_ticket(ticket, self.node_id, NIXL)
        known = self._peers.get(ticket.receiver_id)
        if known is None:
            raise NotConnected(f"no nixl agent of {ticket.receiver_id!r}: connect first")
        name, offer = known
        src = check_source_ids(src_block_ids, self.kv_pool.shape[0])
        dst = check_block_ids(ticket.block_ids, offer.num_blocks)
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source blocks for {len(dst)} destination blocks")
        if not src:
            return 0
        if self.kv_pool.device.type == "cuda":
            torch.cuda.current_stream(self.kv_pool.device).synchronize()  # the blocks are written
        agent, size = self._agent, self._agent.block_bytes
        runs = joint_runs(src, dst)
        local = agent.descs(agent.base, [(s, n) for s, _, n in runs], agent.device, agent.mem)
        remote = agent.descs(offer.base, [(d, n) for _, d, n in runs], offer.device, offer.mem)
        handle = None
        # Below the receiver's grace for an unfinished reservation, so a WRITE given up on here
        # never lands in blocks the receiver has handed to another request.
        limit = min(timeout, NIXL_SEND_LIMIT_S)
        try:
            with agent.mu:
                handle = agent.agent.initialize_xfer("WRITE", local, remote, name)
                state = agent.agent.transfer(handle)
            deadline = time.monotonic() + limit
            while state == "PROC":
                if time.monotonic() > deadline:
                    with self._mu:  # closes the peer's endpoints: nothing queued goes out
                        self._remove(ticket.receiver_id)
                    raise TransferTimeout(
                        f"nixl: the WRITE to {ticket.receiver_id} took over {limit} s"
                    )
                time.sleep(POLL_S)
                with agent.mu:
                    state = agent.agent.check_xfer_state(handle)
            if state != "DONE":
                raise PeerLost(f"nixl: the WRITE to {ticket.receiver_id} ended {state}")
        except TransferError:
            raise
        except Exception as exc:  # nixlRemoteDisconnectError and the like
            raise PeerLost(f"nixl: the WRITE to {ticket.receiver_id} failed: {exc}") from exc
        finally:
            if handle is not None:
                try:
                    with agent.mu:
                        agent.agent.release_xfer_handle(handle)
                except Exception as exc:
                    logger.warning("nixl: releasing a transfer request failed: %s", exc)
        return len(src) * size


def joint_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """``(first source, first destination, count)`` of each run of pairs consecutive on both
    sides (one descriptor each side: NIXL pairs the two lists entry by entry)."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


@functools.cache
def has_rdma() -> bool:
    """Whether this host has an RDMA device (InfiniBand or RoCE: ``/sys/class/infiniband``)."""
    try:
        devices = any(Path("/sys/class/infiniband").iterdir())
    except OSError:
        return False
    # (a container sees the host's /sys/class without being given /dev/infiniband)
    return devices and any(Path("/dev/infiniband").glob("uverbs*"))


def why_not_nixl(sender: Endpoint, receiver: Endpoint) -> str | None:
    """Why the pair does not take nixl (None: it does): the receiver offers it, the pools are of
    one device kind, and either both are on one host (UCX's shared memory or cuda_ipc) or both
    hosts have RDMA devices. Between hosts without RDMA UCX falls back to TCP, measured at a
    ninth of the tcp path's rate (docs/benchmarks.md, "KV transfer paths: transfer.py"): the tcp
    and dist paths go first there."""
    raw = receiver.offered(NIXL)
    if not isinstance(raw, bytes | bytearray):
        return (
            "the receiver offers none (NIXL not installed there, or a cluster token or TLS "
            "without --trust-kv-network)"
        )
    if sender.device != receiver.device:
        return "the pools are on different kinds of device"
    if sender.same_host(receiver):
        return None
    try:
        offer = NixlOffer.from_bytes(bytes(raw))
    except ValueError as exc:
        return str(exc)
    if not (offer.rdma and has_rdma()):
        return "another host, and not both with RDMA (UCX would fall back to TCP)"
    return None


def reaches(sender: Endpoint, receiver: Endpoint) -> bool:
    return why_not_nixl(sender, receiver) is None


PATH = TransferPath(
    NIXL,
    reaches=reaches,
    open_receiver=NixlReceiver.open,
    open_sender=NixlSender.open,
    # No prior: its rate is the transport UCX picks, 171.2 GB/s over cuda_ipc and 0.49 GB/s over
    # TCP at 256 blocks on one H200 (docs/benchmarks.md, "KV transfer paths: transfer.py").
    rate_prior=None,
)
