"""A decode node killed mid-answer does not end its streams (real processes): the router resumes
each on the other decode node — the prompt and the tokens already sent prefilled again — and
every client gets its whole greedy answer, token-exact with transformers, no token lost or
repeated."""

from __future__ import annotations

import asyncio
import random

import pytest
from support.processes import node_stats, start_node, start_router
from support.reference import hf_greedy
from support.streams import stream_through

from splitserve.models.tiny import write_random_checkpoint

MAX_TOKENS = 160


@pytest.mark.slow
def test_streams_on_a_killed_decode_node_resume_elsewhere(tmp_path):
    model = write_random_checkpoint(tmp_path / "m", seed=21, with_tokenizer=True)
    prefill = start_node("prefill", model, tmp_path)
    decode = [start_node("decode", model, tmp_path) for _ in range(2)]
    router = start_router(model, tmp_path, [prefill.address], [d.address for d in decode])
    rng = random.Random(5)
    prompts = [[rng.randrange(250) for _ in range(rng.randrange(8, 48))] for _ in range(8)]
    try:
        kill = decode[0].popen.kill  # mid-answer
        outputs = asyncio.run(stream_through(router.address, prompts, MAX_TOKENS, kill))
        for prompt, tokens in zip(prompts, outputs, strict=True):
            assert tokens == hf_greedy(model, prompt, MAX_TOKENS)
        survivor = node_stats(decode[1])
        assert survivor.num_free_blocks == survivor.num_blocks  # the resumed requests freed theirs
    finally:
        router.stop()
        prefill.stop()
        for d in decode:
            d.stop()
