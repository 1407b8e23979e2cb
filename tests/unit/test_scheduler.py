"""Scheduler on its own (no model): admission under the token budget and max_num_seqs, chunked
prefill, prefix-cache hits, preemption by recompute, and the request that can never fit."""

import random

from splitserve.engine.scheduler import Request, Scheduler
from splitserve.kvstore import BlockPool, KVCacheManager, ModelIdentity
from splitserve.models.sampling_params import SamplingParams

BS = 16
ROOT = ModelIdentity("m", block_size=BS).root_hash


def _scheduler(num_blocks=64, max_num_seqs=8, budget=64):
    kv = KVCacheManager(BlockPool(num_blocks), BS)
    return Scheduler(kv, ROOT, max_num_seqs, budget)


def _request(rid, n=None, prompt=None):
    prompt = prompt if prompt is not None else [random.randrange(1000) for _ in range(n)]
    return Request(rid, prompt, SamplingParams(), token_ids=list(prompt))


def _step(sched):
    """schedule → (pretend forward) → record it; a request that is ready gets a random token,
    as the engine's sampler would give it. Returns the schedule and the ready requests."""
    scheduled = sched.schedule()
    ready = [scheduled[i].request for i in sched.update_after_forward(scheduled)]
    for req in ready:
        req.token_ids.append(random.randrange(1000))
    return scheduled, ready


def _check_blocks_cover(sched, req):
    num_blocks = len(sched.kv.get_block_ids(req.request_id))
    assert num_blocks == -(-req.num_computed_tokens // BS)


def test_admission_respects_the_token_budget_and_arrival_order():
    budget = random.randrange(20, 100)
    sched = _scheduler(num_blocks=128, max_num_seqs=64, budget=budget)
    reqs = [_request(f"r{i}", random.randrange(1, 40)) for i in range(12)]
    for req in reqs:
        sched.add_waiting(req)
    scheduled = sched.schedule()
    counts = [n for _, n in scheduled]
    assert sum(counts) <= budget and all(n > 0 for n in counts)
    # A prefix of the queue, in order; only the last one admitted may be a partial chunk.
    admitted = [r for r, _ in scheduled]
    assert admitted == reqs[: len(admitted)] == sched.running
    assert counts[:-1] == [len(r.token_ids) for r in admitted[:-1]]
    if len(admitted) < len(reqs):
        assert sum(counts) == budget  # the head waits only because the budget is spent
    assert list(sched.waiting) == reqs[len(admitted) :]


def test_admission_stops_at_max_num_seqs():
    max_num_seqs = random.randrange(1, 6)
    sched = _scheduler(num_blocks=128, max_num_seqs=max_num_seqs, budget=4096)
    reqs = [_request(f"r{i}", random.randrange(1, 20)) for i in range(max_num_seqs + 3)]
    for req in reqs:
        sched.add_waiting(req)
    _step(sched)
    assert sched.running == reqs[:max_num_seqs]
    assert list(sched.waiting) == reqs[max_num_seqs:]
    # Next step: only the running requests decode, one token each.
    scheduled, _ = _step(sched)
    assert [(r, n) for r, n in scheduled] == [(r, 1) for r in reqs[:max_num_seqs]]


def test_chunked_prefill_continues_next_step_then_samples_once():
    budget = random.randrange(5, 30)
    length = random.randrange(3 * budget, 5 * budget)
    sched = _scheduler(num_blocks=64, budget=budget)
    req = _request("long", length)
    sched.add_waiting(req)
    done = 0
    while done < length:
        scheduled, ready = _step(sched)
        num_new = min(budget, length - done)
        assert [(r, n) for r, n in scheduled] == [(req, num_new)]
        done += num_new
        assert req.num_computed_tokens == done
        _check_blocks_cover(sched, req)
        # Only the chunk that completes the prompt yields a token.
        assert ready == ([req] if done == length else [])
    assert len(req.output_token_ids) == 1
    scheduled, ready = _step(sched)
    assert [(r, n) for r, n in scheduled] == [(req, 1)] and ready == [req]


def test_running_requests_are_scheduled_before_new_admissions():
    sched = _scheduler(num_blocks=64, budget=8)
    first = _request("first", 8)
    sched.add_waiting(first)
    _step(sched)  # first's whole prompt fills the budget
    second = _request("second", 20)
    sched.add_waiting(second)
    scheduled = sched.schedule()
    # first decodes one token; second gets only what is left of the budget.
    assert [(r.request_id, n) for r, n in scheduled] == [("first", 1), ("second", 7)]


def test_prefix_cache_hit_skips_the_cached_blocks():
    sched = _scheduler(num_blocks=64, budget=512)
    shared = [random.randrange(1000) for _ in range(3 * BS)]
    a = _request("a", prompt=shared + [random.randrange(1000) for _ in range(5)])
    sched.add_waiting(a)
    _step(sched)
    b = _request("b", prompt=shared + [random.randrange(1000) for _ in range(9)])
    sched.add_waiting(b)
    scheduled = sched.schedule()
    assert [(r, n) for r, n in scheduled] == [(a, 1), (b, 9)]
    assert b.num_cached_tokens == b.num_computed_tokens == 3 * BS
    assert sched.kv.get_block_ids("b")[:3] == sched.kv.get_block_ids("a")[:3]


def test_preemption_frees_the_last_admitted_and_requeues_it_at_the_front():
    # 6 usable blocks; two prompts of 2 full blocks + 1 token take 3 blocks each.
    sched = _scheduler(num_blocks=7, budget=512)
    old, young = _request("old", 2 * BS + 1), _request("young", 2 * BS + 1)
    later = _request("later", 4)
    for req in (old, young, later):
        sched.add_waiting(req)
    _step(sched)
    assert sched.running == [old, young] and sched.kv.block_pool.num_free_blocks == 0
    # Decode until old needs a fourth block: there is none, so young is preempted.
    while sched.num_preemptions == 0:
        scheduled, _ = _step(sched)
    assert [r for r, _ in scheduled] == [old]
    assert sched.running == [old] and list(sched.waiting) == [young, later]
    assert young.num_computed_tokens == 0 and not sched.kv.has_request("young")
    assert len(sched.kv.get_block_ids("old")) == 4
    sched.kv.block_pool.check_invariants()
    # young keeps its output: recomputed later from prompt + output, it continues from there.
    num_out = len(young.output_token_ids)
    assert num_out >= 1
    sched.finish(old)
    sched.kv.free("old")
    num_tokens = len(young.token_ids)
    scheduled, ready = _step(sched)
    # NOTE: young's blocks were freed tail first, so old's fourth block evicted young's third:
    # two blocks come back from the prefix cache and the rest is recomputed.
    assert scheduled == [(young, num_tokens - 2 * BS), (later, 4)]
    assert young.num_computed_tokens == num_tokens and ready == [young, later]
    assert len(young.output_token_ids) == num_out + 1
    sched.kv.block_pool.check_invariants()


def test_a_request_preempting_itself_waits_at_the_front():
    sched = _scheduler(num_blocks=4, budget=512)  # 3 usable blocks
    req = _request("r", 3 * BS)
    sched.add_waiting(req)
    _step(sched)  # 3 blocks, full; the sampled token needs a fourth
    scheduled = sched.schedule()
    assert scheduled == [] and sched.num_preemptions == 1
    assert list(sched.waiting) == [req] and not sched.kv.has_request("r")
    assert sched.kv.block_pool.num_free_blocks == 3


def test_pop_unfittable_only_when_nothing_runs():
    sched = _scheduler(num_blocks=5, budget=512)  # 4 usable blocks
    small, huge = _request("small", 10), _request("huge", 4 * BS + 1)
    sched.add_waiting(small)
    _step(sched)
    sched.add_waiting(huge)
    assert sched.schedule() == [(small, 1)]
    assert sched.pop_unfittable(4) is None  # small runs: huge may fit once it ends
    sched.finish(small)
    sched.kv.free("small")
    assert sched.schedule() == []
    assert sched.pop_unfittable(4) is huge and not sched.waiting
    fits = _request("fits", 4 * BS)
    sched.add_waiting(fits)
    assert sched.pop_unfittable(4) is None


def test_remove_takes_a_request_out_of_either_queue():
    sched = _scheduler(num_blocks=64, max_num_seqs=1)
    a, b = _request("a", 5), _request("b", 5)
    sched.add_waiting(a)
    sched.add_waiting(b)
    _step(sched)
    assert sched.running == [a] and list(sched.waiting) == [b]
    sched.remove(b)
    sched.remove(a)
    sched.remove(_request("unknown", 1))
    assert not sched.has_unfinished()
