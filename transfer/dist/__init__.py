"""Cross-host path: torch.distributed point-to-point in a two-rank group per (receiver, sender).

No global world: every pair gets its own group, built directly from a ``(store, rank, size=2)``
triple (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on CUDA), on demand, and torn down by
``close(peer)`` or the first failure. Nothing calls ``init_process_group``.

Rendezvous. The receiver (decode node) hosts a ``TCPStore`` and advertises its address. A sender
(prefill node) connects as a store client, takes a join number ``n`` (``add``), announces itself
under ``join/n`` (node id, backend, block layout) and waits for ``ack/n``; the receiver's accept
thread checks the layout, acks, and both sides construct the group on ``PrefixStore("pair/n/")``,
receiver rank 0, sender rank 1. The receiver registers the pair's channel, then sets ``ready/n``;
``connect`` returns after it. ``n`` is the channel's generation: a sender that reconnects gets a
new one, which replaces (and fails) the old channel on both sides.

One transfer. The receiver reserves destination ids (``reserve``: a ``Reservation`` whose ticket
carries ``(gen, seq, block ids)``); the sender gathers its source blocks into one buffer and
sends a header ``[magic, gen, seq, n, block elements, element size]`` then the buffer. The
receiver's ``receive`` receives a header then the data into a staging buffer, and only once the
whole buffer has arrived scatters it into the reservation named by the header's ``seq``
(``index_copy_``; CUDA: synchronized) and ends it. Concurrent transfers on one pair are fine: the
sender sends header+data of one transfer at a time, and receivers waiting on the same channel take
turns receiving whatever comes next and completing the reservation it names; data for a
reservation that ended meanwhile (cancelled, timed out) is received and dropped.

Failures. Every wait has a deadline (``Work.wait(timeout)``; gloo's recv honours it). A sender
killed mid-transfer breaks the connection (``PeerLost``) or stops sending (``TransferTimeout``);
either way the staging buffer is dropped, the pool is untouched, the channel is torn down on this
side and every outstanding reservation on it fails. The next ``connect`` builds a new group.

Modules: ``group`` (backends, the pair group, rendezvous store addresses), ``channel``
(one pair's channel and the header framing), ``receiver`` and ``sender`` (the two
sides); this module declares the path (``PATH``).
"""

from splitserve.transfer.base import TransferPath
from splitserve.transfer.dist.group import make_pair_group, prepare_backend
from splitserve.transfer.dist.receiver import DistReceiver
from splitserve.transfer.dist.sender import DistSender
from splitserve.transfer.endpoint import BACKEND_FOR_DEVICE, DIST, Endpoint


def reaches(sender: Endpoint, receiver: Endpoint) -> bool:
    """The receiver advertises a rendezvous address whose backend the sender runs for its device
    kind (nccl on CUDA, gloo on CPU), both pools are on the same device kind, and (NCCL) not on
    the same GPU (NCCL cannot pair two processes on one GPU: that pair gets ipc)."""
    address = receiver.dist
    return (
        address is not None
        and sender.device == receiver.device
        and address.backend == BACKEND_FOR_DEVICE.get(sender.device)
        and address.backend in sender.dist_backends
        and not (
            sender.device == "cuda"
            and sender.same_host(receiver)
            and sender.device_uuid == receiver.device_uuid
        )
    )


PATH = TransferPath(
    DIST, reaches=reaches, open_receiver=DistReceiver.open, open_sender=DistSender.open
)

__all__ = ["PATH", "DistReceiver", "DistSender", "make_pair_group", "prepare_backend", "reaches"]
