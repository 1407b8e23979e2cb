"""The tcp path: raw sockets from pinned memory, several connections, CRC-checked chunks — for
pairs without ipc or NCCL between them (other hosts, CPU senders into CUDA pools, two nodes on
one GPU with ipc off). ``wire`` is the wire format, ``receiver`` (the listener) and
``sender`` the two sides; this module declares the path."""

from splitserve.transfer.base import TransferPath
from splitserve.transfer.endpoint import TCP, Endpoint
from splitserve.transfer.tcp.receiver import TcpReceiver
from splitserve.transfer.tcp.sender import TcpSender


def reaches(sender: Endpoint, receiver: Endpoint) -> bool:
    """The receiver advertises a tcp listener."""
    return receiver.tcp is not None


PATH = TransferPath(
    TCP,
    reaches=reaches,
    open_receiver=TcpReceiver.open,
    open_sender=TcpSender.open,
    rate_prior=2e9,  # 3.8 GB/s measured (docs/benchmarks-history.md, "The tcp byte path, H200
    # (2026-12-01)"), taken lower: see chooser
)

__all__ = ["PATH", "TcpReceiver", "TcpSender", "reaches"]
