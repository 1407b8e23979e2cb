"""OpenTelemetry traces through a CPU cluster (a prefill node, a decode node, a router, Redis),
each process started with ``--otlp-endpoint`` pointing at an OTLP/HTTP receiver run by the test:
one request yields one trace across the three services, every stage a span in its place
(admission, prefix look-up, routing decision, the Prefill call with the prefill node's queue,
compute and KV transfer, the decode node's TransferKV and Decode with its queue, the router's
decode), children of the client's own span (its ``traceparent``); a request refused at admission
yields a failed trace saying why."""

import json
import os
import urllib.request

import pytest
from support.otlp import serve_receiver
from support.processes import node_stats, start_node, start_redis, start_router

from splitserve.client import Client, SplitserveError
from splitserve.models.tiny import write_random_checkpoint

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tracing")
    model = write_random_checkpoint(tmp / "m", seed=5, with_tokenizer=True, num_hidden_layers=2)
    receiver, server, endpoint = serve_receiver()
    procs = []
    saved = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # the children export every 0.1 s
    try:
        procs.append(start_redis(tmp))
        redis_url = procs[0].address
        common = ("--otlp-endpoint", endpoint, "--redis-url", redis_url)
        prefill = start_node("prefill", model, tmp, *common)
        # A small decode pool (1 MB: ~60 blocks of 16 tokens), so that a prompt within the
        # model's context can be larger than it.
        decode = start_node("decode", model, tmp, *common, "--kv-cache-mb", "1")
        procs += [prefill, decode]
        http_port_file = tmp / "http.port"
        http = ("--http-port", "0", "--http-port-file", str(http_port_file))
        procs.append(start_router(model, tmp, [prefill.address], [decode.address], *common, *http))
        procs[-1].http = f"http://127.0.0.1:{http_port_file.read_text().strip()}"
        yield receiver, procs[-1], decode
    finally:
        for proc in reversed(procs):
            proc.stop()
        server.shutdown()
        if saved is None:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = saved


ROUTER = {"request", "lookup", "admission", "route", "prefill", "decode"}
PREFILL = {"prefill_node.Prefill", "queue", "compute", "kv_transfer"}
DECODE = {"decode_node.TransferKV", "decode_node.Decode", "queue"}


def _names(trace, service):
    return {s.name for s in trace if s.service == service}


def _complete(trace) -> bool:
    return (
        _names(trace, "splitserve-router") >= ROUTER
        and _names(trace, "splitserve-prefill") >= PREFILL
        and _names(trace, "splitserve-decode") >= DECODE
    )


def test_one_request_is_one_trace_across_router_prefill_and_decode(cluster):
    receiver, router, _ = cluster
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    with Client(router.address) as client:
        result = client.generate(
            prompt_token_ids=list(range(1, 70)),
            max_tokens=6,
            temperature=0.0,
            ignore_eos=True,
            metadata=[("traceparent", traceparent)],
        )
    assert len(result.token_ids) == 6
    trace = receiver.wait_for(lambda s: s.trace_id == CLIENT_TRACE, _complete)

    def one(service, name):
        found = [s for s in trace if s.service == service and s.name == name]
        assert len(found) == 1, (service, name, found)
        return found[0]

    request = one("splitserve-router", "request")
    assert request.parent_id == CLIENT_SPAN  # the client's span is the parent
    assert request.attributes["splitserve.prompt_tokens"] == 69
    assert request.attributes["splitserve.completion_tokens"] == 6
    assert "first_token" in request.events and not request.failed
    by_id = {s.span_id: s for s in trace}
    for name in ("lookup", "admission", "route", "prefill", "decode"):
        assert one("splitserve-router", name).parent_id == request.span_id, name
    route = one("splitserve-router", "route").attributes
    assert route["splitserve.route"] == "disaggregated"
    assert route["splitserve.decode_node"] and route["splitserve.prefill_node"]
    # The prefill node's span is the child of the router's Prefill call; its stages are its own.
    on_p = one("splitserve-prefill", "prefill_node.Prefill")
    assert by_id[on_p.parent_id].name == "prefill"
    compute = one("splitserve-prefill", "compute")
    assert compute.parent_id == on_p.span_id
    assert compute.attributes["splitserve.computed_tokens"] == 69
    queue = next(s for s in trace if s.service == "splitserve-prefill" and s.name == "queue")
    assert queue.end_ns <= compute.start_ns + 1_000_000  # the queue, then the compute
    shipped = one("splitserve-prefill", "kv_transfer").attributes
    assert shipped["splitserve.transfer_path"] and shipped["splitserve.blocks_shipped"] == 4
    assert shipped["splitserve.bytes"] > 0
    # The decode node: the transfer under the prefill node's span, the decode under the router's.
    transfer = one("splitserve-decode", "decode_node.TransferKV")
    assert transfer.parent_id == on_p.span_id
    assert transfer.attributes["splitserve.blocks_received"] == 4
    decode = one("splitserve-decode", "decode_node.Decode")
    assert by_id[decode.parent_id].name == "decode"
    assert decode.attributes["splitserve.tokens"] == 5  # (the first came from the prefill node)
    assert (
        by_id[one("splitserve-router", "prefill").span_id].attributes["splitserve.computed_tokens"]
        == 69
    )


def test_a_request_refused_at_admission_is_a_failed_trace_saying_why(cluster):
    receiver, router, decode = cluster
    n = node_stats(decode).num_blocks * 16 + 1  # one block more than the decode node holds
    assert n + 4 <= 1024  # (within the model's context: admission, not the checks, refuses it)
    with Client(router.address) as client, pytest.raises(SplitserveError) as refused:
        client.generate(prompt_token_ids=[i % 300 + 1 for i in range(n)], max_tokens=4)
    assert "KV blocks" in str(refused.value)

    def done(trace):
        return {"request", "admission"} <= {s.name for s in trace}

    trace = receiver.wait_for(lambda s: s.attributes.get("splitserve.prompt_tokens") == n, done)
    request = next(s for s in trace if s.name == "request")
    assert request.failed and "RESOURCE_EXHAUSTED" in request.error
    assert request.attributes["splitserve.refusal_reason"] == "prompt_too_large"
    admission = next(s for s in trace if s.name == "admission")
    assert admission.failed and "KV blocks" in admission.error
    assert admission.attributes["splitserve.refusal_reason"] == "prompt_too_large"
    assert not [s for s in trace if s.service != "splitserve-router"]  # no node did any work


def test_an_http_request_continues_the_callers_trace(cluster):
    """The OpenAI-compatible HTTP API reads the W3C ``traceparent`` header."""
    receiver, router, _ = cluster
    trace_id, parent = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"
    body = json.dumps({"model": "m", "prompt": [3, 4, 5, 6], "max_tokens": 2}).encode()
    request = urllib.request.Request(
        f"{router.http}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json", "traceparent": f"00-{trace_id}-{parent}-01"},
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert json.loads(reply.read())["choices"][0]["text"] is not None
    trace = receiver.wait_for(
        lambda s: s.trace_id == trace_id,
        lambda t: {"request", "prefill_node.Prefill", "decode_node.Decode"} <= {s.name for s in t},
    )
    (request_span,) = [s for s in trace if s.name == "request"]
    assert request_span.parent_id == parent and not request_span.failed
