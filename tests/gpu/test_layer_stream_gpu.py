"""Layer-wise KV streams on a CUDA engine (engine.layer_stream): each piece waits for the CUDA
event recorded after its layer, so the bytes it copies are those the forward wrote, with async
scheduling and several steps per prompt; and the tcp path's ``send_part`` between CUDA pools.
Skipped without a GPU; CPU counterparts: tests/unit/test_layer_stream.py (the streams on a CPU
engine) and tests/cluster/test_transfer_tcp.py (layer ranges over tcp)."""

import threading

import pytest
import torch
from support.kv_pools import SenderProcess, block_checksums, fill_pool, make_pool

from splitserve.engine.core import LLMEngine
from splitserve.engine.layer_stream import LayerStreams
from splitserve.kvstore import ModelIdentity
from splitserve.models.loader import load_model
from splitserve.models.runner import ModelRunner, RunnerConfig
from splitserve.models.sampling_params import SamplingParams
from splitserve.models.tiny import write_random_checkpoint
from splitserve.transfer import TCP, open_receiver

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA GPU; CPU counterpart: tests/unit/test_layer_stream.py",
    ),
]


class EventRecorder:
    """Copies each piece to the host once its event is reached (what the tcp sender does)."""

    def __init__(self, pool: torch.Tensor, positions: int) -> None:
        self.pool = pool
        self.got = torch.zeros((positions, *pool.shape[1:]), dtype=pool.dtype)
        self.sent = torch.zeros((positions, pool.shape[1]), dtype=torch.int64)
        self.stream = torch.cuda.Stream(pool.device)
        self.partial = 0
        self.mu = threading.Lock()

    def send_part(self, ticket, first, src, layers, *, timeout, after=None):
        lo, hi = layers
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            else:
                self.stream.wait_stream(torch.cuda.default_stream(self.pool.device))
            index = torch.tensor(src, device=self.pool.device)
            data = self.pool.narrow(1, lo, hi - lo).index_select(0, index).cpu()
        with self.mu:
            self.got[first : first + len(src), lo:hi] = data
            self.sent[first : first + len(src), lo:hi] += 1
            self.partial += hi - lo < self.pool.shape[1]
        return data.numel() * data.element_size()


def test_streamed_pieces_carry_the_bytes_the_forward_wrote(tmp_path):
    path = write_random_checkpoint(
        tmp_path / "m", seed=9, num_hidden_layers=8, hidden_size=512, intermediate_size=1024
    )
    config, model = load_model(path, device="cuda", dtype=torch.bfloat16)
    rc = RunnerConfig(kv_cache_bytes=512 * 16 * config.kv_bytes_per_token(torch.bfloat16))
    engine = LLMEngine(
        ModelRunner(config, model, rc),
        ModelIdentity("m"),
        prefill_only=True,
        max_num_batched_tokens=256,
        async_scheduling=True,
    )
    pool = engine.runner.kv_pool
    prompt = [(13 * i + 5) % 300 for i in range(1000)]  # 62 full blocks and a tail, 4 steps
    index = list(range(63))
    recorder = EventRecorder(pool, len(index))
    engine.layer_streams = LayerStreams(recorder, pool.shape[1], engine.block_size, cuda=True)
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=2))
    future = engine.open_stream("r", b"ticket", index, timeout=60)
    while "r" in engine.requests or engine.has_unfinished():
        engine.step()
    assert future.result(timeout=60) > 0
    torch.cuda.synchronize()
    assert bool((recorder.sent == 1).all())
    final = pool[engine.kv.get_block_ids("r")].cpu()
    assert torch.equal(recorder.got.view(torch.uint8), final.view(torch.uint8))
    assert recorder.partial > 0  # some pieces left before their step's last layer


def test_tcp_layer_ranges_between_cuda_pools():
    spec = dict(num_blocks=64, num_layers=4, block_size=16, num_kv_heads=8, head_dim=128)
    spec = {**spec, "device": "cuda:0"}
    pool = fill_pool(make_pool(**spec), 5)
    torch.cuda.synchronize()
    rx = open_receiver(pool, "decode-gpu-layers", paths=(TCP,), host="127.0.0.1")
    sender = SenderProcess("prefill-gpu-layers", spec, 6, tcp_options=dict(streams=2))
    try:
        sender.wait_ready()
        assert sender.call("connect", rx.endpoint().to_bytes()) == TCP
        src, dst = list(range(30, 50)), list(range(1, 41, 2))
        res = rx.reserve(sender.node_id, dst, TCP)
        ticket = res.ticket.to_bytes()
        for lo, hi in ((0, 1), (1, 3), (3, 4)):
            sender.call("send_part", ticket, 0, src, (lo, hi), 30.0)
        rx.finish(res)
        assert res.state == "done"
        assert sender.call("checksums", src) == block_checksums(pool, dst)
    finally:
        sender.stop()
        rx.shutdown()
