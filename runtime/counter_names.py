"""The names of the nodes' monotonic counters, declared once.

A node's service counts into a ``Counter[str]`` keyed by these names (``counters[names.PREFILLS]
+= 1``) and ``NodeCollector`` exports each as ``splitserve_<role>_<name>_total``
(runtime.metrics); ``GetStats`` answers them under the same names. ``for_role`` lists what a role
may count, which tests/unit/test_metric_names.py feeds to the collectors. The engine's own
counters (``AsyncEngine.counters``: steps, step_seconds, engine_job_seconds) and the prefix-cache
look-ups (``KVPort.prefix_stats``: prefix_queries, prefix_queried_tokens, prefix_hit_tokens,
prefix_host_hit_tokens, the host tier's host_tier_{offloaded,skipped,loaded,evicted}_blocks, the
disk's disk_tier_*_blocks, the shared store's store_tier_*) are named where they are produced,
once each, and joined in by the services' ``all_counters``.
"""

from __future__ import annotations

from collections.abc import Iterable

# ------------------------------------------------------------------ both roles

TRANSFERS_FAILED = "transfers_failed"  # prefill: shipping failed; decode: a transfer in
IPC_BLOCKS_QUARANTINED = "ipc_blocks_quarantined"  # blocks an IPC copy may still be writing


def transfers_via(path: str) -> str:
    """Transfers over one KV path (ipc, dist, tcp, grpc)."""
    return f"transfers_{path}"


# ------------------------------------------------------------------ prefill node

PREFILLS = "prefills"
PROMPT_TOKENS = "prompt_tokens"
CACHED_TOKENS = "cached_tokens"
PREFILLS_NOT_SHIPPED = "prefills_not_shipped"
BLOCKS_SHIPPED = "blocks_shipped"
BLOCKS_REUSED_ON_DECODE = "blocks_reused_on_decode"
BYTES_SHIPPED = "bytes_shipped"
TRANSFERS_STREAMED = "transfers_streamed"  # shipped while the prefill ran (layer by layer)
TRANSFER_SECONDS = "transfer_seconds"
PREFIX_BLOCKS_FETCHED = "prefix_blocks_fetched"
PREFIX_FETCH_FAILED = "prefix_fetch_failed"
PREFIX_FETCH_SKIPPED_SLOWER = "prefix_fetch_skipped_slower"
# Fetches that outlasted their budget (prefill_node.peer_fetch), and those then not tried
# because their peer had just timed out.
PREFIX_FETCH_TIMED_OUT = "prefix_fetch_timed_out"
PREFIX_FETCH_SKIPPED_PEER_SLOW = "prefix_fetch_skipped_peer_slow"
BLOCKS_SERVED_TO_PEERS = "blocks_served_to_peers"
# Of those, the blocks sent from the host tier's memory (the pool no longer held them).
TIER_BLOCKS_SERVED_TO_PEERS = "tier_blocks_served_to_peers"


def prefix_fetches_via(path: str) -> str:
    """Prefixes fetched from a peer over one transfer path."""
    return f"prefix_fetches_{path}"


def blocks_served_to_peers_via(path: str) -> str:
    """Blocks a peer fetched from this node over one transfer path."""
    return f"blocks_served_to_peers_{path}"


# ------------------------------------------------------------------ decode node

TRANSFERS = "transfers"
TRANSFERS_EXPIRED = "transfers_expired"
TRANSFERS_RELEASED = "transfers_released"
TRANSFERS_WAITED_FOR_BLOCKS = "transfers_waited_for_blocks"
TRANSFERS_WAITED_FOR_SAME_BLOCKS = "transfers_waited_for_same_blocks"
TRANSFERS_DECLINED_STALE_ENDPOINT = "transfers_declined_stale_endpoint"
# Refused because their sender was at its cap (decode_node.peer_caps): transfers, KV blocks.
TRANSFERS_REFUSED_PEER_TRANSFERS = "transfers_refused_peer_transfers"
TRANSFERS_REFUSED_PEER_BLOCKS = "transfers_refused_peer_blocks"
BLOCKS_ADOPTED = "blocks_adopted"
BLOCKS_REUSED = "blocks_reused"
BYTES_RECEIVED = "bytes_received"
REQUESTS_ABORTED = "requests_aborted"
REQUESTS_FINISHED = "requests_finished"
DIRECT_REQUESTS = "direct_requests"
DIRECT_PROMPT_TOKENS = "direct_prompt_tokens"
DIRECT_CACHED_TOKENS = "direct_cached_tokens"
PREEMPTIONS = "preemptions"

_PREFILL = (
    PREFILLS,
    PROMPT_TOKENS,
    CACHED_TOKENS,
    PREFILLS_NOT_SHIPPED,
    BLOCKS_SHIPPED,
    BLOCKS_REUSED_ON_DECODE,
    BYTES_SHIPPED,
    TRANSFER_SECONDS,
    TRANSFERS_FAILED,
    IPC_BLOCKS_QUARANTINED,
    PREFIX_BLOCKS_FETCHED,
    PREFIX_FETCH_FAILED,
    PREFIX_FETCH_SKIPPED_SLOWER,
    PREFIX_FETCH_TIMED_OUT,
    PREFIX_FETCH_SKIPPED_PEER_SLOW,
    BLOCKS_SERVED_TO_PEERS,
    TIER_BLOCKS_SERVED_TO_PEERS,
    TRANSFERS_STREAMED,
)
_PREFILL_PER_PATH = (transfers_via, prefix_fetches_via, blocks_served_to_peers_via)
_DECODE = (
    TRANSFERS,
    TRANSFERS_FAILED,
    TRANSFERS_EXPIRED,
    TRANSFERS_RELEASED,
    TRANSFERS_WAITED_FOR_BLOCKS,
    TRANSFERS_WAITED_FOR_SAME_BLOCKS,
    TRANSFERS_DECLINED_STALE_ENDPOINT,
    TRANSFERS_REFUSED_PEER_TRANSFERS,
    TRANSFERS_REFUSED_PEER_BLOCKS,
    IPC_BLOCKS_QUARANTINED,
    BLOCKS_ADOPTED,
    BLOCKS_REUSED,
    BYTES_RECEIVED,
    REQUESTS_ABORTED,
    REQUESTS_FINISHED,
    DIRECT_REQUESTS,
    DIRECT_PROMPT_TOKENS,
    DIRECT_CACHED_TOKENS,
    PREEMPTIONS,
)
_DECODE_PER_PATH = (transfers_via,)
_ROLES = {"prefill": (_PREFILL, _PREFILL_PER_PATH), "decode": (_DECODE, _DECODE_PER_PATH)}


def for_role(role: str, paths: Iterable[str]) -> tuple[str, ...]:
    """Every counter a ``role`` ("prefill", "decode") node may count, over transfer ``paths``."""
    fixed, per_path = _ROLES[role]
    paths = tuple(paths)
    return (*fixed, *(name(path) for name in per_path for path in paths))
