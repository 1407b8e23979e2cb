"""Nodes whose engine runs in a process of its own (``--engine-process on``; the default on a GPU,
off on a CPU, so these tests turn it on): they answer token-exact with transformers on both
routes, and the failure of either process ends the other cleanly — an engine process killed
mid-answer takes its node down (exit status 70, a clear log line) and the router resumes the
streams on another decode node; a node killed outright leaves no engine process behind."""

from __future__ import annotations

import asyncio
import functools
import os
import random
import signal

import pytest
from support.processes import (
    alive,
    children,
    node_stats,
    start_node,
    start_router,
    still_alive,
)
from support.reference import hf_greedy
from support.streams import stream_through

from splitserve.client import AsyncClient
from splitserve.models.tiny import write_random_checkpoint
from splitserve.runtime.engine_process import GONE_EXIT_CODE

ON = ("--engine-process", "on")
MAX_TOKENS = 24


def _engine_pid(node_pid: int) -> int:
    """The node's engine process: its one child."""
    found = children(node_pid)
    assert len(found) == 1, f"node {node_pid} has children {found}"
    return found[0]


async def _greedy(address: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    async with AsyncClient(address) as client:
        out = await client.generate(
            prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
        return list(out.token_ids)


@pytest.mark.slow
def test_nodes_with_engine_processes_answer_token_exact_on_both_routes(tmp_path):
    model = write_random_checkpoint(tmp_path / "m", seed=31, with_tokenizer=True)
    prefill = start_node("prefill", model, tmp_path, *ON)
    decode = start_node("decode", model, tmp_path, *ON)
    split = start_router(model, tmp_path, [prefill.address], [decode.address])
    direct = start_router(model, tmp_path, [], [decode.address])
    rng = random.Random(3)
    prompts = [[rng.randrange(250) for _ in range(rng.randrange(5, 60))] for _ in range(6)]
    try:

        async def run() -> tuple[list[list[int]], list[list[int]]]:
            a = await asyncio.gather(*(_greedy(split.address, p) for p in prompts))
            b = await asyncio.gather(*(_greedy(direct.address, p) for p in prompts))
            return a, b

        disaggregated, colocated = asyncio.run(run())
        for prompt, x, y in zip(prompts, disaggregated, colocated, strict=True):
            want = hf_greedy(model, prompt, MAX_TOKENS)
            assert x == want
            assert y == want
        for node in (prefill, decode):
            stats = node_stats(node)
            assert stats.running == 0
            assert stats.counters["steps"] > 0  # figures come from the engine process
        stats = node_stats(decode)
        assert stats.num_free_blocks == stats.num_blocks  # every request's blocks freed
        assert stats.counters["transfers"] == len(prompts)
        assert alive(_engine_pid(decode.popen.pid))
    finally:
        for proc in (split, direct, prefill, decode):
            proc.stop()
    # A drained node stops its engine process before it exits.
    assert prefill.popen.returncode == 0 and decode.popen.returncode == 0


@pytest.mark.slow
def test_an_engine_process_killed_mid_answer_takes_its_node_down_and_streams_resume(tmp_path):
    model = write_random_checkpoint(tmp_path / "m", seed=32, with_tokenizer=True)
    prefill = start_node("prefill", model, tmp_path, *ON)
    decode = [start_node("decode", model, tmp_path, *ON) for _ in range(2)]
    router = start_router(model, tmp_path, [prefill.address], [d.address for d in decode])
    rng = random.Random(7)
    prompts = [[rng.randrange(250) for _ in range(rng.randrange(8, 40))] for _ in range(6)]
    max_tokens = 160
    victim = _engine_pid(decode[0].popen.pid)
    try:
        kill = functools.partial(os.kill, victim, signal.SIGKILL)  # mid-step, mid-answer
        outputs = asyncio.run(stream_through(router.address, prompts, max_tokens, kill))
        for prompt, tokens in zip(prompts, outputs, strict=True):
            assert tokens == hf_greedy(model, prompt, max_tokens)
        assert decode[0].popen.wait(30) == GONE_EXIT_CODE
        assert "the engine process" in decode[0].log.read_text()
        survivor = node_stats(decode[1])
        assert survivor.num_free_blocks == survivor.num_blocks
    finally:
        router.stop()
        prefill.stop()
        for d in decode:
            d.stop()


@pytest.mark.slow
def test_a_node_killed_outright_leaves_no_engine_process(tmp_path):
    model = write_random_checkpoint(tmp_path / "m", seed=33)
    node = start_node("decode", model, tmp_path, *ON)
    engine = _engine_pid(node.popen.pid)
    try:
        node.popen.kill()
        node.popen.wait(10)
        assert not still_alive([engine], 20), "the engine process outlived its node"
    finally:
        node.stop()
        if alive(engine):
            os.kill(engine, signal.SIGKILL)
