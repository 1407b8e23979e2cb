"""Per-peer caps on a real decode node (``--max-transfers-per-peer``,
``--max-kv-share-per-peer``): a sending node over its block or transfer cap is refused with
RESOURCE_EXHAUSTED naming the option, while another sending node's transfer proceeds; whatever
ends a transfer (finished, failed, cancelled by its sender, given up at the node's deadline) its
share comes back, so afterwards the capped peer gets its whole share again and every block is
free. Then a router with two decode nodes, one of which allows a single transfer per peer: every
request is answered, the refused ones on another pair."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
from support.processes import start_node, start_router

from splitserve.client import Client
from splitserve.kvstore import ModelIdentity, hash_request_tokens
from splitserve.transfer.grpc_bytes.codec import encode_blocks
from splitserve.v1 import common_pb2, nodes_pb2, nodes_pb2_grpc

BS = 16
DEADLINE_S = 4  # the node's --transfer-deadline-s: a silent sender loses its hold after it
SHARE = 0.1  # of the node's blocks, per peer
MAX_TRANSFERS = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from splitserve.models.tiny import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("caps") / "model", with_tokenizer=True)


@pytest.fixture(scope="module")
def decode(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("decode")
    node = start_node(
        "decode",
        model,
        tmp,
        "--kv-cache-mb",
        "4",
        "--transfer-deadline-s",
        str(DEADLINE_S),
        "--max-transfers-per-peer",
        str(MAX_TRANSFERS),
        "--max-kv-share-per-peer",
        str(SHARE),
    )
    channel = grpc.insecure_channel(node.address)
    node_stub = Node(channel, ModelIdentity.for_checkpoint(model, "float32").root_hash, model)
    yield node_stub
    channel.close()
    node.stop()


class Node:
    """A decode node seen by a test acting as its prefill nodes."""

    def __init__(self, channel, root: bytes, model) -> None:
        self.stub = nodes_pb2_grpc.DecodeNodeServiceStub(channel)
        self.stats_stub = nodes_pb2_grpc.NodeStatsServiceStub(channel)
        self.root = root
        config = __import__("json").loads((model / "config.json").read_text())
        layers, heads, dim = (
            config[k] for k in ("num_hidden_layers", "num_key_value_heads", "head_dim")
        )
        self.block_nbytes = layers * 2 * BS * heads * dim * 4
        self.idle_free_blocks = self.stats().num_free_blocks

    def stats(self):
        return self.stats_stub.GetStats(nodes_pb2.GetStatsRequest(), timeout=10)

    @property
    def cap_blocks(self) -> int:
        return int(SHARE * (self.stats().num_blocks - 1))

    def send(
        self, sender: str, num_blocks: int, hold: bool = True, corrupt: bool = False
    ) -> Sending:
        """A TransferKV of a fresh prompt of ``num_blocks`` blocks (the last a partial tail) as
        the sending node ``sender``; with ``hold``, its blocks wait until ``finish()``;
        ``corrupt``: they fail their CRC."""
        prompt = [random.randrange(256) for _ in range(BS * (num_blocks - 1) + BS // 2)]
        return Sending(self, sender, prompt, hold, corrupt)

    def release(self, rid: str) -> None:
        self.stub.Release(nodes_pb2.ReleaseRequest(request_id=rid), timeout=10)


class Sending:
    """One transfer running in a thread: its replies, or the error that ended it."""

    def __init__(
        self, node: Node, sender: str, prompt: list[int], hold: bool, corrupt: bool
    ) -> None:
        self.node, self.prompt, self.corrupt = node, prompt, corrupt
        self.rid = f"{sender}-{random.getrandbits(40):x}"
        self.gate = threading.Event()
        if not hold:
            self.gate.set()
        self.replies: list = []
        self.error: grpc.RpcError | None = None
        header = nodes_pb2.TransferHeader(
            request_id=self.rid,
            prompt_token_ids=prompt,
            first_token_id=5,
            block_hashes=hash_request_tokens(prompt, BS, node.root),
            model_root_hash=node.root,
            block_nbytes=node.block_nbytes,
            deadline_s=30,
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=2),
            sender_id=sender,
        )
        self.call = node.stub.TransferKV(self._messages(header), timeout=30)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _messages(self, header):
        yield nodes_pb2.TransferKVRequest(header=header)
        while not self.replies:
            time.sleep(0.01)
        self.gate.wait(60)
        nbytes = self.node.block_nbytes
        missing = list(self.replies[0].missing)
        if missing:
            meta, data = encode_blocks(missing, random.randbytes(len(missing) * nbytes))
            yield nodes_pb2.TransferKVRequest(blocks=nodes_pb2.BlockData(meta=meta, data=data))
        meta, data = encode_blocks([-1], random.randbytes(nbytes), tail=True)
        if self.corrupt:
            data = data[:-1] + bytes([data[-1] ^ 1])
        yield nodes_pb2.TransferKVRequest(blocks=nodes_pb2.BlockData(meta=meta, data=data))
        yield nodes_pb2.TransferKVRequest(end=nodes_pb2.TransferEnd())

    def _run(self) -> None:
        try:
            for reply in self.call:
                self.replies.append(reply)
        except grpc.RpcError as exc:
            self.error = exc

    def accepted(self, timeout: float = 10.0) -> bool:
        """True once the node answered the header; False when it refused the transfer."""
        deadline = time.monotonic() + timeout
        while not self.replies and self.thread.is_alive():
            assert time.monotonic() < deadline, "no answer to the header"
            time.sleep(0.01)
        return bool(self.replies)

    def refusal(self) -> str:
        self.thread.join(10)
        assert self.error is not None and not self.replies
        assert self.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, self.error
        return self.error.details() or ""

    def finish(self) -> None:
        """Let the blocks go, wait for the node's confirmation and free what it adopted."""
        self.gate.set()
        self.thread.join(30)
        assert self.error is None and self.replies[-1].done, self.error
        self.node.release(self.rid)


def _wait_until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _once_room(node: Node, sender: str, timeout: float = 5.0) -> Sending:
    """A transfer from ``sender`` accepted as soon as the node has given a share back (an
    ending the sender saw first, a cancel or a refusal, reaches the node's handler a moment
    later)."""
    deadline = time.monotonic() + timeout
    while not (sending := node.send(sender, 1)).accepted():
        assert time.monotonic() < deadline, f"{sender}'s share did not come back"
        time.sleep(0.05)
    return sending


def assert_caps_back_to_zero(node: Node) -> None:
    """Every block is free, and the capped peer "a" may again hold its whole share: its first
    transfers up to the block cap and up to the transfer cap are all accepted."""
    _wait_until(lambda: node.stats().num_free_blocks == node.idle_free_blocks)
    each = node.cap_blocks // MAX_TRANSFERS
    held = [node.send("a", each) for _ in range(MAX_TRANSFERS)]
    assert all(s.accepted() for s in held)
    for sending in held:
        sending.finish()
    _wait_until(lambda: node.stats().num_free_blocks == node.idle_free_blocks)


def test_a_peer_over_its_block_cap_is_refused_while_another_peer_proceeds(decode):
    cap = decode.cap_blocks
    assert cap >= 8, "the test needs a cap of several blocks"
    before = decode.stats().counters["transfers_refused_peer_blocks"]
    first = decode.send("a", cap - 2)
    assert first.accepted()
    over = decode.send("a", 3)  # cap - 2 + 3 > cap
    assert not over.accepted()
    details = over.refusal()
    assert "--max-kv-share-per-peer" in details and "'a'" in details, details
    other = decode.send("b", cap - 2, hold=False)  # another peer: its own share
    assert other.accepted()
    other.finish()
    fits = decode.send("a", 2)  # cap - 2 + 2 == cap: at the cap, accepted
    assert fits.accepted()
    fits.finish()
    first.finish()
    assert decode.stats().counters["transfers_refused_peer_blocks"] == before + 1
    assert_caps_back_to_zero(decode)


def test_a_peer_at_its_transfer_cap_is_refused_and_every_ending_gives_its_share_back(decode):
    before = decode.stats().counters["transfers_refused_peer_transfers"]
    # One of each ending: finished, failed (bad block bytes), cancelled by the sender, given up
    # by the node when the sender went silent.
    finished, cancelled = decode.send("a", 1), decode.send("a", 1)
    failing = decode.send("a", 1, corrupt=True)
    assert all(s.accepted() for s in (finished, failing, cancelled))
    refused = decode.send("a", 1)
    details = refused.refusal()
    assert "--max-transfers-per-peer" in details and "'a'" in details, details
    other = decode.send("b", 1)
    assert other.accepted()
    other.finish()
    assert decode.stats().counters["transfers_refused_peer_transfers"] == before + 1

    finished.finish()
    again = decode.send("a", 1)  # one share came back: room for exactly one
    assert again.accepted()
    assert not decode.send("a", 1).accepted()
    cancelled.call.cancel()
    cancelled.thread.join(10)
    silent = _once_room(decode, "a")  # the cancelled one's share is back
    failing.gate.set()  # its tail block fails its CRC: the node refuses the transfer
    failing.thread.join(10)
    assert failing.error is not None
    assert failing.error.code() == grpc.StatusCode.INVALID_ARGUMENT, failing.error
    last = _once_room(decode, "a")  # the failed one's share is back
    again.finish()
    last.finish()
    # ``silent`` never sends its blocks: the node gives it up after --transfer-deadline-s.
    silent.thread.join(DEADLINE_S * 3)
    assert silent.error is not None
    assert silent.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, silent.error
    assert_caps_back_to_zero(decode)


def test_a_sender_without_an_id_counts_against_its_host(decode):
    held = [decode.send("", 1) for _ in range(MAX_TRANSFERS)]
    assert all(s.accepted() for s in held)
    refused = decode.send("", 1)
    assert "ipv4:127.0.0.1" in refused.refusal()
    for sending in held:
        sending.finish()
    assert_caps_back_to_zero(decode)


def test_a_router_retries_a_capped_decode_node_on_another_pair(model, tmp_path):
    """Decode node d1 takes one transfer per peer at a time, d2 the default: 16 requests at
    once through one prefill node are all answered (those d1 refuses go to d2 or, later, to d1
    again); d1 did refuse some."""
    d1 = start_node("decode", model, tmp_path, "--max-transfers-per-peer", "1")
    d2 = start_node("decode", model, tmp_path)
    p = start_node("prefill", model, tmp_path, "--kv-transfer", "none")
    router = start_router(model, tmp_path, [p.address], [d1.address, d2.address])
    try:
        refused = 0.0
        with Client(router.address) as client, grpc.insecure_channel(d1.address) as channel:
            stats = nodes_pb2_grpc.NodeStatsServiceStub(channel)
            # Rounds until d1 has refused (16 prompts at once reach it together in practice).
            for _ in range(3):
                assert all(r.usage.completion_tokens == 4 for r in _at_once(client, 16))
                reply = stats.GetStats(nodes_pb2.GetStatsRequest(), timeout=10)
                refused = reply.counters["transfers_refused_peer_transfers"]
                if refused:
                    break
        assert refused > 0, "d1 never refused a transfer: the test did not test the retry"
    finally:
        for proc in (router, p, d1, d2):
            proc.stop()


def _at_once(client: Client, n: int) -> list:
    results: list = [None] * n

    def ask(i: int) -> None:
        prompt = [random.randrange(256) for _ in range(64)]
        results[i] = client.generate(
            prompt_token_ids=prompt, max_tokens=4, ignore_eos=True, timeout=60
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert all(r is not None for r in results), "a request failed (its thread logged why)"
    return results
