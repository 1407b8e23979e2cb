"""A node that comes back after a while down is used again within seconds of being ready: the
router's channel to it reconnects with a backoff capped at 2 s (gRPC's default grows toward
120 s: a node restarted after 90 s went unused for ~23 s)."""

from __future__ import annotations

import contextlib
import time

from support.processes import node_stats, start_cli, start_node, start_router

from splitserve.client import Client, SplitserveError
from splitserve.launcher import free_port
from splitserve.models.tiny import write_random_checkpoint

DOWN_S = 15.0


def test_a_restarted_decode_node_is_used_within_seconds_of_ready(tmp_path):
    model = write_random_checkpoint(
        tmp_path / "m", seed=4, with_tokenizer=True, num_hidden_layers=1
    )
    port = free_port()

    def decode_on_port():
        args = ["decode", "--model", str(model), "--kv-cache-mb", "64"]
        return start_cli("decode", args, tmp_path, port=port)

    prefill = start_node("prefill", model, tmp_path)
    decode = decode_on_port()
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
            decode = decode_on_port()  # SERVING when this returns
            procs.append(decode)
            ready = time.monotonic()
            while True:
                try:
                    client.generate(prompt_token_ids=[7] * 20, max_tokens=2, timeout=5)
                    break
                except SplitserveError:
                    assert time.monotonic() - ready < 10, "the restarted node is not used"
                    time.sleep(0.2)
            used_after = time.monotonic() - ready
        # Used either way the router may send it: a transfer from the prefill node, or direct
        # (the decode node prefills it) when the router's probe of a busy prefill node timed out
        # and marked it down for a moment.
        counters = node_stats(decode).counters
        assert counters["transfers"] + counters["direct_requests"] >= 1, dict(counters)
        print(f"restarted node used {used_after:.2f} s after it was ready")
        assert used_after < 5, f"used {used_after:.1f} s after it was ready"
    finally:
        for proc in procs:
            proc.stop()
