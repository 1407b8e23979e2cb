"""The tcp path with CUDA pools on both sides (pinned staging, side-stream gather and scatter):
a sender process on this GPU fills this process's reservation in several chunks over several
connections, byte-exact, and the blocks around it stay untouched; in plaintext and inside mutual
TLS. CPU counterparts: tests/cluster/test_transfer_tcp.py (the same path with CPU pools, plus the
refusal cases) and tests/cluster/test_kv_tls.py (TLS: the wire, refused certificates)."""

from __future__ import annotations

import pytest
import torch
from support.kv_pools import SenderProcess, block_checksums, fill_pool, make_pool, security_of
from support.pki import HAVE_OPENSSL, make_pki, tls_triple

from splitserve.transfer import TCP, open_receiver
from splitserve.transfer.reservation import block_nbytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU: this test moves CUDA pools over tcp"
    ),
]

SPEC = dict(num_blocks=96, num_layers=4, block_size=16, num_kv_heads=8, head_dim=128)


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "mtls"])
def test_tcp_between_cuda_pools_is_byte_exact(tls, tmp_path):
    if tls and not HAVE_OPENSSL:
        pytest.skip("making test certificates needs the openssl CLI")
    security = {"tls": tls_triple(make_pki(tmp_path / "pki"))} if tls else None
    spec = {**SPEC, "device": "cuda:0"}
    pool = fill_pool(make_pool(**spec), 5)
    torch.cuda.synchronize()
    before = pool.clone()
    rx = open_receiver(
        pool, "decode-gpu-tcp", paths=(TCP,), host="127.0.0.1", security=security_of(security)
    )
    chunk = 5 * block_nbytes(pool)  # 40 blocks: 8 chunks over 3 connections
    opts = dict(streams=3, chunk_bytes=chunk)
    sender = SenderProcess("prefill-gpu-tcp", spec, 6, tcp_options=opts, security=security)
    try:
        sender.wait_ready()
        assert sender.call("connect", rx.endpoint().to_bytes()) == TCP
        src = list(range(50, 90))
        dst = list(range(1, 80, 2))
        for _ in range(2):
            res = rx.reserve(sender.node_id, dst, TCP)
            sender.request("send", res.ticket.to_bytes(), src, 30.0)
            rx.receive(res, 30.0)
            sender.reply()
            assert res.state == "done"
            assert sender.call("checksums", src) == block_checksums(pool, dst)
        rest = [i for i in range(SPEC["num_blocks"]) if i not in dst]
        assert torch.equal(pool[rest].view(torch.uint8), before[rest].view(torch.uint8))
    finally:
        sender.stop()
        rx.shutdown()
