"""Scheduler: which requests take part in the next forward, and how many tokens each computes.

Running requests come first (one token each when decoding, the next chunk when a long prompt is
mid-prefill), then waiting ones are admitted in arrival order under the token budget and
``max_num_seqs``, each starting from its longest cached prefix. When the pool runs short the most
recently admitted running request is preempted: its blocks are freed and it goes back to the
front of the queue, to be recomputed later from its prompt and the tokens it already produced
(the same output, since its sampler state lives in the request).

With a host tier (engine.kv_tiers), a waiting request whose prefix continues in host memory past
what the pool holds gets pool blocks for that part, filled by copies, and waits in ``loading``
(holding them) until the copies are done; it then joins the running requests with that prefix
computed. Other requests' steps go on meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from splitserve.kvstore import BlockHash, KVCacheManager, extend_block_hashes
from splitserve.kvstore.kv_cache_manager import ComputedBlocks
from splitserve.models.sampling_params import SamplingParams

if TYPE_CHECKING:
    from splitserve.engine.kv_store import Probe
    from splitserve.engine.kv_tiers import HostTier

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    admitted: bool = False
    # Asynchronous steps (engine.core): tokens appended as placeholders while the step that
    # samples them is still on the device; ``closing``: its last sampled token ends it for sure
    # (max_tokens, max_model_len, prefill-only), so it is not scheduled again; ``epoch`` counts
    # its preemptions (a step's bookkeeping skips a request preempted since).
    num_pending: int = 0
    closing: bool = False
    epoch: int = 0
    # When it joined the waiting queue and when a step first took it (monotonic clock): its
    # wait in this engine's queue, reported with its first token (traces).
    added_at: float = field(default_factory=time.monotonic)
    admitted_at: float = 0.0
    # With a shared KV store: the question asked about its prefix when it was queued.
    store_probe: Probe | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]


class ScheduledRequest(NamedTuple):
    request: Request
    num_new_tokens: int  # tokens whose KV this step computes, from ``num_computed_tokens`` on


class Scheduler:
    """Owns the waiting queue and the running list; allocates KV through ``kv`` for each step.

    ``schedule`` → (the caller runs the forward) → ``update_after_forward`` is one step; the
    caller ends requests with ``finish`` or ``remove``.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        root_hash: BlockHash,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        tier: HostTier | None = None,
    ) -> None:
        self.kv = kv
        self.tier = tier
        self.block_size = kv.block_size
        self.root_hash = root_hash
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        # NOTE: in admission order; the last one is the first preempted (it has the least work
        # to redo, and the oldest requests keep making progress).
        self.running: list[Request] = []
        # Transferred requests (KV already here) waiting for a running slot, in arrival order:
        # a decode node at max_num_seqs queues them rather than refuse work already prefilled.
        self.ready: deque[Request] = deque()
        # Requests whose prefix is being copied in from a tier, by id (they hold blocks).
        self.loading: dict[str, Request] = {}
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queues

    def add_waiting(self, req: Request) -> None:
        """Queue a new prompt; with a shared store, ask it about the prompt's blocks now, so the
        answer is usually in by the time the request is at the head."""
        self.waiting.append(req)
        if self.tier is not None and self.tier.store is not None and self.kv.enable_caching:
            self.hash_blocks(req, len(req.token_ids))
            max_blocks = (len(req.token_ids) - 1) // self.block_size
            req.store_probe = self.tier.probe(req.block_hashes[:max_blocks])

    def add_running(self, req: Request) -> None:
        """Join a request whose KV is already allocated under its id (a transferred prefill):
        running at once, or, while max_num_seqs are running, as soon as one finishes."""
        preempted_first = self.waiting and self.waiting[0].admitted
        if self._num_seqs() < self.max_num_seqs and not self.ready and not preempted_first:
            self.running.append(req)
        else:
            self.ready.append(req)

    def finish(self, req: Request) -> None:
        """Take a running request out of the schedule; its blocks are the caller's to free."""
        self.running.remove(req)

    def remove(self, req: Request) -> None:
        """Take a request out of whichever queue holds it (an abort); unknown ones are ignored."""
        if req in self.running:
            self.running.remove(req)
        elif self.loading.get(req.request_id) is req:
            del self.loading[req.request_id]  # (the load holds its blocks until it is done)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.ready:
            self.ready.remove(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.ready or self.loading)

    def hash_blocks(self, req: Request, num_tokens: int) -> None:
        """Extend the request's block hashes to the full blocks of its first ``num_tokens``."""
        if num_tokens // self.block_size > len(req.block_hashes):
            extend_block_hashes(
                req.block_hashes,
                req.token_ids[:num_tokens],
                self.block_size,
                self.root_hash,
                req.cache_salt,
            )

    # ------------------------------------------------------------------ one step

    def schedule(self) -> list[ScheduledRequest]:
        """The requests of the next forward, running ones first, and their KV slots allocated."""
        scheduled: list[ScheduledRequest] = []
        if self.tier is not None:
            self._admit_loaded()
        # A preempted request at the head of the queue (admitted before) goes first; then
        # transferred ones; then new prompts (in _schedule_waiting).
        while (
            self.ready
            and self._num_seqs() < self.max_num_seqs
            and not (self.waiting and self.waiting[0].admitted)
        ):
            self.running.append(self.ready.popleft())
        budget = self._schedule_running(self.max_num_batched_tokens, scheduled)
        self._schedule_waiting(budget, scheduled)
        return scheduled

    def update_after_forward(self, scheduled: list[ScheduledRequest]) -> list[int]:
        """Record the KV the forward wrote and cache the newly full blocks. Returns the indices
        into ``scheduled`` of the requests whose known tokens are now all computed: they sample
        (a prompt chunk that is not the last does not)."""
        ready = self.advance(scheduled)
        for req, _ in scheduled:
            self.cache_computed(req, req.num_computed_tokens)
        return ready

    def advance(self, scheduled: list[ScheduledRequest]) -> list[int]:
        """``update_after_forward`` without caching blocks: count the tokens the forward
        computes (the next schedule goes on from there) before its KV is on the device."""
        ready = []
        for i, (req, num_new) in enumerate(scheduled):
            req.num_computed_tokens += num_new
            if req.num_computed_tokens == len(req.token_ids):
                ready.append(i)
        return ready

    def cache_computed(self, req: Request, num_tokens: int) -> None:
        """Hash and cache the full blocks of the first ``num_tokens`` tokens (their KV is on the
        device, their token ids known)."""
        self.hash_blocks(req, num_tokens)
        self.kv.cache_blocks(req.request_id, req.block_hashes, num_tokens)

    def pop_unfittable(self, num_usable_blocks: int) -> Request | None:
        """After a step that scheduled nothing: the head of the queue when it can never run.

        Blocks held elsewhere (shipping, transfers) come back, so only a request with nothing
        running beside it that needs more than the whole pool is dropped (and returned)."""
        if not self.waiting or self.running:
            return None
        req = self.waiting[0]
        if -(-len(req.token_ids) // self.block_size) <= num_usable_blocks:
            return None
        return self.waiting.popleft()

    # ------------------------------------------------------------------ internals

    def _schedule_running(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted below for an earlier request
                continue
            if req.closing:  # its last token is still being sampled: it ends then
                continue
            num_new = min(len(req.token_ids) - req.num_computed_tokens, budget)
            total = req.num_computed_tokens + num_new
            while self.kv.allocate_slots(req.request_id, total) is None:
                # NOTE: never a closing request: its last token is still being sampled, and a
                # prefill-only one must keep its KV for the transfer that follows.
                victim = next((r for r in reversed(self.running) if not r.closing), None)
                if victim is None:
                    break
                self._preempt(victim)
                if victim is req:
                    break
            else:
                scheduled.append(ScheduledRequest(req, num_new))
                budget -= num_new
        return budget

    def _admit_loaded(self) -> None:
        """Requests whose tier copies are done join the running ones (or ``ready``, while
        max_num_seqs run), the blocks that came in now cached in the pool (the rest of their
        prompt is computed). A request aborted meanwhile freed its blocks then; the load held
        them until now and has let them go."""
        assert self.tier is not None
        for (req, num_prefix), num_loaded in self.tier.loaded():
            request_id = req.request_id
            if self.loading.get(request_id) is not req:  # aborted while its blocks were written
                continue
            del self.loading[request_id]
            self.kv.stats.host_hit_tokens += num_loaded * self.block_size
            num_cached = (num_prefix + num_loaded) * self.block_size
            self._admitted(req, num_cached)
            self.kv.cache_blocks(request_id, req.block_hashes, num_cached)
            if self._num_seqs() < self.max_num_seqs and not self.ready:
                self.running.append(req)
            else:
                self.ready.append(req)

    def _num_seqs(self) -> int:
        """Requests that hold a place in the batch: running, and loading their prefix."""
        return len(self.running) + len(self.loading)

    def _start_load(self, req: Request, computed: ComputedBlocks) -> bool | None:
        """Load the part of ``req``'s prefix past ``computed`` that the tiers hold.
        True: loading (it left the queue); False: nothing to load; None: not now (the pool is
        short, or the store's answer about its prefix is still due)."""
        assert self.tier is not None
        max_blocks = (len(req.token_ids) - 1) // self.block_size
        start = len(computed.blocks)
        if not self.kv.enable_caching or start >= max_blocks:
            return False
        hashes = req.block_hashes[start:max_blocks]
        num_found = self.tier.match(hashes)
        probe = req.store_probe
        if num_found < len(hashes) and probe is not None and self.tier.store is not None:
            if self.tier.store.waiting_on(probe):
                return None  # its answer is due within probe_wait_s: the queue waits for it
            req.store_probe = None  # (asked once; a preempted request computes what is gone)
            num_found = self.tier.match(hashes)
        if not num_found:
            return False
        total = (start + num_found) * self.block_size
        new_blocks = self.kv.allocate_slots(req.request_id, total, computed)
        if new_blocks is None:
            return None
        self.tier.load(hashes[:num_found], new_blocks, (req, start))
        self.waiting.popleft()
        self.loading[req.request_id] = req
        return True

    def _admitted(self, req: Request, num_cached_tokens: int) -> None:
        if not req.admitted:
            req.num_cached_tokens = num_cached_tokens
            req.admitted = True
            req.admitted_at = time.monotonic()
        req.num_computed_tokens = num_cached_tokens

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> None:
        while self.waiting and budget > 0 and self._num_seqs() < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_pending:  # preempted with a token still on the device: wait for it
                break
            if -(-len(req.token_ids) // self.block_size) > self.kv.block_pool.num_blocks - 1:
                # NOTE: more than the whole pool (less the null block): never admitted, so the
                # engine drops it once nothing runs (pop_unfittable). Admitted chunk by chunk it
                # would preempt itself each time it grows; with asynchronous steps its last
                # chunk is not cached yet then, so it would start over for ever.
                break
            self.hash_blocks(req, len(req.token_ids))
            # NOTE: lookup and allocation in the same step: a cached free block found here may
            # be evicted by any allocation in between.
            computed = self.kv.get_computed_blocks(req.block_hashes, len(req.token_ids))
            if self.tier is not None:
                loading = self._start_load(req, computed)
                if loading is None:
                    break  # strict arrival order, as below
                if loading:
                    continue
            num_new = min(len(req.token_ids) - computed.num_computed_tokens, budget)
            total = computed.num_computed_tokens + num_new
            if self.kv.allocate_slots(req.request_id, total, computed) is None:
                break  # strict arrival order: no later request overtakes the head
            self.waiting.popleft()
            self._admitted(req, computed.num_computed_tokens)
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.epoch += 1
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        logger.debug("preempted %s (%d tokens)", req.request_id, len(req.token_ids))
