"""The disaggregated pipeline end to end on CPU: router, 2 prefill and 2 decode nodes as separate
processes on loopback, driven through the SDK, checked token for token against transformers."""

import asyncio
import random
import time

import grpc
import pytest
import torch
from support.processes import node_stats, start_node, start_router
from transformers import AutoModelForCausalLM, GenerationConfig

from splitserve.client import AsyncClient, Client, SplitserveError
from splitserve.models.tiny import write_random_checkpoint

MAX_NEW = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    # head_dim 64 and 4 layers: small, but every part of the model is exercised.
    return write_random_checkpoint(
        path,
        "LlamaForCausalLM",
        seed=7,
        with_tokenizer=True,
        num_hidden_layers=4,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=300,
    )


@pytest.fixture(scope="module")
def hf(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(hf, prompt, n=MAX_NEW):
    ids = torch.tensor([prompt])
    config = GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    procs = []
    try:
        prefill = [start_node("prefill", model_dir, tmp) for _ in range(2)]
        decode = [start_node("decode", model_dir, tmp) for _ in range(2)]
        procs += prefill + decode
        router = start_router(
            model_dir, tmp, [p.address for p in prefill], [d.address for d in decode]
        )
        procs.append(router)
        yield router, prefill, decode
    finally:
        for proc in reversed(procs):
            proc.stop()


def wait_idle(nodes, idle, timeout=15.0):
    deadline = time.monotonic() + timeout
    while True:
        now = [node_stats(n).num_free_blocks for n in nodes]
        if now == idle or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


GREEDY = dict(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def test_32_concurrent_requests_match_transformers(cluster, hf):
    router, prefill, decode = cluster
    prompts = [
        [random.randrange(256) for _ in range(n)] for n in random.choices(range(1, 90), k=32)
    ]
    expected = [hf_greedy(hf, p) for p in prompts]

    async def run():
        async with AsyncClient(router.address) as client:
            return await asyncio.gather(
                *(client.generate(prompt_token_ids=p, **GREEDY) for p in prompts)
            )

    results = asyncio.run(run())
    assert [list(r.token_ids) for r in results] == expected
    for prompt, r in zip(prompts, results, strict=True):
        assert r.finish_reason == "length"
        assert r.usage.prompt_tokens == len(prompt)
        assert r.usage.completion_tokens == MAX_NEW
    # Both pools took part.
    assert all(node_stats(p).counters["prefills"] > 0 for p in prefill)
    assert all(node_stats(d).counters["transfers"] > 0 for d in decode)


def test_stream_gives_the_tokens_and_text_of_generate(cluster, hf):
    router, _, _ = cluster
    with Client(router.address) as client:
        whole = client.generate(prompt="héllo wörld, paged KV", **GREEDY)
        chunks = list(client.stream(prompt="héllo wörld, paged KV", **GREEDY))
    assert [t for c in chunks for t in c.token_ids] == list(whole.token_ids)
    assert "".join(c.text for c in chunks) == whole.text
    assert len(whole.token_ids) == MAX_NEW


def test_bad_input_is_invalid_argument_and_the_next_request_succeeds(cluster):
    router, _, _ = cluster
    bad = [
        dict(prompt=""),
        dict(prompt_token_ids=[1] * 5000),
        dict(prompt="hi", max_tokens=0),
        dict(prompt="hi", temperature=-1.0),
        dict(prompt="hi", top_p=1.5),
        dict(prompt_token_ids=[1, 2, 100000]),
    ]
    with Client(router.address) as client:
        for kwargs in bad:
            with pytest.raises(SplitserveError) as err:
                client.generate(**kwargs)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, kwargs
            assert err.value.message
            ok = client.generate(prompt="still fine", max_tokens=3, temperature=0.0)
            assert len(ok.token_ids) == 3


def test_cancelled_stream_frees_every_block_on_both_pools(cluster):
    router, prefill, decode = cluster
    nodes = [*prefill, *decode]
    idle = wait_idle(nodes, [node_stats(n).num_free_blocks for n in nodes])
    with Client(router.address) as client:
        stream = client.stream(
            prompt_token_ids=[7] * 70, max_tokens=400, ignore_eos=True, temperature=0.0
        )
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
    assert wait_idle(nodes, idle) == idle
    assert all(node_stats(d).running == 0 for d in decode)


def test_unreachable_nodes_give_unavailable(model_dir, tmp_path):
    router = start_router(model_dir, tmp_path, ["127.0.0.1:1"], ["127.0.0.1:2"])
    try:
        with Client(router.address) as client, pytest.raises(SplitserveError) as err:
            client.generate(prompt="hello", max_tokens=2, timeout=30)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        router.stop()


def test_killed_decode_nodes_stream_resumes_and_the_router_moves_on(model_dir, tmp_path, hf):
    """The stream goes on on the other decode node (router.front's resume; its tokens are
    checked against transformers in test_decode_resume.py), and new requests avoid the dead one."""
    prefill = start_node("prefill", model_dir, tmp_path)
    decode = [start_node("decode", model_dir, tmp_path) for _ in range(2)]
    router = start_router(model_dir, tmp_path, [prefill.address], [d.address for d in decode])
    try:
        with Client(router.address) as client:
            request = {"prompt_token_ids": [3] * 20, "max_tokens": 1000, "ignore_eos": True}
            stream = client.stream(**request, temperature=0.0, timeout=60)
            first = next(iter(stream))  # the first token comes from the prefill node
            deadline = time.monotonic() + 20
            while not (busy := [d for d in decode if node_stats(d).running == 1]):
                assert time.monotonic() < deadline, "no decode node started the request"
                time.sleep(0.05)
            victim = busy[0]
            victim.popen.kill()
            t0 = time.monotonic()
            rest = [t for chunk in stream for t in chunk.token_ids]
            assert time.monotonic() - t0 < 50
            # Up to the model's length limit, exactly what an undisturbed run gives.
            whole = client.generate(**request, temperature=0.0, timeout=60)
            assert [*first.token_ids, *rest] == list(whole.token_ids)
            prompt = [random.randrange(256) for _ in range(20)]
            for _ in range(4):  # every request lands on the surviving decode node
                r = client.generate(prompt_token_ids=prompt, **GREEDY, timeout=60)
                assert list(r.token_ids) == hf_greedy(hf, prompt)
    finally:
        for proc in (router, prefill, *decode):
            proc.stop()


def test_shared_prefix_ships_fewer_blocks_and_gives_the_same_output(model_dir, tmp_path, hf):
    prefill = start_node("prefill", model_dir, tmp_path)
    decode = start_node("decode", model_dir, tmp_path)
    router = start_router(model_dir, tmp_path, [prefill.address], [decode.address])
    try:
        system = [random.randrange(256) for _ in range(80)]  # five full blocks
        first, second = [*system, 1, 2, 3], [*system, 4, 5, 6, 7]
        with Client(router.address) as client:
            a = client.generate(prompt_token_ids=first, **GREEDY)
            shipped_a = node_stats(prefill).counters["blocks_shipped"]
            b = client.generate(prompt_token_ids=second, **GREEDY)
            shipped_b = node_stats(prefill).counters["blocks_shipped"] - shipped_a
        assert [list(a.token_ids), list(b.token_ids)] == [
            hf_greedy(hf, first),
            hf_greedy(hf, second),
        ]
        assert shipped_a == 5 and shipped_b == 0
        assert b.usage.cached_tokens == 80 and a.usage.cached_tokens == 0
        assert node_stats(decode).counters["blocks_reused"] == 5
    finally:
        for proc in (router, prefill, decode):
            proc.stop()
