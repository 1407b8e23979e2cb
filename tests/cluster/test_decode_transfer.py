"""The decode node's KV transfer protocol against a real decode process: good transfers are
adopted, every malformed one is refused with INVALID_ARGUMENT and leaves the pool as it was, and
abandoned or cancelled work frees its blocks."""

import random
import time

import grpc
import pytest
from support.processes import start_node
from support.relay import SyncRelayCall, decode_on_relay

from splitserve.kvstore import ModelIdentity, hash_request_tokens
from splitserve.transfer.grpc_bytes.codec import encode_blocks
from splitserve.v1 import common_pb2, nodes_pb2, nodes_pb2_grpc

BS = 16


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    from splitserve.models.tiny import write_random_checkpoint

    tmp = tmp_path_factory.mktemp("decode")
    model = write_random_checkpoint(tmp / "model", with_tokenizer=True)
    node = start_node("decode", model, tmp)
    channel = grpc.insecure_channel(node.address)
    stub = nodes_pb2_grpc.DecodeNodeServiceStub(channel)
    stub.GetStats = nodes_pb2_grpc.NodeStatsServiceStub(channel).GetStats  # both on one node
    yield stub, ModelIdentity.for_checkpoint(model, "float32").root_hash, _block_nbytes(model)
    channel.close()
    node.stop()


def _block_nbytes(model) -> int:
    config = __import__("json").loads((model / "config.json").read_text())
    layers, heads, dim = (
        config[k] for k in ("num_hidden_layers", "num_key_value_heads", "head_dim")
    )
    return layers * 2 * BS * heads * dim * 4


def _stats(stub):
    return stub.GetStats(nodes_pb2.GetStatsRequest(), timeout=10)


def _transfer(
    stub,
    root,
    nbytes,
    rid,
    prompt,
    corrupt=None,
    stop_after_header=False,
    max_tokens=4,
    replies=None,
    gate=None,
):
    """Run one TransferKV as a prefill node would; ``gate`` (an Event) holds the blocks back
    until set; ``replies`` collects the node's answers as they come."""
    hashes = hash_request_tokens(prompt, BS, root)
    header = nodes_pb2.TransferHeader(
        request_id=rid,
        prompt_token_ids=prompt,
        first_token_id=5,
        block_hashes=hashes,
        model_root_hash=root,
        block_nbytes=nbytes,
        deadline_s=30,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    if corrupt == "root":
        header.model_root_hash = b"\x00" * 32
    if corrupt == "hashes":
        header.block_hashes[0] = b"\x01" * 32
    if corrupt in ("nan-deadline", "inf-deadline"):
        header.deadline_s = float(corrupt.split("-")[0])
    if corrupt == "salt":
        header.cache_salt = "s" * 300
    replies = [] if replies is None else replies

    def messages():
        yield nodes_pb2.TransferKVRequest(header=header)
        while not replies:
            time.sleep(0.01)
        if stop_after_header:
            return
        if gate is not None:
            gate.wait(30)
        missing = list(replies[0].missing)
        data = random.randbytes(len(missing) * nbytes)
        meta, data = encode_blocks(missing, data)
        if corrupt == "crc":
            data = data[:-1] + bytes([data[-1] ^ 1])
        if corrupt == "size":
            data = data[:-4]
        if missing:
            yield nodes_pb2.TransferKVRequest(blocks=nodes_pb2.BlockData(meta=meta, data=data))
        if len(prompt) % BS:
            meta, data = encode_blocks([-1], random.randbytes(nbytes), tail=True)
            yield nodes_pb2.TransferKVRequest(blocks=nodes_pb2.BlockData(meta=meta, data=data))
        yield nodes_pb2.TransferKVRequest(end=nodes_pb2.TransferEnd())

    for reply in stub.TransferKV(messages(), timeout=30):
        replies.append(reply)
    return replies


def _wait_until(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _prompt(n=40):
    return [random.randrange(256) for _ in range(n)]


def test_good_transfer_then_decode_frees_everything(decode):
    stub, root, nbytes = decode
    idle = _stats(stub).num_free_blocks
    prompt = _prompt()
    replies = _transfer(stub, root, nbytes, "good", prompt)
    assert list(replies[0].missing) == [0, 1] and replies[-1].done
    assert _stats(stub).pending_transfers == 1
    tokens = decode_on_relay(stub, "good", timeout=30)
    assert len(tokens) == 3  # max_tokens 4, the first came from the prefill node
    stats = _stats(stub)
    assert stats.num_free_blocks == idle and stats.pending_transfers == 0
    # The same prompt again: both full blocks are already here, only the tail is sent.
    again = _transfer(stub, root, nbytes, "good-2", prompt)
    assert list(again[0].missing) == [] and again[-1].blocks_reused == 2
    decode_on_relay(stub, "good-2", timeout=30)


@pytest.mark.parametrize(
    "corrupt", ["crc", "size", "root", "hashes", "nan-deadline", "inf-deadline", "salt"]
)
def test_malformed_transfer_is_refused_and_adopts_nothing(decode, corrupt):
    stub, root, nbytes = decode
    before = _stats(stub)
    with pytest.raises(grpc.RpcError) as err:
        _transfer(stub, root, nbytes, f"bad-{corrupt}", _prompt(), corrupt=corrupt)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    after = _stats(stub)
    assert after.num_free_blocks == before.num_free_blocks
    assert after.num_cached_blocks == before.num_cached_blocks
    assert after.pending_transfers == 0
    replies = _transfer(stub, root, nbytes, f"after-{corrupt}", _prompt())
    assert replies[-1].done
    decode_on_relay(stub, f"after-{corrupt}", timeout=30)


def test_abandoned_transfer_and_cancelled_decode_free_their_blocks(decode):
    stub, root, nbytes = decode
    idle = _stats(stub).num_free_blocks
    with pytest.raises(grpc.RpcError):
        _transfer(stub, root, nbytes, "abandoned", _prompt(), stop_after_header=True)
    deadline = time.monotonic() + 10
    while _stats(stub).num_free_blocks != idle and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _stats(stub).num_free_blocks == idle

    _transfer(stub, root, nbytes, "cancelled", _prompt(), max_tokens=500)
    command = nodes_pb2.RelayCommand(decode=nodes_pb2.DecodeRequest(request_id="cancelled"))
    call = SyncRelayCall(stub, command, timeout=30)
    next(iter(call))  # decoding has started
    call.cancel()  # the stream's end ends the request
    deadline = time.monotonic() + 10
    while _stats(stub).num_free_blocks != idle and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _stats(stub).num_free_blocks == idle


def test_concurrent_transfers_of_one_new_prefix_ship_it_once(decode):
    """B arrives while A is still receiving their shared blocks: B waits for A, then reuses
    the blocks A wrote and is asked only for its own."""
    import threading

    stub, root, nbytes = decode
    shared = _prompt(48)  # three full blocks
    prompts = {"dedupe-a": [*shared, *_prompt(24)], "dedupe-b": [*shared, *_prompt(24)]}
    waited = _stats(stub).counters["transfers_waited_for_same_blocks"]
    gate, replies = threading.Event(), {rid: [] for rid in prompts}
    threads = {
        rid: threading.Thread(
            target=_transfer,
            args=(stub, root, nbytes, rid, prompt),
            kwargs=dict(replies=replies[rid], gate=gate if rid == "dedupe-a" else None),
        )
        for rid, prompt in prompts.items()
    }
    threads["dedupe-a"].start()
    deadline = time.monotonic() + 10
    while not replies["dedupe-a"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert list(replies["dedupe-a"][0].missing) == [0, 1, 2, 3]
    threads["dedupe-b"].start()
    _wait_until(lambda: _stats(stub).counters["transfers_waited_for_same_blocks"] == waited + 1)
    time.sleep(0.3)
    assert not replies["dedupe-b"], "B must wait while A receives the shared blocks"
    gate.set()
    for thread in threads.values():
        thread.join(30)
    assert replies["dedupe-a"][-1].done and replies["dedupe-b"][-1].done
    assert list(replies["dedupe-b"][0].missing) == [3]
    assert replies["dedupe-b"][-1].blocks_reused == 3
    for rid in prompts:
        decode_on_relay(stub, rid, timeout=30)


def test_transfers_of_one_new_prefix_arriving_at_once_reserve_it_once(decode):
    """Six transfers sharing a new prefix, all sent at the same moment: one reserves and
    receives the shared blocks, the others wait for it and reuse them (two copies of one prefix
    would hold blocks the router's KV ledger counts once)."""
    import threading

    stub, root, nbytes = decode
    shared = _prompt(48)  # three full blocks
    prompts = {f"at-once-{i}": [*shared, *_prompt(24)] for i in range(6)}
    gate, replies = threading.Event(), {rid: [] for rid in prompts}
    threads = [
        threading.Thread(
            target=_transfer,
            args=(stub, root, nbytes, rid, prompt),
            kwargs=dict(replies=replies[rid], gate=gate),
        )
        for rid, prompt in prompts.items()
    ]
    for thread in threads:
        thread.start()
    _wait_until(lambda: any(replies.values()))
    time.sleep(0.5)  # the others, if they did not wait, have their answers by now
    gate.set()
    for thread in threads:
        thread.join(30)
    assert all(r[-1].done for r in replies.values())
    shippers = [rid for rid, r in replies.items() if 0 in r[0].missing]
    assert len(shippers) == 1, {rid: list(r[0].missing) for rid, r in replies.items()}
    assert all(list(r[0].missing) == [3] for rid, r in replies.items() if rid not in shippers)
    for rid in prompts:
        decode_on_relay(stub, rid, timeout=30)
    _wait_until(lambda: _stats(stub).num_free_blocks == _stats(stub).num_blocks)


def test_a_second_transfer_of_a_request_in_transfer_is_refused(decode):
    import threading

    stub, root, nbytes = decode
    idle = _stats(stub).num_free_blocks
    gate, replies = threading.Event(), []
    first = threading.Thread(
        target=_transfer,
        args=(stub, root, nbytes, "twice", _prompt()),
        kwargs=dict(replies=replies, gate=gate),
    )
    first.start()
    _wait_until(lambda: bool(replies))
    with pytest.raises(grpc.RpcError) as err:
        _transfer(stub, root, nbytes, "twice", _prompt())
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS, err.value.details()
    gate.set()
    first.join(30)
    assert replies[-1].done  # the first one was not disturbed
    decode_on_relay(stub, "twice", timeout=30)
    assert _stats(stub).num_free_blocks == idle


def test_decode_of_an_unknown_request_is_not_found(decode):
    stub, _, _ = decode
    with pytest.raises(grpc.RpcError) as err:
        decode_on_relay(stub, "nope", timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_burst_waits_for_blocks_instead_of_failing(tmp_path):
    """A 1 MB pool holds 63 blocks: a second 40-block transfer waits until the first request's
    blocks are freed by its decode, then succeeds; a prompt larger than the pool fails at once."""
    import threading

    from splitserve.models.tiny import write_random_checkpoint

    model = write_random_checkpoint(tmp_path / "model", with_tokenizer=True)
    node = start_node("decode", model, tmp_path, "--kv-cache-mb", "1")
    root = ModelIdentity.for_checkpoint(model, "float32").root_hash
    nbytes = 2 * 2 * BS * 2 * 32 * 4
    try:
        with grpc.insecure_channel(node.address) as channel:
            stub = nodes_pb2_grpc.DecodeNodeServiceStub(channel)
            stub.GetStats = nodes_pb2_grpc.NodeStatsServiceStub(channel).GetStats
            assert _stats(stub).num_blocks == 63
            assert _transfer(stub, root, nbytes, "first", _prompt(640))[-1].done
            second: list = []
            waiter = threading.Thread(
                target=lambda: second.extend(_transfer(stub, root, nbytes, "second", _prompt(640)))
            )
            waiter.start()
            _wait_until(lambda: _stats(stub).counters["transfers_waited_for_blocks"] == 1)
            time.sleep(0.3)
            assert not second, "the second transfer cannot have its blocks yet"
            decode_on_relay(stub, "first", timeout=30)
            waiter.join(30)
            assert second and second[-1].done
            decode_on_relay(stub, "second", timeout=30)
            with pytest.raises(grpc.RpcError) as err:
                _transfer(stub, root, nbytes, "huge", _prompt(1020))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "64 KV blocks" in err.value.details() and "63 in all" in err.value.details()
            assert _stats(stub).num_free_blocks == 63
    finally:
        node.stop()


def test_a_sender_that_goes_silent_loses_its_reservation(tmp_path):
    """A transfer whose sender stops sending after the header (a frozen or buggy prefill node)
    holds its blocks only --transfer-deadline-s, not until its call's own deadline."""
    import threading

    from splitserve.models.tiny import write_random_checkpoint

    model = write_random_checkpoint(tmp_path / "model", with_tokenizer=True)
    node = start_node("decode", model, tmp_path, "--transfer-deadline-s", "2")
    try:
        with grpc.insecure_channel(node.address) as channel:
            stub = nodes_pb2_grpc.DecodeNodeServiceStub(channel)
            stub.GetStats = nodes_pb2_grpc.NodeStatsServiceStub(channel).GetStats
            root = ModelIdentity.for_checkpoint(model, "float32").root_hash
            idle = _stats(stub).num_free_blocks
            never = threading.Event()
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                _transfer(stub, root, _block_nbytes(model), "silent", _prompt(), gate=never)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
            assert "sent nothing" in err.value.details()
            assert time.monotonic() - t0 < 15
            assert _stats(stub).num_free_blocks == idle
            never.set()
    finally:
        node.stop()
