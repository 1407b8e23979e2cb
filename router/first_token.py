"""What a request's first stage hands on, whichever route it took: its first token
(``FirstToken``); and the nodes an attempt already tried (``Tried``). The dispatcher hands the
front both the token and the request's session on its decode node (``router.dispatch.Started``)."""

from __future__ import annotations

from typing import NamedTuple

from splitserve.router.pool import Node


class FirstToken(NamedTuple):
    """A request's first output token: from P's Prefill answer (disaggregated) or from the first
    message of D's Generate stream (direct)."""

    token_id: int
    logprob: float
    finish_reason: str  # set: the node that sampled it ended the request there
    cached_tokens: int  # prompt tokens found in the computing node's cache
    computed_tokens: int = 0  # prompt tokens a prefill node computed for it (0: direct route)
    # As the prefill node reported them (0, "": direct): its engine's time to the first token,
    # the time the KV transfer added after it, and the path the blocks took.
    compute_s: float = 0.0
    transfer_s: float = 0.0
    transfer_path: str = ""
    blocks_shipped: int = 0  # as P reported them: blocks sent with data, and their bytes
    bytes_shipped: int = 0


class Tried(NamedTuple):
    """The nodes a request already tried: those that failed and those that only refused."""

    unreachable: set[Node]
    busy: set[Node]
