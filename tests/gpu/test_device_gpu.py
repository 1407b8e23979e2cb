"""A node on any GPU of a host: `--device cuda:N` makes N the current device before any kernel
runs (a prefill node on cuda:1 died at warm-up before). Needs two GPUs; skipped otherwise. CPU
counterpart: tests/cluster/test_cli.py checks that a device that does not exist is refused
clearly."""

import pytest
import torch
from support.processes import start_node, start_router

from splitserve.client import Client

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


def test_prefill_on_cuda1_and_decode_on_cuda0_serve_the_same_tokens_as_one_gpu(tmp_path):
    from splitserve.models.tiny import write_random_checkpoint

    # bf16: what KV moves between GPUs in (the GPU paths take fp16/bf16 blocks).
    model = write_random_checkpoint(tmp_path / "m", with_tokenizer=True, dtype="bfloat16")
    prompts = [[(5 * i + j) % 250 + 1 for j in range(40 + 17 * i)] for i in range(4)]
    outputs = []
    for prefill_dev, decode_dev in (("cuda:1", "cuda:0"), ("cuda:0", "cuda:0")):
        flags = ("--gpu-memory-utilization", "0.2")
        prefill = start_node("prefill", model, tmp_path, "--device", prefill_dev, *flags)
        decode = start_node("decode", model, tmp_path, "--device", decode_dev, *flags)
        router = start_router(model, tmp_path, [prefill.address], [decode.address])
        try:
            with Client(router.address) as client:
                outputs.append(
                    [
                        list(
                            client.generate(
                                prompt_token_ids=p, max_tokens=8, temperature=0.0, ignore_eos=True
                            ).token_ids
                        )
                        for p in prompts
                    ]
                )
        finally:
            for proc in (router, decode, prefill):
                proc.stop()
    assert outputs[0] == outputs[1]
