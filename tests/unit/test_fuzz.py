"""Fuzzing the checks that stand between the network and the engine (hypothesis): whatever a
public request or a transfer header holds — field values or raw bytes — the router's
``parse_request`` either accepts it or raises ``InvalidRequest``, and the decode node's
``check_header`` either accepts it or raises ``TransferRefused``; no other exception escapes
(those would reach a client as UNKNOWN)."""

from __future__ import annotations

import contextlib

import hypothesis.strategies as st
import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from support.router_helpers import MODEL

from splitserve.decode_node.header import TransferRefused, check_header
from splitserve.engine.core import LLMEngine
from splitserve.engine.local import LocalEngine
from splitserve.kvstore import ModelIdentity, hash_request_tokens
from splitserve.models.loader import load_model
from splitserve.models.runner import ModelRunner, RunnerConfig
from splitserve.models.tiny import write_random_checkpoint
from splitserve.router.request import InvalidRequest, parse_request
from splitserve.router.service import input_of
from splitserve.v1 import common_pb2, nodes_pb2, router_pb2

FAST = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))

numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32), st.integers(-(2**31), 2**31 - 1)
)
sampling = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.floats(width=32),
        "top_p": st.floats(width=32),
        "top_k": st.integers(-(2**31), 2**31 - 1),
        "min_p": st.floats(width=32),
        "max_tokens": st.integers(0, 2**32 - 1),
        "min_tokens": st.integers(0, 2**32 - 1),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "repetition_penalty": st.floats(width=32),
        "presence_penalty": st.floats(width=32),
        "frequency_penalty": st.floats(width=32),
        "stop_token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=40),
        "ignore_eos": st.booleans(),
    },
)


def _sampling(values: dict) -> common_pb2.SamplingParams:
    try:
        return common_pb2.SamplingParams(**values)
    except (ValueError, TypeError):  # a value protobuf itself refuses: not our input
        return common_pb2.SamplingParams()


@FAST
@given(
    text=st.text(max_size=200),
    ids=st.lists(st.integers(0, 2**32 - 1), max_size=80),
    use_ids=st.booleans(),
    stop=st.lists(st.text(max_size=5), max_size=20),
    salt=st.text(max_size=300),
    values=sampling,
)
def test_parse_request_accepts_or_refuses_cleanly(text, ids, use_ids, stop, salt, values):
    request = router_pb2.GenerateRequest(
        stop=stop, cache_salt=salt, sampling=_sampling(values), request_id="r"
    )
    if use_ids:
        request.token_ids.ids.extend(ids)
    else:
        request.text = text
    try:
        params = parse_request(input_of(request), MODEL)
    except InvalidRequest:
        return
    assert 0 < len(params.prompt_token_ids) <= MODEL.max_prompt_tokens
    assert all(0 <= t < MODEL.vocab_size for t in params.prompt_token_ids)


@FAST
@given(data=st.binary(max_size=300))
def test_raw_bytes_never_parse_into_an_unchecked_request(data):
    try:
        request = router_pb2.GenerateRequest.FromString(data)
    except DecodeError:
        return  # answered INVALID_ARGUMENT by the interceptor (tests/cluster/test_malformed.py)
    with contextlib.suppress(InvalidRequest):
        parse_request(input_of(request), MODEL)


@pytest.fixture(scope="module")
def info(tmp_path_factory):
    """The engine's figures, as a decode node checks headers with (``NodeEngine.info``)."""
    path = write_random_checkpoint(tmp_path_factory.mktemp("fuzz") / "m", seed=2)
    config, model = load_model(path)
    rc = RunnerConfig(kv_cache_bytes=32 * 16 * config.kv_bytes_per_token(torch.float32))
    return LocalEngine(LLMEngine(ModelRunner(config, model, rc), ModelIdentity("fuzz"))).info


@FAST
@given(
    prompt=st.lists(st.integers(0, 2**32 - 1), max_size=70),
    first=st.integers(0, 2**32 - 1),
    corrupt_hash=st.booleans(),
    deadline=numbers,
    salt=st.text(max_size=300),
    nbytes=st.integers(0, 2**32 - 1),
    good_nbytes=st.booleans(),
    values=sampling,
)
def test_check_header_accepts_or_refuses_cleanly(
    info, prompt, first, corrupt_hash, deadline, salt, nbytes, good_nbytes, values
):
    identity = ModelIdentity("fuzz")
    block_nbytes = info.block_nbytes
    claimed_nbytes = block_nbytes if good_nbytes else nbytes
    hashes = hash_request_tokens(prompt, 16, identity.root_hash, salt or None)
    if corrupt_hash and hashes:
        hashes[0] = bytes(32)
    try:
        header = nodes_pb2.TransferHeader(
            request_id="h", prompt_token_ids=prompt, first_token_id=first, block_hashes=hashes,
            model_root_hash=identity.root_hash, block_nbytes=claimed_nbytes,
            deadline_s=float(deadline), cache_salt=salt, sampling=_sampling(values),
        )  # fmt: skip
    except (ValueError, TypeError):
        return
    try:
        params, checked = check_header(header, info, identity, lambda _: False)
    except TransferRefused:
        return
    vocab = info.vocab_size
    assert checked == prompt and all(t < vocab for t in checked) and first < vocab
    assert params.max_tokens >= 1
