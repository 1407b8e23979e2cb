"""Shared by the CPU transfer tests (test_transfer*.py): the pool spec, seeds and a byte view."""

import torch

SPEC = dict(num_blocks=24, num_layers=2, block_size=16, num_kv_heads=2, head_dim=8)
SENDER_SEED = 1234
RECEIVER_SEED = 99


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def ship(rx, sender, src, dst, path: str, timeout: float = 10.0):
    """Blocks ``src`` of a sender process into ``dst`` of receiver ``rx`` over ``path``: the
    reservation, and the bytes the sender says it sent."""
    res = rx.reserve(sender.node_id, dst, path)
    sender.request("send", res.ticket.to_bytes(), src, timeout)
    rx.receive(res, timeout)
    nbytes, _ = sender.reply()
    return res, nbytes
