"""Corrupt request bytes, sent raw to every kind of method of a real node and router, get
INVALID_ARGUMENT with a short message and one log line (no traceback); the next good request is
served (runtime/guard.py)."""

from __future__ import annotations

import random

import grpc
import pytest
from support.processes import node_stats, start_node, start_router

from splitserve.client import Client
from splitserve.models.tiny import write_random_checkpoint

GARBAGE = b"\xff\xff\xff\xff\x0f\x08"  # a varint longer than protobuf allows


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("malformed")
    model = write_random_checkpoint(tmp / "m", seed=4, with_tokenizer=True, num_hidden_layers=2)
    prefill = start_node("prefill", model, tmp)
    decode = start_node("decode", model, tmp)
    router = start_router(model, tmp, [prefill.address], [decode.address])
    try:
        yield prefill, decode, router
    finally:
        for proc in (router, prefill, decode):
            proc.stop()


METHODS = [  # (component, method, request streaming, response streaming)
    ("router", "/splitserve.v1.RouterService/Generate", False, True),
    ("router", "/splitserve.v1.RouterService/Complete", False, False),
    ("prefill", "/splitserve.v1.PrefillNodeService/Prefill", False, False),
    ("prefill", "/splitserve.v1.PrefillNodeService/FetchBlocks", False, True),
    ("decode", "/splitserve.v1.DecodeNodeService/TransferKV", True, True),
    ("decode", "/splitserve.v1.DecodeNodeService/Relay", True, True),
    ("decode", "/splitserve.v1.DecodeNodeService/Release", False, False),
    ("decode", "/splitserve.v1.NodeStatsService/GetStats", False, False),
]


@pytest.mark.parametrize(("who", "method", "req_stream", "resp_stream"), METHODS)
def test_corrupt_bytes_get_invalid_argument(cluster, who, method, req_stream, resp_stream):
    prefill, decode, router = cluster
    proc = {"prefill": prefill, "decode": decode, "router": router}[who]
    kinds = {
        (False, False): "unary_unary",
        (False, True): "unary_stream",
        (True, True): "stream_stream",
    }
    with grpc.insecure_channel(proc.address) as channel:
        call = getattr(channel, kinds[(req_stream, resp_stream)])(method)
        payload = iter([GARBAGE]) if req_stream else GARBAGE
        with pytest.raises(grpc.RpcError) as err:
            result = call(payload, timeout=10)
            if resp_stream:
                list(result)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert "not a valid" in err.value.details() and "Traceback" not in err.value.details()
    log = proc.log.read_text()
    assert "Traceback" not in log, log[-2000:]
    assert log.count("malformed") >= 1


def test_good_requests_after_garbage(cluster):
    _, decode, router = cluster
    with Client(router.address) as client:
        ids = [random.Random(2).randrange(200) for _ in range(30)]
        reply = client.generate(prompt_token_ids=ids, max_tokens=3, ignore_eos=True)
        assert len(reply.token_ids) == 3
    assert node_stats(decode).role == "decode"
