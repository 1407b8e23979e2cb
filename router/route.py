"""Which way a request goes: disaggregated (P prefills and ships its KV to D, which decodes) or
direct (D prefills the prompt in its own engine and decodes it: no KV transfer).

Pure rules over the router's own bookkeeping (no I/O). Direct when

- no prefill node may take work (none configured: ``splitserve up --num-prefill 0`` or a router
  with decode nodes only; or every one down, leaving or already failed for this request);
- the prompt's uncached part on the chosen decode node (its prompt length less the prefix the
  index says that node holds; without an index, the prompt length) is at most
  ``direct_prefill_tokens`` (0: never): shipping the KV of a short prompt costs more than
  computing it beside the decodes. The break-even depends on the model, the GPU and the
  transfer path: measure it with benchmarks (docs/deploy.md), it is not guessed here;
- every usable prefill node has at least ``direct_prefill_backlog_tokens`` prompt tokens of this
  router's requests in flight (0: never) while the decode node has a free batch slot (fewer of
  this router's requests than its ``max_num_seqs``; unknown until its GetStats answered).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import NamedTuple

from splitserve.router.pool import Node, NodePool, prompt_tokens_to_compute

DIRECT = "direct"
DISAGGREGATED = "disaggregated"


class RoutePolicy(NamedTuple):
    direct_prefill_tokens: int = 0  # uncached prompt tokens at most this: direct (0: never)
    direct_prefill_backlog_tokens: int = 0  # every P at least this backlogged: direct (0: never)


NO_DIRECT = RoutePolicy()  # direct only when no prefill node is usable


def choose_route(
    policy: RoutePolicy,
    prefill: NodePool,
    decode_node: Node,
    cached: Mapping[str, float],
    prompt_tokens: int,
    block_size: int,
    exclude: Collection[Node] = (),
) -> str:
    """``DIRECT`` or ``DISAGGREGATED`` for a prompt of ``prompt_tokens`` whose decode node is
    ``decode_node``; ``exclude``: prefill nodes this request found unreachable."""
    usable = [n for n in prefill.usable() if n not in exclude]
    if not usable:
        return DIRECT
    uncached = prompt_tokens_to_compute(
        prompt_tokens, cached.get(decode_node.address, 0), block_size
    )
    if uncached <= policy.direct_prefill_tokens:
        return DIRECT
    backlog = policy.direct_prefill_backlog_tokens
    if backlog > 0 and all(n.queued_tokens >= backlog for n in usable):
        slots = decode_node.slots
        if slots is not None and decode_node.in_flight < slots:
            return DIRECT
    return DISAGGREGATED
