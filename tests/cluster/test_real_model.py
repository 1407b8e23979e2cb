"""The default real model (SmolLM2-135M-Instruct, converted from its GGUF file) served by a 1
prefill + 1 decode cluster of real processes (`splitserve up`'s launcher) answers greedy requests
token for token as transformers does (float32, CPU) on the same converted checkpoint: chat and
completion prompts, text and token ids, stop strings, streaming, the OpenAI HTTP API, and again
when the prompt's prefix comes from the cache."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from splitserve.client import Client
from splitserve.launcher import ClusterSpec, LocalCluster
from splitserve.models.embedded import default_model_file, resolve_model_path

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0.0, timeout=300)
CHATS = [
    "What is the capital of France?",
    "Name the three primary colors.",
    "Write one sentence about the ocean.",
    "What is 12 plus 7?",
    "Give me a synonym for happy.",
]
COMPLETIONS = [
    "The capital of Germany is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
]


@pytest.fixture(scope="module")
def model() -> Path:
    try:
        default_model_file()
    except ValueError as exc:
        pytest.skip(str(exc))
    return Path(resolve_model_path(None))


@pytest.fixture(scope="module")
def reference(model):
    """transformers' greedy continuation (float32, CPU) of a list of prompt token ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model)
    eos = hf.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())

    def generate(ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        return out[0, len(ids) :].tolist()

    generate.tokenizer = tokenizer
    generate.eos = eos
    return generate


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    spec = ClusterSpec(
        model_path=str(model),
        num_prefill=1,
        num_decode=1,
        port=0,  # the router binds a free one (a port picked here could be taken first)
        http_port=0,
        node_args=("--kv-cache-mb", "256"),
        log_file=str(tmp_path_factory.mktemp("real-model") / "components.log"),
    )
    # (Its router takes every request: tests/conftest.py turns --max-loop-lag-s off.)
    with LocalCluster(spec) as c:
        yield c.addresses


def _chat_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


def _text(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


def test_greedy_output_is_token_exact_with_transformers(cluster, reference):
    tok = reference.tokenizer
    with Client(cluster.router) as client, ThreadPoolExecutor(8) as pool:
        chats = [
            pool.submit(client.chat, [{"role": "user", "content": q}], **GREEDY) for q in CHATS
        ]
        texts = [pool.submit(client.generate, prompt=p, **GREEDY) for p in COMPLETIONS]
        ids = [tok(p).input_ids for p in COMPLETIONS]
        by_ids = [pool.submit(client.generate, prompt_token_ids=i, **GREEDY) for i in ids]
        chats, texts, by_ids = ([f.result() for f in fs] for fs in (chats, texts, by_ids))
    for question, got in zip(CHATS, chats, strict=True):
        prompt = _chat_ids(tok, question)
        want = reference(prompt)
        assert list(got.token_ids) == want, question
        assert got.text == _text(tok, want)
        assert got.usage.prompt_tokens == len(prompt)
        assert got.finish_reason == ("stop" if want[-1] in reference.eos else "length")
    assert chats[0].text == "The capital of France is Paris."
    for prompt, prompt_ids, got, got_ids in zip(COMPLETIONS, ids, texts, by_ids, strict=True):
        want = reference(prompt_ids)
        assert list(got.token_ids) == want == list(got_ids.token_ids), prompt
        assert got.text == got_ids.text == _text(tok, want)


def test_streaming_stop_strings_and_http_match_transformers(cluster, reference):
    tok = reference.tokenizer
    question = "Write one sentence about the ocean."
    messages = [{"role": "user", "content": question}]
    want = reference(_chat_ids(tok, question))
    full = _text(tok, want)
    with Client(cluster.router) as client:
        chunks = list(client.chat_stream(messages, **GREEDY))
        assert len(chunks) > 2  # streamed, not one message
        assert [t for c in chunks for t in c.token_ids] == want
        assert "".join(c.text for c in chunks) == full
        stop = full.split()[3]  # a word in the middle of the answer
        stopped = client.chat(messages, stop=[stop], **GREEDY)
    assert stopped.text == full[: full.index(stop)] and stopped.finish_reason == "stop"

    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    request = urllib.request.Request(
        f"http://{cluster.http}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        answer = json.load(reply)
    assert answer["choices"][0]["message"]["content"] == full
    assert answer["usage"]["completion_tokens"] == len(want)


def test_a_cached_prefix_gives_the_same_tokens(cluster, reference):
    tok = reference.tokenizer
    system = {"role": "system", "content": "You answer in one short sentence. " * 6}
    questions = ["What is the largest planet?", "What color is the sky?"]
    with Client(cluster.router) as client:
        first = [client.chat([system, {"role": "user", "content": q}], **GREEDY) for q in questions]
        again = client.chat([system, {"role": "user", "content": questions[0]}], **GREEDY)
    prompt = tok.apply_chat_template(
        [system, {"role": "user", "content": questions[1]}],
        add_generation_prompt=True,
        return_dict=False,
    )
    assert list(first[1].token_ids) == reference(prompt)
    assert first[1].usage.cached_tokens >= 48  # the shared system prompt's full blocks
    assert again.usage.cached_tokens >= again.usage.prompt_tokens - 16
    assert again.token_ids == first[0].token_ids
