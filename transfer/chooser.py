"""The one place a transfer path is chosen: which paths exist, in which order they are preferred,
which a node opens (``--kv-transfer``, less what its ``KVSecurity`` forbids: ``secured_paths``),
and which one a (sender, receiver) pair takes.

Each path is a module declaring a ``base.TransferPath``; adding one (an RDMA library such as
NIXL/UCX, say) is that module and its line in ``PREFERENCE`` (docs/transfer.md shows what it
implements). Nothing outside ``transfer/`` names a path: callers hold a ``KVReceiver`` and a
``KVSender`` (``api.open_receiver`` / ``open_sender``) and act on what a reservation says of
itself (``caller_writes``, ``receive_first``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import TypeVar

import torch

from splitserve.transfer import dist, grpc_bytes, ipc, nixl, tcp
from splitserve.transfer.base import KVReceiver, KVSender, PathOptions, TransferPath
from splitserve.transfer.endpoint import DIST, GRPC, IPC, NIXL, TCP, Endpoint
from splitserve.transfer.security import KVSecurity

# The paths of a node whose blocks only the byte path can carry.
BYTES_ONLY: tuple[str, ...] = (GRPC,)
# The paths that move the blocks of a tensor-parallel engine (spread over its ranks' pools): dist
# rank to rank (transfer.shards), the byte path through rank 0. The others move one pool tensor.
TP_PATHS: tuple[str, ...] = (DIST, GRPC)

PREFERENCE: tuple[TransferPath, ...] = (
    ipc.PATH,  # same host, CUDA: the sender copies into the receiver's mapped pool
    nixl.PATH,  # NIXL one-sided WRITEs (UCX: RDMA, shared memory, TCP), when installed
    dist.PATH,  # torch.distributed in a two-rank group per pair (NCCL on GPUs, gloo on CPU)
    tcp.PATH,  # raw sockets from pinned memory
    grpc_bytes.PATH,  # the byte path, in the services' own stream: reaches every peer, last
)
PATHS = tuple(path.name for path in PREFERENCE)
# What a node, or a caller that names no paths, opens: nixl only when asked for (docs/transfer.md
# says why it is not a default yet).
DEFAULT_PATHS = tuple(p for p in PATHS if p != NIXL)
_Part = TypeVar("_Part", KVReceiver, KVSender)

# Peer prefix fetches (a prefill node asking a peer): paths that can fill the first n blocks of a
# reservation and whose receiver need not take part while the holder sends (the asker waits for
# the holder's FetchBlocks answer); dist pairs are kept for decode nodes.
FETCH_PATHS = (IPC, TCP)


def choose_path(local: Endpoint, peer: Endpoint, allowed: Collection[str] = PATHS) -> str:
    """The path the sender ``local`` uses to ship KV blocks into the receiver ``peer``: the first
    of ``PREFERENCE`` in ``allowed`` that reaches it (each path's ``reaches``: ipc when both pools
    are on CUDA on one kernel, in two processes, the peer's pool exported and its GPU visible;
    dist when the peer's rendezvous backend is the sender's for its device kind, not on one GPU;
    tcp when the peer has a listener); ``grpc`` otherwise, whatever ``allowed`` says, and whenever
    the two pools' block layouts differ (the byte path then reports the mismatch as it always
    has). A side at tensor parallel size > 1 takes dist or the byte path (``TP_PATHS``)."""
    if (local.block_shape, local.dtype) != (peer.block_shape, peer.dtype):
        return GRPC
    if local.tp > 1 or peer.tp > 1:
        allowed = [p for p in allowed if p in TP_PATHS]
    for path in PREFERENCE:
        if path.name in allowed and path.reaches(local, peer):
            return path.name
    return GRPC


def why_not_preferred(local: Endpoint, peer: Endpoint, chosen: str) -> str | None:
    """Why the pair does not take the more preferred paths (None: it takes the first); for
    the log line a sender writes once per peer."""
    if chosen == IPC:
        return None
    reasons = [f"not ipc: {ipc.why_not_ipc(local, peer) or 'not among the paths allowed here'}"]
    if chosen != NIXL:
        why = nixl.why_not_nixl(local, peer) or "this node opened no nixl sender, or it failed"
        reasons.append(f"not nixl: {why}")
    return "; ".join(reasons)


def rate_prior(path: str) -> float:
    """The bytes/s a transfer over ``path`` ("": the services' byte stream) is assumed to move
    until measured: its ``TransferPath.rate_prior``, else the byte path's. The priors are
    benchmarks/transfer.py's 256 blocks of the 8B shape on an H200 host (2026-12-01), taken lower
    where a peer fetch also pays its round trip and the adoption."""
    by_name = {p.name: p.rate_prior for p in PREFERENCE}
    prior = by_name.get(path or GRPC)
    return prior if prior is not None else _byte_rate(by_name)


def _byte_rate(by_name: dict[str, float | None]) -> float:
    prior = by_name[GRPC]
    assert prior is not None
    return prior


def parse_paths(spec: str, device: str) -> tuple[str, ...]:
    """The paths a node may use from ``--kv-transfer`` (comma-separated names, or ``none``) on
    ``device``, in order of preference, the byte path last (always there). ``ValueError`` for an
    unknown name."""
    names = [p.strip() for p in spec.split(",") if p.strip()]
    if names == ["none"]:
        return (GRPC,)
    unknown = set(names) - set(PATHS)
    if unknown:
        choices = ", ".join(p for p in PATHS if p != GRPC)
        raise ValueError(f"--kv-transfer: unknown path(s) {sorted(unknown)}; use {choices} or none")
    if not device.startswith("cuda"):
        names = [p for p in names if p != IPC]  # ipc maps CUDA memory only
    return (*[p for p in PATHS if p in names and p != GRPC], GRPC)


def secured_paths(paths: Iterable[str], security: KVSecurity) -> tuple[str, ...]:
    """Of a node's ``paths``, those its ``security`` lets KV take. dist is plaintext between
    nodes and cannot be wrapped in TLS: with TLS configured it is kept only where the cluster
    trusts its KV network (``--trust-kv-network``), so an untrusted pair takes tcp (inside TLS)
    instead. nixl (UCX: neither encryption nor a check of who writes) is kept only without TLS
    and without a cluster token, or under ``--trust-kv-network``. ipc never leaves the host and
    the byte path rides the node's (m)TLS gRPC stream; tcp runs TLS itself when the node has
    it."""
    return tuple(
        p
        for p in paths
        if (p != DIST or security.plaintext_allowed)
        and (p != NIXL or security.unauthenticated_allowed)
    )


def fetch_paths(paths: Iterable[str]) -> tuple[str, ...]:
    """Of a node's ``paths``, those a peer prefix fetch may take (``FETCH_PATHS``)."""
    return tuple(p for p in paths if p in FETCH_PATHS)


def open_receivers(
    kv_pool: torch.Tensor, node_id: str, paths: Collection[str], options: PathOptions
) -> dict[str, KVReceiver]:
    """The receiving side of each of ``paths`` that can run here and that the node's security
    allows (``secured_paths``), and of the byte path."""
    paths = secured_paths(paths, options.security)
    return _open(PREFERENCE, paths, lambda p: p.open_receiver(kv_pool, node_id, options))


def open_senders(
    kv_pool: torch.Tensor, node_id: str, paths: Collection[str], options: PathOptions
) -> dict[str, KVSender]:
    """The sending side of each of ``paths`` that can run here and that the node's security
    allows (``secured_paths``), and of the byte path."""
    paths = secured_paths(paths, options.security)
    return _open(PREFERENCE, paths, lambda p: p.open_sender(kv_pool, node_id, options))


def _open(
    table: Iterable[TransferPath],
    paths: Collection[str],
    open_one: Callable[[TransferPath], _Part | None],
) -> dict[str, _Part]:
    parts: dict[str, _Part] = {}
    for path in table:
        if path.name in paths or path.name == GRPC:
            part = open_one(path)
            if part is not None:
                parts[path.name] = part
    return parts
