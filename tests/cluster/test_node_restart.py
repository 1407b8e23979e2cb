"""A node that comes back after a while down is used again: the router's channel to it keeps
reconnecting (with a backoff capped at 2 s, CHANNEL_OPTIONS: gRPC's default grows toward 120 s, and
a node restarted after 90 s went unused for ~23 s) and its health round finds it SERVING.

How soon it is used is a latency, measured by no test here: the outage is as short as lets the
channel fail a few reconnects, and the bound is a hang guard. The cap itself is checked below,
on the options every router channel is built with."""

from __future__ import annotations

import contextlib
import time

from support.processes import node_stats, start_cli, start_node, start_router
from support.reference import hf_greedy

from splitserve.client import Client, SplitserveError
from splitserve.models.tiny import write_random_checkpoint
from splitserve.runtime.server import CHANNEL_OPTIONS

DOWN_S = 4.0  # the channel's reconnects fail at ~0.5, 1.3, 2.6 s: it is backing off
USED_WITHIN_S = 60.0  # a hang guard, not a speed: the cap keeps it to seconds


def test_a_restarted_decode_node_is_used_within_seconds_of_ready(tmp_path):
    model = write_random_checkpoint(
        tmp_path / "m", seed=4, with_tokenizer=True, num_hidden_layers=1
    )

    def decode_on_port(port: int = 0):
        args = ["decode", "--model", str(model), "--kv-cache-mb", "64"]
        return start_cli("decode", args, tmp_path, port=port)

    prefill = start_node("prefill", model, tmp_path)
    decode = decode_on_port()  # on a port it binds; restarted on the same one
    port = int(decode.address.rsplit(":", 1)[1])
    router = start_router(model, tmp_path, [prefill.address], [decode.address])
    procs = [router, prefill, decode]
    try:
        with Client(router.address) as client:
            reply = client.generate(prompt_token_ids=[5] * 20, max_tokens=2, ignore_eos=True)
            assert len(reply.token_ids) == 2
            decode.stop()
            for _ in range(3):  # the router finds it gone (and its channel starts backing off)
                with contextlib.suppress(SplitserveError):
                    client.generate(prompt_token_ids=[6] * 20, max_tokens=2, timeout=5)
            time.sleep(DOWN_S)
            decode = decode_on_port(port)  # SERVING when this returns
            procs.append(decode)
            ready = time.monotonic()
            while True:
                try:
                    reply = client.generate(prompt_token_ids=[7] * 20, max_tokens=2, timeout=5,
                                            temperature=0.0, ignore_eos=True)  # fmt: skip
                    break
                except SplitserveError:
                    waited = time.monotonic() - ready
                    assert waited < USED_WITHIN_S, "the restarted node is not used"
                    time.sleep(0.2)
            used_after = time.monotonic() - ready
        # Used either way the router may send it: a transfer from the prefill node, or direct
        # (the decode node prefills it) when the router's probe of a busy prefill node timed out
        # and marked it down for a moment.
        # Greedy and two tokens: the second is a decode node's, as transformers has it.
        assert list(reply.token_ids) == hf_greedy(model, [7] * 20, 2), reply
        # NOTE: this request once sampled (no temperature given) and ended at its first token
        # (EOS drawn) without reaching the decode node: 0 transfers, the test failed on a
        # random draw. Greedy with ignore_eos now; the counters are still waited for.
        deadline = time.monotonic() + 10
        while (counters := node_stats(decode).counters)["transfers"] + counters[
            "direct_requests"
        ] < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert counters["transfers"] + counters["direct_requests"] >= 1, (
            dict(counters),
            router.log.read_text()[-3000:],
        )
        print(f"restarted node used {used_after:.2f} s after it was ready")
    finally:
        for proc in procs:
            proc.stop()


def test_every_router_channel_reconnects_within_two_seconds():
    """The cap the test above relies on, on the options the registry builds its channels with."""
    options = dict(CHANNEL_OPTIONS)
    assert options["grpc.max_reconnect_backoff_ms"] <= 2000
    assert options["grpc.initial_reconnect_backoff_ms"] <= options["grpc.max_reconnect_backoff_ms"]
