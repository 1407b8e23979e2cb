"""DecodeNodeService.Release on real processes (a prefill and a decode node with the cluster
token): it frees the KV a transfer left on the decode node, once (idempotent), refuses a call
without the token and an id out of bounds, and the router's decode stage calls it, so a request
that ended at its first token does not hold the blocks until the node's transfer deadline (a
node without Release, an older version: tests/unit/test_router_stages.py and
tests/cluster/test_router_unit.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from support.processes import start_node
from support.relay import decode_on_relay

from splitserve.models.tiny import write_random_checkpoint
from splitserve.router.decode_stage import DecodeStage
from splitserve.router.registry import NodeRegistry
from splitserve.runtime.auth import metadata_for, use_token, write_token_file
from splitserve.v1 import common_pb2, nodes_pb2, nodes_pb2_grpc

# Long enough that a request whose blocks were not released would still be held when checked.
NODE_FLAGS = ("--transfer-deadline-s", "120")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("release")
    model = write_random_checkpoint(tmp / "m", seed=4, with_tokenizer=True)
    token_file = tmp / "token"
    token = write_token_file(token_file)
    flags = ("--auth-token-file", str(token_file))
    prefill = start_node("prefill", model, tmp, *flags, *NODE_FLAGS)
    decode = start_node("decode", model, tmp, *flags, *NODE_FLAGS)
    try:
        yield token, prefill, decode
    finally:
        for proc in (prefill, decode):
            proc.stop()


def stats(proc, token):
    with grpc.insecure_channel(proc.address) as channel:
        stub = nodes_pb2_grpc.NodeStatsServiceStub(channel)
        return stub.GetStats(nodes_pb2.GetStatsRequest(), timeout=10, metadata=metadata_for(token))


def prefill_into(prefill, decode, token: str, request_id: str) -> None:
    """P's Prefill shipping a prompt's KV into D, which then holds it for a decode command."""
    with grpc.insecure_channel(prefill.address) as channel:
        nodes_pb2_grpc.PrefillNodeServiceStub(channel).Prefill(
            nodes_pb2.PrefillRequest(
                request_id=request_id,
                prompt_token_ids=[(7 * i) % 250 for i in range(40)],
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                decode_address=decode.address,
            ),
            timeout=60,
            metadata=metadata_for(token),
        )


def test_release_frees_a_transferred_request_once(cluster):
    token, prefill, decode = cluster
    md = metadata_for(token)
    idle = stats(decode, token).num_free_blocks
    with grpc.insecure_channel(prefill.address) as p_channel:
        p_stub = nodes_pb2_grpc.PrefillNodeServiceStub(p_channel)
        p_stub.Prefill(
            nodes_pb2.PrefillRequest(
                request_id="held-1",
                prompt_token_ids=[(7 * i) % 250 for i in range(40)],
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                decode_address=decode.address,
            ),
            timeout=60,
            metadata=md,
        )
    assert stats(decode, token).pending_transfers == 1
    assert stats(decode, token).num_free_blocks < idle

    with grpc.insecure_channel(decode.address) as channel:
        stub = nodes_pb2_grpc.DecodeNodeServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:  # no token
            stub.Release(nodes_pb2.ReleaseRequest(request_id="held-1"), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for bad in ("", "x" * 1025):
            with pytest.raises(grpc.RpcError) as err:
                stub.Release(nodes_pb2.ReleaseRequest(request_id=bad), timeout=10, metadata=md)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert stats(decode, token).pending_transfers == 1  # none of those touched it

        release = nodes_pb2.ReleaseRequest(request_id="held-1")
        assert stub.Release(release, timeout=10, metadata=md).released
        assert not stub.Release(release, timeout=10, metadata=md).released  # idempotent
        unknown = nodes_pb2.ReleaseRequest(request_id="never-sent")
        assert not stub.Release(unknown, timeout=10, metadata=md).released
        with pytest.raises(grpc.RpcError) as err:  # nothing left to decode
            decode_on_relay(stub, "held-1", timeout=10, metadata=md)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

    after = stats(decode, token)
    assert (after.pending_transfers, after.num_free_blocks) == (0, idle)  # cached blocks: free
    assert after.counters["transfers_released"] == 1


def test_the_router_releases_through_its_decode_stage(cluster):
    # What the router does when a request ends at its first token (a stop string) and D holds
    # the KV P shipped there: DecodeSession.close(release_kv=True) calls D's Release.
    token, prefill, decode = cluster
    prefill_into(prefill, decode, token, "held-2")
    before = stats(decode, token).counters.get("transfers_released", 0)
    assert stats(decode, token).pending_transfers == 1

    async def main() -> None:
        use_token(token)
        registry = NodeRegistry([], [decode.address])
        try:
            session = DecodeStage(registry).claim(registry.decode.nodes[0], None, "held-2")
            session.close(release_kv=True)
            for _ in range(100):
                if (await asyncio.to_thread(stats, decode, token)).pending_transfers == 0:
                    break
                await asyncio.sleep(0.1)
        finally:
            use_token(None)
            await registry.close()

    asyncio.run(main())
    after = stats(decode, token)
    assert after.pending_transfers == 0
    assert after.counters["transfers_released"] == before + 1
