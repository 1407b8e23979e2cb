"""Asynchronous scheduling (``LLMEngine(async_scheduling=True)``, the default on a GPU): step N+1
is scheduled and launched before step N's tokens are read, its inputs fed from N's samples on
the device. On the CPU the forward runs inside the launch, so nothing overlaps, but every path
is the same: these tests run it there against the synchronous engine — the same tokens, stop
reasons and log-probabilities, a request that ended at N dropping its extra token of N+1, no
placeholder left behind, the same prefix cache, and every block back after aborts at random
moments."""

import pytest
import torch

from splitserve.engine.core import LLMEngine
from splitserve.kvstore import ModelIdentity
from splitserve.models.loader import load_model
from splitserve.models.runner import ModelRunner, RunnerConfig
from splitserve.models.sampling_params import SamplingParams
from splitserve.models.tiny import write_random_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_random_checkpoint(tmp_path_factory.mktemp("async") / "m", seed=7)
    return load_model(path)


def _engine(model, async_scheduling, num_blocks=96, max_tokens_per_step=64, **kw):
    config, m = model
    rc = RunnerConfig(
        kv_cache_bytes=num_blocks * 16 * config.kv_bytes_per_token(torch.float32),
        max_num_batched_tokens=max_tokens_per_step,
        max_num_seqs=8,
    )
    runner = ModelRunner(config, m, rc)
    return LLMEngine(runner, ModelIdentity("m"), async_scheduling=async_scheduling, **kw)


def _prompts(rng, n=10):
    return [[rng.randrange(300) for _ in range(rng.randint(3, 70))] for _ in range(n)]


def _run(engine, prompts, params):
    reqs = [engine.add_request(f"q{i}", p, params[i]) for i, p in enumerate(prompts)]
    outputs: dict[str, list] = {r.request_id: [] for r in reqs}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
        steps += 1
        assert steps < 2000
    return reqs, outputs


def _assert_same(sync_run, async_run):
    (s_reqs, s_out), (a_reqs, a_out) = sync_run, async_run
    for s, a in zip(s_reqs, a_reqs, strict=True):
        assert a.output_token_ids == s.output_token_ids, a.request_id
        assert a.finish_reason == s.finish_reason, a.request_id
        assert -1 not in a.token_ids and a.num_pending == 0
        # NOTE: the same tokens; their logprobs come from other batch shapes (the two runs
        # group requests into steps differently), which moves float32 sums by ~1e-6.
        assert a.logprobs == pytest.approx(s.logprobs, rel=1e-5, abs=1e-5)
        got = [(o.new_token_id, o.finish_reason) for o in a_out[a.request_id]]
        assert got == [(o.new_token_id, o.finish_reason) for o in s_out[s.request_id]]


def _stop_tokens(model, prompts, params):
    """Tokens the synchronous run produces mid-answer: as stop tokens they end some requests
    early, the case where the asynchronous engine computed one step too many."""
    reqs, _ = _run(_engine(model, False), prompts, params)
    return sorted({r.output_token_ids[len(r.output_token_ids) // 2] for r in reqs})[:3]


@pytest.mark.parametrize("kind", ["greedy", "seeded", "penalties", "logprobs"])
def test_async_steps_give_the_synchronous_tokens(model, rng, kind):
    prompts = _prompts(rng)
    base = {
        "greedy": dict(temperature=0.0),
        "seeded": dict(temperature=0.9, top_p=0.9),
        "penalties": dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.2),
        "logprobs": dict(temperature=0.0, logprobs=True),
    }[kind]

    def params(stop=()):
        return [
            SamplingParams(
                **base,
                max_tokens=rng_max[i],
                stop_token_ids=list(stop),
                seed=(100 + i if kind == "seeded" else None),
            )
            for i in range(len(prompts))
        ]

    rng_max = [rng.randint(1, 12) for _ in prompts]
    stop = _stop_tokens(model, prompts, params())
    sync_run = _run(_engine(model, False), prompts, params(stop))
    async_engine = _engine(model, True)
    async_run = _run(async_engine, prompts, params(stop))
    _assert_same(sync_run, async_run)
    assert any(r.finish_reason == "stop" for r in async_run[0])  # some ended early
    pool = async_engine.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_async_steps_preempt_and_chunk_like_the_synchronous_engine(model, rng):
    """A pool too small for every request at once (preemption and recompute) and a token
    budget that splits prompts into chunks."""
    prompts = _prompts(rng, n=12)
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * len(prompts)
    sync_engine = _engine(model, False, num_blocks=14, max_tokens_per_step=32)
    sync_run = _run(sync_engine, prompts, params)
    async_engine = _engine(model, True, num_blocks=14, max_tokens_per_step=32)
    async_run = _run(async_engine, prompts, params)
    assert async_engine.num_preemptions > 0
    _assert_same(sync_run, async_run)
    assert async_engine.pool.num_free_blocks == async_engine.pool.num_blocks - 1


def test_async_steps_cache_the_same_prefixes(model, rng):
    """Blocks are hashed and cached once their step is read: a second run of the same prompts
    finds as many cached tokens as after synchronous steps."""
    prompts = _prompts(rng)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * len(prompts)
    cached = []
    for mode in (False, True):
        engine = _engine(model, mode)
        _run(engine, prompts, params)
        again = [[*p, 1, 2] for p in prompts]
        reqs, _ = _run(engine, again, params)
        cached.append([r.num_cached_tokens for r in reqs])
    assert cached[0] == cached[1] and sum(cached[1]) > 0


def test_async_prefill_only_holds_the_kv_of_the_first_token(model, rng):
    prompts = _prompts(rng, n=6)
    params = [SamplingParams(temperature=0.0, max_tokens=8)] * len(prompts)
    runs = []
    for mode in (False, True):
        engine = _engine(model, mode, prefill_only=True)
        reqs, outputs = _run(engine, prompts, params)
        assert sorted(engine.held) == sorted(r.request_id for r in reqs)
        firsts = [[o.new_token_id for o in outputs[r.request_id]] for r in reqs]
        # (block, layer, k/v, offset, head, dim), cut to the prompt's tokens (the pool is
        # allocated uninitialised: slots past a prompt hold whatever was there)
        kv = [
            engine.runner.kv_pool[engine.kv.get_block_ids(r.request_id)]
            .transpose(1, 3)
            .flatten(0, 1)[: len(r.prompt_token_ids)]
            .clone()
            for r in reqs
        ]
        runs.append((firsts, kv))
        for r in reqs:
            engine.release(r.request_id)
        assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1
    assert runs[0][0] == runs[1][0] and all(len(f) == 1 for f in runs[1][0])
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("trial", range(3))
def test_aborts_at_random_moments_give_every_block_back(model, rng, trial):
    """Requests aborted between any two steps — while their step is on the device, while they
    wait, after they ended — leave no block behind, and the rest run to their length."""
    engine = _engine(model, True, num_blocks=20, max_tokens_per_step=48)
    prompts = _prompts(rng, n=10)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    reqs = [engine.add_request(f"a{i}", p, params) for i, p in enumerate(prompts)]
    aborted = set()
    while engine.has_unfinished():
        engine.step()
        if rng.random() < 0.4:
            victim = rng.choice(reqs).request_id
            engine.abort(victim)
            engine.abort(victim)  # idempotent
            aborted.add(victim)
    for r in reqs:
        assert -1 not in r.token_ids or r.request_id in aborted
        if r.request_id not in aborted:
            assert len(r.output_token_ids) == 10
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1


def test_an_abort_while_the_step_computes_frees_after_it(model):
    """Blocks of a request aborted while its step is in flight stay allocated until that step
    is read (the device may still write them), then go back."""
    engine = _engine(model, True)
    engine.add_request("x", list(range(40)), SamplingParams(temperature=0.0, max_tokens=5))
    engine.step()  # its prompt's step is in flight
    blocks = list(engine.kv.get_block_ids("x"))
    assert blocks and engine._inflight is not None
    engine.abort("x")
    free_now = engine.pool.num_free_blocks
    assert free_now == engine.pool.num_blocks - 1 - len(blocks)
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1


def test_outputs_read_before_a_request_that_never_fits_are_not_lost(model):
    """A step that reads the tokens of the step before (penalties need them) and then finds only
    a request larger than the pool returns those tokens; the next step raises for that one."""
    from splitserve.engine.core import RequestDoesNotFit

    engine = _engine(model, True, num_blocks=8)
    params = SamplingParams(temperature=0.0, max_tokens=3, repetition_penalty=1.2, ignore_eos=True)
    engine.add_request("small", list(range(10)), params)
    got, refused = [], []
    for _ in range(20):
        try:
            got += [o for o in engine.step() if o.request_id == "small"]
        except RequestDoesNotFit as exc:
            refused.append(exc.request_id)
        if len(got) == 1 and "big" not in engine.requests and not refused:
            engine.add_request("big", list(range(200)), params)  # 13 blocks: never fits in 7
        if not engine.has_unfinished():
            break
    assert [o.finish_reason for o in got] == [None, None, "length"]
    assert refused == ["big"]
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1


def test_generate_returns_with_every_block_back(model, rng):
    """``generate`` also reads the step still on the device, whose wasted rows hold the blocks
    of requests that ended at the step before."""
    engine = _engine(model, True)
    stop = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=list(range(0, 300, 7)))
    reqs = engine.generate(_prompts(rng, n=6), stop)
    assert all(r.finish_reason is not None for r in reqs)
    assert engine._inflight is None
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1
