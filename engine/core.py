"""LLMEngine: continuous batching over one ModelRunner, with prefix caching and chunked prefill.

The engine keeps the request store and runs steps: ``Scheduler`` (engine/scheduler.py) picks the
requests and token counts of the next forward and allocates their KV, the runner computes the
logits, and the engine samples where a request's known tokens are all computed, checks stop
conditions and ends finished requests (frees their blocks, or holds them in prefill-only mode).

Over 300 lines on purpose: the request store and the step (add, abort, launch, read back,
stop checks, ends) share the engine's state — an asynchronous step's placeholders, deferred
frees and aborts touch the same requests and blocks; scheduling, sampling and the KV port are
modules of their own already.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import NamedTuple

import torch

from splitserve.engine.kv_disk import DiskTier
from splitserve.engine.kv_port import KVPort
from splitserve.engine.kv_store import StoreClient, StoreTier
from splitserve.engine.kv_tiers import HostTier
from splitserve.engine.layer_stream import LayerStreams, StepRow
from splitserve.engine.scheduler import Request, ScheduledRequest, Scheduler
from splitserve.kvstore import BlockPool, KVCacheManager, ModelIdentity
from splitserve.models.runner import ModelRunner, SequenceInput
from splitserve.models.sampler import (
    PendingSample,
    Sampler,
    SamplingParams,
    check_stop,
    make_generator,
    skip_draws,
    to_device,
)

__all__ = ["FirstFacts", "LLMEngine", "Request", "RequestDoesNotFit", "StepOutput"]


_PLACEHOLDER = -1  # a sampled token still on the device (Request.num_pending)
# Steps computing fewer prompt tokens than this say more about a step's overheads than about
# the prefill's speed: not sampled for the tier's compute-or-read choice (``_time_prefill``).
PREFILL_SAMPLE_MIN_TOKENS = 256


class _Launched:
    """A step queued on the device whose tokens are not read yet."""

    def __init__(
        self,
        scheduled: list[tuple[Request, int, int]],
        reqs: list[Request],
        sample: PendingSample,
    ) -> None:
        self.scheduled = scheduled  # (request, tokens computed after this step, its epoch)
        self.ids = {req.request_id for req, _, _ in scheduled}
        self.reqs = reqs  # the requests that sample, in the sample's row order
        self.sample = sample
        self.row_of: dict[str, int] = {}  # request id → its row of the sample
        self.slots: list[int] = []  # where each row's token goes in its request's token_ids
        self.free_after: list[str] = []  # ended meanwhile: free once this step is read
        self.needs_tokens = False  # a request samples with penalties over its own tokens


class RequestDoesNotFit(RuntimeError):
    """A request needs more KV blocks than the whole pool has; it was dropped."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class FirstFacts(NamedTuple):
    """What a request's first sampled token brings besides the token: how much of its prompt
    was cached, and on a prefill-only engine the blocks it holds for shipping (its full
    blocks' hashes and every block id, the partial tail last)."""

    num_cached_tokens: int
    block_hashes: list[bytes] | None = None
    block_ids: list[int] | None = None
    queued_s: float = 0.0  # from its arrival in the engine to the first step that took it


class StepOutput(NamedTuple):
    request_id: str
    new_token_id: int
    logprob: float | None
    finish_reason: str | None
    facts: FirstFacts | None = None  # on a request's first token sampled here


def check_prompt(prompt_token_ids: Sequence[int], vocab: int, max_len: int) -> list[int]:
    """The prompt as a list, or ``ValueError`` saying what is wrong with it: empty, a token id
    outside the vocabulary, or no room left to generate within ``max_len``."""
    prompt = list(prompt_token_ids)
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
        async_scheduling: bool | None = None,
        host_cache_blocks: int = 0,
        disk_cache_dir: str | None = None,
        disk_cache_bytes: int = 0,
        kv_store: StoreClient | None = None,
    ) -> None:
        """``prefill_only``: a request ends after its first sampled token and keeps its blocks
        until ``release`` (a prefill node ships them first). ``enable_kv_events``: the pool
        records stored/evicted hashes for a prefix index, which must then drain them.
        ``async_scheduling`` (default: on a GPU): schedule and launch step N+1 before reading
        step N's tokens (see ``step``). ``host_cache_blocks``: a host-memory tier of that many
        blocks behind the pool (engine.kv_tiers; 0: none; only with prefix caching, at tensor
        parallel size 1). ``disk_cache_dir``: a disk tier of at most ``disk_cache_bytes`` there,
        behind the host tier (engine.kv_disk). ``kv_store``: a connected client of a store shared
        with other nodes, behind the host tier too (engine.kv_store)."""
        if identity.block_size != runner.block_size:
            raise ValueError(
                f"identity.block_size {identity.block_size} != runner block size "
                f"{runner.block_size}"
            )
        self.runner = runner
        self.identity = identity
        self.root_hash = identity.root_hash
        self.block_size = runner.block_size
        self.pool = BlockPool(runner.num_blocks, enable_events=enable_kv_events)
        self.kv = KVCacheManager(self.pool, self.block_size, enable_caching=enable_prefix_caching)
        self.host_tier: HostTier | None = None
        self._last_step: tuple[float | None, int] = (None, 0)  # (its start, prompt tokens)
        if host_cache_blocks > 0 and enable_prefix_caching:
            if runner.tp.size > 1:
                # NOTE: rank 0's pool holds its heads only; the tier would need every rank's.
                raise ValueError(
                    "the host KV tier is not yet available at tensor parallel size > 1: "
                    "start the node with --kv-host-cache-mb 0"
                )
            disk = None
            if disk_cache_dir:
                disk = DiskTier(
                    disk_cache_dir,
                    identity.root_hash,
                    disk_cache_bytes,
                    runner.block_bytes,
                    enable_events=enable_kv_events,
                )
            store = StoreTier(kv_store, runner.block_bytes) if kv_store is not None else None
            self.host_tier = HostTier(
                runner.kv_pool,
                self.pool,
                host_cache_blocks,
                enable_events=enable_kv_events,
                disk=disk,
                store=store,
            )
        elif disk_cache_dir or kv_store is not None:
            raise ValueError(
                "the disk KV tier and the shared store sit behind the host tier: give "
                "--kv-host-cache-mb > 0 (and keep prefix caching on)"
            )
        self.scheduler = Scheduler(
            self.kv,
            self.root_hash,
            max_num_seqs or runner.rc.max_num_seqs,
            max_num_batched_tokens or runner.rc.max_num_batched_tokens,
            self.host_tier,
        )
        self.sampler = Sampler()
        eos = runner.config.eos_token_ids
        self.eos_token_id = eos_token_id if eos_token_id is not None else (eos[0] if eos else None)
        self.requests: dict[str, Request] = {}
        self.prefill_only = prefill_only
        self.held: dict[str, Request] = {}  # prefill_only: finished, blocks not yet released
        # A prefill node's layer-wise KV streams (engine.layer_stream; set with its sender).
        self.layer_streams: LayerStreams | None = None
        self.last_num_scheduled = 0
        if async_scheduling is None:
            async_scheduling = runner.device.type == "cuda"
        self.async_scheduling = async_scheduling
        self._inflight: _Launched | None = None
        # Requests to drop before the next step schedules anything (``abort_soon``): marked from
        # any thread, applied on the engine thread.
        self._abort_soon: set[str] = set()
        self._abort_lock = threading.Lock()
        # The door for code that moves KV between nodes (servicers, shippers, peer fetch).
        # NOTE: the ignore: pyright reads this file at two paths (pyproject.toml's NOTE).
        self.kv_port = KVPort(self)  # pyright: ignore[reportArgumentType]

    # NOTE: the queues and limits live in the scheduler; these read-through properties keep the
    # engine's attributes that nodes and metrics read (``len``, iteration, ``in``).
    @property
    def waiting(self) -> deque[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def ready(self) -> deque[Request]:
        """Transferred requests waiting for a running slot (see Scheduler.add_running)."""
        return self.scheduler.ready

    @property
    def loading(self) -> list[Request]:
        """Requests whose prefix is being copied in from the host or disk tier."""
        # NOTE: copied in one call first: read from other threads too (engine_figures).
        return list(self.scheduler.loading.values())

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.scheduler.max_num_batched_tokens

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ------------------------------------------------------------------ requests

    def check_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt as a list, or ``ValueError`` saying what is wrong with it."""
        config = self.runner.config
        return check_prompt(prompt_token_ids, config.vocab_size, config.max_model_len)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a new prompt; ``ValueError`` (from ``check_prompt``) when it cannot run."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = self.check_prompt(prompt_token_ids)
        generator = make_generator(params, self.runner.device)
        req = Request(request_id, prompt, params, cache_salt, generator, token_ids=list(prompt))
        self.requests[request_id] = req
        self.scheduler.add_waiting(req)
        if self.layer_streams is not None:  # a stream opened for it before: from its first step
            self.layer_streams.attach(request_id, req.epoch, [], 0, len(prompt), False)
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
        prompt = list(prompt_token_ids)
        generator = make_generator(params, self.runner.device)
        if generator is not None and not params.greedy:
            # The first token was drawn elsewhere from this seed: continue its sequence.
            skip_draws(generator, self.runner.config.vocab_size, self.runner.device)
        tokens = [*prompt, first_token_id]
        req = Request(request_id, prompt, params, cache_salt, generator, token_ids=tokens)
        req.num_computed_tokens = len(prompt)
        req.admitted = True
        self.scheduler.hash_blocks(req, len(prompt))
        self.scheduler.add_running(req)  # queued while max_num_seqs are running
        self.requests[request_id] = req
        return req

    def release(self, request_id: str) -> None:
        """Free a held (prefill_only) request's blocks: they stay cached as prefix in the LRU."""
        if self.held.pop(request_id, None) is not None:
            self.kv.free(request_id)

    def open_stream(
        self, request_id: str, ticket: bytes, index: Sequence[int], timeout: float
    ) -> Future:
        """Stream the request's blocks ``index`` (per reserved position of ``ticket``) into a
        decode node's reservation as its prefill writes them (``engine.layer_stream``); the
        future holds the bytes sent. Engine thread, between steps; best before ``add_request``
        (the stream then sees every step of the prefill). A request never added fails it when
        aborted."""
        streams = self.layer_streams
        if streams is None:
            raise ValueError("this engine streams no KV (no layer-wise transfer path is open)")
        future = streams.open(request_id, ticket, index, timeout)
        req = self.requests.get(request_id)
        if req is not None:
            computed = req.num_computed_tokens
            prompt_len = len(req.prompt_token_ids)
            ids = self.kv.get_block_ids(request_id)
            streams.attach(request_id, req.epoch, ids, computed, prompt_len, computed >= prompt_len)
        elif (held := self.held.get(request_id)) is not None:
            prompt_len = len(held.prompt_token_ids)
            ids = self.kv.get_block_ids(request_id)
            streams.attach(request_id, held.epoch, ids, prompt_len, prompt_len, True)
        return future

    def abort_soon(self, request_id: str) -> None:
        """Mark a request to be aborted at the top of the next step, before it schedules (safe
        from any thread, e.g. the event loop while a step runs): a cancelled request is not
        computed again even when its ``abort`` job waits behind other engine work. The caller
        still queues ``abort`` (which clears the mark): an unknown id is simply dropped."""
        with self._abort_lock:
            self._abort_soon.add(request_id)

    def _apply_aborts(self) -> None:
        """Abort every request marked by ``abort_soon`` (engine thread)."""
        if not self._abort_soon:
            return
        with self._abort_lock:
            marked, self._abort_soon = self._abort_soon, set()
        for request_id in marked:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is (waiting, running or held) and free its blocks.
        Idempotent: an unknown or already aborted id is ignored."""
        if self._abort_soon:
            with self._abort_lock:
                self._abort_soon.discard(request_id)
        self.release(request_id)
        if self.layer_streams is not None:
            self.layer_streams.drop(request_id, "aborted before its prefill ended")
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self.scheduler.remove(req)
        self._free(req)

    def _free(self, req: Request) -> None:
        """Free a request's blocks, once the step on the device no longer writes them (a tier's
        copy into them holds them itself until it is done)."""
        inflight = self._inflight
        if inflight is not None and req.request_id in inflight.ids:
            inflight.free_after.append(req.request_id)
        else:
            self.kv.free(req.request_id)

    @property
    def pending_prefill_tokens(self) -> int:
        """Prompt tokens admitted or queued but not computed yet (a scaler's prefill backlog).

        NOTE: read from other threads too (engine.kv_port's figures): each queue is copied by one
        unpacking, which holds the GIL, before anything is summed."""
        return sum(
            max(len(r.prompt_token_ids) - r.num_computed_tokens, 0)
            for r in (*self.waiting, *self.running, *self.ready, *self.loading)
        )

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_unfinished()
            or self._inflight is not None
            or (self.host_tier is not None and self.host_tier.busy)
        )

    # ------------------------------------------------------------------ step

    def step(self, on_launch: Callable[[], None] | None = None) -> list[StepOutput]:
        """One iteration: apply pending aborts, schedule, launch the forward and the sampling,
        then read the tokens, check stop conditions and end finished requests. ``on_launch`` is
        called once the forward is queued on the device and before the wait for its results (on
        a GPU, what runs then overlaps the forward); not called when nothing was scheduled.

        With ``async_scheduling`` the tokens read are those of the step before: step N+1 is
        scheduled and launched while step N still computes (its sampled tokens feed N+1's
        inputs on the device), then N's tokens are read. The host's work of a step (schedule,
        inputs, stop checks, outputs) thus runs beside the device's instead of between two
        forwards. A request that turns out to have ended at N computed one token too many in
        N+1, which is dropped; its blocks are freed once N+1 is done with them. A step with a
        request whose penalties need its previous token waits for that token first.
        Returns the outputs of every step whose tokens were read in this call.

        With a host tier, the blocks cached by the steps read here are then copied out to it
        (on a GPU: queued on the tier's stream while the launched step computes)."""
        tier = self.host_tier
        if tier is not None:
            self._time_prefill(tier)
        outputs = self._step(on_launch)
        if tier is not None:
            tier.offload()
        return outputs

    def _time_prefill(self, tier: HostTier) -> None:
        """What computing a block costs here, for the tier's choice between reading a block from
        disk or the store and computing it: the time from the last step's start to this one's
        over the prompt tokens it computed, when they were many (a moving average). A step's
        decodes and any idle gap count as prefill time: the estimate errs towards reading."""
        now = time.perf_counter()
        began, tokens = self._last_step
        if began is not None and tokens >= PREFILL_SAMPLE_MIN_TOKENS:
            block_s = (now - began) / tokens * self.block_size
            old = tier.compute_block_s
            tier.compute_block_s = block_s if old is None else 0.8 * old + 0.2 * block_s
        self._last_step = (now, 0)

    def _step(self, on_launch: Callable[[], None] | None) -> list[StepOutput]:
        self._apply_aborts()
        outputs: list[StepOutput] = []
        if self._inflight is not None and self._inflight.needs_tokens:
            outputs += self._read(self._inflight)
        scheduled = self.scheduler.schedule()
        self.last_num_scheduled = len(scheduled)
        if not scheduled:
            if self._inflight is not None:  # nothing to launch behind it: wait for its tokens
                outputs += self._read(self._inflight)
            elif not outputs:  # (outputs go first: the next step raises for the unfittable)
                self._drop_unfittable()
            return outputs
        launched = self._launch(scheduled)
        previous, self._inflight = self._inflight, launched
        if on_launch is not None:
            on_launch()
        if previous is not None:
            outputs += self._read(previous)
        if not self.async_scheduling:
            outputs += self._read(launched)
        return outputs

    def _drop_unfittable(self) -> None:
        """Nothing ran: raise ``RequestDoesNotFit`` for a head request that never can."""
        req = self.scheduler.pop_unfittable(self.pool.num_blocks - 1)
        if req is None:
            return
        self.requests.pop(req.request_id, None)
        if self.layer_streams is not None:
            self.layer_streams.drop(req.request_id, "it does not fit in the KV cache")
        raise RequestDoesNotFit(
            req.request_id,
            f"request {req.request_id} ({len(req.token_ids)} tokens) does not fit in the "
            f"KV cache ({self.pool.num_blocks - 1} blocks of {self.block_size}) even alone",
        )

    def _launch(self, scheduled: list[ScheduledRequest]) -> _Launched:
        """Queue the forward of ``scheduled`` and the sampling of its ready rows; append a
        placeholder token to every request that samples (read back by ``_read``)."""
        inflight = self._inflight
        seqs = []
        prompt_tokens = 0  # what this step computes of prompts (``_time_prefill``)
        for req, n in scheduled:
            if n > 1:
                prompt_tokens += n
            start = req.num_computed_tokens
            tokens = req.token_ids[start : start + n]
            feed_row = -1
            if req.num_pending:  # its one new token is the in-flight step's sample
                assert inflight is not None and req.request_id in inflight.row_of and n == 1
                feed_row, tokens = inflight.row_of[req.request_id], [0]
            seqs.append(
                SequenceInput(tokens, start, self.kv.get_block_ids(req.request_id), feed_row)
            )
        self._last_step = (self._last_step[0], prompt_tokens)
        feed = inflight.sample.token_ids if inflight is not None else None
        hook = None
        if self.layer_streams:
            rows = [
                StepRow(
                    req.request_id,
                    req.epoch,
                    seq.start_pos,
                    len(seq.token_ids),
                    len(req.prompt_token_ids),
                    seq.block_ids,
                )
                for (req, _), seq in zip(scheduled, seqs, strict=True)
            ]
            hook = self.layer_streams.before_step(rows)
        try:
            if hook is None:
                logits = self.runner.execute(seqs, feed)
            else:
                logits = self.runner.execute(seqs, feed, hook.layer_done)
        except BaseException as exc:
            if hook is not None:
                hook.finish(exc)
            raise
        if hook is not None:
            hook.finish()
        ready = self.scheduler.advance(scheduled)
        reqs = [scheduled[i].request for i in ready]
        if len(ready) < len(scheduled):
            logits = logits.index_select(0, to_device(ready, logits.device, torch.long))
        sample = self.sampler.launch(
            logits,
            [r.params for r in reqs],
            [r.prompt_token_ids for r in reqs],
            [r.output_token_ids for r in reqs],
            [r.generator for r in reqs],
            self.eos_token_id,
        )
        launched = _Launched(
            [(req, req.num_computed_tokens, req.epoch) for req, _ in scheduled],
            reqs,
            sample,
        )
        max_len = self.runner.config.max_model_len
        for j, req in enumerate(reqs):
            launched.row_of[req.request_id] = j
            launched.slots.append(len(req.token_ids))
            req.token_ids.append(_PLACEHOLDER)
            req.num_pending += 1
            req.closing = (
                self.prefill_only
                or len(req.output_token_ids) >= req.params.max_tokens
                or len(req.token_ids) >= max_len
            )
            if req.params.needs_previous_tokens:
                launched.needs_tokens = True
        return launched

    def _read(self, launched: _Launched) -> list[StepOutput]:
        """Wait for a launched step's tokens; put them in place of their placeholders, cache the
        blocks it filled, check stop conditions, end finished requests and free the blocks of
        those that ended while it computed."""
        if self._inflight is launched:
            self._inflight = None
        try:
            result = launched.sample.result()
            for req, computed, epoch in launched.scheduled:
                if req.epoch == epoch and req.request_id in self.requests:
                    self.scheduler.cache_computed(req, min(computed, req.num_computed_tokens))
            outputs = []
            max_len = self.runner.config.max_model_len
            for j, req in enumerate(launched.reqs):
                if self.requests.get(req.request_id) is not req:
                    continue  # aborted, or ended at the step before: this token is dropped
                slot = launched.slots[j]
                token = result.token_ids[j]
                req.token_ids[slot] = token
                req.num_pending -= 1
                logprob = result.logprobs[j] if result.logprobs is not None else None
                if logprob is not None:
                    req.logprobs.append(logprob)
                num_output = slot + 1 - len(req.prompt_token_ids)
                reason = check_stop(req.params, token, num_output, self.eos_token_id)
                if reason is None and slot + 1 >= max_len:
                    reason = "length"
                if reason is not None or self.prefill_only:
                    del req.token_ids[slot + 1 :]  # a placeholder of the step after, if any
                    req.num_pending = 0
                    self._finish(req, reason)
                facts = None
                if num_output == 1:
                    facts = self._first_facts(req)
                outputs.append(StepOutput(req.request_id, token, logprob, reason, facts))
            return outputs
        finally:  # even when reading failed (a device error): the step is over
            for rid in launched.free_after:
                self.kv.free(rid)

    def _first_facts(self, req: Request) -> FirstFacts:
        queued = max(req.admitted_at - req.added_at, 0.0) if req.admitted else 0.0
        if not self.prefill_only:
            return FirstFacts(req.num_cached_tokens, queued_s=queued)
        full = len(req.prompt_token_ids) // self.block_size
        return FirstFacts(
            req.num_cached_tokens,
            list(req.block_hashes[:full]),
            self.kv.get_block_ids(req.request_id),
            queued,
        )

    def _finish(self, req: Request, reason: str | None) -> None:
        """End a request: free its blocks, or hold them until ``release`` (prefill-only)."""
        req.finish_reason = reason
        req.closing = False
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)
        if self.prefill_only:
            self.held[req.request_id] = req
        else:
            self._free(req)

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
        # (then the step still on the device, if any: it may hold blocks of ended requests)
        while any(r.request_id in self.requests for r in reqs) or self._inflight is not None:
            self.step()
        return reqs
