"""LLMEngine: continuous batching over one ModelRunner, with prefix caching and chunked prefill.

Each ``step`` schedules running requests first (one token each when decoding, the next chunk when
a long prompt is mid-prefill), then admits waiting ones under the token budget, runs one forward,
samples where a request's known tokens are all computed, and frees finished requests' blocks.
When the pool runs short, the most recently admitted request is preempted: its blocks are freed
and it is recomputed later from its prompt and the tokens it already produced (same output).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from splitserve.kvstore import BlockPool, KVCacheManager, ModelIdentity, extend_block_hashes
from splitserve.models.kv_port import KVPort
from splitserve.models.runner import ModelRunner, SequenceInput
from splitserve.models.sampler import (
    Sampler,
    SamplingParams,
    check_stop,
    make_generator,
    skip_draws,
)

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    admitted: bool = False

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]


class RequestDoesNotFit(RuntimeError):
    """A request needs more KV blocks than the whole pool has; it was dropped."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class StepOutput(NamedTuple):
    request_id: str
    new_token_id: int
    logprob: float | None
    finish_reason: str | None


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        identity: ModelIdentity,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        eos_token_id: int | None = None,
        prefill_only: bool = False,
        enable_kv_events: bool = False,
    ) -> None:
        """``prefill_only``: a request ends after its first sampled token and keeps its blocks
        until ``release`` (a prefill node ships them first). ``enable_kv_events``: the pool
        records stored/evicted hashes for a prefix index, which must then drain them."""
        if identity.block_size != runner.block_size:
            raise ValueError(
                f"identity.block_size {identity.block_size} != runner block size "
                f"{runner.block_size}"
            )
        self.runner = runner
        self.identity = identity
        self.root_hash = identity.root_hash
        self.block_size = runner.block_size
        self.max_num_seqs = max_num_seqs or runner.rc.max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens or runner.rc.max_num_batched_tokens
        self.pool = BlockPool(runner.num_blocks, enable_events=enable_kv_events)
        self.kv = KVCacheManager(self.pool, self.block_size, enable_caching=enable_prefix_caching)
        self.sampler = Sampler()
        eos = runner.config.eos_token_ids
        self.eos_token_id = eos_token_id if eos_token_id is not None else (eos[0] if eos else None)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.prefill_only = prefill_only
        self.held: dict[str, Request] = {}  # prefill_only: finished, blocks not yet released
        self.num_preemptions = 0
        self.last_num_scheduled = 0
        # The door for code that moves KV between nodes (servicers, shippers, peer fetch).
        self.kv_port = KVPort(self)

    # ------------------------------------------------------------------ requests

    def check_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt as a list, or ``ValueError`` saying what is wrong with it."""
        prompt = list(prompt_token_ids)
        vocab, max_len = self.runner.config.vocab_size, self.runner.config.max_model_len
        if not prompt:
            raise ValueError("the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= vocab:
            bad = next(t for t in prompt if not 0 <= t < vocab)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if len(prompt) >= max_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens leaves no room to generate within "
                f"max_model_len {max_len}"
            )
        return prompt

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = list(prompt_token_ids)
        vocab, max_len = self.runner.config.vocab_size, self.runner.config.max_model_len
        if not prompt:
            raise ValueError("the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt) >= max_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens leaves no room to generate within "
                f"max_model_len {max_len}"
            )
        req = Request(
            request_id,
            prompt,
            params,
            cache_salt,
            make_generator(params, self.runner.device),
            token_ids=list(prompt),
        )
        self.requests[request_id] = req
        self.waiting.append(req)
        return req

    def add_transferred(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        first_token_id: int,
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> Request:
        """Join a request whose prompt KV is already in this engine's blocks (adopted with
        ``self.kv.adopt_blocks`` + ``allocate_slots`` for the tail, under ``request_id``) and whose
        first token was sampled elsewhere; it decodes from the next step on."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(self.running) >= self.max_num_seqs:
            raise RuntimeError(f"{len(self.running)} requests are running (max_num_seqs)")
        prompt = list(prompt_token_ids)
        generator = make_generator(params, self.runner.device)
        if generator is not None and not params.greedy:
            # The first token was drawn elsewhere from this seed: continue its sequence.
            skip_draws(generator, self.runner.config.vocab_size, self.runner.device)
        req = Request(
            request_id,
            prompt,
            params,
            cache_salt,
            generator,
            token_ids=[*prompt, first_token_id],
        )
        req.num_computed_tokens = len(prompt)
        req.admitted = True
        self._hash(req, len(prompt))
        self.requests[request_id] = req
        self.running.append(req)
        return req

    def release(self, request_id: str) -> None:
        """Free a held (prefill_only) request's blocks: they stay cached as prefix in the LRU."""
        if self.held.pop(request_id, None) is not None:
            self.kv.free(request_id)

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is (waiting, running or held) and free its blocks."""
        self.release(request_id)
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(request_id)

    @property
    def pending_prefill_tokens(self) -> int:
        """Prompt tokens admitted or queued but not computed yet (a scaler's prefill backlog)."""
        return sum(
            max(len(r.prompt_token_ids) - r.num_computed_tokens, 0)
            for r in (*self.waiting, *self.running)
        )

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling

    def _hash(self, req: Request, num_tokens: int) -> None:
        """Extend the request's block hashes to the full blocks of its first ``num_tokens``."""
        if num_tokens // self.block_size > len(req.block_hashes):
            extend_block_hashes(
                req.block_hashes,
                req.token_ids[:num_tokens],
                self.block_size,
                self.root_hash,
                req.cache_salt,
            )

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        logger.debug("preempted %s (%d tokens)", req.request_id, len(req.token_ids))

    def _schedule(self) -> list[tuple[Request, int]]:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted below by an earlier request
                continue
            num_new = min(len(req.token_ids) - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req.request_id, req.num_computed_tokens + num_new) is None:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            else:
                scheduled.append((req, num_new))
                budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            self._hash(req, len(req.token_ids))
            computed = self.kv.get_computed_blocks(req.block_hashes, len(req.token_ids))
            num_new = min(len(req.token_ids) - computed.num_computed_tokens, budget)
            total = computed.num_computed_tokens + num_new
            if self.kv.allocate_slots(req.request_id, total, computed) is None:
                break
            self.waiting.popleft()
            if not req.admitted:
                req.num_cached_tokens = computed.num_computed_tokens
                req.admitted = True
            req.num_computed_tokens = computed.num_computed_tokens
            self.running.append(req)
            scheduled.append((req, num_new))
            budget -= num_new
        return scheduled

    # ------------------------------------------------------------------ step

    def step(self) -> list[StepOutput]:
        scheduled = self._schedule()
        self.last_num_scheduled = len(scheduled)
        if not scheduled:
            req = self.waiting[0] if self.waiting and not self.running else None
            # Blocks held elsewhere (shipping, transfers) come back; only a request larger than
            # the whole pool can never run.
            if req is not None and -(-len(req.token_ids) // self.block_size) > (
                self.pool.num_blocks - 1
            ):
                self.waiting.popleft()
                self.requests.pop(req.request_id, None)
                raise RequestDoesNotFit(
                    req.request_id,
                    f"request {req.request_id} ({len(req.token_ids)} tokens) does not fit in the "
                    f"KV cache ({self.pool.num_blocks - 1} blocks of {self.block_size}) even alone",
                )
            return []
        seqs = [
            SequenceInput(
                req.token_ids[req.num_computed_tokens : req.num_computed_tokens + n],
                req.num_computed_tokens,
                self.kv.get_block_ids(req.request_id),
            )
            for req, n in scheduled
        ]
        logits = self.runner.execute(seqs)
        sample_rows, sample_reqs = [], []
        for i, (req, n) in enumerate(scheduled):
            req.num_computed_tokens += n
            self._hash(req, req.num_computed_tokens)
            self.kv.cache_blocks(req.request_id, req.block_hashes, req.num_computed_tokens)
            if req.num_computed_tokens == len(req.token_ids):
                sample_rows.append(i)
                sample_reqs.append(req)
        outputs: list[StepOutput] = []
        if not sample_reqs:
            return outputs
        rows = torch.tensor(sample_rows, device=logits.device)
        result = self.sampler.sample(
            logits.index_select(0, rows),
            [r.params for r in sample_reqs],
            [r.prompt_token_ids for r in sample_reqs],
            [r.output_token_ids for r in sample_reqs],
            [r.generator for r in sample_reqs],
            self.eos_token_id,
        )
        for j, req in enumerate(sample_reqs):
            token = result.token_ids[j]
            logprob = result.logprobs[j] if result.logprobs is not None else None
            req.token_ids.append(token)
            if logprob is not None:
                req.logprobs.append(logprob)
            reason = check_stop(req.params, token, len(req.output_token_ids), self.eos_token_id)
            if reason is None and len(req.token_ids) >= self.runner.config.max_model_len:
                reason = "length"
            if reason is not None or self.prefill_only:
                req.finish_reason = reason
                self.running.remove(req)
                self.requests.pop(req.request_id, None)
                if self.prefill_only:
                    self.held[req.request_id] = req
                else:
                    self.kv.free(req.request_id)
            outputs.append(StepOutput(req.request_id, token, logprob, reason))
        return outputs

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Request]:
        """Run prompts to completion; returns their requests (``output_token_ids`` etc.)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        reqs = [
            self.add_request(f"gen-{id(self)}-{i}-{len(self.requests)}", p, sp)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        while any(r.request_id in self.requests for r in reqs):
            self.step()
        return reqs
