"""LLMEngine behaviours the nodes rely on: prefill-only holding, joining transferred requests,
a request larger than the whole pool failing alone, one prompt validation, and the queues that
read through to the scheduler."""

import random

import pytest
import torch

from splitserve.engine.core import LLMEngine, RequestDoesNotFit
from splitserve.kvstore import ModelIdentity, hash_request_tokens
from splitserve.models.loader import load_model
from splitserve.models.runner import ModelRunner, RunnerConfig
from splitserve.models.sampling_params import SamplingParams
from splitserve.models.tiny import write_random_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_random_checkpoint(tmp_path_factory.mktemp("engine") / "m", seed=3)
    return load_model(path)


def _engine(model, num_blocks=64, **kw):
    config, m = model
    rc = RunnerConfig(kv_cache_bytes=num_blocks * 16 * config.kv_bytes_per_token(torch.float32))
    return LLMEngine(ModelRunner(config, m, rc), ModelIdentity("m"), **kw)


SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefill_only_holds_blocks_until_release_and_transfer_resumes_exactly(model, params):
    prompt = [random.randrange(300) for _ in range(37)]
    expected = _engine(model).generate([prompt], params)[0].output_token_ids

    prefill = _engine(model, prefill_only=True)
    prefill.add_request("r", prompt, params)
    outs = []
    while not outs:
        outs = prefill.step()
    assert outs[0].new_token_id == expected[0] and outs[0].finish_reason is None
    held = prefill.kv.get_block_ids("r")
    assert len(held) == 3 and "r" in prefill.held and not prefill.has_unfinished()
    kv_bytes = prefill.runner.kv_pool[held].clone()
    prefill.release("r")
    assert prefill.pool.num_free_blocks == prefill.pool.num_blocks - 1

    # A second engine adopts the same KV bytes and continues: the same tokens as one engine.
    decode = _engine(model)
    block_hashes = hash_request_tokens(prompt, 16, decode.root_hash)
    assert len(decode.kv.adopt_blocks("r", block_hashes)) == 2
    assert decode.kv.allocate_slots("r", len(prompt)) is not None
    decode.runner.kv_pool[decode.kv.get_block_ids("r")] = kv_bytes
    decode.kv.cache_blocks("r", block_hashes, 32)
    req = decode.add_transferred("r", prompt, outs[0].new_token_id, params)
    while decode.has_unfinished():
        decode.step()
    assert req.output_token_ids == expected
    assert decode.pool.num_free_blocks == decode.pool.num_blocks - 1


def test_a_request_larger_than_the_pool_fails_alone(model):
    engine = _engine(model, num_blocks=5)  # 4 usable blocks: 64 tokens
    engine.add_request("huge", [1] * 100, GREEDY)
    with pytest.raises(RequestDoesNotFit) as err:
        while True:
            engine.step()
    assert err.value.request_id == "huge" and "does not fit" in str(err.value)
    (ok,) = engine.generate([[2] * 20], GREEDY)
    assert len(ok.output_token_ids) == 6


def test_add_request_validates_exactly_as_check_prompt(model):
    config, _ = model
    engine = _engine(model)
    vocab, max_len = config.vocab_size, config.max_model_len
    bad_id = random.choice([-1 - random.randrange(5), vocab + random.randrange(5)])
    cases = [
        ([], "the prompt is empty"),
        ([1, 2, bad_id, 3], rf"token id {bad_id} is outside the vocabulary \[0, {vocab}\)"),
        ([1] * max_len, f"prompt of {max_len} tokens leaves no room"),
    ]
    for prompt, match in cases:
        with pytest.raises(ValueError, match=match) as checked:
            engine.check_prompt(prompt)
        with pytest.raises(ValueError) as added:
            engine.add_request("r", prompt, GREEDY)
        assert str(added.value) == str(checked.value)
    assert not engine.requests and not engine.has_unfinished()
    engine.add_request("r", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="'r' is already in use"):
        engine.add_request("r", [4], GREEDY)


def test_queues_read_through_to_the_scheduler(model):
    engine = _engine(model, max_num_seqs=1)
    a = engine.add_request("a", [random.randrange(300) for _ in range(20)], GREEDY)
    b = engine.add_request("b", [random.randrange(300) for _ in range(20)], GREEDY)
    assert list(engine.waiting) == [a, b] and len(engine.running) == 0
    engine.step()
    assert engine.last_num_scheduled == 1 and engine.max_num_seqs == 1
    assert a in engine.running and b in engine.waiting and a not in engine.waiting
    assert engine.pending_prefill_tokens == 20
    # A transferred request waits while max_num_seqs run (its KV is here: it is not refused),
    # and runs as soon as a slot frees, before prompts still waiting for their prefill.
    t = engine.add_transferred("t", [1] * 17, 5, GREEDY)
    assert list(engine.ready) == [t] and engine.running == [a] and engine.has_unfinished()
    engine.abort("a")
    assert not engine.running and list(engine.waiting) == [b] and "a" not in engine.requests
    engine.step()
    assert engine.running == [t] and not engine.ready and list(engine.waiting) == [b]
    engine.abort("t")
    engine.abort("b")
    assert not engine.has_unfinished()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1


def test_a_preempted_request_is_not_starved_by_transferred_ones(model):
    """Transferred requests waiting for a slot do not overtake a request preempted earlier (it
    was admitted before them)."""
    engine = _engine(model, max_num_seqs=1)
    a = engine.add_request("a", [random.randrange(300) for _ in range(20)], GREEDY)
    engine.step()
    assert engine.running == [a]
    engine.scheduler._preempt(a)  # as the scheduler does when the pool runs short
    t = engine.add_transferred("t", [1] * 17, 5, GREEDY)
    engine.step()
    assert engine.running == [a] and list(engine.ready) == [t]
    engine.abort("a")
    engine.step()
    assert engine.running == [t]
    engine.abort("t")


def test_prepare_checks_tables_on_the_host_so_the_layers_need_not(model):
    from splitserve.models.runner import SequenceInput

    runner = _engine(model).runner
    ids, positions, meta, is_decode = runner.prepare([SequenceInput([5, 6, 7], 0, [3])])
    assert meta.checked and not is_decode  # the layers pass validate=False to the kernels
    assert meta.slot_mapping.tolist() == [48, 49, 50] and positions.tolist() == [0, 1, 2]
    assert ids.tolist() == [5, 6, 7]
    # What the kernels' own checks would have caught is refused here, before any forward.
    with pytest.raises(ValueError, match="null block 0"):
        runner.prepare([SequenceInput([5] * 20, 0, [3, 0])])
    with pytest.raises(ValueError, match="block ids must be in"):
        runner.prepare([SequenceInput([5], 0, [runner.num_blocks])])
    with pytest.raises(ValueError, match="2 blocks for"):
        runner.prepare([SequenceInput([5] * 20, 20, [3, 4])])


def test_a_mixed_step_puts_one_token_sequences_first_and_returns_logits_in_order(model):
    """Prompt chunks and one-token sequences in one forward: the one-token ones run first (the
    decode kernel takes them), and each sequence's logits equal those of a forward of it
    alone, in the order the sequences were given."""
    from splitserve.models.runner import SequenceInput

    runner = _engine(model).runner
    rng = random.Random(5)
    ctx = [rng.randrange(300) for _ in range(40)]
    # Fill blocks 1-3 with a 40-token context, then decode from it in two sequences.
    runner.execute([SequenceInput(ctx, 0, [1, 2, 3])])
    seqs = [
        SequenceInput([rng.randrange(300) for _ in range(9)], 0, [4]),
        SequenceInput([7], 40, [1, 2, 3]),
        SequenceInput([rng.randrange(300) for _ in range(20)], 0, [5, 6]),
        SequenceInput([8], 39, [1, 2, 3]),
    ]
    _, _, meta, is_decode = runner.prepare(seqs)
    assert not is_decode and meta.num_decodes == 2
    assert meta.seq_lens.tolist() == [41, 40, 9, 20]  # one-token sequences first
    rest = meta.prompt_part
    assert rest is not None and rest.cu_seqlens_q.tolist() == [0, 9, 29]
    assert rest.seq_lens.tolist() == [9, 20] and rest.max_query_len == 20
    assert meta.last_rows is not None and meta.last_rows.tolist() == [10, 0, 30, 1]
    # NOTE: the one-token sequence at 39 rewrites that slot of the shared context, before any
    # attention reads it; run alone afterwards each sees the same cache, so the logits agree.
    mixed = runner.execute(seqs)
    for i, seq in enumerate(seqs):
        alone = runner.execute([seq])
        torch.testing.assert_close(mixed[i], alone[0], rtol=1e-5, atol=1e-5)
