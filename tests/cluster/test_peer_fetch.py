"""A prefill node fetches a prefix a peer holds instead of computing it — through the transfer
layer (tcp on CPU) by default, as gRPC bytes from a node without it, and from the peer's host
tier when its pool no longer holds it; stale or dead peers fall back to computing; outputs are
the same either way (token-exact with transformers)."""

import random

import grpc
import pytest
import torch
from support.processes import start_node
from support.relay import decode_on_relay
from transformers import AutoModelForCausalLM, GenerationConfig

from splitserve.models.tiny import write_random_checkpoint
from splitserve.v1 import common_pb2, nodes_pb2, nodes_pb2_grpc

SAMPLING = common_pb2.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
# The fixture's model: 2 layers x (K, V) x 16 tokens x 1 KV head x head_dim 64 x fp32.
BLOCK_NBYTES = 2 * 2 * 16 * 1 * 64 * 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peer")
    model = write_random_checkpoint(
        tmp / "m",
        seed=5,
        with_tokenizer=True,
        num_hidden_layers=2,
        num_key_value_heads=1,
        head_dim=64,
        num_attention_heads=2,
    )
    procs = [
        start_node("prefill", model, tmp),
        start_node("prefill", model, tmp),
        start_node("decode", model, tmp),
        start_node("prefill", model, tmp, "--kv-transfer", "none"),
        # A pool of 63 blocks (1 MiB of 16 KiB blocks) before a host tier of 4 MiB.
        start_node("prefill", model, tmp, "--kv-cache-mb", "1", "--kv-host-cache-mb", "4"),
    ]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    yield procs, hf
    for proc in procs:
        proc.stop()


def _greedy(hf, prompt):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            generation_config=GenerationConfig(max_new_tokens=5, do_sample=False, pad_token_id=0),
        )
    return out[0, len(prompt) :].tolist()


def _run(prefill, decode, rid, prompt, **hint):
    with grpc.insecure_channel(prefill.address) as pc, grpc.insecure_channel(decode.address) as dc:
        resp = nodes_pb2_grpc.PrefillNodeServiceStub(pc).Prefill(
            nodes_pb2.PrefillRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                sampling=SAMPLING,
                decode_address=decode.address,
                **hint,
            ),
            timeout=60,
        )
        decoded = decode_on_relay(nodes_pb2_grpc.DecodeNodeServiceStub(dc), rid, timeout=60)
        tokens = [resp.first_token_id, *decoded]
    return resp, tokens


def _stats(node):
    with grpc.insecure_channel(node.address) as channel:
        return nodes_pb2_grpc.NodeStatsServiceStub(channel).GetStats(nodes_pb2.GetStatsRequest())


def test_prefix_fetched_from_peer_then_stale_and_dead_peers(setup):
    (p1, p2, d, *_), hf = setup
    system = [random.randrange(256) for _ in range(96)]  # six full blocks
    a, b = [*system, 1, 2, 3], [*system, 7, 8]
    resp, tokens = _run(p1, d, "a", a)
    assert resp.blocks_fetched == 0 and tokens == _greedy(hf, a)
    idle = _stats(p1).num_free_blocks

    resp, tokens = _run(p2, d, "b", b, peer_address=p1.address, peer_blocks=6)
    assert resp.blocks_fetched == 6 and resp.cached_tokens == 96
    assert tokens == _greedy(hf, b)
    assert _stats(p1).counters["blocks_served_to_peers"] == 6
    assert _stats(p1).counters["blocks_served_to_peers_tcp"] == 6  # not as gRPC bytes
    assert _stats(p2).counters["prefix_fetches_tcp"] == 1
    assert _stats(p1).num_free_blocks == idle  # the served blocks were only pinned

    # The peer holds only the first 3 of the 6 blocks asked for: those 3 are fetched.
    second = [random.randrange(256) for _ in range(96)]
    _run(p1, d, "a2", [*second, 1])
    half = [*second[:48], *(random.randrange(256) for _ in range(48)), 2]
    resp, tokens = _run(p2, d, "b2", half, peer_address=p1.address, peer_blocks=6)
    assert resp.blocks_fetched == 3 and resp.cached_tokens == 48
    assert tokens == _greedy(hf, half)

    fresh = [random.randrange(256) for _ in range(64)]
    resp, tokens = _run(p2, d, "c", fresh, peer_address=p1.address, peer_blocks=4)  # stale
    assert resp.blocks_fetched == 0 and resp.cached_tokens == 0
    assert tokens == _greedy(hf, fresh)

    other = [random.randrange(256) for _ in range(64)]
    resp, tokens = _run(p2, d, "e", other, peer_address="127.0.0.1:1", peer_blocks=4)  # dead
    assert resp.blocks_fetched == 0 and tokens == _greedy(hf, other)
    assert _stats(p2).counters["prefix_fetch_failed"] >= 1


def test_a_node_without_the_layer_fetches_bytes(setup):
    (p1, _, d, plain, _), hf = setup
    system = [random.randrange(256) for _ in range(64)]  # four full blocks
    a, b = [*system, 4, 5], [*system, 9]
    _run(p1, d, "f", a)
    served = _stats(p1).counters
    resp, tokens = _run(plain, d, "g", b, peer_address=p1.address, peer_blocks=4)
    assert resp.blocks_fetched == 4 and resp.cached_tokens == 64
    assert tokens == _greedy(hf, b)
    after = _stats(p1).counters
    assert after["blocks_served_to_peers"] - served["blocks_served_to_peers"] == 4
    assert after["blocks_served_to_peers_tcp"] == served["blocks_served_to_peers_tcp"]
    assert not _stats(plain).transfer_endpoint  # it offers no path


def test_a_prefix_the_peer_holds_only_in_its_host_tier_is_sent_from_there(setup):
    (_, p2, d, _, small), hf = setup
    system = [random.randrange(256) for _ in range(96)]  # six full blocks
    a, b = [*system, 3], [*system, 5, 6]
    _run(small, d, "t-a", a)
    # Six prompts of 15 blocks each (90 > the pool's 63) push a's blocks out of small's pool;
    # its host tier (256 blocks) keeps them.
    for i in range(6):
        _run(small, d, f"t-fill-{i}", [random.randrange(256) for _ in range(241)])
    before = _stats(small).counters
    resp, tokens = _run(p2, d, "t-b", b, peer_address=small.address, peer_blocks=6)
    assert resp.blocks_fetched == 6 and resp.cached_tokens == 96
    assert tokens == _greedy(hf, b)
    after = _stats(small).counters
    served = after["tier_blocks_served_to_peers"] - before.get("tier_blocks_served_to_peers", 0)
    assert served == 6  # from the tier's memory: the pool no longer held them
    assert after["blocks_served_to_peers"] - before["blocks_served_to_peers"] == 6


def test_a_prefix_is_fetched_only_when_that_beats_computing_it():
    from splitserve.prefill_node.rates import MIN_FETCH_BLOCKS, worth_fetching

    mib = 1 << 20
    # Unknown compute speed (nothing measured yet, CPU): fetch anything worth a round trip.
    assert worth_fetching(MIN_FETCH_BLOCKS, 2 * mib, 16, 0.25e9, None)
    assert not worth_fetching(MIN_FETCH_BLOCKS - 1, 2 * mib, 16, 0.25e9, None)
    # 230 blocks of an 8B model (480 MB) over a 0.25 GB/s stream take ~1.9 s; a GPU computes
    # their 3,680 tokens at ~19k tokens/s in ~0.2 s: compute. Over a 300 GB/s path: fetch.
    assert not worth_fetching(230, 2 * mib, 16, 0.25e9, 19_000)
    assert worth_fetching(230, 2 * mib, 16, 300e9, 19_000)
    # A tiny model's blocks (16 KB) on a slow CPU (2k tokens/s): fetching wins.
    assert worth_fetching(18, 16 << 10, 16, 0.05e9, 2_000)


def test_knowing_the_hashes_is_not_enough_to_read_blocks(setup):
    """The hashes of a tenant's prefix are in the index (Redis); a fetch must also present the
    token ids (and salt) they hash from, else PERMISSION_DENIED and no blocks."""
    from splitserve.kvstore import hash_request_tokens

    (p1, _, d, *_), _ = setup
    secret = [random.randrange(256) for _ in range(48)]  # three full blocks, salted
    with grpc.insecure_channel(p1.address) as pc, grpc.insecure_channel(d.address) as dc:
        nodes_pb2_grpc.PrefillNodeServiceStub(pc).Prefill(
            nodes_pb2.PrefillRequest(request_id="t1", prompt_token_ids=[*secret, 1],
                                     sampling=SAMPLING, decode_address=d.address,
                                     cache_salt="tenant-a"),
            timeout=60,
        )  # fmt: skip
        decode_on_relay(nodes_pb2_grpc.DecodeNodeServiceStub(dc), "t1")
        stats = _stats(p1)
        hashes = hash_request_tokens(secret, 16, stats.model_root_hash, "tenant-a")
        stub = nodes_pb2_grpc.PrefillNodeServiceStub(pc)
        base = dict(block_hashes=hashes, model_root_hash=stats.model_root_hash,
                    block_nbytes=BLOCK_NBYTES)  # fmt: skip
        wrong = [(t + 1) % 256 for t in secret]
        for proof in ({}, dict(prompt_token_ids=wrong, cache_salt="tenant-a"),
                      dict(prompt_token_ids=secret, cache_salt="tenant-b"),
                      dict(prompt_token_ids=secret[:32], cache_salt="tenant-a")):  # fmt: skip
            with pytest.raises(grpc.RpcError) as err:
                list(stub.FetchBlocks(nodes_pb2.FetchBlocksRequest(**base, **proof), timeout=10))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, proof
        proof = dict(prompt_token_ids=secret, cache_salt="tenant-a")
        served = list(stub.FetchBlocks(nodes_pb2.FetchBlocksRequest(**base, **proof), timeout=10))
        assert served and all(m.data for m in served)  # the owner of the prompt may read them
        # Asking for the last two blocks only: the proof still covers the whole chain.
        tail = dict(base, block_hashes=hashes[1:])
        served = list(stub.FetchBlocks(
            nodes_pb2.FetchBlocksRequest(**tail, **proof, first_block=1), timeout=10))  # fmt: skip
        assert served
